"""SimPool: where ``env.step`` runs, behind one awaitable interface; this module chooses the backend.

Three backends (:class:`~ebrl.config.SimBackend`), one file a role:

- ``sim_types.py``: what they share (:class:`StepOut`, :class:`EnvStepError`, the
  :class:`SimPool` interface, ``step_env`` with same-step autoreset).
- ``sim_local.py``: ``InlineSimPool`` steps on the event loop thread (envs cheaper than a
  thread hop; virtual time); ``sim_threads.py``: ``ThreadSimPool`` on lane threads
  (simulators that release the GIL).
- ``sim_workers.py``: ``ProcessSimPool`` hosts the envs in worker processes (GIL-bound Python
  envs, which is most gymnasium envs); ``sim_worker_link.py`` is its handle on one worker,
  ``sim_workers_elastic.py`` moves envs between workers and resizes, ``sim_worker_process.py``
  runs in the worker.
- ``sim_mixed.py``: ``MixedSimPool`` holds both, each env on lanes or in a worker; the resource
  controller moves envs between them by their measured steps (AUTO runs use it).
- here: :func:`make_sim_pool`. Under ``sim.backend="auto"`` the controller's start rule picks
  the backend (and, for threads, the lanes) from the step the start-up probe measured
  (:mod:`~ebrl.runtime.probe`, :mod:`~ebrl.runtime.resources.rules_start`).

Every backend resets an env in the same call as the step that ends its episode
(gymnasium's ``AutoresetMode.SAME_STEP``): ``StepOut.obs`` is then the first observation
of the next episode and ``final_obs`` the last one of the episode that ended.

    >>> import asyncio, gymnasium as gym
    >>> from ebrl.runtime.sim_pool import make_sim_pool
    >>> from ebrl.config import SimConfig
    >>> import numpy as np
    >>> async def demo():
    ...     pool = make_sim_pool(lambda i: gym.make("CartPole-v1"), 2, SimConfig(backend="inline"))
    ...     await pool.start()
    ...     for i in range(2):
    ...         await pool.reset(i, seed=i)
    ...     pool.submit(np.array([0, 1]), np.array([1, 0]))   # one block of two envs ...
    ...     block = await pool.recv()
    ...     pool.close()
    ...     return block.ids.tolist(), block.obs.shape   # ... comes back as one block
    >>> asyncio.run(demo())
    ([0, 1], (2, 4))
"""

from __future__ import annotations

import gymnasium as gym

from ebrl.config import ConfigError, SimBackend, SimConfig
from ebrl.runtime.sim_local import InlineSimPool
from ebrl.runtime.sim_threads import ThreadSimPool
from ebrl.runtime.sim_mixed import MixedSimPool
from ebrl.runtime.sim_types import EnvFn, SimPool
from ebrl.runtime.sim_workers import ProcessSimPool
from ebrl.runtime.threads import usable_cpus

DEFAULT_LANES = 2  # thread lanes when neither the probe nor sim.num_threads says

__all__ = ["make_sim_pool"]


def make_sim_pool(env_fn: EnvFn, num_envs: int, cfg: SimConfig, backend: SimBackend | None = None,
                  lanes: int | None = None, movable: bool = False,
                  spaces: tuple[gym.Space, gym.Space] | None = None, build_timeout_s: float | None = None) -> SimPool:
    """A pool for ``num_envs`` envs: ``num_envs // cfg.vector_size`` vector envs when that is > 1.
    Thread lanes: ``lanes`` (the controller's start decision), else ``cfg.num_threads``, else 2. With ``movable``
    (AUTO chose ``backend`` and the controller may move envs), thread or process envs go in a
    :class:`~ebrl.runtime.sim_mixed.MixedSimPool`, starting on ``backend``: envs can then move
    between lanes and workers. ``sim.backend="mixed"`` asks for that pool, starting on lanes.
    ``spaces``: env 0's (the start-up probe's), so the pool need not build an env to learn them;
    ``build_timeout_s``: the deadline of each env's build (``faults.build_timeout_s``)."""
    backend = backend or cfg.backend
    lanes = lanes or cfg.num_threads or DEFAULT_LANES
    size = cfg.vector_size
    if size > 1:
        # a vectorised (typically GPU) simulator lives in this process, and one call steps many
        # envs, so it is worth a thread hop
        if backend is SimBackend.PROCESS:
            raise ConfigError("sim.backend", "process", f"vector envs (sim.vector_size={size}) step in this "
                              "process: use 'thread', 'inline' or 'auto'")
        if backend is SimBackend.AUTO:
            backend = SimBackend.THREAD
    elif backend is SimBackend.AUTO:
        raise ValueError("sim.backend='auto' for plain envs is the controller's to resolve from the probe's step "
                         "(ebrl.runtime.resources.rules_start.sim_start): pass the backend it chose")
    if backend is SimBackend.MIXED or (movable and size == 1 and backend in (SimBackend.THREAD, SimBackend.PROCESS)):
        if size > 1:
            raise ConfigError("sim.backend", "mixed", f"vector envs (sim.vector_size={size}) step in this "
                              "process: use 'thread', 'inline' or 'auto'")
        start = SimBackend.PROCESS if backend is SimBackend.PROCESS else SimBackend.THREAD
        return MixedSimPool(env_fn, num_envs, lanes, cfg.num_workers or usable_cpus(), start,
                            cfg.start_method, reply_hold_s=cfg.reply_hold_s, spaces=spaces,
                            build_timeout_s=build_timeout_s)
    if backend is SimBackend.INLINE:
        return InlineSimPool(env_fn, num_envs, num_lanes=lanes, vector_size=size, spaces=spaces,
                             build_timeout_s=build_timeout_s)
    if backend is SimBackend.THREAD:
        return ThreadSimPool(env_fn, num_envs, lanes, vector_size=size, spaces=spaces, build_timeout_s=build_timeout_s)
    return ProcessSimPool(env_fn, num_envs, cfg.num_workers or usable_cpus(), cfg.start_method,
                          reply_hold_s=cfg.reply_hold_s, spaces=spaces, build_timeout_s=build_timeout_s)
