"""The driver: one loop turns blocks of finished steps into records and new requests, with no
coroutine, future or Python object per env step (PufferLib's and EnvPool's send/recv):

1. ``block = await pool.recv()`` is recorded and its episodes tracked; NaN/inf rows and failed
   envs go to :class:`~ebrl.runtime.driver.recovery.Recovery`, which says when they are back;
2. released envs claim steps from the budget; those that would open a segment on a full queue
   park (backpressure), the rest make one request (:meth:`Generator.request`);
3. the batch that serves them calls :meth:`Driver.on_actions`, which submits the actions to the pool.

Under ``async`` every unit goes on alone as soon as its step is back; under ``sync`` and ``pipelined``
a lockstep group goes on once all of its units are back. Every transition is counted exactly once:
simulated, then trained, dropped with a reason, or still in flight when the run stops.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from typing import Any

import numpy as np

from ebrl.config import RunConfig
from ebrl.policies.base import ActResult
from ebrl.runtime.driver.episodes import Episodes
from ebrl.runtime.driver.recovery import Moves, Recovery
from ebrl.runtime.errors import EnvStepError, raise_first
from ebrl.runtime.generation import Generator
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.schedules import Barrier, is_lockstep
from ebrl.runtime.sim import Block, SimPool
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats
from ebrl.spaces import all_finite, index, part
from ebrl.telemetry.timeline import Timeline


class Driver:
    """Records finished blocks and releases envs for their next step (see module docstring)."""

    def __init__(self, cfg: RunConfig, pool: SimPool, generator: Generator, rollout: RolloutQueue,
                 stats: RunStats, state: RunState, timeline: Timeline | None = None):
        self.cfg, self.pool, self.generator, self.rollout = cfg, pool, generator, rollout
        self.stats, self.state = stats, state
        self.V = cfg.sim.vector_size
        self.lockstep = is_lockstep(cfg.schedule)
        self.barrier = Barrier(cfg)
        self.parked: deque[np.ndarray] = deque()  # blocks of envs waiting for queue space
        self.episodes = Episodes(cfg, pool, rollout, stats)
        self.recovery = Recovery(cfg, pool, rollout, stats, state, self.episodes)
        self.moves = Moves(pool, self.episodes, self.recovery)  # the controller's, at episode ends
        self.waits = EnvWaits(cfg.num_envs, timeline)  # where each env's time goes: the profiler's and the timeline's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future | None = None
        self._tg: asyncio.TaskGroup | None = None
        rollout.on_space = self.unpark

    async def run(self) -> None:
        """Reset every env, release them all, and return when every env has finished."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                # tasks of the group: a failure cancels the others (none is left running)
                units = range(self.cfg.num_envs // self.V)
                await asyncio.wait([tg.create_task(self.recovery.first_reset(u)) for u in units])
                self.waits.ready(slice(None), self._loop.time())
                helpers = [tg.create_task(self._steps(), name="ebrl-driver")]
                if self.cfg.faults.step_timeout_s is not None:
                    helpers.append(tg.create_task(self.recovery.watch_steps(self.cfg.faults.step_timeout_s),
                                                  name="ebrl-watchdog"))
                for ids in self.barrier.groups:
                    self._release(ids)
                try:
                    await self._done
                finally:
                    for task in helpers:
                        task.cancel()
        except BaseExceptionGroup as group:  # raise the first failure as itself, the others as its notes
            raise_first(group)
        finally:
            self._tg = None
            self.rollout.finish()

    def _fail(self, exc: BaseException) -> None:
        if not self._done.done():
            self._done.set_exception(exc)

    def _finish(self, n: int) -> None:
        self.state.finish(n)
        if self.state.active <= 0 and not self._done.done():
            self._done.set_result(None)

    async def _steps(self) -> None:
        """The loop: every block of finished steps, in the order the pool returns them."""
        recv, on_block = self.pool.recv, self._on_block
        while True:
            on_block(await recv())

    def _on_block(self, block: Block) -> None:
        ids, now = block.ids, self._loop.time()
        if block.errors:
            self._on_errors(block.errors, now)
        if not len(ids):
            return
        self.waits.stepped(ids, now)
        if not self.stats.simulated:  # NaN until now: start-up ends here (RunResult.first_step_s)
            self.stats.first_step_at = now
        self.stats.simulated += len(ids)
        go = ids
        if not block.clean and not block.finite.all():
            # NaN/inf rows are dropped (or raise); their units wait for the reset of those rows, then go on whole
            held = self.recovery.nonfinite_steps(block, np.flatnonzero(~block.finite))
            self._reset_rows(held)
            block = block.take(np.flatnonzero(block.finite))
            ids = block.ids
            go = ids[~np.isin(ids // self.V, list(held))]
        if len(ids):
            self.rollout.record(block)
            self.episodes.track(block)
            if self.moves.wanted and not block.clean:  # the controller's env moves, at episode ends
                for env_id, worker in self.moves.due(block):
                    self._when_back(np.array([env_id]), self.moves.move(env_id, worker))
                    go = go[go != env_id]
        if len(go):
            self._arrive(go)

    def _arrive(self, ids: np.ndarray) -> None:
        """Envs ``ids`` (whole units) are ready for their next step."""
        if not self.lockstep:
            self._release(ids)
            return
        for group in self.barrier.arrive(ids):
            self.waits.passed_barrier(group, self._loop.time())
            self._release(group)

    def _release(self, ids: np.ndarray) -> None:
        """Claim the next step of envs ``ids`` (a block of whole units, or one lockstep group);
        park what would overflow the queue; request actions for the rest."""
        go = self.state.claim(len(ids), self.V, whole=self.lockstep)
        if go < len(ids):  # the budget is spent: the rest are done
            if self.lockstep:
                self.barrier.leave(ids[go:])
            self._finish(len(ids) - go)
            ids = ids[:go]
            if not go:
                return
        blocked = self.rollout.need_space(ids)
        if np.count_nonzero(blocked):
            if self.V > 1:  # a vector env steps whole, or not at all
                blocked = np.isin(ids // self.V, ids[blocked] // self.V)
            # the rest go on: a lockstep group without its parked envs (their segments closed early)
            self._park(ids[blocked])
            ids = ids[~blocked]
            if not len(ids):
                return
        self.generator.request(ids, self.rollout.current_obs(ids), self.on_actions)

    def on_actions(self, ids: np.ndarray, result: ActResult, lo: int, hi: int, version: int) -> None:
        try:
            self.rollout.begin(ids, result, lo, hi, version)
            self.waits.submitted(ids, self._loop.time())
            env_actions = part(result.env_actions, lo, hi, len(result.logprobs))
            if not all_finite(env_actions):  # those envs wait for a new episode (or it raises)
                bad, units = self.recovery.nonfinite_actions(ids, env_actions, version, self.lockstep or self.V > 1)
                self._reset_rows(units)
                ids, env_actions = ids[~bad], index(env_actions, np.flatnonzero(~bad))
                if not len(ids):
                    return
            self.pool.submit(ids, env_actions)
        except BaseException as exc:
            self._fail(exc)

    def _park(self, ids: np.ndarray) -> None:
        if self.lockstep:
            self.barrier.leave(ids)
        self.parked.append(ids)
        self.waits.parked(ids, self._loop.time())
        self.state.park(len(ids))

    def counters(self) -> dict[str, np.ndarray]:
        """Per env, the seconds waited so far by cause (:meth:`EnvWaits.counters`)."""
        if not self.parked:
            return self.waits.counters(np.zeros(0, np.int64), 0.0)
        return self.waits.counters(np.concatenate(self.parked), self._loop.time())

    def unpark(self) -> None:
        """The learner took segments: let parked envs try again."""
        parked, self.parked = self.parked, deque()
        now = self._loop.time()
        for ids in parked:
            self.state.parked -= len(ids)
            self.waits.unparked(ids, now)
            self.state.release(len(ids))  # _release claims again
            if self.lockstep:
                self.barrier.rejoin(ids)
            self._release(ids)
        self.state.changed()

    def _on_errors(self, errors: list[tuple[int, str]], now: float) -> None:
        detail = dict(errors)
        for u in sorted({i // self.V for i in detail}):
            ids = self.recovery.unit_ids(u)
            self.waits.failed(ids, now)
            self.state.release(len(ids))  # the claimed step never happened
            exc = EnvStepError(u, "step", detail.get(int(ids[0]), next(iter(detail.values()))))
            self._when_back(ids, self.recovery.recover(u, exc))

    def _reset_rows(self, units: dict[int, list[int]]) -> None:
        """Reset the rows ``units[u]`` of each unit ``u``; the unit goes on once they are back."""
        for unit, env_ids in units.items():
            self._when_back(self.recovery.unit_ids(unit), self.recovery.reset_rows(unit, env_ids))

    def _when_back(self, ids: np.ndarray, back: Coroutine[Any, Any, bool]) -> None:
        """Envs ``ids`` go on once ``back`` (a reset, rebuild or move, a task of the run's
        TaskGroup) answers True."""
        async def go_on() -> None:
            if await back:
                self.waits.ready(ids, self._loop.time())
                self._arrive(ids)

        task = go_on()
        if self._tg is not None:
            try:
                self._tg.create_task(task)
                return
            except RuntimeError:  # the group is shutting down (the run is stopping on a failure)
                pass
        task.close()  # never started: neither coroutine may be left unawaited
        back.close()


class EnvWaits:
    """Per-env wait seconds by cause (the profiler's) and the timeline's spans, from the same
    calls, so the controller's profile and a trace cannot disagree."""

    def __init__(self, num_envs: int, timeline: Timeline | None = None):
        self.timeline = timeline
        self.lanes = [f"env {i}" for i in range(num_envs)]
        # when each env became ready (or parked), and when its step was submitted
        self.t_ready = np.zeros(num_envs)
        self.t_sub = np.zeros(num_envs)
        # seconds since the start: the round trip of its sim steps (the step, plus any wait for a
        # lane or worker), waits for an action, for the lockstep group's last member (the
        # barrier) and for queue space (backpressure)
        self.sim = np.zeros(num_envs)
        self.action = np.zeros(num_envs)
        self.barrier = np.zeros(num_envs)
        self.blocked = np.zeros(num_envs)

    def _spans(self, ids: np.ndarray, name: str, since: np.ndarray, now: float) -> None:
        if self.timeline is not None:
            for i in ids.tolist():
                self.timeline.record(self.lanes[i], name, since[i], now)

    def _waited(self, ids: np.ndarray, name: str, since: np.ndarray, into: np.ndarray, now: float,
                mark: np.ndarray) -> None:
        """Envs ``ids`` waited from ``since`` to ``now``: counted in ``into``, drawn as ``name``; their
        next wait starts now (``mark``)."""
        self._spans(ids, name, since, now)
        into[ids] += now - since[ids]
        mark[ids] = now

    def ready(self, ids: np.ndarray | slice, now: float) -> None:
        """Envs ``ids`` are ready for their next step (after a reset, a rebuild or a move)."""
        self.t_ready[ids] = now

    def stepped(self, ids: np.ndarray, now: float) -> None:
        """Their steps came back: ready now."""
        self._waited(ids, "sim", self.t_sub, self.sim, now, self.t_ready)

    def failed(self, ids: np.ndarray, now: float) -> None:
        """Their step failed (recovery takes them until they are ready again)."""
        self._spans(ids, "fail", self.t_sub, now)

    def passed_barrier(self, ids: np.ndarray, now: float) -> None:
        """A lockstep group goes on: the time since each member came back was the barrier.
        ``t_ready`` stays at the arrival (the timeline's ``act`` spans the barrier too), so the
        action wait, measured from ``t_ready`` when the actions come, is credited it back now."""
        barrier = now - self.t_ready[ids]
        self.barrier[ids] += barrier
        self.action[ids] -= barrier

    def submitted(self, ids: np.ndarray, now: float) -> None:
        """Their actions came and their steps went to the pool."""
        self._waited(ids, "act", self.t_ready, self.action, now, self.t_sub)

    def parked(self, ids: np.ndarray, now: float) -> None:
        """They wait for queue space (backpressure) from now on."""
        self._waited(ids, "act", self.t_ready, self.action, now, self.t_ready)

    def unparked(self, ids: np.ndarray, now: float) -> None:
        """The learner took segments: they may go on."""
        self._waited(ids, "blocked", self.t_ready, self.blocked, now, self.t_ready)

    def counters(self, parked: np.ndarray, now: float) -> dict[str, np.ndarray]:
        """Per env, the seconds waited so far by cause, a park in progress (envs ``parked``) counted up
        to ``now``: a long update holds them across profile windows, and each window should see its share."""
        blocked = self.blocked.copy()
        blocked[parked] += now - self.t_ready[parked]
        return {"sim": self.sim.copy(), "action": self.action.copy(), "barrier": self.barrier.copy(),
                "backpressure": blocked}
