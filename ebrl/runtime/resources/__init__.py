"""The resource manager: a profile of what each stage used per epoch (``profiler``), pure rules
that re-tune the knobs from it (``controller``, ``rules_*``, ``knobs``), the run's task that
applies their decisions (``manager``), and CUDA streams for generation and training (``gpu``)."""
