"""The lane host: a resizable set of threads sharing one queue of units to step, for simulators
that release the GIL while stepping (MuJoCo, C++ or GPU sims, anything that sleeps).

A lane wakes the loop only if no wake-up is pending, so finished steps come back a block per
wake-up. A step, reset or build past its deadline is abandoned: a new lane takes the stuck one's
place, the env is left to it (never touched again), and if the call ever returns nothing of it is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from time import perf_counter
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.errors import EnvStepError, TimedOut
from ebrl.runtime.sim.local import LocalHost
from ebrl.runtime.sim.stepping import close_quietly, step_unit
from ebrl.runtime.threads import CLOSE_WAIT_S, in_thread, settle
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")


class LaneHost(LocalHost):
    """Lane threads take units to step from one queue; finished steps come back a block per loop wake-up."""

    backend = SimBackend.THREAD

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._next_lane = 0
        self._lock = threading.Lock()
        self._done, self._failed = [], []  # units stepped and errors since the last drain
        self._t_submit = [0.0] * self.num_units  # perf_counter when each unit's step was queued
        # the lane running each unit's step, or its reset or rebuild, and a count per unit that
        # abandoning bumps (the lane, if it ever returns, sees it is no longer wanted and exits)
        self._stepping: dict[int, threading.Thread] = {}
        self._calling: dict[int, threading.Thread] = {}
        self._gen = [0] * self.num_units
        self._tls = threading.local()
        self.hung: list[threading.Thread] = []  # lanes abandoned in a step, replaced by new ones

    async def start(self, spaces, hosted=None):
        spaces = await super().start(spaces, hosted)
        # off the loop: starting 64 threads takes the loop ~20 ms
        await in_thread(self.resize, self.lanes, name="ebrl-sim-lanes")
        return spaces

    def resize(self, n: int) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        self.lanes = n
        for _ in range(n - len(self._threads)):
            self._start_lane()
        for _ in range(len(self._threads) - n):
            self._requests.put(None)  # a lane exits after the step it is running

    def _start_lane(self) -> None:
        t = threading.Thread(target=self._lane, name=f"ebrl-sim-{self._next_lane}", daemon=True)
        self._next_lane += 1
        t.start()
        self._threads.append(t)

    def submit(self, ids: np.ndarray, actions: Any) -> None:
        self.rows.set_actions(ids, actions)
        put = self._requests.put
        t, now = self._t_submit, perf_counter()
        for unit in self._units(ids):
            t[unit] = now
            put(unit)

    def _commit(self, unit: int) -> float:
        def write(*args) -> None:
            with self._lock:
                if self._gen[unit] != self._tls.gen:
                    raise _Abandoned
                self.rows.write(*args)
                self._stepping.pop(unit, None)
                self.rows.started[unit * self.vector_size] = 0.0

        return step_unit(self.envs[unit], self.rows, unit, self.vector_size, write)

    def _keep(self, unit: int, env: gym.Env) -> None:
        with self._lock:
            if self._gen[unit] != self._tls.gen:
                close_quietly(env)
                raise _Abandoned
            self.envs[unit] = env
            self.unbuilt.pop(unit, None)

    def _lane(self) -> None:
        me = threading.current_thread()
        while (item := self._requests.get()) is not None:
            if isinstance(item, tuple):  # a rare call (reset, rebuild, adopt, drop) with its future
                if not self._run_call(me, *item):
                    return
                continue
            # no lock: only a step that has run for the whole timeout is ever abandoned
            self._stepping[item] = me
            self._tls.gen = gen = self._gen[item]
            self.rows.started[item * self.vector_size] = perf_counter()
            try:
                self._step(item, perf_counter() - self._t_submit[item])
                failed = None
            except _Abandoned:
                return  # it hung past the timeout: another lane has taken this one's place
            except Exception as exc:
                failed = self._errors(item, exc)
            with self._lock:
                if self._gen[item] != gen:
                    return  # abandoned, then it raised
                self._stepping.pop(item, None)
                self.rows.started[item * self.vector_size] = 0.0
                wake = not self._done and not self._failed
                if failed is None:
                    self._done.append(item)
                else:
                    self._failed += failed
            if wake and not self._soon(self._drain):
                return

    def _run_call(self, me: threading.Thread, unit: int, gen: int, fn, args, fut) -> bool:
        """Run a queued call in this lane; False: this lane was abandoned in it (and exits)."""
        with self._lock:
            given_up = self._gen[unit] != gen
            if not given_up:
                self._calling[unit] = me
                self._tls.gen = gen
                self.rows.started[unit * self.vector_size] = perf_counter()
        if given_up:  # while it waited for a lane: it never runs
            self._settle(_given_up, (unit,), fut)
            return True
        self._settle(fn, args, fut)
        with self._lock:
            if self._gen[unit] != gen:
                return False  # abandoned past the timeout: another lane has taken this one's place
            self._calling.pop(unit, None)
            self.rows.started[unit * self.vector_size] = 0.0
        return True

    def _soon(self, fn, *args) -> bool:
        """``fn(*args)`` on the loop, from a lane; False: the loop was closed (shutdown)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            return False

    def _drain(self) -> None:
        with self._lock:
            units, self._done = self._done, []
            errors, self._failed = self._failed, []
        ids = np.array(units, np.int64)
        if self.vector_size > 1:
            ids = (ids[:, None] * self.vector_size + np.arange(self.vector_size)).ravel()
        self.outbox.put(self.rows.block(ids, errors))

    def _settle(self, fn, args, fut: asyncio.Future) -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, exc = None, e
        self._soon(settle, fut, result, exc)

    async def _invoke(self, unit: int, fn, args):
        fut = self._loop.create_future()
        self._requests.put((unit, self._gen[unit], fn, args, fut))
        return await fut

    def abandon_late(self, limit_s: float) -> list[int]:
        """Give up each unit whose step started over ``limit_s`` ago: it comes back as a :class:`TimedOut` error."""
        if self.rows is None:
            return []
        return [u for u in list(self._stepping) if self._give_up(u, self._stepping, limit_s)]

    def abandon(self, unit: int, limit_s: float) -> bool:
        """Give up unit ``unit``'s reset or build if it has run over ``limit_s`` in a lane (not waited for one)."""
        return self._give_up(unit, self._calling, limit_s)

    def _give_up(self, unit: int, busy: dict[int, threading.Thread], limit_s: float) -> bool:
        """Give up the unit's step (``busy``: ``_stepping``) or call if it has run over ``limit_s``:
        its env is left to the lane stuck in it, and a new lane takes that one's place."""
        step = busy is self._stepping
        with self._lock:
            lane, started = busy.get(unit), float(self.rows.started[unit * self.vector_size])
            if lane is None or not started or perf_counter() - started <= limit_s:
                return False  # queued behind busy lanes, or it finished meanwhile
            del busy[unit]
            self._gen[unit] += 1
            self.envs[unit] = None
            self.rows.started[unit * self.vector_size] = 0.0
            wake = step and not self._done and not self._failed
            if step:
                self._failed += [(i, TimedOut("the step ran past faults.step_timeout_s and was abandoned"))
                                 for i in self._ids(unit).tolist()]
        with contextlib.suppress(ValueError):
            self._threads.remove(lane)
        self.hung.append(lane)
        self._start_lane()
        if wake:
            self._loop.call_soon(self._drain)
        return True

    def close(self) -> None:
        """Stop the lanes, waiting ``CLOSE_WAIT_S`` at most; a lane still in a step then (a simulator
        hung in C code) is left behind, reported, with its env."""
        for _ in self._threads:
            self._requests.put(None)
        deadline = perf_counter() + CLOSE_WAIT_S
        for t in self._threads:
            t.join(max(0.0, deadline - perf_counter()))
        stuck = [t for t in self._threads + self.hung if t.is_alive()]
        if stuck:
            log.warning("sim_lanes_left_hung", lanes=[t.name for t in stuck],
                        hint="a step or reset that never returned (a simulator hung in C code); the threads are daemons")
        with self._lock:
            for u in [*self._stepping, *self._calling]:  # their envs stay with the hung lanes
                self.envs[u] = None
                self._gen[u] += 1
        self._threads, self.hung = [], stuck
        super().close()


def _given_up(unit: int) -> None:
    raise EnvStepError(unit, "call", TimedOut("given up (past faults.step_timeout_s) before it ran"))


class _Abandoned(Exception):
    """Raised in a lane whose step was abandoned, before it could touch the rows."""
