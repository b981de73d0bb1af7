"""Fault recovery for the driver: failed, hung and NaN/inf env steps, resets and rebuilds.

Every method here answers the driver (is the unit back?) and never releases an env. Failures the
env itself caused count toward ``faults.max_env_failures`` within ``faults.failure_window_s``; past
it the run stops with one :class:`~ebrl.runtime.errors.TooManyEnvFailures`. A unit is ``V`` envs:
one env, or one vector env of ``cfg.sim.vector_size`` rows.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any

import numpy as np

from ebrl.config import NonFinite, RunConfig
from ebrl.runtime.driver.episodes import Episodes
from ebrl.runtime.errors import EnvStepError, NonFiniteError, NonFiniteReset, TimedOut, TooManyEnvFailures
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.sim import Block, SimPool
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats
from ebrl.spaces import all_finite, batch_of_one, finite_rows, stack
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.env")


class Recovery:
    """Drops, resets and rebuilds failed units (see module docstring)."""

    def __init__(self, cfg: RunConfig, pool: SimPool, rollout: RolloutQueue, stats: RunStats, state: RunState,
                 episodes: Episodes):
        self.cfg, self.pool, self.rollout, self.stats, self.state = cfg, pool, rollout, stats, state
        self.episodes = episodes
        self.V = cfg.sim.vector_size
        # failures charged to faults.max_env_failures in the window: (loop time, unit, reason)
        self.failure_times: deque[tuple[float, int, str]] = deque()
        self._gave_up = False  # TooManyEnvFailures raised: the run is stopping on it
        # steps abandoned past faults.step_timeout_s, builds and resets past faults.build_timeout_s
        self.timeouts = 0

    def unit_ids(self, unit: int) -> np.ndarray:
        return np.arange(unit * self.V, unit * self.V + self.V)

    def nonfinite_steps(self, block: Block, rows: np.ndarray) -> dict[int, list[int]]:
        """Raise, or drop the NaN/inf steps at ``rows`` of ``block``; returns the envs to reset
        by unit (the driver holds those units until :meth:`reset_rows`)."""
        envs = block.ids[rows].tolist()
        for r, i in zip(rows.tolist(), envs):
            step = int(self.rollout.steps_per_env[i])
            if self.cfg.faults.nonfinite is NonFinite.RAISE:
                raise NonFiniteError(f"env {i} produced NaN/inf at step {step} (reward={block.reward[r]}); "
                                     "set faults.nonfinite='drop' to drop such segments instead")
            log.warning("nonfinite_dropped", env=i, step=step)
        self.stats.drop("nonfinite", len(envs))
        return self._drop_open(envs)

    def nonfinite_actions(self, ids: np.ndarray, actions: Any, version: int,
                          whole: bool) -> tuple[np.ndarray, dict[int, list[int]]]:
        """NaN/inf in the policy's actions for envs ``ids``: raise, or give up those envs' steps
        (their open segments dropped, their claimed steps given back). Returns the rows held
        back (all of them when ``whole``: a lockstep group or a vector env steps whole or not
        at all) and the envs to reset by unit."""
        bad = ~finite_rows(actions, len(ids))
        if whole:
            bad[:] = True
        which = ids[bad].tolist()
        what = f"the policy (weights version {version}) produced NaN/inf actions for envs {which}"
        if self.cfg.faults.nonfinite is NonFinite.RAISE:
            raise NonFiniteError(what + "; set faults.nonfinite='drop' to drop those segments instead")
        log.warning("nonfinite_actions_dropped", envs=which, version=version)
        self.state.release(len(which))  # the claimed steps never happen
        return bad, self._drop_open(which)

    def _drop_open(self, env_ids: list[int]) -> dict[int, list[int]]:
        """Drop the open segments of envs with NaN/inf; returns those envs by unit, to reset."""
        units: dict[int, list[int]] = {}
        for i in env_ids:
            self.rollout.drop_open(i, "nonfinite")
            units.setdefault(i // self.V, []).append(i)
        return units

    def checked_reset(self, unit: int, obs: Any) -> Any:
        """A reset's observation, if finite; else NonFiniteError (``raise``) or an EnvStepError
        (``drop``: the env is then rebuilt and reset again, as for any failed reset)."""
        if all_finite(obs):
            return obs
        if self.cfg.faults.nonfinite is NonFinite.RAISE:
            raise NonFiniteError(f"env {unit}'s reset observation has NaN/inf; set faults.nonfinite='drop' to "
                                 "rebuild such envs instead")
        log.warning("nonfinite_reset", unit=unit)
        raise EnvStepError(unit, "reset", NonFiniteReset("the reset observation has NaN/inf"))

    async def recover(self, unit: int, exc: EnvStepError) -> bool:
        """Drop the failed unit's open segments, rebuild it from env_fn and reset it. True: it is
        back; False: the run is already stopping on too many failures."""
        ids = self.unit_ids(unit)
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
                return False  # the run is stopping on a TooManyEnvFailures raised already: not a copy of it
            try:
                await self._timed(unit, "env_fn", self.pool.rebuild(unit))
                await self.reset_unit(unit)
                return True
            except EnvStepError as again:
                exc = again

    def _charge(self, unit: int, reason: str, exc: EnvStepError) -> bool:
        """Count a failure of ``unit`` toward ``faults.max_env_failures``; raise
        TooManyEnvFailures once it is over (True: it was raised before, by another recovery)."""
        faults, now = self.cfg.faults, asyncio.get_running_loop().time()
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

    async def first_reset(self, unit: int) -> None:
        """The run's first reset of a unit. NaN/inf, a timeout or a dead worker is recovered like a
        later failed reset; any other failure stops the run (an env that cannot start is a setup error)."""
        try:
            await self.reset_unit(unit)
        except EnvStepError as exc:
            if exc.reason not in ("nonfinite", "timeout", "worker_died"):
                raise
            await self.recover(unit, exc)  # the driver releases every env after the first resets

    async def watch_steps(self, limit: float) -> None:
        """Every quarter of ``limit`` (a second at most), give up the steps that started longer ago:
        they come back as ``timeout`` errors, recovered as any failed step."""
        period = min(1.0, limit / 4)
        while True:
            await asyncio.sleep(period)
            for unit in self.pool.abandon_late(limit):
                self.timeouts += 1
                log.warning("step_timed_out", unit=unit, limit_s=limit)

    async def _timed(self, unit: int, op: str, call):
        """Await a unit's build (``env_fn``) or reset; once it has *run* past ``faults.build_timeout_s``
        (waits for a lane or for worker-mates do not count) the pool gives it up and it fails as
        ``timeout``, as does a call the pool timed itself (the inline host's builds)."""
        limit = self.cfg.faults.build_timeout_s
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
                except EnvStepError as exc:
                    if exc.reason == "timeout":
                        self._timed_out(unit, op, limit)
                    raise
        finally:
            fut.cancel()
        self._timed_out(unit, op, limit)
        raise EnvStepError(unit, op, TimedOut(f"the {op} ran past faults.build_timeout_s={limit:g} s and was abandoned"))

    def _timed_out(self, unit: int, op: str, limit: float) -> None:
        self.timeouts += 1
        log.warning("reset_timed_out" if op == "reset" else "build_timed_out", unit=unit, op=op, limit_s=limit)

    async def reset_unit(self, unit: int, env_ids: list[int] | None = None) -> None:
        """Start new episodes for envs ``env_ids`` of ``unit`` (default: all) from fresh seeds:
        the one path of every reset."""
        ids = self.unit_ids(unit) if env_ids is None else np.asarray(env_ids)
        seeds = [self.episodes.reset_seed(i) for i in ids.tolist()]
        if self.V == 1:
            arg = seeds[0]
        else:  # every row, or some: {row: seed}
            arg = seeds if env_ids is None else {i - unit * self.V: s for i, s in zip(ids.tolist(), seeds)}
        got, _ = await self._timed(unit, "reset", self.pool.reset(unit, arg))
        self.observe(unit, ids, got)

    def observe(self, unit: int, ids: np.ndarray, got: Any) -> None:
        """New episodes' first observations (a plain env's, or a vector env's ``{row: obs}``),
        checked, into the rollout."""
        obs = batch_of_one(got) if self.V == 1 else stack([got[i - unit * self.V] for i in ids.tolist()])
        self.rollout.set_obs(ids, self.checked_reset(unit, obs))

    async def reset_rows(self, unit: int, env_ids: list[int]) -> bool:
        """Reset some envs of a unit after dropped NaN steps or actions (a failed reset, or one
        with NaN/inf, rebuilds the unit as a failed step does). True: the unit may go on."""
        try:
            await self.reset_unit(unit, env_ids)
        except EnvStepError as exc:
            return await self.recover(unit, exc)
        return True


class Moves:
    """The controller's env moves (:attr:`wanted`), each made at the env's next episode end."""

    def __init__(self, pool: SimPool, episodes: Episodes, recovery: Recovery):
        self.pool, self.episodes, self.recovery = pool, episodes, recovery
        self.wanted: dict[int, int] = {}  # env -> worker: the controller's, done at the env's next episode end
        self.under_way: set[int] = set()  # envs whose move started (the pool's placement is not yet theirs)
        self.done = 0  # moves made

    @property
    def pending(self) -> bool:
        """Moves wanted or under way: a placement read now would be stale."""
        return bool(self.wanted or self.under_way)

    def due(self, block: Block) -> list[tuple[int, int]]:
        """``(env, worker)`` for each env of ``block`` whose episode just ended and that is
        wanted elsewhere; those moves are under way from now on."""
        start = []
        for i in block.ids[block.terminated | block.truncated].tolist():
            target = self.wanted.pop(i, None)
            if target is None:
                continue
            if int(self.pool.placement[i]) == target:  # a decision made while an earlier move was in flight
                log.info("env_move_skipped", env=i, where=target)
                continue
            self.under_way.add(i)
            start.append((i, target))
        return start

    async def move(self, env_id: int, worker: int) -> bool:
        """Rebuild env ``env_id`` in ``worker`` and start its next episode there. True: the env
        may go on (moved, or left where it was by a failed move)."""
        try:  # a new episode where it goes: seeded and observed as every reset is
            obs, _ = await self.pool.migrate(env_id, worker, seed=self.episodes.reset_seed(env_id))
            self.recovery.observe(env_id, np.array([env_id]), obs)
            self.done += 1
            log.info("env_migrated", env=env_id, worker=worker)
        except EnvStepError as exc:
            log.warning("env_migration_failed", env=env_id, worker=worker, error=exc.detail)
        finally:
            self.under_way.discard(env_id)
        return True
