"""The hosts that keep their units in this process: what they share (:class:`LocalHost`, also the
base of the lane host and of virtual time's), and :class:`InlineHost`, which steps on the event loop
(right for envs whose step costs less than a thread hop).
"""

from __future__ import annotations

import asyncio
from time import perf_counter, thread_time
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.errors import EnvStepError, TimedOut
from ebrl.runtime.sim.block import Outbox, StepRows
from ebrl.runtime.sim.stepping import EnvFn, build_unit, close_quietly, describe, reset_unit, single_spaces, step_unit
from ebrl.runtime.threads import in_thread
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")


class LocalHost:
    """Units (envs, or vector envs of ``vector_size``) living in this process, and their rows.
    ``hosted``: the units to build at start (None: all); the others arrive by :meth:`adopt`."""

    def __init__(self, env_fn: EnvFn, num_envs: int, outbox: Outbox, lanes: int, vector_size: int = 1,
                 build_timeout_s: float | None = None):
        self.env_fn, self.num_envs, self.outbox = env_fn, num_envs, outbox
        self.vector_size = vector_size
        self.num_units = num_envs // vector_size
        self.lanes = lanes
        self.rows: StepRows | None = None
        self.envs: list[gym.Env | None] = []  # None: not hosted here (on a worker), or left to a hung lane
        self.build_timeout_s = build_timeout_s
        self.unbuilt: dict[int, TimedOut] = {}  # units whose build timed out, until rebuilt
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, spaces: tuple[gym.Space, gym.Space] | None, hosted: set[int] | None = None
                    ) -> tuple[gym.Space, gym.Space]:
        """Build the ``hosted`` units off the event loop (64 MuJoCo envs take a few hundred ms to
        build); returns one env's spaces (``spaces``, else the first unit's)."""
        self._loop = asyncio.get_running_loop()
        self.envs = [None] * self.num_units
        for u in range(self.num_units) if hosted is None else sorted(hosted):
            self.envs[u] = await self._build_off_loop(u)
        first = next((env for env in self.envs if env is not None), None)
        if spaces is None and first is None:
            raise EnvStepError(min(self.unbuilt, default=0), "env_fn", self._build_timed_out())
        spaces = spaces or single_spaces(first)
        self.rows = StepRows(self.num_envs, *spaces)
        return spaces

    async def _build_off_loop(self, unit: int) -> gym.Env | None:
        """``env_fn(unit)`` in a thread of its own; None past ``build_timeout_s`` (the thread is left,
        and the unit recorded in ``unbuilt``: its first reset fails as ``timeout``, and the driver rebuilds it)."""
        try:
            return await in_thread(self._build, unit, name="ebrl-sim-build", timeout_s=self.build_timeout_s,
                                   may_hang=True)
        except TimeoutError:
            self.unbuilt[unit] = self._build_timed_out()
            log.warning("env_build_timed_out", unit=unit, limit_s=self.build_timeout_s)
            return None

    def _build_timed_out(self) -> TimedOut:
        return TimedOut(f"its build ran past faults.build_timeout_s={self.build_timeout_s:g} s (its thread was left)")

    def _build(self, unit: int) -> gym.Env:
        return build_unit(self.env_fn, unit, self.vector_size)

    def _ids(self, unit: int) -> np.ndarray:
        return np.arange(self.vector_size) + unit * self.vector_size

    def _units(self, ids: np.ndarray) -> list[int]:
        return ids.tolist() if self.vector_size == 1 else (ids[:: self.vector_size] // self.vector_size).tolist()

    def _step(self, unit: int, queued_s: float = 0.0) -> float:
        """Step one unit and count its cost (``queued_s``: its wait for a lane); returns its declared cost."""
        t0, c0 = perf_counter(), thread_time()
        declared = self._commit(unit)
        self._add_cost(unit, perf_counter() - t0, thread_time() - c0, queued_s)
        return declared

    def _add_cost(self, unit: int, wall: float, cpu: float, queued_s: float) -> None:
        """One step of ``unit`` in its rows' costs (a vector env's: every row waited through the call)."""
        if self.vector_size == 1:
            self.rows.add_cost(unit, wall, cpu, queued_s)
        else:
            self.rows.cost[self._ids(unit)] += (1.0, wall, cpu, queued_s)

    def _commit(self, unit: int) -> float:
        """Step the unit into the rows (the lane host checks, first, that it was not abandoned)."""
        return step_unit(self.envs[unit], self.rows, unit, self.vector_size)

    def _errors(self, unit: int, exc: BaseException) -> list[tuple[int, str]]:
        return [(i, describe(exc)) for i in self._ids(unit).tolist()]

    # the rare calls, run where the host runs them (_call): inline, or in a lane

    def _reset(self, unit: int, seed: Any) -> tuple[Any, Any]:
        if unit in self.unbuilt:  # never built: the driver rebuilds it
            raise EnvStepError(unit, "env_fn", self.unbuilt[unit])
        return reset_unit(self.envs[unit], seed, self.vector_size)

    def _rebuild(self, unit: int) -> None:
        self._drop(unit)
        self._keep(unit, self._build(unit))

    def _keep(self, unit: int, env: gym.Env) -> None:
        """Make ``env`` unit ``unit``'s (the lane host checks, first, that the call was not abandoned)."""
        self.envs[unit] = env
        self.unbuilt.pop(unit, None)

    def _adopt(self, unit: int, seed: Any) -> tuple[Any, Any]:
        """Build unit ``unit`` here (it was hosted elsewhere) and reset it; nothing is kept if either fails."""
        env = self._build(unit)
        try:
            out = reset_unit(env, seed, self.vector_size)
        except Exception as exc:
            close_quietly(env)
            raise EnvStepError(unit, "reset", describe(exc)) from exc
        self._keep(unit, env)
        return out

    def _drop(self, unit: int) -> None:
        env, self.envs[unit] = self.envs[unit], None  # None: not here, or left to a lane that hung in it
        close_quietly(env)

    async def _call(self, unit: int, op: str, fn, *args):
        """``fn(*args)`` where the host runs its rare calls; an exception becomes the unit's :class:`EnvStepError`."""
        try:
            return await self._invoke(unit, fn, args)
        except EnvStepError:
            raise
        except Exception as exc:
            raise EnvStepError(unit, op, describe(exc)) from exc

    async def _invoke(self, unit: int, fn, args):
        return fn(*args)  # on the loop; the lane host runs it in a lane

    async def reset(self, unit: int, seed: Any = None) -> tuple[Any, Any]:
        return await self._call(unit, "reset", self._reset, unit, seed)

    async def rebuild(self, unit: int) -> None:
        await self._call(unit, "env_fn", self._rebuild, unit)

    async def adopt(self, unit: int, seed: Any = None) -> tuple[Any, Any]:
        """Build unit ``unit`` from ``env_fn`` and reset it (it moves here from a worker);
        :class:`EnvStepError` (op ``env_fn`` or ``reset``) keeps nothing."""
        return await self._call(unit, "env_fn", self._adopt, unit, seed)

    async def drop(self, unit: int) -> None:
        """Close unit ``unit`` and forget it (it moved elsewhere)."""
        await self._call(unit, "close", self._drop, unit)

    def abandon_late(self, limit_s: float) -> list[int]:
        return []

    def abandon(self, unit: int, limit_s: float) -> bool:
        return False

    def close(self) -> None:
        for env in self.envs:
            close_quietly(env)
        self.envs = []


class InlineHost(LocalHost):
    """Steps on the event loop: every block submitted within one loop iteration in one call soon
    after, back as one block. A hung inline step holds the event loop itself: nothing can give it up."""

    backend = SimBackend.INLINE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: list[np.ndarray] = []

    def resize(self, n: int) -> None:
        self.lanes = n  # one loop steps them all: nothing to start or stop

    def submit(self, ids: np.ndarray, actions: Any) -> None:
        self.rows.set_actions(ids, actions)
        if not self._pending:
            self._loop.call_soon(self._run)
        self._pending.append(ids)

    def _run(self) -> None:
        pending, self._pending = self._pending, []
        ids = pending[0] if len(pending) == 1 else np.concatenate(pending)
        errors: list[tuple[int, str]] = []
        # inline steps are cheap by definition (< sim.inline_below_s): timing each would cost as
        # much as a no-op step, so the batch is timed once and its time split evenly
        t0, c0 = perf_counter(), thread_time()
        for unit in self._units(ids):
            try:
                self._commit(unit)
            except Exception as exc:
                errors += self._errors(unit, exc)
        if errors:
            ids = ids[~np.isin(ids, [i for i, _ in errors])]
        if n := len(ids):
            self.rows.cost[ids] += (1.0, (perf_counter() - t0) / n, (thread_time() - c0) / n, 0.0)
        self.outbox.put(self.rows.block(ids, errors))

    async def rebuild(self, unit: int) -> None:
        """Build the unit anew: off the loop, under ``build_timeout_s``."""
        self._drop(unit)
        env = await self._build_off_loop(unit)
        if env is None:
            raise EnvStepError(unit, "env_fn", self.unbuilt[unit])
        self._keep(unit, env)
