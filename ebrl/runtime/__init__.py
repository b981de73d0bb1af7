"""The runtime's parts, one file a role: ``run`` (the TaskGroup), ``env_task`` (env drivers),
``sim_pool``/``sim_workers``/``vector_envs`` (where simulation runs), ``generation`` (dynamic
batching), ``rollout`` (segments and policy lag), ``learner``, ``schedules``, ``stats``,
``profiler`` and ``virtual_time``. Most users need only :func:`ebrl.run`."""
