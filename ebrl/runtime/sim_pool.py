"""SimPool: where ``env.step`` runs, behind one awaitable interface; this module chooses the backend.

Three backends (:class:`~ebrl.config.SimBackend`), one file a role:

- ``sim_types.py``: what they share (:class:`StepOut`, :class:`EnvStepError`, the
  :class:`SimPool` interface, ``step_env`` with same-step autoreset).
- ``sim_local.py``: ``InlineSimPool`` steps on the event loop thread (envs cheaper than a
  thread hop; virtual time), ``ThreadSimPool`` on lane threads (simulators that release the GIL).
- ``sim_workers.py``: ``ProcessSimPool`` hosts the envs in worker processes (GIL-bound Python
  envs, which is most gymnasium envs).
- here: :func:`make_sim_pool` and the ``auto`` rule, which measures a step and picks one.

Every backend resets an env in the same call as the step that ends its episode
(gymnasium's ``AutoresetMode.SAME_STEP``): ``StepOut.obs`` is then the first observation
of the next episode and ``final_obs`` the last one of the episode that ended. The shared
names are importable from here too, as before the split.

    >>> import asyncio, gymnasium as gym
    >>> from ebrl.runtime.sim_pool import make_sim_pool
    >>> from ebrl.config import SimConfig
    >>> import numpy as np
    >>> async def demo():
    ...     pool = make_sim_pool(lambda i: gym.make("CartPole-v1"), 2, SimConfig(backend="inline"))
    ...     blocks = []
    ...     pool.on_block = blocks.append
    ...     await pool.start()
    ...     for i in range(2):
    ...         await pool.reset(i, seed=i)
    ...     pool.submit(np.array([0, 1]), np.array([1, 0]))   # one block of two envs ...
    ...     await asyncio.sleep(0)
    ...     pool.close()
    ...     return blocks[0].ids.tolist(), blocks[0].obs.shape   # ... comes back as one block
    >>> asyncio.run(demo())
    ([0, 1], (2, 4))
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

from ebrl.config import ConfigError, SimBackend, SimConfig
from ebrl.runtime.sim_local import InlineSimPool, ThreadSimPool
from ebrl.runtime.sim_types import (
    EnvFn,
    EnvStepError,
    SimPool,
    StepOut,
    close_quietly,
    reset_env,
    single_spaces,
    step_env,
)
from ebrl.runtime.sim_workers import ProcessSimPool
from ebrl.spaces import all_finite, copy_tree

own = copy_tree  # the name this module gave it before the split

__all__ = [
    "EnvFn", "EnvStepError", "InlineSimPool", "ProcessSimPool", "SimPool", "StepOut", "ThreadSimPool",
    "all_finite", "choose_backend", "close_quietly", "decide_backend", "make_sim_pool", "measure_step_cost",
    "own", "probe_backend", "reset_env", "single_spaces", "step_env",
]


def measure_step_cost(env_fn: EnvFn, steps: int = 100, rounds: int = 3) -> tuple[float, bool]:
    """Seconds per random-action step of ``env_fn(0)`` (best of ``rounds``, after a warm-up),
    and whether the env says it releases the GIL (``metadata["ebrl.releases_gil"]``)."""
    env = env_fn(0)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        actions = [env.action_space.sample() for _ in range(steps)]

        def one_round() -> float:
            t0 = time.perf_counter()
            for a in actions:
                _, _, term, trunc, _ = env.step(a)
                if term or trunc:
                    env.reset()
            return (time.perf_counter() - t0) / steps

        one_round()  # warm-up: first calls pay for caches and lazy imports
        cost = min(one_round() for _ in range(rounds))
        releases_gil = bool(env.metadata.get("ebrl.releases_gil", False))
    finally:
        env.close()
    return cost, releases_gil


def decide_backend(cost_s: float, releases_gil: bool, cfg: SimConfig, cpus: int | None = None) -> SimBackend:
    """The AUTO rule: inline if a step is cheaper than a thread hop; threads if the env
    releases the GIL (or there is one core); worker processes otherwise."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    if cost_s < cfg.inline_below_s:
        return SimBackend.INLINE
    if releases_gil or cpus < 2:
        return SimBackend.THREAD
    return SimBackend.PROCESS


def choose_backend(env_fn: EnvFn, cfg: SimConfig) -> tuple[SimBackend, float]:
    cost, releases_gil = measure_step_cost(env_fn)
    return decide_backend(cost, releases_gil, cfg), cost


async def probe_backend(env_fn: EnvFn, cfg: SimConfig) -> SimBackend:
    """``cfg.backend``, with AUTO for plain envs resolved by :func:`choose_backend` in a private
    thread, so the probe (a few hundred steps of ``env_fn(0)``: about 0.7 s for an env with 1 ms
    steps) never blocks the event loop. The thread is joined before this returns (no thread
    outlives the run). Vector envs keep AUTO: :func:`make_sim_pool` gives them threads unprobed."""
    if cfg.backend is not SimBackend.AUTO or cfg.vector_size > 1:
        return cfg.backend
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1, thread_name_prefix="ebrl-sim-probe")
    try:
        backend, _ = await loop.run_in_executor(executor, choose_backend, env_fn, cfg)
        return backend
    finally:
        executor.shutdown(wait=True)  # on cancel too: the probe is bounded, and must not outlive us


def make_sim_pool(env_fn: EnvFn, num_envs: int, cfg: SimConfig, backend: SimBackend | None = None) -> SimPool:
    """A pool for ``num_envs`` envs: ``num_envs // cfg.vector_size`` vector envs when that is > 1."""
    backend = backend or cfg.backend
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
        backend, _ = choose_backend(env_fn, cfg)
    if backend is SimBackend.INLINE:
        return InlineSimPool(env_fn, num_envs, num_lanes=cfg.num_threads, vector_size=size)
    if backend is SimBackend.THREAD:
        return ThreadSimPool(env_fn, num_envs, cfg.num_threads, vector_size=size)
    return ProcessSimPool(env_fn, num_envs, cfg.num_workers or os.cpu_count() or 1, cfg.start_method,
                          reply_hold_s=cfg.reply_hold_s)
