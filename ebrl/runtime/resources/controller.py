"""The controller: pure functions from an epoch's profile and the current knobs to decisions.

Each rule looks at one knob, changes it only when the profile shows a cost it can remove, in
bounded steps, with hysteresis, and says why. Knobs the user set (``fixed``) are never touched.

- **Thread lanes** (:func:`lanes_rule`). Envs that wait for a free lane longer than
  ``lane_wait_above`` of their sim round trip get more lanes: as many as the units that were
  stepping or queued on average (Little's law, plus a fifth), at most 4x a step, at most one
  per unit, and never more than the cores can keep busy (``cpus / busy``, where ``busy`` is the
  steps' CPU over wall time: lanes beyond that only queue on the GIL). Lanes shrink, by half at
  most, after two epochs in a row with fewer than half of them stepping and no lane waits, and
  never to a count at which waits were seen.
- **Placement of envs on worker processes** (:func:`placement_rule`). When the idlest worker is
  busy ``imbalance_above`` (a fraction) less than the busiest, the envs are re-placed by
  longest-processing-time first on their measured cost per step, if that balances the predicted
  load better; the new placement keeps as many envs where they are as it can. (Under ``async``
  with every worker saturated the measured busy times are even and nothing moves: a busy worker
  spinning through cheap envs loses no throughput; under the lockstep schedules an unbalanced
  worker idles at every barrier.)
- **SM split** (:func:`sm_split_rule`, GPU with green contexts): generation gets the fewest SMs
  that keep the mean env wait for an action under ``act_wait_target_s``
  (:func:`~ebrl.runtime.resources.gpu.plan_sm_split`), training the rest.
- **Learner threads** (:func:`threads_rule`): one more torch thread for the learner process
  while training holds envs back (backpressure) and cores idle.
- **CPU affinity** (:func:`affinity_rule`): the event loop, the learner and the sim workers on
  cores of their own, where there are at least ``workers + 2`` cores.
- **Generation** (:func:`generation_rule`). The generator waits for a batch to fill about one
  batch's duration, never longer than ``max_wait_s``. When most batches start only because that
  cap ran out while the generator idles, the cap is halved; when the generator is busy over 80%
  of the time with batches under half the live envs, it is doubled (to 8 ms at most): fuller
  batches, fewer calls.

    >>> import numpy as np
    >>> from ebrl.runtime.resources.controller import Knobs, Limits, Memory, decide
    >>> from ebrl.runtime.resources.profiler import EpochProfile
    >>> n = 16   # 16 sleeping envs on 2 lanes: each step 1 ms asleep, 7 ms waiting for a lane
    >>> p = EpochProfile(epoch=0, t_start=0.0, t_end=1.0, backend="thread", lanes=2, num_units=n,
    ...                  steps=np.full(n, 125.0), wall_s=np.full(n, 0.125), cpu_s=np.full(n, 0.001),
    ...                  mean_step_s=np.full(n, 0.001), waits={"lane": np.full(n, 0.875),
    ...                  "action": np.zeros(n), "barrier": np.zeros(n), "backpressure": np.zeros(n)})
    >>> [d.to_dict()["new"] for d in decide(p, Knobs("thread", lanes=2), Limits(num_units=n, cpus=2), Memory())]
    [8]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ebrl.runtime.resources.affinity import split_plan
from ebrl.runtime.resources.gpu import plan_sm_split
from ebrl.runtime.resources.profiler import EpochProfile
from ebrl.runtime.sim_mixed import LOCAL
from ebrl.runtime.sim_pool import WAITS_BELOW  # a step computing less of its wall time than this mostly waits

MIN_STEPS_PER_UNIT = 4  # a window with fewer steps per unit says too little to act on


@dataclass(frozen=True)
class Knobs:
    """What the controller may set, as it stands."""

    backend: str
    lanes: int | None = None  # resizable lanes (thread backend, virtual-time inline); None: not resizable
    workers: int | None = None  # worker processes (process backend)
    placement: tuple[int, ...] | None = None  # env -> worker (process backend)
    max_wait_s: float | None = None
    gen_sms: int | None = None  # generation's SMs (green contexts); None: no split to set
    learner_threads: int | None = None  # torch threads of the learner process; None: not adjustable
    affinity: str | None = None  # "shared" (every core for everyone) or "split"; None: not adjustable
    offload: str | None = None  # where policy calls run: "inline" or "thread"; None: not adjustable
    mixed: bool = False  # a mixed pool: envs may move between lanes (placement LOCAL) and workers
    batch_target: int | None = None  # rows that start a batch at once; None: not adjustable


@dataclass(frozen=True)
class Limits:
    """What bounds the decisions."""

    num_units: int
    cpus: int
    num_envs: int = 0  # envs (rows); 0: one per unit
    fixed: frozenset[str] = frozenset()  # knob names the user set: never changed
    lane_wait_above: float = 0.1
    imbalance_above: float = 0.1
    min_max_wait_s: float = 100e-6
    total_sms: int = 0  # the GPU's SMs (green contexts)
    sm_granularity: int = 8
    act_wait_target_s: float = 0.002  # generation gets the fewest SMs that keep env waits for actions under this


@dataclass(frozen=True)
class Decision:
    epoch: int
    knob: str
    old: Any
    new: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        new = list(self.new) if isinstance(self.new, tuple) else self.new
        old = list(self.old) if isinstance(self.old, tuple) else self.old
        return {"epoch": self.epoch, "knob": self.knob, "old": old, "new": new, "reason": self.reason}


@dataclass
class Trial:
    """A change on probation: kept only if the env steps/s it runs at hold up."""

    decision: Decision
    rate_before: float  # env steps/s of the window that led to it
    judge_at: int  # the first epoch whose window ran entirely with the change in force


@dataclass
class Memory:
    """What the rules remember between epochs (hysteresis, and the change on trial)."""

    shrink_votes: int = 0
    lanes_needed: int = 0  # the most lanes at which envs were still seen waiting for one
    settle_until: dict[str, int] = field(default_factory=dict)  # knob -> first epoch it may change again
    trials: dict[str, Trial] = field(default_factory=dict)  # knob -> its latest change, until judged


REVERT_BELOW = 0.95  # a change whose next full window runs below this fraction of the one before is undone
FROZEN_EPOCHS = 10  # and its knob is left alone this long
# lanes grow on a direct signal (lane waits), not on trial
ON_TRIAL = ("backend", "placement", "workers", "offload", "max_wait_s", "batch_target", "gen_sms", "learner_threads", "affinity")


def decide(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> list[Decision]:
    """Every rule's decision for this epoch (``memory`` is updated in place).

    Each change of a knob in ``ON_TRIAL`` is then measured: on the first window that ran with
    it entirely in force, if env steps/s fell below ``REVERT_BELOW`` of the window that led to
    it, the change is undone (a decision of its own, with the two rates as its reason) and the
    knob is left alone for ``FROZEN_EPOCHS``. The rules' models (balanced workers, fuller
    batches) are guesses about this machine; the throughput is the measurement.
    """
    stalled = profile.total_steps < MIN_STEPS_PER_UNIT * limits.num_units
    # a window that barely ran (an update held every env) says nothing about a change's rate: judge a later one
    out = [] if stalled else [d for d in (_judge(profile, knob, memory) for knob in list(memory.trials)) if d is not None]
    reverted = {d.knob for d in out}
    views = _views(profile, knobs, limits)
    for rule in STALL_RULES if stalled else RULES:
        p, k, lim, remap = views.get(rule, (profile, knobs, limits, None))
        d = None if p is None else rule(p, k, lim, memory)
        if d is None or d.knob in reverted:
            continue
        if remap is not None:
            d = remap(d)
        if d.knob in ON_TRIAL and profile.epoch == 0:
            continue  # the first window is start-up (first update, first calls): no baseline to judge by
        memory.settle_until[d.knob] = profile.epoch + 2  # judge a change on a window it ran through
        if d.knob in ON_TRIAL:
            memory.trials[d.knob] = Trial(d, profile.total_steps / profile.window_s, profile.epoch + 2)
        out.append(d)
    return out


def _views(profile: EpochProfile, knobs: Knobs, limits: Limits) -> dict:
    """What each rule sees of a mixed pool: the lanes rule its envs on the lanes, the worker
    rules its envs in workers (a placement of those is mapped back onto every env); None: no
    env there. Other pools and rules: everything (an empty dict)."""
    if not knobs.mixed or knobs.placement is None:
        return {}
    place = np.asarray(knobs.placement)
    local, proc = place == LOCAL, place != LOCAL
    lanes = (profile.subset(local), knobs, replace(limits, num_units=int(local.sum())), None) if local.any() else None

    def remap(d: Decision) -> Decision:
        new = place.copy()
        new[proc] = d.new
        return replace(d, old=tuple(place.tolist()), new=tuple(new.tolist()))

    workers = None
    if proc.any() and knobs.workers:
        view = (profile.subset(proc), replace(knobs, placement=tuple(place[proc].tolist())),
                replace(limits, num_units=int(proc.sum())))
        workers = (*view, None)
        placed = (*view, remap)
    none = (None, None, None, None)
    return {lanes_rule: lanes or none, workers_rule: workers or none, placement_rule: placed if workers else none}


def _judge(profile: EpochProfile, knob: str, memory: Memory) -> Decision | None:
    trial = memory.trials[knob]
    if profile.epoch < trial.judge_at:
        return None
    del memory.trials[knob]
    rate = profile.total_steps / profile.window_s
    if rate >= REVERT_BELOW * trial.rate_before:
        return None
    memory.settle_until[knob] = profile.epoch + FROZEN_EPOCHS
    d = trial.decision
    return Decision(profile.epoch, knob, d.new, d.old,
                    f"reverted: env steps/s fell from {trial.rate_before:.0f} to {rate:.0f} with the change of epoch "
                    f"{d.epoch} in force (below {REVERT_BELOW:.0%})")


def postpone_trials(memory: Memory, epoch: int) -> None:
    """A change still under way (envs waiting for their episode end to move): judge it later."""
    for trial in memory.trials.values():
        trial.judge_at = max(trial.judge_at, epoch + 2)


def _settling(knob: str, profile: EpochProfile, memory: Memory) -> bool:
    return profile.epoch < memory.settle_until.get(knob, 0)


def lane_cap(profile: EpochProfile, limits: Limits) -> int:
    """The most lanes worth having: one per unit, and no more than the cores can keep stepping."""
    busy = max(profile.busy, 1.0 / max(limits.num_units, 1))
    return max(1, min(limits.num_units, max(limits.cpus, math.ceil(limits.cpus / busy))))


def lanes_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    lanes = knobs.lanes
    if lanes is None or "lanes" in limits.fixed or _settling("lanes", profile, memory):
        return None
    share, cap = profile.lane_wait_share, lane_cap(profile, limits)
    if share > limits.lane_wait_above:
        memory.lanes_needed = max(memory.lanes_needed, lanes)
        memory.shrink_votes = 0
        if lanes >= cap:
            return None
        want = min(cap, 4 * lanes, max(lanes + 1, math.ceil(profile.units_in_sim * 1.2)))
        return Decision(profile.epoch, "lanes", lanes, want,
                        f"envs waited {share:.0%} of their sim round trip for a lane; {profile.units_in_sim:.1f} "
                        f"units stepping or queued on average on {lanes} lanes (steps busy {profile.busy:.0%} "
                        f"of their wall time: up to {cap} lanes can step at once)")
    running = profile.lanes_running
    floor = max(1, memory.lanes_needed + 1, math.ceil(running * 2), lanes // 2)
    if share < limits.lane_wait_above / 4 and running < 0.5 * lanes and floor < lanes:
        memory.shrink_votes += 1
        if memory.shrink_votes >= 2:
            memory.shrink_votes = 0
            return Decision(profile.epoch, "lanes", lanes, floor,
                            f"{running:.1f} of {lanes} lanes stepping on average for two epochs, "
                            f"lane waits {share:.0%}")
    else:
        memory.shrink_votes = 0
    return None


def lpt_placement(costs: np.ndarray, workers: int, current: np.ndarray | None = None) -> np.ndarray:
    """Longest processing time first: each env, costliest first, onto the least-loaded worker.
    With ``current``, the new bins are renamed to keep as many envs where they are as possible."""
    order = np.argsort(-costs, kind="stable")
    load = np.zeros(workers)
    out = np.zeros(len(costs), np.int64)
    for i in order.tolist():
        w = int(np.argmin(load))
        out[i] = w
        load[w] += costs[i]
    if current is None:
        return out
    # rename bins greedily by overlap with the current workers (W is small)
    overlap = np.zeros((workers, workers), np.int64)
    np.add.at(overlap, (out, current), 1)
    rename, used = {}, set()
    for flat in np.argsort(-overlap, axis=None, kind="stable").tolist():
        b, w = divmod(flat, workers)
        if b in rename or w in used:
            continue
        rename[b] = w
        used.add(w)
    return np.array([rename[b] for b in out.tolist()], np.int64)


def spread(costs: np.ndarray, placement: np.ndarray, workers: int) -> float:
    """The busiest worker's load over the mean load (1.0: balanced), at equal step rates."""
    load = np.bincount(placement, weights=costs, minlength=workers)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


