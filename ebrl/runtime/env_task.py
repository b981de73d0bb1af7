"""The env drivers: one coroutine per env (``async``) or per lockstep group (``sync``, ``pipelined``);
for vectorised envs (``sim.vector_size > 1``), one per vector env or per lockstep set of them.

Both share :class:`EnvSteps`, the per-step bookkeeping: record the transition, track the
episode, check for NaN/inf, and recover a failed env (drop its open segment, rebuild it
from ``env_fn``, reset it). Every transition is counted exactly once: simulated, then
trained, dropped with a reason, or still in flight when the run stops.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ebrl.config import NonFinite, RunConfig
from ebrl.runtime.generation import ActReply, Generator
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.sim_types import EnvStepError, SimPool, StepOut
from ebrl.runtime.stats import RunStats
from ebrl.telemetry.logging import get_logger

if TYPE_CHECKING:
    from ebrl.runtime.profiler import Timeline

log = get_logger("ebrl.env")


class TooManyEnvFailures(RuntimeError):
    """More env failures within the window than ``faults.max_env_failures`` allows."""


class NonFiniteError(RuntimeError):
    """An env produced NaN or inf in an observation or reward."""


class StepBudget:
    """The run's env steps; each driver claims steps before it asks for actions."""

    def __init__(self, total: int):
        self.remaining = total

    def claim(self, n: int = 1) -> bool:
        if self.remaining < n:
            return False
        self.remaining -= n
        return True

    def release(self, n: int = 1) -> None:
        self.remaining += n

    def stop(self) -> None:
        self.remaining = 0



