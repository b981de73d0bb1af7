"""The sim pools that keep their envs in this process: what they share (``LocalEnvs``), and
the inline one.

``InlineSimPool`` steps on the event loop thread: every block submitted within one loop
iteration runs in one call soon after, and comes back as one block. Right for envs whose step
costs less than a thread hop. Under virtual time each unit's step holds one of ``num_lanes``
lanes while its declared cost is charged with ``asyncio.sleep``. The thread pool
(:mod:`ebrl.runtime.sim_threads`) builds on the same ``LocalEnvs``; both also host vector envs
(:mod:`ebrl.runtime.vector_envs`), one unit per vector env.
"""

from __future__ import annotations

import asyncio
from time import perf_counter, thread_time
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.errors import EnvStepError, TimedOut
from ebrl.runtime.sim_types import (
    EnvFn,
    SimPool,
    StepRows,
    close_quietly,
    describe,
    reset_env,
    single_spaces,
    step_env,
)
from ebrl.runtime.threads import in_thread
from ebrl.runtime.vector_envs import check_vector_env, reset_vector_env, step_vector_env
from ebrl.runtime.virtual_time import is_virtual
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")


class LocalEnvs(SimPool):
    """Units (envs, or vector envs of ``vector_size``) living in this process, and their rows."""

    def __init__(self, env_fn: EnvFn, num_envs: int, vector_size: int = 1,
                 spaces: tuple[gym.Space, gym.Space] | None = None, build_timeout_s: float | None = None):
        super().__init__(env_fn, num_envs)
        self.vector_size = vector_size
        self.num_units = num_envs // vector_size
        self.rows: StepRows | None = None
        self.envs: list[gym.Env | None] = []  # None: hosted elsewhere (a mixed pool's other part)
        self.virtual = False  # under virtual time a step's cost is the one it declares
        # which units to build at start (None: all), and one env's spaces (the probe's; else the
        # first unit built gives them)
        self.hosted: set[int] | None = None
        self.spaces = spaces
        self.build_timeout_s = build_timeout_s
        self.unbuilt: dict[int, TimedOut] = {}  # units whose build timed out, until rebuilt

    async def _build_all(self) -> None:
        """Build every unit off the event loop, each in a private thread under ``build_timeout_s``
        (64 MuJoCo envs take a few hundred ms to build, which would stall the caller's loop). A
        unit past its deadline is left to its thread and recorded in ``unbuilt``: its first reset
        fails as ``timeout`` and the driver rebuilds it. Inline under virtual time, where threads
        are not allowed."""
        if is_virtual(asyncio.get_running_loop()):
            self.virtual = True
            self.envs = [self._build(u) if self._hosts(u) else None for u in range(self.num_units)]
        else:
            self.envs = [None] * self.num_units
            for u in filter(self._hosts, range(self.num_units)):
                self.envs[u] = await self._build_off_loop(u)
        first = next((env for env in self.envs if env is not None), None)
        if self.spaces is None and first is None:
            raise EnvStepError(min(self.unbuilt, default=0), "env_fn", self._build_timed_out())
        self.observation_space, self.action_space = self.spaces or single_spaces(first)
        self.rows = StepRows(self.num_envs, self.observation_space, self.action_space)

    def _hosts(self, unit: int) -> bool:
        return self.hosted is None or unit in self.hosted

    async def _build_off_loop(self, unit: int) -> gym.Env | None:
        """``env_fn(unit)`` in a thread of its own under ``build_timeout_s``; None past it (the
        thread is left, and the unit recorded in ``unbuilt``)."""
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
        try:
            env = self.env_fn(unit)
        except Exception as exc:
            raise EnvStepError(unit, "env_fn", describe(exc)) from exc
        if self.vector_size > 1:
            try:
                check_vector_env(env, unit, self.vector_size)
            except (TypeError, ValueError):
                close_quietly(env)
                raise  # a configuration error, not an env failure to retry
        return env

    def _ids(self, unit: int) -> np.ndarray:
        v = self.vector_size
        return np.arange(unit * v, unit * v + v)

    def _units(self, ids: np.ndarray) -> list[int]:
        return ids.tolist() if self.vector_size == 1 else (ids[:: self.vector_size] // self.vector_size).tolist()

    def _step_unit(self, unit: int, queued_s: float = 0.0, account: bool = True) -> float:
        """Step one unit with the actions in its rows and write the results there; with
        ``account``, also the step's cost (wall and stepping-thread CPU seconds, and ``queued_s``
        it waited for a lane; under virtual time the declared cost, all of it waiting). Returns
        the declared cost."""
        rows, env = self.rows, self.envs[unit]
        if account:
            t0, c0 = perf_counter(), thread_time()
        if self.vector_size == 1:
            out = step_env(env, _row(rows.act, unit), rows.reset_seed, unit)
            self._commit(unit, rows.write, unit, out)
            declared = out.cost_s
        else:
            ids = self._ids(unit)
            vs = step_vector_env(env, rows.actions(ids))
            self._commit(unit, rows.write_many, ids, vs)
            declared = vs.cost_s
        if not account:
            return declared
        wall, cpu = (declared, 0.0) if self.virtual else (perf_counter() - t0, thread_time() - c0)
        if self.vector_size == 1:
            rows.add_cost(unit, wall, cpu, queued_s)
        else:
            rows.cost[ids] += (1.0, wall, cpu, queued_s)  # every row waited through the whole call
        return declared

    def _commit(self, unit: int, write, *args) -> None:
        """Store a finished step in the rows (the thread pool checks, first, that it was not abandoned)."""
        write(*args)

    def _reset_unit(self, unit: int, seed: Any) -> tuple[Any, Any]:
        if unit in self.unbuilt:  # never built: the driver rebuilds it
            raise EnvStepError(unit, "env_fn", self.unbuilt[unit])
        return self._reset_with(self.envs[unit], seed)

    def _rebuild_unit(self, unit: int) -> None:
        if self.envs[unit] is not None:  # None: left to a lane that hung in it (never touched again)
            close_quietly(self.envs[unit])
            self.envs[unit] = None
        self._keep(unit, self._build(unit))

    def _keep(self, unit: int, env: gym.Env) -> None:
        """Make ``env`` unit ``unit``'s (the thread pool checks, first, that the call was not abandoned)."""
        self.envs[unit] = env
        self.unbuilt.pop(unit, None)

    def _errors(self, unit: int, exc: BaseException) -> list[tuple[int, str]]:
        return [(i, describe(exc)) for i in self._ids(unit).tolist()]

    def _adopt_unit(self, unit: int, seed: Any) -> tuple[Any, Any]:
        """Build unit ``unit`` here (it was hosted elsewhere) and reset it; nothing is kept if either fails."""
        env = self._build(unit)
        try:
            out = self._reset_with(env, seed)
        except Exception as exc:
            close_quietly(env)
            raise EnvStepError(unit, "reset", describe(exc)) from exc
        self._keep(unit, env)
        return out

    def _drop_unit(self, unit: int) -> None:
        env, self.envs[unit] = self.envs[unit], None
        close_quietly(env)

    def _reset_with(self, env: gym.Env, seed: Any) -> tuple[Any, Any]:
        return reset_env(env, seed) if self.vector_size == 1 else reset_vector_env(env, seed)

    def _close_envs(self) -> None:
        for env in self.envs:
            if env is not None:
                close_quietly(env)
        self.envs = []


def _row(tree: Any, i: int) -> Any:
    return {k: _row(v, i) for k, v in tree.items()} if isinstance(tree, dict) else tree[i]


class InlineSimPool(LocalEnvs):
    """Steps on the event loop. Under virtual time, charges each step's cost on one of ``num_lanes`` lanes."""

    backend = SimBackend.INLINE
    resizable = True

    def __init__(self, env_fn: EnvFn, num_envs: int, num_lanes: int = 1, vector_size: int = 1,
                 spaces: tuple[gym.Space, gym.Space] | None = None, build_timeout_s: float | None = None):
        super().__init__(env_fn, num_envs, vector_size, spaces, build_timeout_s)
        self._lanes = num_lanes
        self._lane_sem: asyncio.Semaphore | None = None
        self._pending: list[np.ndarray] = []
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._lane_sem = asyncio.Semaphore(self._lanes)
        await self._build_all()

    @property
    def size(self) -> int:
        return self._lanes

    def resize(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        delta, self._lanes = n - self._lanes, n
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
        if self.virtual:
            for unit in self._units(ids):
                self._spawn(self._virtual_step(unit))
            return
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
                self._step_unit(unit, account=False)
            except Exception as exc:
                errors += self._errors(unit, exc)
        if errors:
            failed = {i for i, _ in errors}
            ids = np.array([i for i in ids.tolist() if i not in failed], np.int64)
        if len(ids):
            n = len(ids)
            self.rows.cost[ids] += (1.0, (perf_counter() - t0) / n, (thread_time() - c0) / n, 0.0)
        self.outbox.put(self.rows.block(ids, errors))

    async def _virtual_step(self, unit: int) -> None:
        t_in = self._loop.time()
        async with self._lane_sem:
            try:
                cost = self._step_unit(unit, self._loop.time() - t_in)
            except Exception as exc:
                self.outbox.put(self.rows.block(np.zeros(0, np.int64), self._errors(unit, exc)))
                return
            if cost > 0:
                await asyncio.sleep(cost)
            self.outbox.put(self.rows.block(self._ids(unit)))

    async def reset(self, unit: int, seed: Any = None) -> tuple[Any, Any]:
        try:
            return self._reset_unit(unit, seed)
        except EnvStepError:
            raise
        except Exception as exc:
            raise EnvStepError(unit, "reset", describe(exc)) from exc

    async def rebuild(self, unit: int) -> None:
        """Build the unit anew: off the loop, under ``build_timeout_s`` (inline under virtual time)."""
        if self.virtual:
            self._rebuild_unit(unit)
            return
        old, self.envs[unit] = self.envs[unit], None
        if old is not None:
            close_quietly(old)
        env = await self._build_off_loop(unit)
        if env is None:
            raise EnvStepError(unit, "env_fn", self.unbuilt[unit])
        self._keep(unit, env)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._close_envs()
        self.outbox.close()