def placement_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    if knobs.placement is None or not knobs.workers or knobs.workers < 2 or "placement" in limits.fixed:
        return None
    if any(_settling(k, profile, memory) for k in ("placement", "workers", "backend")):
        return None
    if np.isnan(profile.mean_step_s).any():
        return None
    w = knobs.workers
    current = np.asarray(knobs.placement)
    busy = np.bincount(current, weights=profile.wall_s, minlength=w) / profile.window_s
    gap = float((busy.max() - busy.min()) / busy.max()) if busy.max() > 0 else 0.0
    if gap <= limits.imbalance_above:
        return None
    costs = profile.mean_step_s
    new = lpt_placement(costs, w, current)
    before, after = spread(costs, current, w), spread(costs, new, w)
    if after > before - 0.05:
        return None
    moves = int((new != current).sum())
    return Decision(profile.epoch, "placement", tuple(current.tolist()), tuple(new.tolist()),
                    f"workers busy {', '.join(f'{b:.0%}' for b in busy)} of the window; placing by measured "
                    f"cost per step (longest first) takes the busiest worker's load from {before:.2f}x to "
                    f"{after:.2f}x the mean; {moves} envs move at their next episode end")


MAX_WAIT_CAP_S = 0.008  # generation.max_wait_s never grows past this


