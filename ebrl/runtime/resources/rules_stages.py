"""The controller's rules for the generation and training stages: the generator's wait, batch
target and where its calls run; the SM split on a GPU; the learner process's threads; core
affinity. See :mod:`ebrl.runtime.resources.controller`."""

from __future__ import annotations

import math

import numpy as np

from ebrl.runtime.resources.affinity import split_plan
from ebrl.runtime.resources.gpu import clamp_split, plan_sm_split
from ebrl.runtime.resources.knobs import SATURATED_ABOVE, Decision, Knobs, Limits, Memory, hands_off
from ebrl.runtime.resources.profiler import EpochProfile

MAX_WAIT_CAP_S = 0.008  # generation.max_wait_s never grows past this
GIL_WAIT_ABOVE = 2.0  # thread calls this many times longer than their CPU time mostly wait for the GIL
LOOP_FULL_ABOVE = 0.85  # the event loop busy over this share of the window is the bottleneck
GEN_BUSY_GOAL = 0.5  # the smallest batch target that serves the rows' rate with the generator busy at most this


def generation_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """The batch-fill wait's cap: halved when it only holds envs back, doubled when the generator is full."""
    wait = knobs.max_wait_s
    # after an offload change the window ran the old way
    if wait is None or hands_off(profile, limits, memory, "max_wait_s", "offload") or not profile.gen_batches:
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


def offload_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """Policy calls inline on the event loop, or in the generator's thread: inline when calls in the
    thread mostly wait for the GIL and cost little CPU, back to the thread when inline calls cost more."""
    mode = knobs.offload
    if mode is None or hands_off(profile, limits, memory, "offload"):
        return None
    if not profile.gen_batches or profile.gen_cpu_s <= 0 or profile.offload != mode:
        return None  # the window ran (partly) the other way: judge on one that did not
    cpu, wall = profile.gen_cpu_per_batch_s, profile.gen_latency_s
    line = limits.inline_up_to_s
    if mode == "thread" and cpu < line and wall > GIL_WAIT_ABOVE * cpu:
        return Decision(profile.epoch, "offload", "thread", "inline",
                        f"policy calls in the generator thread took {wall * 1e6:.0f} us for {cpu * 1e6:.0f} us "
                        f"of CPU: they wait for the GIL; on the event loop they cost about their CPU time")
    if mode == "inline" and cpu > line:
        return Decision(profile.epoch, "offload", "inline", "thread",
                        f"policy calls cost {cpu * 1e3:.1f} ms of CPU each on the event loop (over "
                        f"{line * 1e3:.1f} ms): in a thread the loop delivers sim results meanwhile")
    return None


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
    """The rows that start a batch at once (docs/resources.md): at least what the cost curve needs
    (:func:`rows_needed`); half the envs, once, on saturated cores (a second call and every message
    cost the simulators CPU); halved while rows wait and the thread and cores idle; doubled when
    whatever makes the calls is full."""
    target = knobs.batch_target
    # after an offload change the window ran the old way
    if target is None or hands_off(profile, limits, memory, "batch_target", "offload"):
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
    util = profile.system.get("cpu_util_mean", 0.0)
    fill = max(need, -(-n // 2))
    # not on epoch 0: its CPU use is start-up's (imports, the probe, the first update), not the run's
    if util >= SATURATED_ABOVE and target > fill and not memory.saturated_target and profile.epoch > 0:
        memory.saturated_target = True
        return Decision(profile.epoch, "batch_target", target, fill,
                        f"the cores were {util:.0f}% busy: each policy call and each message to a simulator takes CPU "
                        f"from the simulators, so a batch fills to {fill} of {n} envs while the others step"
                        + (f" ({curve})" if curve else ""), trial=False)
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


def sm_split_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """Green contexts: :func:`~ebrl.runtime.resources.gpu.plan_sm_split` on each side's busy share,
    moved when two windows in a row want a move the same way (as far as the nearer of the two): an
    RL run has phases longer than a window, and one window of a phase change is not its balance."""
    if knobs.gen_sms is None or hands_off(profile, limits, memory, "gen_sms"):
        return None
    gen_busy = min(1.0, profile.gen_busy_s / profile.window_s)
    train_busy = min(1.0, profile.learner_busy_s / profile.window_s)
    split = plan_sm_split(limits.total_sms, knobs.gen_sms, gen_busy, train_busy, limits.sm_granularity)
    now, wanted = knobs.gen_sms, memory.sm_wanted
    memory.sm_wanted = split.generation if split.generation != now else None
    if memory.sm_wanted is None or wanted is None or (wanted - now) * (split.generation - now) <= 0:
        return None
    new = min(wanted, split.generation, key=lambda g: abs(g - now))
    memory.sm_wanted = None  # the next move is judged from windows after this one
    return Decision(profile.epoch, "gen_sms", now, new,
                    f"{split.reason}, as the window before wanted ({wanted}); "
                    f"training gets {clamp_split(limits.total_sms, new, limits.sm_granularity).training}"
                    f" of {limits.total_sms} SMs")


def threads_rule(profile: EpochProfile, knobs: Knobs, limits: Limits, memory: Memory) -> Decision | None:
    """One more torch thread for the learner process when training holds envs back (they park
    on a full queue, or wait on a generator paused for the update) while cores idle. It runs
    on windows with few env steps too: an update longer than the window is such a window."""
    n = knobs.learner_threads
    if n is None or hands_off(profile, limits, memory, "learner_threads"):
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
    if knobs.affinity != "shared" or hands_off(profile, limits, memory, "affinity"):
        return None
    plan = split_plan(limits.cpus, knobs.workers or 0)
    if plan is None:
        return None
    return Decision(profile.epoch, "affinity", "shared", "split",
                    f"{limits.cpus} cores: the event loop on {plan['loop']}, the learner on {plan['learner']}, "
                    f"the {knobs.workers} sim workers on {plan['workers'][0]}-{plan['workers'][-1]}")
