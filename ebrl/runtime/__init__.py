"""The runtime's parts: ``run`` (assembles the parts on a ``platform`` and runs them under one
TaskGroup), ``platform`` (what tests and emulation replace: executor, sim pool, device, sampler), ``driver`` (the driver core: blocks in,
requests out), ``state`` (RunState), ``sim/`` (where simulation runs: one pool, its hosts, one
stepping function), ``generation`` (dynamic batching), ``rollout`` (batch-first storage and policy
lag), ``learner`` (with ``learner_process``), ``stage`` (where a stage's calls run, and their
cost), ``schedules``, ``stats``, ``resources/`` (the profiler and the controller),
``children`` (child processes) and ``errors`` (one error out of a TaskGroup); virtual time is
a platform of its own (:mod:`ebrl.virtual_time`). Most users need only
:func:`ebrl.run`. docs/design.md walks one env step through them."""
