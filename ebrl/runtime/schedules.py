"""The three schedules. They share envs, policy, algorithm and every runtime piece, so a
benchmark's ratio between them measures the scheduling alone.

- ``async`` (EBRL): every env (or vector env) goes on alone as soon as its step is back, no barrier anywhere; generation batches
  whoever is waiting; training overlaps rollout within ``max_policy_lag``.
- ``sync``: all envs in one lockstep group; rollout ``T`` steps, then train, then repeat
  (gymnasium's vector-env loop, RLinf's collocated mode).
- ``pipelined``: ``num_groups`` lockstep groups; one group's simulation overlaps another's
  generation; training still waits for the whole rollout (RLinf's ``pipeline_stage_num``).
"""

from __future__ import annotations

from ebrl.config import RunConfig, Schedule
from ebrl.runtime.drivers import lockstep_groups


def is_lockstep(schedule: Schedule) -> bool:
    return schedule is not Schedule.ASYNC


def effective_lag(cfg: RunConfig) -> int:
    """Lockstep schedules train after the rollout that used the same weights: lag 0."""
    return 0 if is_lockstep(cfg.schedule) else cfg.max_policy_lag


def generation_target(cfg: RunConfig) -> int:
    if cfg.schedule is Schedule.ASYNC:
        return cfg.gen_batch_target
    return max(len(g) for g in lockstep_groups(cfg)) * cfg.sim.vector_size  # a lockstep group is one batch
