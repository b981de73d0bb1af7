"""SimPool: every env of a run, each on a host, behind one send/recv interface.

Each env steps on the **local host** (:class:`~ebrl.runtime.sim.local.InlineHost` on the event
loop, :class:`~ebrl.runtime.sim.lanes.LaneHost` on lane threads) or the **worker host**
(:class:`~ebrl.runtime.sim.workers.WorkerHost`: processes, for GIL-bound Python envs). Every host
steps a unit with :func:`~ebrl.runtime.sim.stepping.step_unit` and hands back blocks through the
pool's one outbox. A pool whose envs may move has both hosts; :meth:`SimPool.migrate` moves an env
at an episode end, rebuilt from ``env_fn`` where it goes.

    >>> import asyncio, gymnasium as gym
    >>> from ebrl.config import SimConfig
    >>> async def demo():
    ...     pool = SimPool(lambda i: gym.make("CartPole-v1"), 2, SimConfig(backend="inline"))
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

from collections.abc import Awaitable
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import ConfigError, FaultConfig, SimBackend, SimConfig
from ebrl.runtime.probe import EnvProbe
from ebrl.runtime.sim.block import Block, Outbox
from ebrl.runtime.sim.lanes import LaneHost
from ebrl.runtime.sim.local import InlineHost, LocalHost
from ebrl.runtime.sim.stepping import EnvFn
from ebrl.runtime.sim.workers import NOWHERE, WorkerHost
from ebrl.runtime.threads import usable_cpus
from ebrl.spaces import index

DEFAULT_LANES = 2  # thread lanes when neither the probe nor sim.num_threads says
LOCAL_HOSTS = {SimBackend.INLINE: InlineHost, SimBackend.THREAD: LaneHost}  # the local host of each backend
LOCAL = NOWHERE  # the placement of an env on the local host: no worker hosts it


class SimPool:
    """``num_envs`` envs built by ``env_fn(i)`` (or ``num_envs // sim.vector_size`` vector envs):
    :meth:`submit` starts the steps of a block of idle envs and returns at once; their results come
    back from ``await pool.recv()`` (PufferLib's and EnvPool's send/recv). A *unit* is one env, or
    one vector env (``reset`` and ``rebuild`` take units; ``submit`` takes env ids, whole units).

    ``backend`` defaults to ``cfg.backend`` (``auto`` is the start rule's to resolve, except for
    vector envs, which go on lanes). With ``movable``, plain envs get both hosts. ``spaces``: env
    0's, so nothing is built to learn them. ``local_hosts``: the local host class of the ``inline``
    and ``thread`` backends (virtual time replaces them).
    """

    def __init__(self, env_fn: EnvFn, num_envs: int, cfg: SimConfig | None = None, *,
                 backend: SimBackend | None = None, lanes: int | None = None, movable: bool = False,
                 spaces: tuple[gym.Space, gym.Space] | None = None, build_timeout_s: float | None = None,
                 local_hosts: dict[SimBackend, type[LocalHost]] | None = None):
        cfg = cfg or SimConfig()
        backend = SimBackend(backend or cfg.backend)
        size = self.vector_size = cfg.vector_size
        if size > 1:
            # a vectorised (typically GPU) simulator lives in this process, and one call steps many
            # envs, so it is worth a thread hop
            if backend in (SimBackend.PROCESS, SimBackend.MIXED):
                raise ConfigError("sim.backend", backend.value, f"vector envs (sim.vector_size={size}) step in "
                                  "this process: use 'thread', 'inline' or 'auto'")
            backend = SimBackend.THREAD if backend is SimBackend.AUTO else backend
        elif backend is SimBackend.AUTO:
            raise ValueError("sim.backend='auto' for plain envs is the controller's to resolve from the probe's step "
                             "(ebrl.runtime.resources.rules_start.sim_start): pass the backend it chose")
        self.env_fn, self.num_envs, self.spaces = env_fn, num_envs, spaces
        self.outbox = Outbox()
        lanes = lanes or cfg.num_threads or DEFAULT_LANES
        both = backend is SimBackend.MIXED or (movable and size == 1 and backend is not SimBackend.INLINE)
        self.local: LocalHost | None = None
        self.remote: WorkerHost | None = None
        if backend is not SimBackend.PROCESS or both:
            kind = (local_hosts or LOCAL_HOSTS)[SimBackend.INLINE if backend is SimBackend.INLINE else SimBackend.THREAD]
            self.local = kind(env_fn, num_envs, self.outbox, lanes, size, build_timeout_s)
        if backend is SimBackend.PROCESS or both:
            self.remote = WorkerHost(env_fn, num_envs, self.outbox, cfg.num_workers or usable_cpus(),
                                     cfg.start_method, cfg.reply_hold_s, build_timeout_s)
        self.hosts = [h for h in (self.local, self.remote) if h is not None]
        self.start_method, self.build_timeout_s = cfg.start_method, build_timeout_s
        self.on_local = np.full(num_envs, backend is not SimBackend.PROCESS)  # env -> on the local host
        self.mixed = both  # envs may move between the lanes and the workers
        self.movable = self.remote is not None and size == 1  # envs on workers can move
        self.resizable = self.local is not None  # the lanes
        self._moved_out = 0  # envs moved from a worker to the lanes
        self.observation_space: gym.Space | None = None
        self.action_space: gym.Space | None = None

    @property
    def backend(self) -> SimBackend:
        """Where the envs step now: ``mixed`` once they are split between the hosts."""
        local = int(np.count_nonzero(self.on_local))
        if local == self.num_envs:
            return self.local.backend
        return SimBackend.PROCESS if local == 0 else SimBackend.MIXED

    @property
    def lanes(self) -> int:
        return self.local.lanes if self.local is not None else 0

    @property
    def workers(self) -> int:
        return self.remote.workers if self.remote is not None else 0

    @property
    def size(self) -> int:
        """What hosts the envs now: the lanes, the workers, or both once the envs are split."""
        return (self.lanes if self.on_local.any() else 0) + (0 if self.on_local.all() else self.workers)

    @property
    def placement(self) -> np.ndarray:
        """Env -> worker, ``LOCAL`` for an env on the local host (a copy)."""
        return self.remote.placement if self.remote is not None else np.full(self.num_envs, LOCAL, np.int64)

    @property
    def respawns(self) -> int:
        """Worker processes replaced after dying."""
        return self.remote.respawns if self.remote is not None else 0

    @property
    def migrations(self) -> int:
        return (self.remote.migrations if self.remote is not None else 0) + self._moved_out

    def _host(self, env_id: int) -> LocalHost | WorkerHost:
        return self.local if self.on_local[env_id * self.vector_size] else self.remote

    async def start(self) -> None:
        """Build the envs where they start, and learn one env's spaces."""
        first, other = (self.local, self.remote) if self.on_local.all() else (self.remote, self.local)
        try:
            spaces = self.spaces
            if spaces is None and first is self.remote:  # env 0 built once, in a probe's child, to read them
                spaces = await self._probe_spaces()
            spaces = await first.start(spaces)
            if other is not None:
                await other.start(spaces, set())
        except BaseException:
            self.close()
            raise
        self.spaces = spaces
        self.observation_space, self.action_space = spaces

    async def _probe_spaces(self) -> tuple[gym.Space, gym.Space]:
        sim = SimConfig(backend=SimBackend.PROCESS, start_method=self.start_method)
        async with EnvProbe(self.env_fn, sim, FaultConfig(build_timeout_s=self.build_timeout_s)) as probe:
            facts = await probe.facts()
        return facts.observation_space, facts.action_space

    def submit(self, ids: np.ndarray, actions: Any) -> None:
        """Start a step for each env in ``ids`` (idle envs) with ``actions`` rows (a tree ``[B, ...]``)."""
        if self.remote is None:
            self.local.submit(ids, actions)
            return
        local = self.on_local[ids]
        if local.all():
            self.local.submit(ids, actions)
        elif not local.any():
            self.remote.submit(ids, actions)
        else:
            self.local.submit(ids[local], index(actions, local))
            self.remote.submit(ids[~local], index(actions, ~local))

    def recv(self) -> Awaitable[Block]:
        """The next block of finished steps (or of step errors), waiting until one is back;
        raises :class:`PoolClosed` once the pool is closed and every block was taken."""
        return self.outbox.get()

    async def reset(self, unit: int, seed: Any = None) -> tuple[Any, Any]:
        """Reset a unit (see :func:`~ebrl.runtime.sim.stepping.reset_unit`)."""
        return await self._host(unit).reset(unit, seed)

    async def rebuild(self, unit: int) -> None:
        """Close unit ``unit`` (ignoring its errors) and build it anew from ``env_fn``."""
        await self._host(unit).rebuild(unit)

    async def migrate(self, env_id: int, worker: int, seed: int | None = None) -> tuple[Any, dict]:
        """Move idle env ``env_id`` to ``worker``, or to the lanes (``LOCAL``), rebuilt there from
        ``env_fn`` and reset with ``seed``; returns that reset's ``(obs, info)``. If the build or
        the reset fails (:class:`EnvStepError`), the env stays where it was."""
        env_id, worker = int(env_id), int(worker)
        if not self.movable:
            raise ValueError(f"the {self.backend.value} backend's envs cannot move")
        if worker == LOCAL:
            if self.on_local[env_id] or self.local is None:
                raise ValueError(f"env {env_id} is already on the thread lanes" if self.on_local[env_id]
                                 else "this pool has no thread lanes")
            out = await self.local.adopt(env_id, seed)  # a worker -> the lanes
            self.on_local[env_id] = True
            self._moved_out += 1
            await self.remote.evict(env_id)
            return out
        out = await self.remote.adopt(env_id, worker, seed)  # the lanes, or another worker -> a worker
        if self.on_local[env_id]:
            self.on_local[env_id] = False
            await self.local.drop(env_id)
        return out

    def resize(self, n: int) -> None:
        """The local host's lanes."""
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        if self.local is None:
            raise ValueError(f"the {self.backend.value} sim backend has no lanes to resize")
        self.local.resize(n)

    async def grow(self, n: int) -> None:
        """Worker processes, up to ``n`` (forked off the event loop)."""
        await self.remote.grow(n)

    def resize_workers(self, n: int) -> None:
        """Retire the workers past ``n`` (their envs must have moved off first; :meth:`grow` adds)."""
        self.remote.resize(n)

    def worker_pids(self) -> list[int]:
        return self.remote.worker_pids() if self.remote is not None else []

    def abandon_late(self, limit_s: float) -> list[int]:
        """Give up the steps that started more than ``limit_s`` ago (not those still waiting for a
        lane or for worker-mates): each comes back as a :class:`TimedOut` error. Returns their units."""
        return [u for host in self.hosts for u in host.abandon_late(limit_s)]

    def abandon(self, unit: int, limit_s: float) -> bool:
        """Give up unit ``unit``'s reset or rebuild if it has *run* (not waited) over ``limit_s``."""
        return self._host(unit).abandon(unit, limit_s)

    def set_reset_seeds(self, ids: np.ndarray, seeds: np.ndarray) -> None:
        """The seeds of the autoresets inside the steps that end these envs' episodes (under
        ``RunConfig.reset_group``); both hosts' rows, as an env may move."""
        for host in self.hosts:
            if host.rows is not None:
                host.rows.reset_seed[ids] = np.asarray(seeds, np.int64) + 1

    def costs(self) -> np.ndarray | None:
        """The per-env step costs summed over both hosts (:attr:`StepRows.cost`), or None before start."""
        parts = [h.rows.cost.copy() for h in self.hosts if h.rows is not None and h.rows.cost is not None]
        return sum(parts[1:], parts[0]) if parts else None

    def close(self) -> None:
        """Release every thread, process and env. Safe to call twice."""
        for host in self.hosts:
            host.close()
        self.outbox.close()
