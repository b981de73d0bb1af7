"""The resource manager: what each stage uses, measured live, and the knobs re-tuned from it.

- :mod:`~ebrl.runtime.resources.profiler`: a profile per epoch (sim wall and CPU time per env,
  env waits by cause, generation batches, learner updates, core utilisation);
- :mod:`~ebrl.runtime.resources.controller`: pure functions from a profile and the current
  knobs to decisions, each with its reason;
- :mod:`~ebrl.runtime.resources.manager`: the run's task that takes a profile every
  ``resources.epoch_s``, asks the controller and applies its decisions (the actuators live in
  the sim pools, the generator and the driver);
- :mod:`~ebrl.runtime.resources.gpu`: CUDA streams and green contexts for generation and
  training, with their fallbacks.
"""
