"""The live profiler: what every stage did in the last window, from counters the stages keep anyway.

Nothing here runs per env step. The stages keep running sums (the sim pool a row per env in
:attr:`~ebrl.runtime.sim.block.StepRows.cost`, written where the step runs; the driver its
waits per env; the generator and the learner their busy seconds), and :meth:`LiveProfiler.take`
subtracts the previous snapshot. An :class:`EpochProfile` holds, for one window, each env's
steps, wall and CPU seconds and its waits by cause (:data:`WAIT_CAUSES`), the generator's
batches and calls, the learner's updates, the event loop's CPU time and the cores' and GPUs'
use; docs/resources.md says where each is measured.

    >>> import ebrl
    >>> from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual
    >>> trainer = ebrl.Trainer(
    ...     env_fn=lambda i: MockEnv(latency=Latency.constant(0.004)),
    ...     policy=MockPolicy(act_dim=4, base_cost_s=0.001), algo=NoopAlgo(base_cost_s=0.002),
    ...     config=ebrl.RunConfig(num_envs=8, segment_len=8, total_env_steps=4000,
    ...                           sim={"num_threads": 2}, resources={"epoch_s": 0.5}))
    >>> result = run_virtual(trainer)
    >>> first = result.profiles[0]
    >>> first["sim"]["lanes"], first["waits_share"]["lane"] > 0.5   # 8 sleeping envs on 2 lanes wait
    (2, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ebrl.runtime.sim.block import CPU, QUEUE, STEPS, WALL

WAIT_CAUSES = ("lane", "delivery", "action", "barrier", "backpressure")


@dataclass
class EpochProfile:
    """One window of a run, as measured (see the module docstring). Sums are in seconds."""

    epoch: int
    t_start: float
    t_end: float
    backend: str
    lanes: int  # thread lanes, worker processes, or virtual-time inline lanes
    num_units: int
    steps: np.ndarray  # [N] env steps in the window
    wall_s: np.ndarray  # [N] seconds inside env.step
    cpu_s: np.ndarray  # [N] CPU seconds of those steps
    mean_step_s: np.ndarray  # [N] wall seconds per step since the start (NaN: no step yet)
    waits: dict[str, np.ndarray]  # cause -> [N] seconds
    gen_batches: int = 0
    gen_rows: int = 0
    gen_busy_s: float = 0.0
    gen_cpu_s: float = 0.0  # CPU seconds of the threads making the policy calls
    offload: str = ""  # where policy calls ran at the window's end: "inline" or "thread"
    loop_busy: float = float("nan")  # the event loop thread's CPU time over the window (NaN: virtual time)
    gen_wait_s: float = 0.0  # rows' summed wait for their batch to start
    gen_capped: int = 0  # batches started when their wait reached max_wait_s
    batch_target: int = 0
    max_wait_s: float = 0.0
    live_envs: int = 0
    updates: int = 0
    learner_busy_s: float = 0.0
    gen_fit: tuple[float, float] | None = None  # seconds per policy call = fixed + per_row * rows (BatchCosts)
    gen_paused_s: float = 0.0  # the generator paused while the learner trained (lockstep schedules, lag 0)
    placement: np.ndarray | None = None  # [N] env -> worker (process backend; -1: a mixed pool's lanes)
    workers: int = 0  # worker processes (process or mixed backend)
    system: dict[str, float] = field(default_factory=dict)  # SystemSampler keys: cores, GPUs

    @property
    def window_s(self) -> float:
        return max(self.t_end - self.t_start, 1e-9)

    @property
    def total_steps(self) -> int:
        return int(self.steps.sum())

    @property
    def busy(self) -> float:
        """CPU over wall time of the window's steps: ~0 for steps that wait, ~1 for GIL-bound ones."""
        wall = float(self.wall_s.sum())
        return min(1.0, float(self.cpu_s.sum()) / wall) if wall > 0 else 1.0

    @property
    def held_by_training(self) -> float:
        """The share of the window the envs were held back by training (:func:`held_share`)."""
        return held_share(self.waits.get("backpressure", np.zeros(1)), self.gen_paused_s, self.window_s)

    @property
    def sim_s(self) -> float:
        return float(self.wall_s.sum())

    def wait_s(self, cause: str) -> float:
        return float(self.waits[cause].sum())

    @property
    def lane_wait_share(self) -> float:
        """The share of the sim round trip spent waiting for a lane (or worker)."""
        lane = self.wait_s("lane")
        total = lane + self.sim_s
        return lane / total if total > 0 else 0.0

    @property
    def units_in_sim(self) -> float:
        """Units stepping or waiting for a lane, on average over the window (Little's law)."""
        return (self.sim_s + self.wait_s("lane")) / self.window_s / (self.steps.size // max(self.num_units, 1))

    @property
    def lanes_running(self) -> float:
        """Lanes busy stepping, on average over the window."""
        return self.sim_s / self.window_s / (self.steps.size // max(self.num_units, 1))

    @property
    def gen_busy(self) -> float:
        return self.gen_busy_s / self.window_s

    @property
    def gen_latency_s(self) -> float:
        return self.gen_busy_s / self.gen_batches if self.gen_batches else 0.0

    @property
    def gen_cpu_per_batch_s(self) -> float:
        return self.gen_cpu_s / self.gen_batches if self.gen_batches else 0.0

    @property
    def gen_request_wait_s(self) -> float:
        return self.gen_wait_s / self.gen_rows if self.gen_rows else 0.0

    def subset(self, mask: np.ndarray) -> EpochProfile:
        """The window of the envs in ``mask`` only (a mixed pool's lanes, or its workers)."""
        return replace(self, num_units=int(mask.sum()), steps=self.steps[mask], wall_s=self.wall_s[mask],
                       cpu_s=self.cpu_s[mask], mean_step_s=self.mean_step_s[mask],
                       waits={c: w[mask] for c, w in self.waits.items()},
                       placement=None if self.placement is None else self.placement[mask])

    def worker_busy(self, workers: int) -> np.ndarray:
        """Each worker's share of the window spent stepping its envs (process backend)."""
        if self.placement is None:
            return np.zeros(0)
        on = self.placement >= 0  # not the envs on a mixed pool's lanes
        return np.bincount(self.placement[on], weights=self.wall_s[on], minlength=workers)[:workers] / self.window_s

    def to_dict(self) -> dict[str, Any]:
        env_time = self.window_s * max(self.steps.size, 1)
        out = {
            "epoch": self.epoch, "t_start": round(self.t_start, 4), "t_end": round(self.t_end, 4),
            "sim": {"backend": self.backend, "lanes": self.lanes, "steps": self.total_steps,
                    "steps_per_s": round(self.total_steps / self.window_s, 1),
                    "step_wall_us": _per_step(self.wall_s.sum(), self.total_steps),
                    "step_cpu_us": _per_step(self.cpu_s.sum(), self.total_steps),
                    "cpu_step_us": [_per_step(c, s) for c, s in zip(self.cpu_s.tolist(), self.steps.tolist())],
                    "busy": round(self.busy, 3), "lane_wait_share": round(self.lane_wait_share, 3),
                    "units_in_sim": round(self.units_in_sim, 2), "lanes_running": round(self.lanes_running, 2),
                    "mean_step_us": [None if np.isnan(c) else round(float(c) * 1e6, 1) for c in self.mean_step_s]},
            # the share of all envs' time (envs x window) spent in each state
            "waits_share": {c: round(self.wait_s(c) / env_time, 4) for c in WAIT_CAUSES},
            "generation": {"batches": self.gen_batches, "mean_batch": round(self.gen_rows / self.gen_batches, 2)
                           if self.gen_batches else 0.0, "busy": round(self.gen_busy, 3),
                           "latency_us": round(self.gen_latency_s * 1e6, 1),
                           "cpu_us": round(self.gen_cpu_per_batch_s * 1e6, 1), "offload": self.offload,
                           "request_wait_us": round(self.gen_request_wait_s * 1e6, 1),
                           "capped_batches": self.gen_capped,
                           # rows waiting for a batch, on average (Little's law)
                           "queue_rows": round(self.gen_wait_s / self.window_s, 2),
                           "batch_target": self.batch_target, "max_wait_s": self.max_wait_s,
                           "fixed_us": None if self.gen_fit is None else round(self.gen_fit[0] * 1e6, 1),
                           "per_row_us": None if self.gen_fit is None else round(self.gen_fit[1] * 1e6, 2)},
            "learner": {"updates": self.updates, "busy": round(self.learner_busy_s / self.window_s, 3),
                        "held_envs": round(self.held_by_training, 3),
                        "idle": round(max(0.0, 1.0 - self.learner_busy_s / self.window_s), 3),
                        "update_s": round(self.learner_busy_s / self.updates, 4) if self.updates else 0.0},
            "system": {k: round(v, 1) for k, v in self.system.items()},
            "loop_busy": None if np.isnan(self.loop_busy) else round(self.loop_busy, 3),
        }
        out["sim"]["share"] = round(self.sim_s / env_time, 4)
        if self.placement is not None:  # -1: on a mixed pool's lanes
            out["sim"]["placement"] = self.placement.tolist()
            out["sim"]["worker_busy"] = [round(float(b), 3) for b in self.worker_busy(self.workers or self.lanes)]
        return out


def held_share(parked_s: np.ndarray, paused_s: float, window_s: float) -> float:
    """The share of a window of ``window_s`` the envs were held back by training: parked on a
    full queue (``parked_s``, per env), or waiting on a generator paused for an update
    (``paused_s``, lockstep schedules)."""
    window_s = max(window_s, 1e-9)
    parked = float(parked_s.sum()) / (window_s * max(parked_s.size, 1))
    return min(1.0, max(parked, paused_s / window_s))


def _per_step(total: float, steps: int) -> float:
    return round(float(total) / steps * 1e6, 1) if steps else 0.0


class LiveProfiler:
    """Takes an :class:`EpochProfile` from the run's counters. ``system``: a
    :class:`~ebrl.telemetry.system.SystemSampler` (None: no core or GPU numbers, as under virtual time)."""

    def __init__(self, pool, driver, generator, learner, clock, system=None):
        self.pool, self.driver, self.generator, self.learner = pool, driver, generator, learner
        self.clock, self.system = clock, system
        self.epoch = 0
        self._last = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        costs = self.pool.costs()
        if costs is None:
            costs = np.zeros((self.driver.cfg.num_envs, 4))
        now = self.clock()
        return {"t": now, "costs": costs, "loop_cpu": time.thread_time(),  # taken on the loop thread
                **self.driver.counters(), **self.generator.counters(now), **self.learner.counters(now)}

    @property
    def window_s(self) -> float:
        """Seconds since the last profile was taken (the window :meth:`take` would cover)."""
        return self.clock() - self._last["t"]

    def window_done(self, min_steps: int, max_s: float) -> bool:
        """Whether the window since the last profile should close now: it holds ``min_steps`` env
        steps, or has lasted ``max_s``, or training held the envs back for most of it (parked on
        a full queue, or a generator paused for an update). Such a window closes as it stands
        (stalled): grown, it would mix an update's hold into the rollout's numbers."""
        last, now = self._last, self._snapshot()
        window = now["t"] - last["t"]
        if now["costs"][:, STEPS].sum() - last["costs"][:, STEPS].sum() >= min_steps or window >= max_s:
            return True
        return held_share(now["backpressure"] - last["backpressure"], now["gen_paused"] - last["gen_paused"],
                          window) > 0.5

    def close(self) -> None:
        if self.system is not None:
            self.system.close()  # NVML, where it was initialised
            self.system = None

    def take(self) -> EpochProfile:
        """The profile of the window since the previous call (or since the profiler was made)."""
        last, now = self._last, self._snapshot()
        self._last = now
        d = {k: now[k] - last[k] for k in now}  # the window's share of every running sum
        dc, total = d["costs"], now["costs"]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(total[:, STEPS] > 0, total[:, WALL] / total[:, STEPS], np.nan)
        pool = self.pool
        elastic = pool.movable
        placement, workers = (pool.placement, pool.workers) if elastic else (None, 0)
        profile = EpochProfile(
            epoch=self.epoch, t_start=last["t"], t_end=now["t"], backend=pool.backend.value,
            lanes=pool.lanes if elastic and pool.mixed else pool.size, workers=workers,
            num_units=self.driver.cfg.num_envs // self.driver.V,
            steps=dc[:, STEPS], wall_s=dc[:, WALL], cpu_s=dc[:, CPU], mean_step_s=mean,
            waits={"lane": dc[:, QUEUE], "delivery": np.maximum(d["sim"] - dc[:, WALL] - dc[:, QUEUE], 0.0),
                   **{c: d[c] for c in ("action", "barrier", "backpressure")}},
            gen_batches=d["gen_batches"], gen_rows=d["gen_rows"], gen_busy_s=d["gen_busy"], gen_cpu_s=d["gen_cpu"],
            gen_wait_s=d["gen_wait"], gen_capped=d["gen_capped"], gen_paused_s=d["gen_paused"],
            updates=d["updates"], learner_busy_s=max(0.0, d["learner_busy"]), offload=self.generator.offload_mode.value,
            batch_target=self.generator.batch_target, max_wait_s=self.generator.max_wait_s,
            live_envs=self.generator.live, gen_fit=self.generator.costs.fit(),
            placement=None if placement is None else np.asarray(placement),
            system=self.system.sample() if self.system is not None else {},
            # under virtual time (no system sampler) CPU time says nothing about the simulated run
            loop_busy=d["loop_cpu"] / max(d["t"], 1e-9) if self.system is not None else float("nan"),
        )
        self.epoch += 1
        return profile
