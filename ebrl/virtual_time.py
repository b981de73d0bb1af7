"""Virtual time: an event loop whose clock jumps to the next timer whenever nothing is ready, and
the platform (:mod:`ebrl.runtime.platform`) that runs ``ebrl.run`` on it.

Scheduler tests run on it to be exact and fast: a MockEnv step of 10 ms "takes" 10 ms of loop
time and no wall time. Nothing may run in threads on it (their real duration would be
invisible), so :func:`virtual_platform` runs every call inline and charges its declared cost
with ``asyncio.sleep``: a policy's and an algorithm's ``virtual_cost(size)``, an env step's
``virtual_step_cost``. The runtime itself is the real one: the same probe (inline), start rules,
controller, learner loop and evaluation.

    >>> import asyncio
    >>> async def nap():
    ...     t0 = asyncio.get_running_loop().time()
    ...     await asyncio.sleep(3600)
    ...     return asyncio.get_running_loop().time() - t0
    >>> with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
    ...     runner.run(nap())
    3600.0
"""

from __future__ import annotations

import asyncio
import functools
import selectors
from collections.abc import Callable
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend, SimConfig
from ebrl.runtime.platform import Platform
from ebrl.runtime.sim.local import InlineHost
from ebrl.runtime.stage import Stage

T = TypeVar("T")
VIRTUAL_CORES = 2  # the virtual machine's cores, whatever this one has: a run repeats on any machine


class _JumpingSelector:
    """Wraps the loop's selector: polls real I/O, and where the loop would sleep, advances the clock."""

    def __init__(self, inner: selectors.BaseSelector, loop: "VirtualTimeLoop"):
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None):
        events = self._inner.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer pending: only real I/O (a thread calling back) can wake us
            return self._inner.select(None)
        self._loop._now += timeout
        return []

    def __getattr__(self, name):
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop with a virtual clock starting at 0."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._selector = _JumpingSelector(self._selector, self)

    def time(self) -> float:
        return self._now


class InlineStage(Stage):
    """A stage whose calls run inline on the loop and then sleep ``cost(size)`` virtual seconds."""

    threads = False

    def __init__(self, name: str, cost: Callable[[int], float] | None = None):
        super().__init__(name)
        self.cost = cost

    async def call(self, fn: Callable[..., T], *args: Any, thread: bool = False, size: int = 0) -> T:
        loop = asyncio.get_running_loop()
        self._started = t0 = loop.time()
        try:
            result = fn(*args)
            if self.cost is not None:
                await asyncio.sleep(float(self.cost(size)))
        finally:
            self._started = None
        self.last_s, self.last_cpu_s = loop.time() - t0, 0.0
        self.busy_s += self.last_s
        self.calls += 1
        return result

    async def aside(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def start_thread(self) -> None:
        pass


class VirtualHost(InlineHost):
    """The local host of virtual time: each unit's step holds one of ``lanes`` lanes while its
    declared cost (``virtual_step_cost``) is charged with ``asyncio.sleep``; builds run inline."""

    backend = SimBackend.THREAD

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lane_sem: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, spaces, hosted=None):
        self._lane_sem = asyncio.Semaphore(self.lanes)
        return await super().start(spaces, hosted)

    async def _build_off_loop(self, unit: int) -> gym.Env | None:
        return self._build(unit)

    async def rebuild(self, unit: int) -> None:
        await self._call(unit, "env_fn", self._rebuild, unit)

    def resize(self, n: int) -> None:
        delta, self.lanes = n - self.lanes, n
        for _ in range(max(delta, 0)):
            self._lane_sem.release()
        for _ in range(max(-delta, 0)):  # shrink lazily: lanes are taken as steps finish
            self._spawn(self._lane_sem.acquire())

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def submit(self, ids: np.ndarray, actions: Any) -> None:
        self.rows.set_actions(ids, actions)
        for unit in self._units(ids):
            self._spawn(self._virtual_step(unit))

    def _step(self, unit: int, queued_s: float = 0.0) -> float:
        declared = self._commit(unit)
        self._add_cost(unit, declared, 0.0, queued_s)  # all of it waiting: a virtual run's CPU time means nothing
        return declared

    async def _virtual_step(self, unit: int) -> None:
        t_in = self._loop.time()
        async with self._lane_sem:
            try:
                cost = self._step(unit, self._loop.time() - t_in)
            except Exception as exc:
                self.outbox.put(self.rows.block(np.zeros(0, np.int64), self._errors(unit, exc)))
                return
            if cost > 0:
                await asyncio.sleep(cost)
            self.outbox.put(self.rows.block(self._ids(unit)))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        super().close()


