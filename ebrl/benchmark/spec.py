"""What a benchmark suite declares: cases, models, sizes, schedules, peers and targets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ebrl.benchmark.figures import Target

PEERS = ("sync", "async", "cleanrl")  # gym-sync, gym-async (same-policy control), cleanrl (own networks)


@dataclass
class Suite:
    """What a benchmark runs. ``cases`` maps a case name to ``env_fn(i)``."""

    description: str
    cases: dict[str, Callable[[int], Any]]
    policy_fn: Callable[[Any, Any, int], Any]  # (observation_space, action_space, seed) -> policy
    algo_fn: Callable[[int], Any]  # seed -> algorithm
    num_envs: int
    steps: int  # env steps per measured run
    quick_steps: int
    segment_len: int = 32
    rounds: int = 3
    schedules: tuple[str, ...] = ("async", "pipelined", "sync")
    peers: tuple[str, ...] = PEERS
    run_config: dict = field(default_factory=dict)  # extra RunConfig fields (sim backend, ...)
    targets: dict[str, float | Target] = field(default_factory=dict)  # e.g. {"async/sync": 2.0}: median >= 2.0
    quick_num_envs: int = 8  # --quick is a smoke test: few envs, few steps
    quick_schedules: tuple[str, ...] | None = None  # --quick runs only these (None: every schedule)
    limits: bool = True  # measure each stage alone (the physical limit)
    # EBRL runs as `asyncio.run(main())` awaiting ebrl.run: the user's own (default asyncio) loop,
    # not run_sync's uvloop
    embedded: bool = False
    # per-case (num_envs, steps) where the cases' envs differ in cost by orders of magnitude (a
    # LIBERO env with a camera steps 50x slower than ManiSkill's); the others take the suite's
    case_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # per-case policy_fn where the cases train different models (the vla suite's token, π0 and π0.5)
    case_policies: dict[str, Callable[[Any, Any, int], Any]] = field(default_factory=dict)

    def for_case(self, case: str) -> "Suite":
        suite = self
        if case in self.case_sizes:
            num_envs, steps = self.case_sizes[case]
            suite = replace(suite, num_envs=num_envs, steps=steps)
        if case in self.case_policies:
            suite = replace(suite, policy_fn=self.case_policies[case])
        return suite

    def sized(self, quick: bool) -> "Suite":
        if not quick:
            return self
        return replace(self, num_envs=min(self.num_envs, self.quick_num_envs), segment_len=min(self.segment_len, 16),
                       rounds=1, schedules=self.quick_schedules or self.schedules)
