"""Learning algorithms: they turn a :class:`Batch` of padded segments into weight updates."""

from ebrl.algos.advantages import build_next_values, gae
from ebrl.algos.batch import Batch
from ebrl.algos.ppo import PPO, PPOConfig

__all__ = ["PPO", "PPOConfig", "Batch", "gae", "build_next_values"]
