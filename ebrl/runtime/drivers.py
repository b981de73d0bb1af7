"""The driver core: one object turns blocks of finished steps into records and new requests,
for every schedule and backend.

The hot path is three callbacks, with no coroutine, future or Python object per env step:

1. the sim pool calls :meth:`Driver.on_block` with a block of envs whose steps are done: the
   block is recorded into the rollout storage (one write per field), episodes are tracked in
   NumPy, and NaN/inf rows and failed envs go aside for recovery;
2. the envs that may go on are released: they claim steps from the budget, envs that would
   open a segment on a full queue park (backpressure), and the rest make one generation
   request (:meth:`Generator.request`) for the block;
3. the batch that serves them calls :meth:`Driver.on_actions`, which keeps the behaviour data
   for the record and submits the action rows to the pool.

The schedules differ only in what is released together (:class:`~ebrl.config.Schedule`):
under ``async`` every unit (an env, or a vector env) goes on alone, as soon as its step is
back; under ``sync`` and ``pipelined`` a lockstep group goes on once all of its units are
back, in env id order. A :class:`~ebrl.runtime.profiler.Timeline`, when given, observes the
same path (``act``, ``sim``, ``blocked``, ``fail`` per env); it does not fork it.

Every transition is counted exactly once: simulated, then trained, dropped with a reason, or
still in flight when the run stops.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ebrl.config import NonFinite, RunConfig, Schedule
from ebrl.policies.base import ActResult
from ebrl.runtime.errors import EnvStepError, NonFiniteError, TooManyEnvFailures, raise_first
from ebrl.runtime.generation import Generator
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.schedules import lockstep_groups
from ebrl.runtime.sim_types import Block, NonFiniteReset, SimPool, TimedOut
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats
from ebrl.spaces import all_finite, batch_of_one, finite_rows, index, stack, tree_map, write
from ebrl.telemetry.logging import get_logger

if TYPE_CHECKING:
    from ebrl.runtime.profiler import Timeline

log = get_logger("ebrl.env")


class Driver:
    """Records finished blocks and releases envs for their next step (see module docstring)."""

    def __init__(self, cfg: RunConfig, pool: SimPool, generator: Generator, rollout: RolloutQueue,
                 stats: RunStats, state: RunState, timeline: Timeline | None = None):
        self.cfg, self.pool, self.generator, self.rollout, self.stats = cfg, pool, generator, rollout, stats
        self.state, self.timeline = state, timeline
        n, v = cfg.num_envs, cfg.sim.vector_size
        self.V = v
        self.lockstep = cfg.schedule is not Schedule.ASYNC
        groups = lockstep_groups(cfg)
        self.group_ids = [np.concatenate([np.arange(u * v, u * v + v) for u in g]) for g in groups]
        self.group_of = np.zeros(n, np.int64)
        for g, ids in enumerate(self.group_ids):
            self.group_of[ids] = g
        self.arrived = np.zeros(len(groups), np.int64)  # lockstep: units of the group back and ready
        self.parked: deque[np.ndarray] = deque()  # blocks of envs waiting for queue space
        # behaviour data of each env's in-flight step (allocated at the first batch)
        self.act_actions: Any = None
        self.act_logprob = np.zeros(n, np.float32)
        self.act_value = np.zeros(n, np.float32)
        self.act_version = np.zeros(n, np.int64)
        # episodes
        self.ep_return = np.zeros(n, np.float64)
        self.ep_length = np.zeros(n, np.int64)
        self.ep_success = np.full(n, -1, np.int8)  # -1 until the env reports a success flag
        self.resets = np.zeros(n, np.int64)
        self.episodes = np.zeros(n, np.int64)  # episodes started per env (reset groups seed by it)
        # failures charged to faults.max_env_failures in the window: (loop time, env, reason)
        self.failure_times: deque[tuple[float, int, str]] = deque()
        self._gave_up = False  # TooManyEnvFailures raised: the run is stopping on it
        self.timeouts = 0  # steps abandoned past faults.step_timeout_s
        # placement changes the controller asked for: env -> worker, done at the env's next episode end
        self.moves: dict[int, int] = {}
        self.migrating: set[int] = set()  # envs whose move is under way (the pool's placement is not yet theirs)
        self.migrations = 0
        # when each env became ready (or parked) and was submitted, and its waits since the start
        # by cause (seconds, read by the live profiler): the round trip of its sim steps (the step,
        # plus any wait for a lane or worker), waits for an action, for the lockstep group's last
        # member (the barrier) and for queue space (backpressure)
        self.t_ready = np.zeros(n)
        self.t_sub = np.zeros(n)
        self.wait_sim = np.zeros(n)
        self.wait_action = np.zeros(n)
        self.wait_barrier = np.zeros(n)
        self.wait_blocked = np.zeros(n)
        self.lanes = [f"env {i}" for i in range(n)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future | None = None
        self._tg: asyncio.TaskGroup | None = None
        pool.on_block = self.on_block
        rollout.on_space = self.unpark

    # ---------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        """Reset every env, release them all, and return when every env has finished."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                units = range(self.cfg.num_envs // self.V)
                # tasks of the group: a failure cancels the others (none is left running)
                await asyncio.wait([tg.create_task(self._first_reset(u)) for u in units])
                now = self._loop.time()
                self.t_ready[:] = now
                for ids in self.group_ids:
                    self._release(ids)
                watchdog = None
                if self.cfg.faults.step_timeout_s is not None:
                    watchdog = tg.create_task(self._watch_steps(self.cfg.faults.step_timeout_s), name="ebrl-watchdog")
                try:
                    await self._done
                finally:
                    if watchdog is not None:
                        watchdog.cancel()
        except BaseExceptionGroup as group:  # raise the first failure as itself, the others as its notes
            raise_first(group)
        finally:
            self._tg = None
            self.rollout.finish()

    def _fail(self, exc: BaseException) -> None:
        if not self._done.done():
            self._done.set_exception(exc)

    def _finish(self, n: int) -> None:
        self.state.active -= n
        self.generator.poke()
        self.rollout.poke()
        if self.state.active <= 0 and not self._done.done():
            self._done.set_result(None)

    # ---------------------------------------------------------------- the hot path

    def on_block(self, block: Block) -> None:
        try:
            self._on_block(block)
        except BaseException as exc:  # a callback: hand it to run(), the TaskGroup's task
            self._fail(exc)

    def _on_block(self, block: Block) -> None:
        ids, now = block.ids, self._loop.time()
        tl = self.timeline
        if block.errors:
            self._on_errors(block.errors, now)
        if not len(ids):
            return
        if tl is not None:
            for i in ids.tolist():
                tl.record(self.lanes[i], "sim", self.t_sub[i], now)
        self.wait_sim[ids] += now - self.t_sub[ids]
        self.t_ready[ids] = now
        if not self.stats.simulated:  # NaN until now: start-up ends here (RunResult.first_step_s)
            self.stats.first_step_at = now
        self.stats.simulated += len(ids)
        go = ids
        if not block.clean and not block.finite.all():
            # NaN/inf rows are dropped; their units wait for the reset of those rows, then go on whole
            held = self._on_nonfinite(block, np.flatnonzero(~block.finite))
            block = _rows(block, np.flatnonzero(block.finite))
            ids = block.ids
            go = ids[~np.isin(ids // self.V, list(held))]
        if len(ids):
            acts = index(self.act_actions, ids)
            self.rollout.record(ids, acts, self.act_logprob[ids], self.act_value[ids], self.act_version[ids],
                                block.reward, block.terminated, block.truncated, block.obs, block.final_obs,
                                block.chunk_rewards, block.chunk_steps)
            self._episodes(block)
            if self.moves and not block.clean:
                go = self._start_moves(block, go)
        if len(go):
            self._arrive(go)

    def _start_moves(self, block: Block, go: np.ndarray) -> np.ndarray:
        """Envs due to move whose episode just ended migrate now; the rest of ``go`` goes on."""
        ended = block.ids[block.terminated | block.truncated]
        moving = []
        for i in ended.tolist():
            if i not in self.moves:
                continue
            target = self.moves.pop(i)
            if int(self.pool.placement[i]) == target:  # a decision made while an earlier move was in flight
                log.info("env_move_skipped", env=i, where=target)
                continue
            moving.append(i)
            self.migrating.add(i)
            self._spawn(self._migrate(i, target))
        return go[~np.isin(go, moving)] if moving else go

    async def _migrate(self, env_id: int, worker: int) -> None:
        """Rebuild env ``env_id`` in ``worker`` (an episode just ended: nothing of it is lost),
        start its next episode there, and let it go on. A failed move leaves it where it was."""
        try:
            obs, _ = await self.pool.migrate(env_id, worker, seed=self._seed(env_id))
            self.rollout.set_obs(np.array([env_id]), batch_of_one(self._checked_reset(env_id, obs)))
            if self.cfg.reset_group is not None:  # the part it moved to holds its own rows
                self.pool.set_reset_seeds(np.array([env_id]), np.array([self._group_seed(env_id)]))
            self.migrations += 1
            log.info("env_migrated", env=env_id, worker=worker)
        except EnvStepError as exc:
            log.warning("env_migration_failed", env=env_id, worker=worker, error=exc.detail)
        finally:
            self.migrating.discard(env_id)
        self.t_ready[env_id] = self._loop.time()
        self._arrive(np.array([env_id]))

    def _episodes(self, block: Block) -> None:
        ids = block.ids
        self.ep_return[ids] += block.reward
        self.ep_length[ids] += 1
        if block.clean:
            return
        known = block.success >= 0
        if known.any():
            k = ids[known]
            self.ep_success[k] = np.maximum(self.ep_success[k], block.success[known])
        ended = (block.terminated | block.truncated).nonzero()[0]
        for r in ended.tolist():
            i = int(ids[r])
            once = None if self.ep_success[i] < 0 else bool(self.ep_success[i])
            at_end = None if block.success[r] < 0 else bool(block.success[r])
            self._autoreset(i)
            ret, length = float(self.ep_return[i]), int(self.ep_length[i])
            self.stats.episode(ret, length, once, at_end)
            log.info("episode", env=i, ep_return=round(ret, 4), length=length, success_once=once,
                     success_at_end=at_end, truncated=bool(block.truncated[r] and not block.terminated[r]))
            self.ep_return[i], self.ep_length[i], self.ep_success[i] = 0.0, 0, -1

    def _arrive(self, ids: np.ndarray) -> None:
        """Envs ``ids`` (whole units) are ready for their next step."""
        if not self.lockstep:
            self._release(ids)
            return
        groups, counts = np.unique(self.group_of[ids], return_counts=True)
        for g, c in zip(groups.tolist(), counts.tolist()):
            self.arrived[g] += c
            if self.arrived[g] == len(self.group_ids[g]):
                self.arrived[g] = 0
                group = self.group_ids[g]
                # the time since each member came back was the barrier. t_ready stays at the
                # arrival (the timeline's "act" spans the barrier too), so the action wait,
                # measured from t_ready when the actions come, is credited it back now
                barrier = self._loop.time() - self.t_ready[group]
                self.wait_barrier[group] += barrier
                self.wait_action[group] -= barrier
                self._release(group)

    def _release(self, ids: np.ndarray) -> None:
        """Claim the next step of envs ``ids`` (a block of whole units, or one lockstep group);
        park what would overflow the queue; request actions for the rest."""
        state = self.state
        if self.lockstep:
            if not state.claim_all(len(ids)):
                self._finish(len(ids))
                return
        elif state.budget < len(ids):  # a vector env claims its whole step, or none of it
            go = min(len(ids) // self.V, state.budget // self.V) * self.V
            state.claim_all(go)
            self._finish(len(ids) - go)
            ids = ids[:go]
            if not go:
                return
        else:
            state.claim_all(len(ids))
        blocked = self.rollout.need_space(ids)
        if np.count_nonzero(blocked):
            if self.lockstep or self.V > 1:
                # a group or a vector env goes whole, or not at all
                self._park(ids)
                return
            self._park(ids[blocked])
            ids = ids[~blocked]
            if not len(ids):
                return
        self._request(ids)

    def _request(self, ids: np.ndarray) -> None:
        self.generator.request(ids, self.rollout.current_obs(ids), self.on_actions)

    def on_actions(self, ids: np.ndarray, result: ActResult, lo: int, hi: int, version: int) -> None:
        try:
            if self.act_actions is None:
                self.act_actions = tree_map(
                    lambda a: np.zeros((self.cfg.num_envs, *np.shape(a)[1:]), np.asarray(a).dtype), result.actions)
            whole = lo == 0 and hi == len(result.logprobs)
            rows = (lambda x: x) if whole else (lambda x: index(x, slice(lo, hi)))
            write(self.act_actions, ids, rows(result.actions))
            self.act_logprob[ids] = rows(result.logprobs)
            self.act_value[ids] = rows(result.values)
            self.act_version[ids] = version
            now = self._loop.time()
            if self.timeline is not None:
                for i in ids.tolist():
                    self.timeline.record(self.lanes[i], "act", self.t_ready[i], now)
            self.wait_action[ids] += now - self.t_ready[ids]
            self.t_sub[ids] = now
            env_actions = rows(result.env_actions)
            if not all_finite(env_actions):
                ids, env_actions = self._on_nonfinite_actions(ids, env_actions, version)
                if not len(ids):
                    return
            self.pool.submit(ids, env_actions)
        except BaseException as exc:
            self._fail(exc)

    # ---------------------------------------------------------------- backpressure

    def _park(self, ids: np.ndarray) -> None:
        self.parked.append(ids)
        self.state.parked += len(ids)
        now = self._loop.time()
        if self.timeline is not None:
            for i in ids.tolist():
                self.timeline.record(self.lanes[i], "act", self.t_ready[i], now)
        self.wait_action[ids] += now - self.t_ready[ids]
        self.t_ready[ids] = now  # from here on "blocked"
        self.generator.poke()
        self.rollout.poke()

    def counters(self) -> dict[str, np.ndarray]:
        """Per env, the seconds waited so far: for the step (``sim``), for the action, at the
        lockstep barrier, and parked by backpressure (a park in progress counted up to now)."""
        return {"sim": self.wait_sim.copy(), "action": self.wait_action.copy(), "barrier": self.wait_barrier.copy(),
                "backpressure": self.blocked_until_now()}

    def blocked_until_now(self) -> np.ndarray:
        """``wait_blocked`` with the envs parked right now counted up to now: a long update holds
        them across profile windows, and each window should see its share."""
        out = self.wait_blocked.copy()
        if self.parked:
            ids = np.concatenate(self.parked)
            out[ids] += self._loop.time() - self.t_ready[ids]
        return out

    def unpark(self) -> None:
        """The learner took segments: let parked envs try again."""
        if not self.parked:
            return
        parked, self.parked = self.parked, deque()
        now = self._loop.time()
        for ids in parked:
            self.state.parked -= len(ids)
            if self.timeline is not None:
                for i in ids.tolist():
                    self.timeline.record(self.lanes[i], "blocked", self.t_ready[i], now)
            self.wait_blocked[ids] += now - self.t_ready[ids]
            self.t_ready[ids] = now
            self.state.release(len(ids))  # _release claims again
            self._release(ids)
        self.generator.poke()

    # ---------------------------------------------------------------- faults

    def _on_nonfinite(self, block: Block, rows: np.ndarray) -> dict[int, list[int]]:
        """Raise, or drop the NaN/inf steps and reset those envs; returns the units held for it."""
        held: dict[int, list[int]] = {}
        for r in rows.tolist():
            i = int(block.ids[r])
            step = int(self.rollout.steps_per_env[i])
            what = f"env {i} produced NaN/inf at step {step} (reward={block.reward[r]})"
            if self.cfg.faults.nonfinite is NonFinite.RAISE:
                raise NonFiniteError(what + "; set faults.nonfinite='drop' to drop such segments instead")
            log.warning("nonfinite_dropped", env=i, step=step)
            self.stats.drop("nonfinite", 1)
            self.rollout.drop_open(i, "nonfinite")
            held.setdefault(i // self.V, []).append(i)
        for unit, ids in held.items():
            self._spawn(self._reset_rows(unit, ids))
        return held

    def _on_nonfinite_actions(self, ids: np.ndarray, actions: Any, version: int) -> tuple[np.ndarray, Any]:
        """NaN/inf in the policy's actions: raise, or hold those envs back (their open segments
        dropped, their claimed steps given back, a new episode begun) and return the rest."""
        bad = ~finite_rows(actions, len(ids))
        if self.lockstep or self.V > 1:  # a group or a vector env steps whole, or not at all
            bad[:] = True
        which = ids[bad].tolist()
        what = f"the policy (weights version {version}) produced NaN/inf actions for envs {which}"
        if self.cfg.faults.nonfinite is NonFinite.RAISE:
            raise NonFiniteError(what + "; set faults.nonfinite='drop' to drop those segments instead")
        log.warning("nonfinite_actions_dropped", envs=which, version=version)
        self.state.release(len(which))  # the claimed steps never happen
        units: dict[int, list[int]] = {}
        for i in which:
            self.rollout.drop_open(i, "nonfinite")
            units.setdefault(i // self.V, []).append(i)
        for unit, env_ids in units.items():
            self._spawn(self._reset_rows(unit, env_ids))
        keep = ~bad
        return ids[keep], index(actions, np.flatnonzero(keep))

    def _checked_reset(self, unit: int, obs: Any) -> Any:
        """A reset's observation, if finite; else NonFiniteError (``raise``) or an EnvStepError
        (``drop``: the env is then rebuilt and reset again, as for any failed reset)."""
        if all_finite(obs):
            return obs
        if self.cfg.faults.nonfinite is NonFinite.RAISE:
            raise NonFiniteError(f"env {unit}'s reset observation has NaN/inf; set faults.nonfinite='drop' to "
                                 "rebuild such envs instead")
        log.warning("nonfinite_reset", unit=unit)
        raise EnvStepError(unit, "reset", NonFiniteReset("the reset observation has NaN/inf"))

    async def _watch_steps(self, limit: float) -> None:
        """Every quarter of the timeout (a second at most), the pool gives up the steps that
        started longer than ``limit`` ago: they come back as ``timeout`` errors, recovered as
        any failed step (the env rebuilt from ``env_fn``)."""
        period = min(1.0, limit / 4)
        while True:
            await asyncio.sleep(period)
            for unit in self.pool.abandon_late(limit):
                self.timeouts += 1
                log.warning("step_timed_out", unit=unit, limit_s=limit)

    def _on_errors(self, errors: list[tuple[int, str]], now: float) -> None:
        units = sorted({i // self.V for i, _ in errors})
        detail = dict(errors)
        for u in units:
            ids = self._unit_ids(u)
            if self.timeline is not None:
                for i in ids.tolist():
                    self.timeline.record(self.lanes[i], "fail", self.t_sub[i], now)
            self.state.release(len(ids))  # the claimed step never happened
            exc = EnvStepError(u, "step", detail.get(int(ids[0]), next(iter(detail.values()))))
            self._spawn(self._recover(u, exc))

    def _spawn(self, coro) -> None:
        if self._tg is None:
            coro.close()
            return
        try:
            self._tg.create_task(coro)
        except RuntimeError:  # the group is shutting down (the run is stopping on a failure)
            coro.close()

    async def _recover(self, unit: int, exc: EnvStepError, arrive: bool = True) -> None:
        """Drop the failed unit's open segments, rebuild it from env_fn, reset it, release it."""
        ids = self._unit_ids(unit)
        while True:
            reason = exc.reason  # env_error, timeout or worker_died
            # the env's own fault counts; a worker-mate lost with a hung or dead worker did nothing wrong
            own = reason != "worker_died"
            self.stats.env_failures += own
            dropped = sum(self.rollout.drop_open(i, reason) for i in ids.tolist())
            log.warning("env_failed", env=int(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}",
                        step=int(self.rollout.steps_per_env[ids[0]]), op=exc.op, error=exc.detail,
                        reason=reason, dropped_steps=dropped)
            if own and self._charge(unit, reason, exc):
                return  # the run is stopping on a TooManyEnvFailures raised already: not a copy of it
            try:
                await self._timed(unit, "env_fn", self.pool.rebuild(unit))
                await self._reset_unit(unit)
                break
            except EnvStepError as again:
                exc = again
        self.t_ready[ids] = self._loop.time()
        if arrive:
            self._arrive(ids)

    def _charge(self, unit: int, reason: str, exc: EnvStepError) -> bool:
        """Count a failure of ``unit`` toward ``faults.max_env_failures``; raise
        TooManyEnvFailures once it is over (True: it was raised before, by another recovery)."""
        faults, now = self.cfg.faults, self._loop.time()
        self.failure_times.append((now, unit, reason))
        while self.failure_times and now - self.failure_times[0][0] > faults.failure_window_s:
            self.failure_times.popleft()
        if len(self.failure_times) <= faults.max_env_failures:
            return False
        if self._gave_up:
            return True
        self._gave_up = True
        failures = [(u, r) for _, u, r in self.failure_times]
        what = "env" if self.V == 1 else "vector env"
        charged = ", ".join(f"{what} {u} {r} x{n}" for (u, r), n in Counter(failures).items())
        raise TooManyEnvFailures(
            f"{len(failures)} env failures within {faults.failure_window_s}s "
            f"(faults.max_env_failures={faults.max_env_failures}): {charged}; last: {exc}", failures) from exc

    async def _first_reset(self, unit: int) -> None:
        """The run's first reset of a unit. A NaN/inf observation (``nonfinite='drop'``) is
        a hung reset (past ``faults.step_timeout_s``) or a dead worker is recovered like a failed
        reset later on; any other failure here stops the run (an env
        that cannot start is a setup error, not a fault to retry)."""
        try:
            await self._reset_unit(unit)
        except EnvStepError as exc:
            if exc.reason not in ("nonfinite", "timeout", "worker_died"):
                raise
            await self._recover(unit, exc, arrive=False)  # run() releases every env after the first resets

    # ---------------------------------------------------------------- resets

    def _unit_ids(self, unit: int) -> np.ndarray:
        return np.arange(unit * self.V, unit * self.V + self.V)

    def _seed(self, env_id: int) -> int:
        # seed each env's first episode; later resets (after a rebuild) get fresh, reproducible seeds
        self.resets[env_id] += 1
        self.ep_return[env_id], self.ep_length[env_id], self.ep_success[env_id] = 0.0, 0, -1
        if self.cfg.reset_group is None:
            seed = self.cfg.seed + env_id + self.cfg.num_envs * int(self.resets[env_id] - 1)
            self.rollout.episode_key[env_id] = seed
            return seed
        seed = self._group_seed(env_id)
        self.rollout.episode_key[env_id] = seed
        self.episodes[env_id] += 1
        self.pool.set_reset_seeds(np.array([env_id]), np.array([self._group_seed(env_id)]))
        return seed

    def _group_seed(self, env_id: int) -> int:
        """Under ``reset_group``: the seed of env ``env_id``'s next episode, shared by its group
        (the group's k-th episodes all start from one seed)."""
        groups = self.cfg.num_envs // self.cfg.reset_group
        return self.cfg.seed + env_id // self.cfg.reset_group + groups * int(self.episodes[env_id])

    def _autoreset(self, env_id: int) -> None:
        """Env ``env_id``'s episode ended and the same step reset it: with reset groups, from the
        seed written for it (the next one is written now); else from the env's own RNG."""
        if self.cfg.reset_group is None:
            self.rollout.episode_key[env_id] = -1
            return
        self.rollout.episode_key[env_id] = self._group_seed(env_id)
        self.episodes[env_id] += 1
        self.pool.set_reset_seeds(np.array([env_id]), np.array([self._group_seed(env_id)]))

    async def _timed(self, unit: int, op: str, call):
        """Await a unit's reset or rebuild; once it has *run* past ``faults.step_timeout_s``
        (waits for a lane or for worker-mates do not count) the pool gives it up (a lane
        replaced, a worker killed) and it fails as ``timeout``, recovered as any failed reset:
        the unit rebuilt from ``env_fn``."""
        limit = self.cfg.faults.step_timeout_s
        if limit is None:
            return await call
        fut = asyncio.ensure_future(call)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(1.0, limit / 4))
                except TimeoutError:
                    if self.pool.abandon(unit, limit):
                        break
        finally:
            fut.cancel()
        self.timeouts += 1
        log.warning("reset_timed_out", unit=unit, op=op, limit_s=limit)
        raise EnvStepError(unit, op, TimedOut(f"the {op} ran past faults.step_timeout_s and was abandoned"))

    async def _reset_unit(self, unit: int) -> None:
        ids = self._unit_ids(unit)
        if self.V == 1:
            obs, _ = await self._timed(unit, "reset", self.pool.reset(unit, seed=self._seed(unit)))
            self.rollout.set_obs(ids, batch_of_one(self._checked_reset(unit, obs)))
        else:
            obs, _ = await self._timed(unit, "reset", self.pool.reset(unit, [self._seed(i) for i in ids.tolist()]))
            self.rollout.set_obs(ids, self._checked_reset(unit, stack([obs[r] for r in range(self.V)])))

    async def _reset_rows(self, unit: int, env_ids: list[int]) -> None:
        """Reset some envs of a unit after dropped NaN steps or actions, then let the unit go on
        (a failed reset, or one with NaN/inf, rebuilds the unit as a failed step does)."""
        try:
            if self.V == 1:
                obs, _ = await self._timed(unit, "reset", self.pool.reset(unit, seed=self._seed(unit)))
                self.rollout.set_obs(np.array(env_ids), batch_of_one(self._checked_reset(unit, obs)))
            else:
                got, _ = await self._timed(unit, "reset",
                                           self.pool.reset(unit, {i - unit * self.V: self._seed(i) for i in env_ids}))
                obs = self._checked_reset(unit, stack([got[i - unit * self.V] for i in env_ids]))
                self.rollout.set_obs(np.array(env_ids), obs)
        except EnvStepError as exc:
            await self._recover(unit, exc)
            return
        ids = self._unit_ids(unit)
        self.t_ready[ids] = self._loop.time()
        self._arrive(ids)


def _rows(block: Block, keep: np.ndarray) -> Block:
    """The rows ``keep`` of a block (final observations renumbered)."""
    where = {int(r): k for k, r in enumerate(keep.tolist())}
    chunk = (None, None) if block.chunk_steps is None else (block.chunk_rewards[keep], block.chunk_steps[keep])
    return Block(block.ids[keep], index(block.obs, keep), block.reward[keep], block.terminated[keep],
                 block.truncated[keep], block.finite[keep], block.success[keep],
                 {where[r]: o for r, o in block.final_obs.items() if r in where}, [], False, *chunk)