def generation_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    wait = knobs.max_wait_s
    if wait is None or "max_wait_s" in limits.fixed or _settling("max_wait_s", profile, memory):
        return None
    if _settling("offload", profile, memory):  # the calls just moved: the window ran the old way
        return None
    if not profile.gen_batches:
        return None
    capped = profile.gen_capped / profile.gen_batches
    busy, mean = profile.gen_busy, profile.gen_rows / profile.gen_batches
    if capped > 0.5 and busy < 0.5 and wait > limits.min_max_wait_s:
        new = max(limits.min_max_wait_s, wait / 2)
        return Decision(profile.epoch, "max_wait_s", wait, round(new, 6),
                        f"{capped:.0%} of batches started only when their wait reached max_wait_s while the "
                        f"generator idled {1 - busy:.0%} of the time: the batch-fill wait holds envs back")
    if busy > 0.8 and mean < 0.5 * max(profile.live_envs, 1) and wait < MAX_WAIT_CAP_S:
        new = min(MAX_WAIT_CAP_S, wait * 2)
        return Decision(profile.epoch, "max_wait_s", wait, round(new, 6),
                        f"the generator was busy {busy:.0%} of the time with batches of {mean:.1f} of "
                        f"{profile.live_envs} live envs: fuller batches take fewer policy calls")
    return None