class VirtualInlineHost(VirtualHost):
    """``sim.backend="inline"`` under virtual time (the same lanes: only the name differs)."""

    backend = SimBackend.INLINE


class _Meter(gym.Wrapper):
    """Adds each step's declared cost to ``spent``: the clock the probe times steps on."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.spent = 0.0

    def step(self, action):
        out = self.env.step(action)
        self.spent += float(getattr(self.env.unwrapped, "virtual_step_cost", 0.0))
        return out


class VirtualExecutor:
    """Every call inline on the loop; stages charge their owner's ``virtual_cost(size)``; no
    child processes; :data:`VIRTUAL_CORES` cores."""

    processes = False
    threads = False

    def __init__(self, cores: int = VIRTUAL_CORES):
        self.cores = cores

    def cpus(self) -> int:
        return self.cores

    def stage(self, name: str, owner: Any) -> Stage:
        return InlineStage(name, getattr(owner, "virtual_cost", None))

    async def call(self, fn: Callable[..., T], *args: Any, name: str, may_hang: bool = False,
                   timeout_s: float | None = None) -> T:
        return fn(*args)

    def metered(self, env: gym.Env) -> tuple[gym.Env, tuple[Callable[[], float], Callable[[], float]]]:
        """``env`` wrapped so that its steps' declared costs are the probe's wall and CPU clocks."""
        if not isinstance(env, gym.Env):  # a vector env: the probe reads its facts, never times it
            return env, (lambda: 0.0, lambda: 0.0)
        meter = _Meter(env)
        clock = lambda: meter.spent
        return meter, (clock, clock)


def virtual_pool(env_fn, num_envs: int, cfg: SimConfig, *, backend: SimBackend | None = None,
                 lanes: int | None = None, cores: int = VIRTUAL_CORES, **kwargs):
    """A :class:`~ebrl.runtime.sim.pool.SimPool` on virtual lanes: ``thread`` and ``inline`` as
    asked, ``process`` and ``mixed`` as one lane per worker (``sim.num_workers``, else a core)."""
    from ebrl.runtime.sim import SimPool

    if SimBackend(backend or cfg.backend) in (SimBackend.PROCESS, SimBackend.MIXED):
        backend, lanes = SimBackend.THREAD, lanes or cfg.num_workers or cores
    kwargs["movable"] = False
    return SimPool(env_fn, num_envs, cfg, backend=backend, lanes=lanes,
                   local_hosts={SimBackend.INLINE: VirtualInlineHost, SimBackend.THREAD: VirtualHost}, **kwargs)


def _no_sampler(nvml: Any) -> None:
    return None  # a virtual run's hardware use means nothing, and its history stays deterministic


def virtual_platform(cores: int = VIRTUAL_CORES) -> Platform:
    """The platform of a virtual-time run (see the module docstring): ``ebrl.run(trainer,
    platform=virtual_platform())`` on a :class:`VirtualTimeLoop`."""
    return Platform(executor=VirtualExecutor(cores), sim_pool=functools.partial(virtual_pool, cores=cores),
                    sampler=_no_sampler, loop_factory=VirtualTimeLoop)
