"""The three schedules. They share envs, policy, algorithm and every runtime piece, so a
benchmark's ratio between them measures the scheduling alone.

- ``async`` (EBRL): one coroutine per env, no barrier anywhere; generation batches
  whoever is waiting; training overlaps rollout within ``max_policy_lag``.
- ``sync``: all envs in one lockstep group; rollout ``T`` steps, then train, then repeat
  (gymnasium's vector-env loop, RLinf's collocated mode).
- ``pipelined``: ``num_groups`` lockstep groups; one group's simulation overlaps another's
  generation; training still waits for the whole rollout (RLinf's ``pipeline_stage_num``).
"""

from __future__ import annotations

import math
from collections.abc import Coroutine

from ebrl.config import RunConfig, Schedule
from ebrl.runtime.env_task import EnvSteps, env_task, lockstep_group, vector_task


def is_lockstep(schedule: Schedule) -> bool:
    return schedule is not Schedule.ASYNC


def effective_lag(cfg: RunConfig) -> int:
    """Lockstep schedules train after the rollout that used the same weights: lag 0."""
    return 0 if is_lockstep(cfg.schedule) else cfg.max_policy_lag


def groups(cfg: RunConfig) -> list[list[int]]:
    """Each lockstep group's units: env ids, or vector env ids when ``sim.vector_size > 1``
    (contiguous, sizes differing by at most one)."""
    units = cfg.num_envs // cfg.sim.vector_size
    n = 1 if cfg.schedule is Schedule.SYNC else cfg.num_groups
    size = math.ceil(units / n)
    return [list(range(s, min(s + size, units))) for s in range(0, units, size)]


def generation_target(cfg: RunConfig) -> int:
    if cfg.schedule is Schedule.ASYNC:
        return cfg.gen_batch_target
    return max(len(g) for g in groups(cfg)) * cfg.sim.vector_size  # a lockstep group is one batch


def drivers(cfg: RunConfig, steps: EnvSteps) -> list[Coroutine]:
    vectorised = cfg.sim.vector_size > 1
    if cfg.schedule is Schedule.ASYNC:
        if vectorised:
            return [vector_task(steps, [k]) for k in range(cfg.num_envs // cfg.sim.vector_size)]
        return [env_task(steps, i) for i in range(cfg.num_envs)]
    return [(vector_task if vectorised else lockstep_group)(steps, ids) for ids in groups(cfg)]
