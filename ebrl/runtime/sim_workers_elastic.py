"""ElasticWorkers: the abilities of :class:`~ebrl.runtime.sim_workers.ProcessSimPool` that change
where envs live and how many workers there are: start with none (:meth:`~ElasticWorkers.start_empty`),
move an idle env between workers (:meth:`~ElasticWorkers.migrate`) or out of the pool
(:meth:`~ElasticWorkers.evict`), add workers (:meth:`~ElasticWorkers.grow`,
:meth:`~ElasticWorkers.resize`) and retire empty ones. A mixin: it works on the pool's state
(``_workers``, ``_placement``, ``_moving``, ...) through the pool's own methods.
"""

from __future__ import annotations

import asyncio
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.sim_worker_link import WorkerLink
from ebrl.runtime.threads import forget, in_thread

NOWHERE = -1  # the placement of an env this pool does not host (a mixed pool's env on thread lanes)


class ElasticWorkers:
    """Migration, eviction and resizing for :class:`~ebrl.runtime.sim_workers.ProcessSimPool`."""

    async def start_empty(self, obs_space: gym.Space, act_space: gym.Space) -> None:
        """Start hosting no env and no worker yet (a mixed pool's workers, before any env moves
        there): :meth:`grow` adds workers, :meth:`migrate` moves envs in (placement ``NOWHERE``
        until then). The shared memory is made by the first :meth:`grow`: a run whose envs never
        move here starts no resource tracker and maps nothing."""
        self._loop = asyncio.get_running_loop()
        self.observation_space, self.action_space = obs_space, act_space
        self._placement[:] = NOWHERE
        self._num_workers = 0

    async def evict(self, env_id: int) -> None:
        """Close idle env ``env_id`` in its worker and host it no more (it moved out of the pool)."""
        self._check_open()
        env_id = int(env_id)
        if self._busy[env_id] or env_id in self._moving:
            raise ValueError(f"env {env_id} is stepping or migrating")
        worker = self._workers[self._placement[env_id]]
        self._placement[env_id] = NOWHERE
        if worker.dead is None:
            await self._request_to(worker, "drop", env_id, None)

    async def migrate(self, env_id: int, worker: int, seed: int | None = None) -> tuple[Any, dict]:
        """Move idle env ``env_id`` to ``worker``, where it is built anew from ``env_fn`` and
        reset with ``seed``; returns that reset's ``(obs, info)``. Meant for an episode boundary:
        the env's state is not carried over.

        The new worker builds the env first: if ``env_fn`` (or the reset) raises there, this
        raises :class:`EnvStepError` (op ``env_fn`` or ``reset``) and the env stays, unchanged,
        where it was. Only then is the env placed on ``worker`` and the old copy closed (the old
        worker does that after whatever it is stepping; steps of the env go to ``worker`` from
        the moment this returns). An env on a dead worker can be migrated off it (recovering it).
        Raises ValueError if the env is stepping, migrating, has a reset or rebuild in flight,
        or is on ``worker`` already; RuntimeError if ``worker`` is dead.
        """
        self._check_open()
        env_id, worker = int(env_id), int(worker)
        if not 0 <= env_id < self.num_envs:
            raise ValueError(f"no env {env_id}: the pool has {self.num_envs}")
        if not 0 <= worker < self._num_workers:
            raise ValueError(f"no worker {worker}: the pool has {self._num_workers}")
        if env_id in self._moving:
            raise ValueError(f"env {env_id} is migrating already")
        old = int(self._placement[env_id])
        if worker == old:
            raise ValueError(f"env {env_id} is already on worker {worker}")
        if self._busy[env_id]:
            raise ValueError(f"env {env_id} is stepping: migrate it between steps")
        source, target = (None if old == NOWHERE else self._workers[old]), self._workers[worker]
        if source is not None and any(e == env_id for e, _, _ in source.waiting):
            raise ValueError(f"env {env_id} has a reset or rebuild in flight")
        adopt = self._request_to(target, "adopt", env_id, seed)
        self._moving[env_id] = worker
        try:
            out = await adopt
        except EnvStepError as exc:
            raise EnvStepError(env_id, exc.op, f"in worker {worker}: {exc.detail}") from None
        except asyncio.CancelledError:
            if target.dead is None and not self._closed:  # it may have built the env: it must not keep it
                self._request_to(target, "drop", env_id, None).add_done_callback(forget)
            raise
        finally:
            del self._moving[env_id]
        self._placement[env_id] = worker
        self._lost.pop(env_id, None)
        self.migrations += 1
        if source is not None and source.dead is None:
            self._request_to(source, "drop", env_id, None).add_done_callback(forget)
        return out

    @property
    def workers(self) -> int:
        return self.size

    def resize_workers(self, n: int) -> None:
        self.resize(n)

    def resize(self, n: int) -> None:
        """Grow to ``n`` workers (new ones host no env until :meth:`migrate` moves some there),
        or shrink by retiring workers ``n..size-1``, which must host no env (ValueError, naming
        the envs still on them, otherwise)."""
        self._check_open()
        n = int(n)
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        W = self._num_workers
        if n < W:
            hosted = np.flatnonzero(self._placement >= n).tolist()
            hosted += [i for i, w in self._moving.items() if w >= n]
            if hosted:
                raise ValueError(f"workers {n}..{W - 1} still host envs {sorted(hosted)}: migrate them first")
            for worker in self._workers[n:]:
                self._retire(worker)
            del self._workers[n:]
        for w in range(W, n):
            worker = self._spawn(w)
            self._workers.append(worker)
            worker.watch(self._on_readable, worker)
        self._num_workers = n

    async def grow(self, n: int) -> None:
        """:meth:`resize` up to ``n`` workers, forking each off the event loop (a fork copies this
        process's page tables holding the GIL: milliseconds with torch loaded). A worker being
        forked when the caller is cancelled, or the pool closed, is joined by :meth:`close`."""
        if self._rows is None and self._loop is not None and not self._closed:  # started empty
            await in_thread(self._make_rows, name="ebrl-sim-shm")  # starting the tracker forks
        self._check_open()

        def spawn(w: int) -> WorkerLink:
            worker = self._spawn(w)
            self._starting.append(worker)  # close() finds it there, whatever happens to the caller
            return worker

        for w in range(self._num_workers, int(n)):
            worker = await in_thread(spawn, w, name="ebrl-sim-spawn")
            if self._closed:  # closed while it forked: close() has joined the others
                WorkerLink.stop([worker])
                return
            self._starting.remove(worker)
            self._workers.append(worker)
            worker.watch(self._on_readable, worker)
            self._num_workers = w + 1

    def _retire(self, worker: WorkerLink) -> None:
        self._flush_worker(worker)  # a drop not yet sent still closes its env
        worker.retire()
        self._retired.append(worker)  # joined at close

