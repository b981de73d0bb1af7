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
- here: :func:`make_sim_pool`, and the probe that measures a step's wall and CPU time for
  ``sim.backend="auto"``; the controller's start rule picks the backend (and, for threads,
  the lanes) from it (:mod:`~ebrl.runtime.resources.rules_start`).

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

import multiprocessing as mp
import time
from dataclasses import dataclass

from ebrl.config import ConfigError, SimBackend, SimConfig
from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.env_facts import EnvFacts, inspect_env
from ebrl.runtime.sim_local import InlineSimPool
from ebrl.runtime.sim_threads import ThreadSimPool
from ebrl.runtime.sim_mixed import MixedSimPool
from ebrl.runtime.sim_types import EnvFn, SimPool, describe
from ebrl.runtime.sim_workers import ProcessSimPool
from ebrl.runtime.threads import ignore_stop_signals, in_thread, usable_cpus
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")
DEFAULT_LANES = 2  # thread lanes when neither the probe nor sim.num_threads says

__all__ = ["Probe", "StepProfile", "make_sim_pool", "measure_step_cost", "probe_backend"]


@dataclass(frozen=True)
class StepProfile:
    """What the AUTO probe measured of one env's step."""

    wall_s: float  # seconds per step
    # CPU seconds per step, of the whole process (process_time): ~0 for a step that waits; a
    # simulator's own helper threads count (Mesa's llvmpipe renders on several), the stepping
    # thread's time alone would take such an env for one that waits
    cpu_s: float
    releases_gil: bool  # the env says so (``metadata["ebrl.releases_gil"]``)

    @property
    def busy(self) -> float:
        """The fraction of a step spent computing (1: CPU-bound; near 0: sleeping or waiting on a
        device or a C++ simulator that released the GIL)."""
        return min(1.0, self.cpu_s / self.wall_s) if self.wall_s > 0 else 1.0


# the probe's rounds take about this long each (10 steps at least): every env's first step waits
# for the probe, and telling a step that computes from one that waits needs no more (it was 0.05:
# 0.2 s before a 1 ms-sleeping env's first step)
PROBE_ROUND_S = 0.015


def measure_step_cost(env_fn: EnvFn, steps: int = 100, rounds: int = 3) -> StepProfile:
    """Wall and CPU seconds per random-action step of ``env_fn(0)`` (the round with the least
    wall time of ``rounds``, after a 10-step warm-up), and whether the env says it releases the
    GIL. A round is ``steps`` steps, fewer for a slow env (about ``PROBE_ROUND_S`` a round, at
    least 10 steps): the controller refines the choice from live numbers, so the probe only has
    to tell a step that computes from one that waits."""
    return _measure(env_fn, steps, rounds)[0]


def _measure(env_fn: EnvFn, steps: int = 100, rounds: int = 3) -> tuple[StepProfile, EnvFacts]:
    """:func:`measure_step_cost`, and env 0's facts, read before its first step."""
    env = env_fn(0)
    try:
        facts = EnvFacts.of(env)
        env.reset(seed=0)
        env.action_space.seed(0)
        actions = [env.action_space.sample() for _ in range(steps)]

        def one_round(n: int) -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            for a in actions[:n]:
                _, _, term, trunc, _ = env.step(a)
                if term or trunc:
                    env.reset()
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

        first, _ = one_round(min(10, steps))  # warm-up: first calls pay for caches and lazy imports
        n = max(min(10, steps), min(steps, int(PROBE_ROUND_S / max(first, 1e-9))))
        wall, cpu = min(one_round(n) for _ in range(rounds))
        releases_gil = bool(env.metadata.get("ebrl.releases_gil", False))
    finally:
        env.close()
    return StepProfile(wall, cpu, releases_gil), facts


@dataclass(frozen=True)
class Probe:
    """What :func:`probe_backend` found: env 0's facts, and its measured step under AUTO."""

    env: EnvFacts
    step: StepProfile | None = None  # None: no step measured (not AUTO, or vector envs)


