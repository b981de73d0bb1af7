"""MixedSimPool: thread lanes and worker processes in one pool, each env where its step runs best.

A step that mostly waits (a sleep, a device, a C++ simulator that releases the GIL) overlaps
with others on thread lanes in this process; a step that computes in Python holds the GIL, so
it belongs in a worker process. One run may have both kinds of env. This pool hosts each env
on one of two parts, a :class:`~ebrl.runtime.sim_threads.ThreadSimPool` and a
:class:`~ebrl.runtime.sim_workers.ProcessSimPool`, and :meth:`MixedSimPool.migrate` moves an
idle env between them (or between workers) at an episode end, rebuilt from ``env_fn`` where it
goes. The resource controller decides the moves from each env's measured step
(:func:`~ebrl.runtime.resources.controller.backend_rule`).

``placement[i]`` is env ``i``'s worker, or ``LOCAL`` (-1) on the lanes. All envs start on
one part (the AUTO probe's choice); the other starts empty and gets workers or lanes when envs
move there. :attr:`backend` says where the envs are now: ``thread`` or ``process`` while all are
on one part, ``mixed`` once they are split.

    >>> import asyncio, numpy as np
    >>> from ebrl.testing import MockEnv
    >>> async def demo():
    ...     pool = MixedSimPool(lambda i: MockEnv(dim=2), num_envs=2, lanes=2, workers=1)
    ...     await pool.start()
    ...     await pool.grow(1)
    ...     await pool.migrate(1, 0)                # env 1 to worker 0; env 0 stays on the lanes
    ...     pool.submit(np.array([0, 1]), np.zeros((2, 2), np.float32))
    ...     back = 0
    ...     while back < 2:                         # both parts answer through one recv()
    ...         back += len((await pool.recv()).ids)
    ...     pool.close()
    ...     return pool.placement.tolist(), pool.backend.value
    >>> asyncio.run(demo())
    ([-1, 0], 'mixed')
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.sim_threads import ThreadSimPool
from ebrl.runtime.sim_types import ElasticPool, EnvFn, SimPool
from ebrl.runtime.sim_workers import ProcessSimPool
from ebrl.runtime.sim_workers_elastic import NOWHERE
from ebrl.spaces import index

LOCAL = NOWHERE  # an env on the thread lanes: its worker pool hosts it nowhere


class MixedSimPool(ElasticPool):
    """Envs on thread lanes (``placement == LOCAL``) or in worker processes; see the module docstring."""

    resizable = True  # the lanes (``size``); workers change with grow() and resize_workers()
    mixed = True

    def __init__(self, env_fn: EnvFn, num_envs: int, lanes: int, workers: int, start: SimBackend = SimBackend.THREAD,
                 start_method: str | None = None, reply_hold_s: float = 0.002,
                 spaces: tuple[gym.Space, gym.Space] | None = None, build_timeout_s: float | None = None):
        if start not in (SimBackend.THREAD, SimBackend.PROCESS):
            raise ValueError(f"a mixed pool starts its envs on threads or processes, not {start.value!r}")
        self.threads = ThreadSimPool(env_fn, num_envs, lanes, spaces=spaces, build_timeout_s=build_timeout_s)
        self.processes = ProcessSimPool(env_fn, num_envs, workers, start_method, reply_hold_s=reply_hold_s,
                                        spaces=spaces, build_timeout_s=build_timeout_s)
        self._start = start
        self._local = np.full(num_envs, start is SimBackend.THREAD)  # env -> on the lanes
        self._moved_out = 0  # envs moved from a worker to the lanes
        super().__init__(env_fn, num_envs)
        self.threads.outbox = self.processes.outbox = self.outbox  # both parts deliver straight to recv()

    @property
    def backend(self) -> SimBackend:
        local = int(self._local.sum())
        if local == self.num_envs:
            return SimBackend.THREAD
        return SimBackend.PROCESS if local == 0 else SimBackend.MIXED

    @property
    def size(self) -> int:
        """What hosts the envs now: the lanes, the workers, or both once the envs are split."""
        backend = self.backend
        if backend is SimBackend.THREAD:
            return self.threads.size
        return self.processes.size if backend is SimBackend.PROCESS else self.threads.size + self.processes.size

    @property
    def lanes(self) -> int:
        return self.threads.size

    @property
    def workers(self) -> int:
        return self.processes.size

    @property
    def placement(self) -> np.ndarray:
        """Env -> worker, ``LOCAL`` for an env on the lanes (a copy)."""
        return self.processes.placement  # NOWHERE there is LOCAL here

    @property
    def respawns(self) -> int:
        return self.processes.respawns

    @property
    def migrations(self) -> int:
        return self.processes.migrations + self._moved_out

    async def start(self) -> None:
        if self._start is SimBackend.THREAD:
            await self.threads.start()
            await self.processes.start_empty(self.threads.observation_space, self.threads.action_space)
            first = self.threads
        else:
            try:
                await self.processes.start()
                self.threads.hosted = set()
                self.threads.spaces = (self.processes.observation_space, self.processes.action_space)
                await self.threads.start()
            except BaseException:
                self.close()
                raise
            first = self.processes
        self.observation_space, self.action_space = first.observation_space, first.action_space

    def submit(self, ids: np.ndarray, actions: Any) -> None:
        local = self._local[ids]
        if local.all():
            self.threads.submit(ids, actions)
        elif not local.any():
            self.processes.submit(ids, actions)
        else:
            self.threads.submit(ids[local], index(actions, local))
            self.processes.submit(ids[~local], index(actions, ~local))

    def _part(self, env_id: int) -> SimPool:
        return self.threads if self._local[env_id] else self.processes

    async def reset(self, env_id: int, seed: Any = None) -> tuple[Any, Any]:
        return await self._part(env_id).reset(env_id, seed)

    async def rebuild(self, env_id: int) -> None:
        await self._part(env_id).rebuild(env_id)

    async def migrate(self, env_id: int, worker: int, seed: int | None = None) -> tuple[Any, dict]:
        """Move idle env ``env_id`` to ``worker``, or to the lanes (``LOCAL``), rebuilt there from
        ``env_fn`` and reset with ``seed``; returns that reset's ``(obs, info)``. If the build or
        the reset fails (:class:`EnvStepError`), the env stays where it was."""
        env_id, worker = int(env_id), int(worker)
        if worker != LOCAL and self._local[env_id]:  # lanes -> a worker
            out = await self.processes.migrate(env_id, worker, seed)
            self._local[env_id] = False
            await self.threads.drop(env_id)
            return out
        if worker == LOCAL:
            if self._local[env_id]:
                raise ValueError(f"env {env_id} is already on the thread lanes")
            out = await self.threads.adopt(env_id, seed)  # a worker -> the lanes
            self._local[env_id] = True
            self._moved_out += 1
            await self.processes.evict(env_id)
            return out
        return await self.processes.migrate(env_id, worker, seed)  # between workers

    def abandon_late(self, limit_s: float) -> list[int]:
        return self.threads.abandon_late(limit_s) + self.processes.abandon_late(limit_s)

    def abandon(self, env_id: int, limit_s: float) -> bool:
        return self._part(env_id).abandon(env_id, limit_s)

    def resize(self, n: int) -> None:
        """Thread lanes."""
        self.threads.resize(n)

    async def grow(self, n: int) -> None:
        """Worker processes, up to ``n`` (forked off the event loop)."""
        await self.processes.grow(n)

    def resize_workers(self, n: int) -> None:
        self.processes.resize(n)

    def worker_pids(self) -> list[int]:
        return self.processes.worker_pids()

    def set_reset_seeds(self, ids: np.ndarray, seeds: np.ndarray) -> None:
        self.threads.set_reset_seeds(ids, seeds)  # both: an env may move between them
        self.processes.set_reset_seeds(ids, seeds)

    def costs(self) -> np.ndarray | None:
        # each part counts the steps its envs took there; an env that moved has rows in both
        a, b = self.threads.costs(), self.processes.costs()
        if a is None or b is None:
            return a if b is None else b
        return a + b

    def close(self) -> None:
        self.threads.close()
        self.processes.close()
        self.outbox.close()
