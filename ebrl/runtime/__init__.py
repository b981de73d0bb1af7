"""The runtime's parts, one file a role: ``run`` (the TaskGroup), ``drivers`` (the driver core: blocks in, requests out), ``state`` (RunState),
``sim_types``/``sim_local``/``sim_threads``/``sim_workers``/``sim_pool`` and ``vector_envs`` (where simulation runs: shared
types, inline and thread pools, worker processes, the backend choice), ``generation`` (dynamic
batching), ``rollout`` (batch-first storage and policy lag), ``learner`` (with
``learner_process`` and ``learner_joint``), ``stage`` (where a stage's calls run, and their
cost), ``schedules``, ``stats``,
``profiler``, ``virtual_time`` and ``errors`` (one error out of a TaskGroup). Most users need only :func:`ebrl.run`."""
