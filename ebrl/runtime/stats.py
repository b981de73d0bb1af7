"""Run counters and the result ``run()`` returns.

The counters obey one invariant, checked by :meth:`RunResult.accounting_ok`:
steps simulated = steps trained + steps dropped (by reason) + steps in flight at stop.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RunStats:
    """Live counters, updated by the env tasks, the generator and the learner."""

    simulated: int = 0  # env.step calls that returned a transition
    trained: int = 0  # transitions in updates that completed
    dropped: Counter = field(default_factory=Counter)  # reason -> transitions
    env_failures: int = 0  # env.step or reset calls that raised or timed out (not worker-mates of a dead worker)
    updates: int = 0
    skipped_updates: int = 0  # updates undone for a NaN/inf loss or weights (faults.nonfinite='drop')
    learner_wakeups: int = 0  # times the rollout queue woke the learner (a segment closed, a driver blocked, ...)
    lag: Counter = field(default_factory=Counter)  # policy lag -> trained transitions
    episodes: int = 0
    returns: deque = field(default_factory=lambda: deque(maxlen=100))
    lengths: deque = field(default_factory=lambda: deque(maxlen=100))
    success_once: deque = field(default_factory=lambda: deque(maxlen=100))  # succeeded at any step
    success_at_end: deque = field(default_factory=lambda: deque(maxlen=100))  # succeeded at the last step
    last_metrics: dict = field(default_factory=dict)
    published_bytes: int = 0  # weight publications: bytes moved, seconds snapshotting them
    publish_snapshot_s: float = 0.0
    # start-up, in loop time: run() called, the first env step done, the first update done
    started_at: float = math.nan
    first_step_at: float = math.nan
    first_update_at: float = math.nan
    steps_at_first_update: int = 0  # env steps simulated by the end of the first update

    def drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] += n

    def episode(self, ret: float, length: int, success_once: bool | None, success_at_end: bool | None) -> None:
        self.episodes += 1
        self.returns.append(ret)
        self.lengths.append(length)
        if success_once is not None:
            self.success_once.append(float(success_once))
            self.success_at_end.append(float(bool(success_at_end)))

    def algorithm_steps(self, n: int, held: int, metrics: dict) -> tuple[int, int]:
        """``(trained, held)``: of an update's ``n`` new steps and the ``held`` its algorithm kept
        from before, those it trained on, and those it keeps now (metric ``steps_held``); what it
        dropped (``dropped/<reason>``, GRPO's dynamic sampling) is counted here."""
        now = int(metrics.get("steps_held", 0))
        trained = n + held - now
        for key, value in metrics.items():
            if key.startswith("dropped/"):
                self.drop(key.removeprefix("dropped/"), int(value))
                trained -= int(value)
        return trained, now

    def updated(self, n: int, lags: np.ndarray, metrics: dict, at: float) -> None:
        """An update of ``n`` steps (each with its policy lag in ``lags``) published at loop time ``at``."""
        self.trained += n
        self.updates += 1
        if self.updates == 1:  # RunResult.first_update_s and the steady-state rate after it
            self.first_update_at, self.steps_at_first_update = at, self.simulated
        values, counts = np.unique(lags, return_counts=True)
        self.lag.update(dict(zip(values.tolist(), counts.tolist())))
        self.last_metrics = metrics
        self.published_bytes += int(metrics.get("publish_bytes", 0))
        self.publish_snapshot_s += metrics.get("publish_s", 0.0)

    @property
    def mean_return(self) -> float:
        return mean(self.returns)


def mean(xs, empty: Any = math.nan) -> Any:
    """The mean of ``xs``, ``empty`` if there are none."""
    return sum(xs) / len(xs) if xs else empty


def hist_mean(hist: dict[int, int]) -> float:
    """The mean of a histogram (value -> count), 0.0 if it is empty."""
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else 0.0


@dataclass
class RunResult:
    """What a finished run reports. ``env_steps_per_s`` counts simulated steps over wall time."""

    schedule: str
    wall_s: float  # loop time: virtual seconds under ebrl.testing.run_virtual
    env_steps: int
    env_steps_per_s: float
    trained: int
    dropped: dict[str, int]
    in_flight_at_stop: int
    env_failures: int
    updates: int
    policy_version: int
    lag_hist: dict[int, int]
    lag_mean: float
    lag_max: int
    gen_batch_hist: dict[int, int]
    gen_batch_mean: float
    gen_wait_max_s: float
    episodes: int
    mean_return: float
    success_once: float  # fraction of the last 100 episodes that succeeded at any step (NaN: no success signal)
    success_at_end: float  # ... that ended in success
    steps_per_env: list[int]
    metrics: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per update (keys: docs/metrics.md)
    sim_backend: str = ""
    sim_size: int = 0  # thread lanes, worker processes, or inline lanes (virtual time)
    learner_mode: str = ""
    generator_busy_s: float = 0.0  # time in policy calls
    learner_busy_s: float = 0.0  # time in updates
    cpu_wall_s: float = 0.0  # real seconds, also under virtual time
    # start-up: seconds from the run() call to the first env step's result and to the end of the
    # first update (NaN: none happened); env steps/s from the end of the first update to the end
    first_step_s: float = math.nan
    first_update_s: float = math.nan
    steady_env_steps_per_s: float = math.nan
    # fraction of wall_s each stage was busy: "generator" and "learner" always (from their busy
    # counters), "sim" (mean over envs) when run() was given a timeline
    busy: dict[str, float] = field(default_factory=dict)
    learner_wakeups: int = 0  # the rollout queue woke the learner this often (not once per env step)
    # the resource manager (ebrl.runtime.resources): one profile per epoch (EpochProfile.to_dict),
    # the controller's decisions with their reasons, and envs moved between worker processes
    profiles: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    migrations: int = 0
    skipped_updates: int = 0  # undone for a NaN/inf loss or weights; their steps are dropped (nonfinite_update)
    timeouts: int = 0  # steps abandoned past faults.step_timeout_s, builds and resets past build_timeout_s
    respawns: int = 0  # sim worker processes replaced after dying (or being killed for a hung step)
    # a data-parallel job (ebrl.distributed): every counter above is the job's (summed over
    # ranks); the SHA-256 of each rank's final weights, each rank's own figures, and how many
    # updates began with the ranks' weights checked equal
    world_size: int = 1
    rank: int = 0
    rank_weight_hashes: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    weight_checks: int = 0
    # weight publications to the generator: how many, bytes each (only the trainable tensors of a
    # policy with a frozen part) and seconds each (the learner's snapshot + the generator's load)
    publications: int = 0
    publish_bytes: float = math.nan
    publish_s: float = math.nan
    # the generator's cost curve: mean microseconds per call by batch size, calls by size, and
    # the line fixed_us + per_row_us * rows through them (None until two sizes were timed)
    gen_costs: dict[str, Any] = field(default_factory=dict)
    # run.eval_every_s: one row per evaluation during the run (env_steps, time, success_once, ...)
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    def accounting_ok(self) -> bool:
        return self.env_steps == self.trained + sum(self.dropped.values()) + self.in_flight_at_stop



def summarize(parts: Any, t0: float, ended_at: float, cpu_wall_s: float = 0.0) -> RunResult:
    """The result of a run whose ``parts`` (:class:`ebrl.runtime.run.Parts`) ran from loop time
    ``t0`` to ``ended_at``: the counters' figures, then what each part reports of itself."""
    stats, generator, learner, pool, manager = parts.stats, parts.generator, parts.learner, parts.pool, parts.manager
    wall_s, version, gen_batches = ended_at - t0, learner.version, generator.batch_sizes
    steady_s = ended_at - stats.first_update_at
    busy = {}
    if wall_s > 0:
        busy = {"generator": generator.busy_s / wall_s, "learner": learner.stage.busy_s / wall_s}
        if parts.timeline is not None:
            busy["sim"] = parts.timeline.busy_fraction("env", t0, ended_at, name="sim")
    return RunResult(
        **{k: getattr(stats, k) for k in ("trained", "env_failures", "updates", "episodes", "mean_return",
                                          "learner_wakeups", "skipped_updates")},
        schedule=parts.cfg.schedule.value,
        wall_s=wall_s,
        env_steps=stats.simulated,
        env_steps_per_s=stats.simulated / wall_s if wall_s > 0 else math.inf,
        dropped=dict(stats.dropped),
        in_flight_at_stop=parts.rollout.pending_steps() + learner.untrained_in_hand + learner.held,
        policy_version=version,
        lag_hist=dict(sorted(stats.lag.items())), lag_mean=hist_mean(stats.lag), lag_max=max(stats.lag, default=0),
        gen_batch_hist=dict(sorted(gen_batches.items())), gen_batch_mean=hist_mean(gen_batches),
        success_once=mean(stats.success_once), success_at_end=mean(stats.success_at_end),
        metrics=dict(stats.last_metrics),
        first_step_s=stats.first_step_at - stats.started_at,
        first_update_s=stats.first_update_at - stats.started_at,
        steady_env_steps_per_s=(stats.simulated - stats.steps_at_first_update) / steady_s if steady_s > 0 else math.nan,
        history=learner.history,
        steps_per_env=parts.rollout.steps_per_env.tolist(),
        gen_wait_max_s=generator.max_request_wait_s, gen_costs=generator.costs.to_dict(),
        timeouts=parts.driver.recovery.timeouts, respawns=pool.respawns, migrations=parts.driver.moves.done,
        sim_backend=pool.backend.value, sim_size=pool.size, learner_mode=parts.mode.value,
        generator_busy_s=generator.busy_s, learner_busy_s=learner.stage.busy_s, busy=busy, cpu_wall_s=cpu_wall_s,
        profiles=[p.to_dict() for p in manager.profiles], decisions=[d.to_dict() for d in manager.decisions],
        evaluations=list(parts.metrics.eval_rows),
        publications=version,
        publish_bytes=stats.published_bytes / version if version else math.nan,
        publish_s=(stats.publish_snapshot_s + generator.load_weights_s) / version if version else math.nan,
    )