INLINE_UP_TO_S = 0.001  # a policy call of more CPU than this runs in a thread: inline it would stall the loop
GIL_WAIT_ABOVE = 2.0  # thread calls this many times longer than their CPU time mostly wait for the GIL


def offload_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """Policy calls inline on the event loop, or in the generator's thread.

    A thread lets the loop deliver sim results while the policy runs, but a call in it must win
    the GIL from the loop and from lane threads stepping Python envs: when its wall time is over
    ``GIL_WAIT_ABOVE`` times its CPU time (it mostly waits) and it costs under ``INLINE_UP_TO_S``
    of CPU, inline is cheaper. Back to the thread when inline calls cost more than that."""
    mode = knobs.offload
    if mode is None or "offload" in limits.fixed or _settling("offload", profile, memory):
        return None
    if not profile.gen_batches or profile.gen_cpu_s <= 0 or profile.offload != mode:
        return None  # the window ran (partly) the other way: judge on one that did not
    cpu, wall = profile.gen_cpu_per_batch_s, profile.gen_latency_s
    if mode == "thread" and cpu < INLINE_UP_TO_S and wall > GIL_WAIT_ABOVE * cpu:
        return Decision(profile.epoch, "offload", "thread", "inline",
                        f"policy calls in the generator thread took {wall * 1e6:.0f} us for {cpu * 1e6:.0f} us "
                        f"of CPU: they wait for the GIL; on the event loop they cost about their CPU time")
    if mode == "inline" and cpu > INLINE_UP_TO_S:
        return Decision(profile.epoch, "offload", "inline", "thread",
                        f"policy calls cost {cpu * 1e3:.1f} ms of CPU each on the event loop (over "
                        f"{INLINE_UP_TO_S * 1e3:.0f} ms): in a thread the loop delivers sim results meanwhile")
    return None


