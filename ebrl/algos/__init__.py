"""Learning algorithms: they turn a :class:`Batch` of padded segments into weight updates.

``PPO`` (clipped surrogate, GAE on the behaviour values); for samples older than one update,
``DecoupledPPO`` (a proximal policy apart from the behaviour one) and ``VTrace`` (IMPALA's
truncated importance weights in the advantages and value targets); ``GRPO`` (group-relative
advantages over episodes from shared resets, no critic).
"""

from ebrl.algos.advantages import build_next_values, gae
from ebrl.algos.batch import Batch
from ebrl.algos.dppo import DecoupledPPO, DecoupledPPOConfig
from ebrl.algos.grpo import GRPO, GRPOConfig, group_advantages
from ebrl.algos.ppo import PPO, PPOConfig
from ebrl.algos.vtrace import VTrace, VTraceConfig, vtrace

__all__ = ["PPO", "PPOConfig", "DecoupledPPO", "DecoupledPPOConfig", "VTrace", "VTraceConfig", "GRPO", "GRPOConfig",
           "Batch", "gae", "build_next_values", "group_advantages", "vtrace"]