@dataclass
class EnvSteps:
    """Shared step logic for every driver."""

    cfg: RunConfig
    pool: SimPool
    generator: Generator
    rollout: RolloutQueue
    stats: RunStats
    budget: StepBudget
    timeline: Timeline | None = None  # stage events, when profiling (ebrl.runtime.profiler)
    ep_return: list[float] = field(init=False)
    ep_length: list[int] = field(init=False)
    resets: list[int] = field(init=False)
    lanes: list[str] = field(init=False)  # timeline lane names, "env i"
    failure_times: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        n = self.cfg.num_envs
        self.ep_return, self.ep_length, self.resets = [0.0] * n, [0] * n, [0] * n
        self.ep_success: list[bool | None] = [None] * n  # None until the env reports a success flag
        self.lanes = [f"env {i}" for i in range(n)]

    def _seed(self, env_id: int) -> int:
        # seed each env's first episode; later resets (after a rebuild) get fresh, reproducible seeds
        seed = self.cfg.seed + env_id + self.cfg.num_envs * self.resets[env_id]
        self.resets[env_id] += 1
        self.ep_return[env_id], self.ep_length[env_id], self.ep_success[env_id] = 0.0, 0, None
        return seed

    async def reset(self, env_id: int) -> Any:
        """Reset one env (one row of its vector env, when vectorised) with its next seed."""
        size = self.cfg.sim.vector_size
        if size > 1:
            unit, row = divmod(env_id, size)
            obs, _ = await self.pool.reset(unit, {row: self._seed(env_id)})
            return obs[row]
        obs, _ = await self.pool.reset(env_id, seed=self._seed(env_id))
        return obs

    async def reset_vector(self, unit: int) -> list[Any]:
        """Reset every env of vector env ``unit``; the same seeds as resetting each env alone."""
        ids = self.vector_ids(unit)
        obs, _ = await self.pool.reset(unit, [self._seed(i) for i in ids])
        return [obs[row] for row in range(len(ids))]

    def vector_ids(self, unit: int) -> list[int]:
        size = self.cfg.sim.vector_size
        return list(range(unit * size, (unit + 1) * size))

    async def after_step(self, env_id: int, obs: Any, reply: ActReply, out: StepOut) -> Any:
        """Record a completed step; returns the env's next observation."""
        self.stats.simulated += 1
        if not out.finite:
            step = self.rollout.steps_per_env[env_id]
            what = f"env {env_id} produced NaN/inf at step {step} (reward={out.reward})"
            if self.cfg.faults.nonfinite is NonFinite.RAISE:
                raise NonFiniteError(what + "; set faults.nonfinite='drop' to drop such segments instead")
            log.warning("nonfinite_dropped", env=env_id, step=step)
            self.stats.drop("nonfinite", 1)
            self.rollout.drop_open(env_id, "nonfinite")
            return await self.reset(env_id)
        res, row, version = reply
        self.rollout.record(env_id, obs, res.actions[row], res.logprobs[row], res.values[row], version,
                            out.reward, out.terminated, out.truncated, out.obs, out.final_obs)
        self.ep_return[env_id] += out.reward
        self.ep_length[env_id] += 1
        ended = out.terminated or out.truncated
        # the step's own info: for an episode's last step it is final_info (info is the next episode's)
        info = (out.final_info or {}) if ended else out.info
        success = info.get("is_success", info.get("success"))
        if success is not None:
            self.ep_success[env_id] = bool(success) or bool(self.ep_success[env_id])
        if ended:
            once, at_end = self.ep_success[env_id], None if success is None else bool(success)
            self.stats.episode(self.ep_return[env_id], self.ep_length[env_id], once, at_end)
            log.info("episode", env=env_id, ep_return=round(self.ep_return[env_id], 4), length=self.ep_length[env_id],
                     success_once=once, success_at_end=at_end, truncated=out.truncated and not out.terminated)
            self.ep_return[env_id], self.ep_length[env_id], self.ep_success[env_id] = 0.0, 0, None
        return out.obs

    async def recover(self, env_id: int, exc: EnvStepError) -> Any:
        """Drop the failed env's open segment, rebuild it from env_fn, reset it."""
        return await self._recover([env_id], env_id, exc, self.reset)

    async def recover_vector(self, unit: int, exc: EnvStepError) -> list[Any]:
        """A vector env failed: every env in it loses its open segment; rebuild and reset it whole."""
        return await self._recover(self.vector_ids(unit), unit, exc, self.reset_vector)

    async def _recover(self, env_ids: list[int], unit: int, exc: EnvStepError, reset) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            self.stats.env_failures += 1
            dropped = sum(self.rollout.drop_open(i, "env_error") for i in env_ids)
            log.warning("env_failed", env=env_ids[0] if len(env_ids) == 1 else f"{env_ids[0]}-{env_ids[-1]}",
                        step=self.rollout.steps_per_env[env_ids[0]], op=exc.op, error=exc.detail,
                        dropped_steps=dropped)
            now = loop.time()
            self.failure_times.append(now)
            while self.failure_times and now - self.failure_times[0] > self.cfg.faults.failure_window_s:
                self.failure_times.popleft()
            if len(self.failure_times) > self.cfg.faults.max_env_failures:
                raise TooManyEnvFailures(
                    f"{len(self.failure_times)} env failures within {self.cfg.faults.failure_window_s}s "
                    f"(faults.max_env_failures={self.cfg.faults.max_env_failures}); last: {exc}") from exc
            try:
                await self.pool.rebuild(unit)
                return await reset(unit)
            except EnvStepError as again:
                exc = again

    async def wait_can_start(self, env_ids: list[int]) -> bool:
        """Wait until every env in ``env_ids`` may start its next step; True if that meant waiting."""
        can_start = self.rollout.can_start
        if can_start(env_ids[0]) if len(env_ids) == 1 else all(can_start(i) for i in env_ids):
            return False
        self.generator.set_live(-len(env_ids))
        self.rollout.set_blocked(+1)
        t0 = asyncio.get_running_loop().time()
        try:
            for i in env_ids:
                await self.rollout.wait_can_start(i)
        finally:
            self.rollout.set_blocked(-1)
            self.generator.set_live(+len(env_ids))
            if self.timeline is not None:
                t1 = asyncio.get_running_loop().time()
                for i in env_ids:
                    self.timeline.record(self.lanes[i], "blocked", t0, t1)
        return True

    async def timed_step(self, env_id: int, obs: Any) -> tuple[ActReply, StepOut]:
        """``generator.act`` then ``pool.step``, recording "act" and "sim" (or "fail") on the timeline."""
        clock, record, lane = asyncio.get_running_loop().time, self.timeline.record, self.lanes[env_id]
        t0 = clock()
        reply = await self.generator.act(env_id, obs)
        t1 = clock()
        record(lane, "act", t0, t1)
        res, row, _ = reply
        try:
            out = await self.pool.step(env_id, res.env_actions[row])
        except EnvStepError:
            record(lane, "fail", t1, clock())
            raise
        record(lane, "sim", t1, clock())
        return reply, out

    async def timed_group_step(self, env_ids: list[int], obs: dict[int, Any],
                               ready: dict[int, float]) -> tuple[list[ActReply], list]:
        """A lockstep group's act-gather and step-gather, recorded on the timeline.

        An env's "act" runs from when it was ready (its previous step returned; ``ready``,
        updated here) to when the group's actions arrive: the wait for the group's slowest
        env (the barrier) shows as part of it.
        """
        clock, record, lanes = asyncio.get_running_loop().time, self.timeline.record, self.lanes
        gen, pool = self.generator, self.pool
        t0 = clock()
        if await self.wait_can_start(env_ids):  # recorded "blocked"; the barrier before it is still "act"
            for i in env_ids:
                if i in ready:
                    record(lanes[i], "act", ready[i], t0)
            t0 = clock()
            ready.update((i, t0) for i in env_ids)
        replies = await asyncio.gather(*(gen.act(i, obs[i]) for i in env_ids))
        t1 = clock()
        for i in env_ids:
            record(lanes[i], "act", ready.get(i, t0), t1)

        began: dict[int, float] = {}

        async def stamped(i: int, action: Any) -> StepOut:
            began[i] = clock()  # gather starts the steps one after another: time each from its own start
            try:
                return await pool.step(i, action)
            finally:
                ready[i] = clock()

        outs = await asyncio.gather(*(stamped(i, r[0].env_actions[r[1]]) for i, r in zip(env_ids, replies)),
                                    return_exceptions=True)
        for i, out in zip(env_ids, outs):
            record(lanes[i], "fail" if isinstance(out, BaseException) else "sim", began.get(i, t1), ready[i])
        return replies, outs