async def probe_backend(env_fn: EnvFn, cfg: SimConfig) -> Probe:
    """Env 0's facts, and under AUTO for plain envs its measured step (:func:`measure_step_cost`,
    from which the controller's start rule picks the backend), measured in a forked child
    process (where fork is the start method; else a private thread), so the probe (building
    ``env_fn(0)`` and about 0.05 s of steps) never blocks the event loop; the facts come from
    the env it probes. Other backends, and vector envs (which keep AUTO: :func:`make_sim_pool`
    gives them threads unprobed), build ``env_fn(0)`` once in a private thread to read its
    facts, and close it unstepped (:func:`~ebrl.runtime.env_facts.inspect_env`). The child and
    the threads are joined before this returns (nothing outlives the run)."""
    if cfg.backend is not SimBackend.AUTO or cfg.vector_size > 1:
        return Probe(await in_thread(inspect_env, env_fn, name="ebrl-env-inspect"))
    probe = _probe_in_child if _can_fork(cfg) else _measure
    step, facts = await in_thread(probe, env_fn, name="ebrl-sim-probe")
    log.info("sim_step_probed", step_wall_us=round(step.wall_s * 1e6, 1), step_cpu_us=round(step.cpu_s * 1e6, 1),
             busy=round(step.busy, 3), declared_releases_gil=step.releases_gil)
    return Probe(facts, step)


def _can_fork(cfg: SimConfig) -> bool:
    return cfg.start_method in (None, "fork") and "fork" in mp.get_all_start_methods()


def _probe_in_child(env_fn: EnvFn) -> tuple[StepProfile, EnvFacts]:
    """:func:`_measure` in a forked child: building and stepping ``env_fn(0)`` in a thread of
    this process would hold the GIL in C code (a MuJoCo model's first build: ~80 ms), which
    stalls the caller's event loop. The child's own CPU clock is then the probe's alone. Called
    from a private thread; the child is joined before this returns."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe_main, args=(child, env_fn), name="ebrl-sim-probe", daemon=True)
    proc.start()
    child.close()
    try:
        ok, value = parent.recv()
    except EOFError:
        ok, value = False, f"the probe process exited (exit code {proc.exitcode})"
    finally:
        parent.close()
        proc.join()
    if not ok:
        raise EnvStepError(0, "probe", value)
    return value


def _probe_main(conn, env_fn: EnvFn) -> None:
    ignore_stop_signals()
    try:
        conn.send((True, _measure(env_fn)))
    except Exception as exc:
        conn.send((False, describe(exc)))
    finally:
        conn.close()


def make_sim_pool(env_fn: EnvFn, num_envs: int, cfg: SimConfig, backend: SimBackend | None = None,
                  lanes: int | None = None, movable: bool = False) -> SimPool:
    """A pool for ``num_envs`` envs: ``num_envs // cfg.vector_size`` vector envs when that is > 1.
    Thread lanes: ``lanes`` (the controller's start decision), else ``cfg.num_threads``, else 2. With ``movable``
    (AUTO chose ``backend`` and the controller may move envs), thread or process envs go in a
    :class:`~ebrl.runtime.sim_mixed.MixedSimPool`, starting on ``backend``: envs can then move
    between lanes and workers. ``sim.backend="mixed"`` asks for that pool, starting on lanes."""
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
                            cfg.start_method, reply_hold_s=cfg.reply_hold_s)
    if backend is SimBackend.INLINE:
        return InlineSimPool(env_fn, num_envs, num_lanes=lanes, vector_size=size)
    if backend is SimBackend.THREAD:
        return ThreadSimPool(env_fn, num_envs, lanes, vector_size=size)
    return ProcessSimPool(env_fn, num_envs, cfg.num_workers or usable_cpus(), cfg.start_method,
                          reply_hold_s=cfg.reply_hold_s)