LOOP_FULL_ABOVE = 0.85  # the event loop busy over this share of the window is the bottleneck


GEN_BUSY_GOAL = 0.5  # the smallest batch target that serves the rows' rate with the generator busy at most this


def rows_needed(fit: tuple[float, float], rate: float, n: int) -> int:
    """The smallest batch with which policy calls costing ``fixed + per_row * rows`` seconds
    serve ``rate`` rows/s with the generator busy at most ``GEN_BUSY_GOAL``; ``n`` when none does.

        >>> rows_needed((0.040, 0.001), rate=40.0, n=16)   # a VLA: 40 ms a call, 1 ms a row
        4
        >>> rows_needed((80e-6, 1e-6), rate=5000.0, n=16)  # a small MLP: batching saves little
        1
    """
    fixed, per_row = fit
    room = GEN_BUSY_GOAL - rate * per_row
    if room <= 0:
        return n
    return max(1, min(n, math.ceil(rate * fixed / room)))


def batch_target_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """The rows that start a batch at once (without waiting for the adaptive wait to run out).

    Once calls of two batch sizes have been timed, the generator's cost curve (``fixed +
    per_row * rows`` seconds a call, :class:`~ebrl.runtime.generation.BatchCosts`) gives the
    smallest batch that serves the window's rows/s with the generator busy at most
    ``GEN_BUSY_GOAL`` (:func:`rows_needed`): the target is raised to it when below, and never
    halved under it. A VLA's call is mostly its fixed cost, so its batches must stay full.

    Halved when the policy runs in the generator thread, rows wait for their batch to start
    over half a batch's latency, and both that thread (busy under half the time) and the cores
    (a quarter idle) have room for more calls: the wait only holds envs back. Inline calls are
    left at their target: there the calls cost the event loop, which also delivers every sim
    result, and smaller batches measured no faster (``bench/suites/controller.py``, mixed and
    long-tail workloads). Doubled, up to every env, when whatever makes the calls is full (the
    generator thread over 80% busy, or the loop over ``LOOP_FULL_ABOVE`` inline) and batches
    start at the target: fuller batches take fewer calls."""
    target = knobs.batch_target
    if target is None or "batch_target" in limits.fixed or _settling("batch_target", profile, memory):
        return None
    if _settling("offload", profile, memory):  # the calls just moved: the window ran the old way
        return None
    if not profile.gen_batches or np.isnan(profile.loop_busy):
        return None
    n = limits.num_envs or limits.num_units
    inline = profile.offload == "inline"
    caller = profile.loop_busy if inline else profile.gen_busy
    who = "the event loop" if inline else "the generator thread"
    mean = profile.gen_rows / profile.gen_batches
    wait, latency = profile.gen_request_wait_s, profile.gen_latency_s
    idle = 100.0 - profile.system.get("cpu_util_mean", 100.0)
    need, curve = 1, ""
    if profile.gen_fit is not None:
        rate = profile.gen_rows / profile.window_s
        need = rows_needed(profile.gen_fit, rate, n)
        fixed, per_row = profile.gen_fit
        curve = (f"a policy call costs {fixed * 1e3:.2f} ms + {per_row * 1e3:.3f} ms a row: at {rate:.0f} rows/s "
                 f"batches of {need} keep the generator busy under {GEN_BUSY_GOAL:.0%}")
        if target < need:
            return Decision(profile.epoch, "batch_target", target, need, curve)
    if not inline and caller < 0.5 and idle > 25.0 and wait > 0.5 * latency and target > 1:
        new = max(1, target // 2, need)
        if new < target:
            return Decision(profile.epoch, "batch_target", target, new,
                            f"rows waited {wait * 1e6:.0f} us on average for their batch to start (a batch takes "
                            f"{latency * 1e6:.0f} us) while the generator thread was busy {caller:.0%} of the time "
                            f"and the cores idled {idle:.0f}%: a batch starts once {new} rows wait"
                            + (f" ({curve})" if curve else ""))
    if caller > (LOOP_FULL_ABOVE if inline else 0.8) and target < n and mean <= 1.5 * target:
        new = min(n, target * 2)
        return Decision(profile.epoch, "batch_target", target, new,
                        f"{who}, which makes the policy calls, was busy {caller:.0%} of the time with batches of "
                        f"{mean:.1f} rows (the target {target}): fuller batches take fewer calls")
    return None


SATURATED_ABOVE = 90.0  # % of the cores busy: a step's CPU share of its wall time includes its wait for a core
WAITS_BELOW_SATURATED = 0.2  # so on saturated cores only a step under this share waits (sleeps measure < 5%)


def _wait_bar(profile: EpochProfile) -> tuple[float, str]:
    """The CPU/wall share under which a worker's steps count as waiting, and a note for the reason.

    A worker whose steps get half of their wall time on the CPU may be waiting (I/O, sleeps),
    or starved: on cores that are all busy a compute-bound step gets only its share of a core.
    FetchReach's steps in two workers next to the generator and learner measured 36-50% on two
    saturated cores; moving them to thread lanes, as if they waited, put them behind the GIL and
    halved the run's steps/s. So on saturated cores (over ``SATURATED_ABOVE`` percent busy, when
    the system sampler measured them) the bar drops to ``WAITS_BELOW_SATURATED``."""
    util = profile.system.get("cpu_util_mean")
    if util is not None and util >= SATURATED_ABOVE:
        return WAITS_BELOW_SATURATED, f" (the cores were {util:.0f}% busy)"
    return WAITS_BELOW, ""


def workers_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """The number of sim worker processes (each steps its envs one after another).

    Up to 4x, at most one per env, when the workers step over 90% of the time but their steps
    mostly wait (worker CPU under half their wall time): more workers overlap the waits. Halved,
    to no fewer than the cores, when there are more workers than cores and the steps compute:
    extra workers only time-slice the cores. The envs are then placed on the new count by
    measured cost (longest first) and move at their episode ends."""
    w = knobs.workers
    if w is None or knobs.placement is None or "workers" in limits.fixed or _settling("workers", profile, memory):
        return None
    if _settling("placement", profile, memory) or _settling("backend", profile, memory):
        return None
    if np.isnan(profile.mean_step_s).any():
        return None
    placement = np.asarray(knobs.placement)
    busy = np.bincount(placement, weights=profile.wall_s, minlength=w) / profile.window_s
    cpu = float(profile.cpu_s.sum()) / max(float(profile.wall_s.sum()), 1e-12)
    bar, note = _wait_bar(profile)
    if busy.mean() > 0.9 and cpu < bar and w < limits.num_units:
        new = min(limits.num_units, 4 * w)
        return Decision(profile.epoch, "workers", w, new,
                        f"the {w} workers stepped {busy.mean():.0%} of the window, their steps computing only "
                        f"{cpu:.0%} of that time{note} (they wait): {new} workers overlap the waits")
    if w > limits.cpus and cpu >= bar:
        new = max(limits.cpus, math.ceil(w / 2))
        return Decision(profile.epoch, "workers", w, new,
                        f"{w} workers on {limits.cpus} cores, their steps computing {cpu:.0%} of their time: "
                        f"{new} workers, the rest only time-slice the cores")
    return None


PROCESS_STEP_CPU_S = 50e-6  # a lane step computing less than this is too cheap to be worth a worker's round trip
LANE_BUSY_ABOVE = 0.25  # a lane step computing this share of its wall time (its GIL waits included) computes
GIL_LOAD_ABOVE = 0.25  # and the lanes' steps must compute this many cores' worth for a move to matter


def backend_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """A mixed pool's envs between thread lanes and worker processes, by their measured steps.

    To the lanes: envs in a worker whose steps compute under ``WAITS_BELOW`` of their wall time
    (``WAITS_BELOW_SATURATED`` on saturated cores, see :func:`_wait_bar`; a worker steps its
    envs one after another, so a step that waits holds the others up; on lanes the waits
    overlap). To workers, with two cores or more: envs on the lanes whose steps
    compute ``LANE_BUSY_ABOVE`` of their wall time and ``PROCESS_STEP_CPU_S`` or more each, when the lanes' steps together compute over
    ``GIL_LOAD_ABOVE`` of a core: that CPU time holds the GIL the event loop and the other lanes
    need. On the lanes a GIL-bound step's wall time includes its wait for the GIL, so the bar
    for CPU over wall time is half the probe's (``LANE_BUSY_ABOVE``); a step that sleeps
    measured under 5% there (``bench/suites/controller.py``, mixed workload). The envs moving to
    workers go to the least-loaded ones (started if there are none: one per core, at most one
    per env); they move at their next episode end."""
    if not knobs.mixed or knobs.placement is None or "backend" in limits.fixed:
        return None
    if any(_settling(k, profile, memory) for k in ("backend", "placement", "workers")):
        return None
    place = np.asarray(knobs.placement)
    local = place == LOCAL
    seen = profile.steps >= MIN_STEPS_PER_UNIT
    with np.errstate(invalid="ignore", divide="ignore"):
        cpu_step = np.where(seen, profile.cpu_s / profile.steps, 0.0)
        busy = np.where(seen & (profile.wall_s > 0), profile.cpu_s / profile.wall_s, 1.0)
    gil = float(profile.cpu_s[local].sum()) / profile.window_s
    to_proc = (local & seen & (busy >= LANE_BUSY_ABOVE) & (cpu_step >= PROCESS_STEP_CPU_S) & (limits.cpus >= 2)
               & (gil > GIL_LOAD_ABOVE))
    bar, note = _wait_bar(profile)
    to_lanes = ~local & seen & (busy < bar)
    if not to_proc.any() and not to_lanes.any():
        return None
    new = place.copy()
    new[to_lanes] = LOCAL
    stay = ~local & ~to_lanes
    if to_proc.any():
        w = knobs.workers or min(limits.cpus, int((stay | to_proc).sum()))
        costs = np.nan_to_num(profile.mean_step_s, nan=0.0)
        load = np.bincount(place[stay], weights=costs[stay], minlength=w)[:w].astype(float)  # int when empty
        for i in sorted(np.flatnonzero(to_proc).tolist(), key=lambda i: -costs[i]):
            new[i] = int(np.argmin(load))
            load[new[i]] += costs[i]
    parts = []
    if to_proc.any():
        parts.append(f"{int(to_proc.sum())} envs on the lanes compute {np.median(cpu_step[to_proc]) * 1e6:.0f} us "
                     f"a step holding the GIL (the lanes' steps took {gil:.2f} cores): to worker processes")
    if to_lanes.any():
        parts.append(f"{int(to_lanes.sum())} envs in workers compute only {np.median(busy[to_lanes]):.0%} of their "
                     f"step's time{note} (they wait): to thread lanes")
    return Decision(profile.epoch, "backend", tuple(place.tolist()), tuple(new.tolist()),
                    "; ".join(parts) + "; they move at their next episode end")


def sm_split_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """Green contexts: :func:`~ebrl.runtime.resources.gpu.plan_sm_split` on the mean wait for an
    action per step and one batch's latency."""
    if knobs.gen_sms is None or "gen_sms" in limits.fixed or _settling("gen_sms", profile, memory):
        return None
    act_wait = profile.wait_s("action") / max(profile.total_steps, 1)
    split = plan_sm_split(limits.total_sms, profile.gen_latency_s or None, knobs.gen_sms, limits.act_wait_target_s,
                          act_wait, limits.sm_granularity)
    if split.generation == knobs.gen_sms:
        return None
    return Decision(profile.epoch, "gen_sms", knobs.gen_sms, split.generation,
                    f"{split.reason}; training gets {split.training} of {limits.total_sms} SMs")


def threads_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """One more torch thread for the learner process when training holds envs back (they park
    on a full queue, or wait on a generator paused for the update) while cores idle. It runs
    on windows with few env steps too: an update longer than the window is such a window."""
    n = knobs.learner_threads
    if n is None or "learner_threads" in limits.fixed or _settling("learner_threads", profile, memory):
        return None
    busy = profile.learner_busy_s / profile.window_s
    held = profile.held_by_training
    idle = 100.0 - profile.system.get("cpu_util_mean", 100.0)
    if busy > 0.7 and held > 0.1 and idle > 25.0 and n < limits.cpus:
        return Decision(profile.epoch, "learner_threads", n, n + 1,
                        f"the learner was busy {busy:.0%} of the window and held the envs back {held:.0%} of it "
                        f"while the cores idled {idle:.0f}%")
    return None


def affinity_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """Separate cores for the event loop, the learner and the sim workers, where there are enough."""
    if knobs.affinity != "shared" or "affinity" in limits.fixed or _settling("affinity", profile, memory):
        return None
    plan = split_plan(limits.cpus, knobs.workers or 0)
    if plan is None:
        return None
    return Decision(profile.epoch, "affinity", "shared", "split",
                    f"{limits.cpus} cores: the event loop on {plan['loop']}, the learner on {plan['learner']}, "
                    f"the {knobs.workers} sim workers on {plan['workers'][0]}-{plan['workers'][-1]}")


RULES = (lanes_rule, backend_rule, workers_rule, placement_rule, offload_rule, generation_rule, batch_target_rule, sm_split_rule,
         threads_rule, affinity_rule)
STALL_RULES = (threads_rule,)  # the rules that judge a window in which few env steps ran


def apply(knobs: Knobs, decisions: list[Decision]) -> Knobs:
    """The knobs after ``decisions``."""
    for d in decisions:
        knobs = replace(knobs, **{d.knob: d.new})
    return knobs
