"""The three schedules. They share envs, policy, algorithm and every runtime piece, so a
benchmark's ratio between them measures the scheduling alone.

- ``async`` (EBRL): every env (or vector env) goes on alone as soon as its step is back, no barrier
  anywhere; generation batches whoever is waiting; training overlaps rollout within ``max_policy_lag``.
- ``sync``: all envs in one lockstep group; rollout ``T`` steps, then train, then repeat
  (gymnasium's vector-env loop, RLinf's collocated mode).
- ``pipelined``: ``num_groups`` lockstep groups; one group's simulation overlaps another's
  generation; training still waits for the whole rollout (RLinf's ``pipeline_stage_num``).
"""

from __future__ import annotations

import numpy as np

from ebrl.config import RunConfig, Schedule


def is_lockstep(schedule: Schedule) -> bool:
    return schedule is not Schedule.ASYNC


def effective_lag(cfg: RunConfig) -> int:
    """Lockstep schedules train after the rollout that used the same weights: lag 0."""
    return 0 if is_lockstep(cfg.schedule) else cfg.max_policy_lag


def lockstep_groups(cfg: RunConfig) -> list[list[int]]:
    """Each lockstep group's units (env ids, or vector env ids when ``sim.vector_size > 1``):
    contiguous, sizes differing by at most one. Under ``async`` every unit is its own group."""
    units = cfg.num_envs // cfg.sim.vector_size
    if cfg.schedule is Schedule.ASYNC:
        return [[u] for u in range(units)]
    n = 1 if cfg.schedule is Schedule.SYNC else cfg.num_groups
    size = -(-units // n)
    return [list(range(s, min(s + size, units))) for s in range(0, units, size)]


def generation_target(cfg: RunConfig) -> int:
    if cfg.schedule is Schedule.ASYNC:
        return cfg.gen_batch_target
    return max(len(g) for g in lockstep_groups(cfg)) * cfg.sim.vector_size  # a lockstep group is one batch


class Barrier:
    """The lockstep barrier: which groups are whole once envs ``ids`` are back (every env of a
    group that is not waiting outside it, in env id order). Under ``async`` each unit is a group
    of its own.

    An env parked on a full queue (its segment closed early: its episode ended, under
    ``segment_cut="episode"``) leaves the barrier (:meth:`leave`) and the rest of its group steps on
    without it until it rejoins (:meth:`rejoin`): the rollout still ends when every env's segment has
    closed, and no env's segment is cut short by another's episode end.

        >>> barrier = Barrier(RunConfig(num_envs=4, schedule="sync"))
        >>> barrier.arrive(np.array([0, 1])), barrier.arrive(np.array([3, 2]))
        ([], [array([0, 1, 2, 3])])
        >>> barrier.leave(np.array([2])); barrier.arrive(np.array([0, 1, 3]))
        [array([0, 1, 3])]
    """

    def __init__(self, cfg: RunConfig):
        v = cfg.sim.vector_size
        self.groups = [np.concatenate([np.arange(u * v, u * v + v) for u in g]) for g in lockstep_groups(cfg)]
        self.group_of = np.zeros(cfg.num_envs, np.int64)
        for g, ids in enumerate(self.groups):
            self.group_of[ids] = g
        self.arrived = np.zeros(len(self.groups), np.int64)  # envs of each group back and ready
        self.inside = np.array([len(g) for g in self.groups], np.int64)  # envs each group waits for
        self.out = np.zeros(cfg.num_envs, bool)  # parked envs: not waited for

    def arrive(self, ids: np.ndarray) -> list[np.ndarray]:
        """Envs ``ids`` (whole units) are ready; the groups now whole (whose count starts again)."""
        whole = []
        groups, counts = np.unique(self.group_of[ids], return_counts=True)
        for g, c in zip(groups.tolist(), counts.tolist()):
            self.arrived[g] += c
            if self.arrived[g] == self.inside[g]:
                self.arrived[g] = 0
                members = self.groups[g]
                whole.append(members[~self.out[members]])
        return whole

    def leave(self, ids: np.ndarray) -> None:
        """Envs ``ids`` (just released, not stepping) wait outside: their groups go on without them."""
        self.out[ids] = True
        np.subtract.at(self.inside, self.group_of[ids], 1)

    def rejoin(self, ids: np.ndarray) -> None:
        """Envs ``ids`` step again: their groups wait for them from their next arrival."""
        self.out[ids] = False
        np.add.at(self.inside, self.group_of[ids], 1)
