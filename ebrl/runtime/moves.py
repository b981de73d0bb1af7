"""Env moves between workers or lanes that the resource controller asked for, made at each
env's next episode end, so nothing of an episode is lost.

The manager writes :attr:`Moves.wanted` (env -> worker); the driver hands every recorded block
to :meth:`Moves.due`, which says which envs move now, and awaits :meth:`Moves.move` for each
before it lets the env go on. A failed move leaves the env where it was.
"""

from __future__ import annotations

import numpy as np

from ebrl.config import RunConfig
from ebrl.runtime.episodes import Episodes
from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.recovery import Recovery
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.sim import Block, SimPool
from ebrl.spaces import batch_of_one
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.env")


class Moves:
    """Placement changes due at episode ends (see module docstring)."""

    def __init__(self, cfg: RunConfig, pool: SimPool, rollout: RolloutQueue, episodes: Episodes,
                 recovery: Recovery):
        self.cfg, self.pool, self.rollout, self.episodes, self.recovery = cfg, pool, rollout, episodes, recovery
        self.wanted: dict[int, int] = {}  # env -> worker: the controller's, done at the env's next episode end
        self.under_way: set[int] = set()  # envs whose move started (the pool's placement is not yet theirs)
        self.done = 0  # moves made

    @property
    def pending(self) -> bool:
        """Moves wanted or under way: a placement read now would be stale."""
        return bool(self.wanted or self.under_way)

    def due(self, block: Block) -> list[tuple[int, int]]:
        """``(env, worker)`` for each env of ``block`` whose episode just ended and that is
        wanted elsewhere; those moves are under way from now on."""
        start = []
        for i in block.ids[block.terminated | block.truncated].tolist():
            target = self.wanted.pop(i, None)
            if target is None:
                continue
            if int(self.pool.placement[i]) == target:  # a decision made while an earlier move was in flight
                log.info("env_move_skipped", env=i, where=target)
                continue
            self.under_way.add(i)
            start.append((i, target))
        return start

    async def move(self, env_id: int, worker: int) -> bool:
        """Rebuild env ``env_id`` in ``worker`` and start its next episode there. True: the env
        may go on (moved, or left where it was by a failed move)."""
        try:
            obs, _ = await self.pool.migrate(env_id, worker, seed=self.episodes.reset_seed(env_id))
            self.rollout.set_obs(np.array([env_id]), batch_of_one(self.recovery.checked_reset(env_id, obs)))
            if self.cfg.reset_group is not None:  # the part it moved to holds its own rows
                self.pool.set_reset_seeds(np.array([env_id]), np.array([self.episodes.group_seed(env_id)]))
            self.done += 1
            log.info("env_migrated", env=env_id, worker=worker)
        except EnvStepError as exc:
            log.warning("env_migration_failed", env=env_id, worker=worker, error=exc.detail)
        finally:
            self.under_way.discard(env_id)
        return True
