"""Episode bookkeeping for the driver: returns, lengths and success per env, reported to
:class:`~ebrl.runtime.stats.RunStats` at each episode's end, and the seed of each env's next episode
(``reset_group``: every env of a group starts its k-th episode from one seed). Nothing here releases or steps an env.
"""

from __future__ import annotations

import numpy as np

from ebrl.config import RunConfig
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.sim import Block, SimPool
from ebrl.runtime.stats import RunStats
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.env")


class Episodes:
    """Per-env episode statistics and reset seeds (see module docstring)."""

    def __init__(self, cfg: RunConfig, pool: SimPool, rollout: RolloutQueue, stats: RunStats):
        self.cfg, self.pool, self.rollout, self.stats = cfg, pool, rollout, stats
        n = cfg.num_envs
        self.ep_return = np.zeros(n, np.float64)
        self.ep_length = np.zeros(n, np.int64)
        self.ep_success = np.full(n, -1, np.int8)  # -1 until the env reports a success flag
        self.resets = np.zeros(n, np.int64)  # resets the driver asked for, per env
        self.episodes = np.zeros(n, np.int64)  # episodes started per env (reset groups seed by it)

    def track(self, block: Block) -> None:
        """Add a recorded block's steps to their episodes; close the episodes that ended."""
        ids = block.ids
        self.ep_return[ids] += block.reward
        self.ep_length[ids] += 1
        if block.clean:  # no episode ended and no success flag in it
            return
        known = block.success >= 0
        if known.any():
            k = ids[known]
            self.ep_success[k] = np.maximum(self.ep_success[k], block.success[known])
        ended = (block.terminated | block.truncated).nonzero()[0]
        for r in ended.tolist():
            i = int(ids[r])
            once = None if self.ep_success[i] < 0 else bool(self.ep_success[i])
            at_end = None if block.success[r] < 0 else bool(block.success[r])
            self._autoreset(i)
            ret, length = float(self.ep_return[i]), int(self.ep_length[i])
            self.stats.episode(ret, length, once, at_end)
            log.info("episode", env=i, ep_return=round(ret, 4), length=length, success_once=once,
                     success_at_end=at_end, truncated=bool(block.truncated[r] and not block.terminated[r]))
            self.ep_return[i], self.ep_length[i], self.ep_success[i] = 0.0, 0, -1

    def reset_seed(self, env_id: int) -> int:
        """The seed of a reset the driver asks for: each env's first episode is seeded ``seed +
        env_id``, later ones (after a rebuild) fresh reproducible seeds; under ``reset_group`` the group's next."""
        self.resets[env_id] += 1
        self.ep_return[env_id], self.ep_length[env_id], self.ep_success[env_id] = 0.0, 0, -1
        if self.cfg.reset_group is not None:
            return self._autoreset(env_id)
        seed = self.cfg.seed + env_id + self.cfg.num_envs * int(self.resets[env_id] - 1)
        self.rollout.episode_key[env_id] = seed
        return seed

    def group_seed(self, env_id: int) -> int:
        """Under ``reset_group``: the seed of env ``env_id``'s next episode, shared by its group
        (the group's k-th episodes all start from one seed)."""
        groups = self.cfg.num_envs // self.cfg.reset_group
        return self.cfg.seed + env_id // self.cfg.reset_group + groups * int(self.episodes[env_id])

    def _autoreset(self, env_id: int) -> int:
        """Env ``env_id``'s next episode starts: with reset groups, from the seed written for it
        (returned; the next one is written now); else from the env's own RNG (-1)."""
        if self.cfg.reset_group is None:
            self.rollout.episode_key[env_id] = -1
            return -1
        seed = self.rollout.episode_key[env_id] = self.group_seed(env_id)
        self.episodes[env_id] += 1
        self.pool.set_reset_seeds(np.array([env_id]), np.array([self.group_seed(env_id)]))
        return seed
