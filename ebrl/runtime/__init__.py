"""The runtime's parts: ``run`` (the TaskGroup), ``drivers`` (the driver core: blocks in,
requests out), ``state`` (RunState), ``sim/`` (where simulation runs: one pool, its hosts, one
stepping function), ``generation`` (dynamic batching), ``rollout`` (batch-first storage and policy
lag), ``learner`` (with ``learner_process``), ``stage`` (where a stage's calls run, and their
cost), ``schedules``, ``stats``, ``resources/`` (the profiler and the controller),
``virtual_time`` and ``errors`` (one error out of a TaskGroup). Most users need only
:func:`ebrl.run`. docs/design.md walks one env step through them."""
