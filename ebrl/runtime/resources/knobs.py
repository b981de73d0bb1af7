"""What the controller's rules read and write: the knobs, their limits, the decisions, and what
the rules remember between epochs. See :mod:`ebrl.runtime.resources.controller`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ebrl.config import GenerationConfig
from ebrl.runtime.resources.profiler import EpochProfile

MIN_STEPS_PER_UNIT = 4  # a window with fewer steps per unit says too little to act on
# a profile window grows, one epoch_s at a time, until it holds MIN_STEPS_PER_UNIT steps per
# unit or has lasted this many epochs (then it is a stalled window: an update held every env)
MAX_WINDOW_EPOCHS = 10
SATURATED_ABOVE = 90.0  # mean core use (%) over which the cores have no room left


@dataclass(frozen=True)
class Knobs:
    """What the controller may set, as it stands."""

    backend: str
    lanes: int | None = None  # resizable lanes (thread backend); None: not resizable
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
    # a policy call of more CPU than this runs in a thread (inline it would stall the loop):
    # generation.inline_below_s, the line the start rule for AUTO draws too (rules_start.py)
    inline_up_to_s: float = GenerationConfig.inline_below_s


@dataclass(frozen=True)
class Decision:
    epoch: int
    knob: str
    old: Any
    new: Any
    reason: str
    # judged on trial when its knob is in ON_TRIAL (controller.py); False: a direct measurement
    # decided it, and a window's noise must not undo it
    trial: bool = True

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
    saturated_target: bool = False  # the batch target was set once for saturated cores (never again: no flapping)
    sm_wanted: int | None = None  # generation's SMs the last window wanted (the SM split moves on two in a row)


def hands_off(profile: EpochProfile, limits: Limits, memory: Memory, knob: str, *also: str) -> bool:
    """Whether a rule must leave ``knob`` alone: the user set it, or it (or a knob of ``also``, which
    acts on the same thing) changed too lately to judge a window by."""
    return knob in limits.fixed or any(profile.epoch < memory.settle_until.get(k, 0) for k in (knob, *also))
