"""The controller's rules for simulation: thread lanes, worker processes, where each env runs
(lanes or workers, which worker). See :mod:`ebrl.runtime.resources.controller`."""

from __future__ import annotations

import math

import numpy as np

from ebrl.runtime.resources.knobs import MIN_STEPS_PER_UNIT, SATURATED_ABOVE, Decision, Knobs, Limits, Memory, hands_off
from ebrl.runtime.resources.profiler import EpochProfile
from ebrl.runtime.resources.rules_start import WAITS_BELOW, lanes_for
from ebrl.runtime.sim import LOCAL

# over SATURATED_ABOVE % of the cores busy, a step's CPU share of its wall time includes its wait for a core
WAITS_BELOW_SATURATED = 0.2  # so on saturated cores only a step under this share waits (sleeps measure < 5%)
PROCESS_STEP_CPU_S = 50e-6  # a lane step computing less than this is too cheap to be worth a worker's round trip
LANE_BUSY_ABOVE = 0.25  # a lane step computing this share of its wall time (its GIL waits included) computes
GIL_LOAD_ABOVE = 0.25  # and the lanes' steps must compute this many cores' worth for a move to matter


def lanes_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """More lanes while envs wait for one (Little's law), fewer after two idle windows (docs/resources.md)."""
    lanes = knobs.lanes
    if lanes is None or hands_off(profile, limits, memory, "lanes"):
        return None
    share, cap = profile.lane_wait_share, lanes_for(profile.busy, limits.num_units, limits.cpus)
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


def lpt_placement(costs: np.ndarray, workers: int, current: np.ndarray) -> np.ndarray:
    """Longest processing time first: each env, costliest first, onto the least-loaded worker; the
    new bins are then renamed to keep as many envs where they are (``current``) as possible."""
    out = np.zeros(len(costs), np.int64)
    _onto_least_loaded(np.argsort(-costs, kind="stable").tolist(), costs, np.zeros(workers), out)
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


def _onto_least_loaded(envs: list[int], costs: np.ndarray, load: np.ndarray, out: np.ndarray) -> None:
    """Each of ``envs``, in order, onto the worker with the least ``load`` (``out[env]``; ``load`` grows)."""
    for i in envs:
        out[i] = int(np.argmin(load))
        load[out[i]] += costs[i]


def spread(costs: np.ndarray, placement: np.ndarray, workers: int) -> float:
    """The busiest worker's load over the mean load (1.0: balanced), at equal step rates."""
    load = np.bincount(placement, weights=costs, minlength=workers)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


def placement_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """Re-place the envs longest-processing-time first when the workers' busy times differ."""
    if knobs.placement is None or not knobs.workers or knobs.workers < 2:
        return None
    if hands_off(profile, limits, memory, "placement", "workers", "backend") or np.isnan(profile.mean_step_s).any():
        return None
    util = profile.system.get("cpu_util_mean")
    if util is not None and util >= SATURATED_ABOVE and not profile.waits["barrier"].any():
        # no env waits at a barrier and no core is idle: a balanced placement frees no core a
        # worker could use (an idle worker's core runs another process), so moves cost rebuilds
        # and buy nothing. Under a lockstep schedule the busiest worker is the critical path.
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


def _wait_bar(profile: EpochProfile) -> tuple[float, str]:
    """The CPU/wall share under which a worker's steps count as waiting, and a note for the reason.

    Starved is not waiting: on saturated cores a compute-bound step gets only its share of a
    core (FetchReach measured 36-50% there, and moved to the lanes it halved the run's steps/s),
    so there the bar drops to ``WAITS_BELOW_SATURATED``."""
    util = profile.system.get("cpu_util_mean")
    if util is not None and util >= SATURATED_ABOVE:
        return WAITS_BELOW_SATURATED, f" (the cores were {util:.0f}% busy)"
    return WAITS_BELOW, ""


def workers_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """The number of sim worker processes: more while their steps wait, fewer when they outnumber the
    cores and compute (extra workers only time-slice the cores)."""
    w = knobs.workers
    if w is None or knobs.placement is None or hands_off(profile, limits, memory, "workers", "placement", "backend"):
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


def backend_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """A mixed pool's envs between thread lanes and worker processes, by their measured steps.

    To the lanes: worker envs whose steps wait (a worker steps its envs one after another, so a
    waiting step holds the others up; on lanes the waits overlap). To workers: lane envs whose
    steps compute while the lanes' steps together hold the GIL the event loop needs."""
    if not knobs.mixed or knobs.placement is None:
        return None
    if hands_off(profile, limits, memory, "backend", "placement", "workers"):
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
        _onto_least_loaded(sorted(np.flatnonzero(to_proc).tolist(), key=lambda i: -costs[i]), costs, load, new)
    parts = []
    if to_proc.any():
        parts.append(f"{int(to_proc.sum())} envs on the lanes compute {np.median(cpu_step[to_proc]) * 1e6:.0f} us "
                     f"a step holding the GIL (the lanes' steps took {gil:.2f} cores): to worker processes")
    if to_lanes.any():
        parts.append(f"{int(to_lanes.sum())} envs in workers compute only {np.median(busy[to_lanes]):.0%} of their "
                     f"step's time{note} (they wait): to thread lanes")
    return Decision(profile.epoch, "backend", tuple(place.tolist()), tuple(new.tolist()),
                    "; ".join(parts) + "; they move at their next episode end")
