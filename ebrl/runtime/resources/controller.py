"""The controller: pure functions from an epoch's profile and the current knobs to decisions.

:func:`decide` runs the rules (``rules_sim.py``: lanes, workers, placement, backend;
``rules_stages.py``: generation, offload, batch target, SMs, learner threads, affinity) and
judges each change on trial; ``knobs.py`` holds what they read and write. Each rule looks at
one knob, changes it only when the profile shows a cost it can remove, in bounded steps, with
hysteresis, and says why. Knobs the user set (``fixed``) are never touched. docs/resources.md
describes each rule and the measurements behind it.

    >>> import numpy as np
    >>> from ebrl.runtime.resources.controller import decide
    >>> from ebrl.runtime.resources.knobs import Knobs, Limits, Memory
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

from dataclasses import replace

import numpy as np

from ebrl.runtime.resources.knobs import MIN_STEPS_PER_UNIT, Decision, Knobs, Limits, Memory, Trial
from ebrl.runtime.resources.profiler import EpochProfile
from ebrl.runtime.resources.rules_sim import backend_rule, lanes_rule, placement_rule, workers_rule
from ebrl.runtime.resources.rules_stages import (
    affinity_rule,
    batch_target_rule,
    generation_rule,
    offload_rule,
    sm_split_rule,
    threads_rule,
)
from ebrl.runtime.sim import LOCAL

REVERT_BELOW = 0.95  # a change whose next full window runs below this fraction of the one before is undone
FROZEN_EPOCHS = 10  # and its knob is left alone this long
# lanes grow on a direct signal (lane waits), not on trial
ON_TRIAL = ("backend", "placement", "workers", "offload", "max_wait_s", "batch_target", "gen_sms", "learner_threads",
            "affinity")


def decide(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> list[Decision]:
    """Every rule's decision for this epoch (``memory`` is updated in place). A change of a knob in
    ``ON_TRIAL`` is undone when the first window that ran entirely with it falls below
    ``REVERT_BELOW`` of the env steps/s before it: the rules' models are guesses about this
    machine, the throughput is the measurement."""
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
        if stalled:
            d = replace(d, trial=False)  # no env rate to judge it against: the window's measurement decides
        if d.knob in ON_TRIAL and d.trial:
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


RULES = (lanes_rule, backend_rule, workers_rule, placement_rule, offload_rule, generation_rule, batch_target_rule,
         sm_split_rule, threads_rule, affinity_rule)
# the rules that judge a window in which few env steps ran (an update held every env): they read
# the learner's and the device's time, not the envs' steps
STALL_RULES = (threads_rule, sm_split_rule)