async def env_task(steps: EnvSteps, env_id: int) -> None:
    """One env, on its own: claim a step, get an action, simulate, record; no barrier."""
    gen, pool, budget = steps.generator, steps.pool, steps.budget
    timed = steps.timeline is not None
    try:
        obs = await steps.reset(env_id)
        while budget.claim():
            await steps.wait_can_start([env_id])
            try:
                if timed:
                    reply, out = await steps.timed_step(env_id, obs)
                else:
                    reply = await gen.act(env_id, obs)
                    res, row, _ = reply
                    out = await pool.step(env_id, res.env_actions[row])
            except EnvStepError as exc:
                budget.release()
                obs = await steps.recover(env_id, exc)
                continue
            obs = await steps.after_step(env_id, obs, reply, out)
    finally:
        gen.set_live(-1)
        steps.rollout.driver_done()


async def lockstep_group(steps: EnvSteps, env_ids: list[int]) -> None:
    """A group of envs stepped together: every env waits for the slowest at each step."""
    gen, pool, budget = steps.generator, steps.pool, steps.budget
    timed, ready = steps.timeline is not None, {}
    try:
        obs = dict(zip(env_ids, await asyncio.gather(*(steps.reset(i) for i in env_ids))))
        while budget.claim(len(env_ids)):
            if timed:
                replies, outs = await steps.timed_group_step(env_ids, obs, ready)
            else:
                await steps.wait_can_start(env_ids)
                replies = await asyncio.gather(*(gen.act(i, obs[i]) for i in env_ids))
                outs = await asyncio.gather(*(pool.step(i, r[0].env_actions[r[1]])
                                              for i, r in zip(env_ids, replies)), return_exceptions=True)
            for i, reply, out in zip(env_ids, replies, outs):
                if isinstance(out, EnvStepError):
                    budget.release()
                    obs[i] = await steps.recover(i, out)
                elif isinstance(out, BaseException):
                    raise out
                else:
                    obs[i] = await steps.after_step(i, obs[i], reply, out)
    finally:
        gen.set_live(-len(env_ids))
        steps.rollout.driver_done()


async def vector_task(steps: EnvSteps, units: list[int]) -> None:
    """Vector envs stepped together: one per driver under ``async`` (no barrier with any other),
    a lockstep set of them under ``sync`` and ``pipelined``. One ``act_many`` request and one
    simulator call per vector env per step."""
    gen, pool, budget, timeline = steps.generator, steps.pool, steps.budget, steps.timeline
    clock = asyncio.get_running_loop().time
    ids = {k: steps.vector_ids(k) for k in units}
    all_ids = [i for k in units for i in ids[k]]
    size = len(ids[units[0]])
    ended: dict[int, float] = {}

    async def step(k: int, replies: list[ActReply]) -> list[StepOut]:
        res, first = replies[0][0], replies[0][1]
        try:
            return await pool.step(k, res.env_actions[first:first + size])  # one request: contiguous rows
        finally:
            ended[k] = clock()

    try:
        obs = dict(zip(units, await asyncio.gather(*(steps.reset_vector(k) for k in units))))
        while budget.claim(len(all_ids)):
            await steps.wait_can_start(all_ids)
            t0 = clock()
            replies = await asyncio.gather(*(gen.act_many(ids[k], obs[k]) for k in units))
            t1 = clock()
            outs = await asyncio.gather(*(step(k, r) for k, r in zip(units, replies)), return_exceptions=True)
            for k, reply, out in zip(units, replies, outs):
                if timeline is not None:
                    name = "fail" if isinstance(out, BaseException) else "sim"
                    for i in ids[k]:
                        timeline.record(steps.lanes[i], "act", t0, t1)
                        timeline.record(steps.lanes[i], name, t1, ended[k])
                if isinstance(out, EnvStepError):
                    budget.release(size)
                    obs[k] = await steps.recover_vector(k, out)
                elif isinstance(out, BaseException):
                    raise out
                else:
                    obs[k] = [await steps.after_step(i, o, r, so) for i, o, r, so in zip(ids[k], obs[k], reply, out)]
    finally:
        gen.set_live(-len(all_ids))
        steps.rollout.driver_done()
