"""Learning algorithms: they turn a :class:`Batch` of padded segments into weight updates.

``PPO`` (clipped surrogate, GAE on the behaviour values); for samples older than one update,
``DecoupledPPO`` (a proximal policy apart from the behaviour one) and ``VTrace`` (IMPALA's
truncated importance weights in the advantages and value targets); ``GRPO`` (group-relative
advantages over episodes from shared resets, no critic); off-policy, ``SAC`` (its own replay
buffer, twin critics, an automatic temperature, n-step returns) and ``RLPD`` (SAC with LayerNorm
critics, an ensemble, a high update-to-data ratio and demonstrations in every minibatch). What an algorithm needs of the run
(GRPO: whole episodes from shared resets) it declares as ``run_needs`` (:class:`RunNeeds`);
:func:`resolve_run_config` applies it (``ebrl.run`` does, before it builds anything).
"""

from ebrl.algos.advantages import build_next_values, gae
from ebrl.algos.batch import Batch
from ebrl.algos.dppo import DecoupledPPO, DecoupledPPOConfig
from ebrl.algos.grpo import GRPO, GRPOConfig, group_advantages
from ebrl.algos.needs import RunNeeds, resolve_run_config
from ebrl.algos.ppo import PPO, PPOConfig
from ebrl.algos.replay import ReplayBuffer, load_demos, sample_mixed
from ebrl.algos.sac import RLPD, SAC, RLPDConfig, SACConfig
from ebrl.algos.vtrace import VTrace, VTraceConfig, vtrace

__all__ = ["PPO", "PPOConfig", "DecoupledPPO", "DecoupledPPOConfig", "VTrace", "VTraceConfig", "GRPO", "GRPOConfig",
           "SAC", "SACConfig", "RLPD", "RLPDConfig", "ReplayBuffer", "load_demos", "sample_mixed",
           "Batch", "RunNeeds", "gae", "build_next_values", "group_advantages", "resolve_run_config", "vtrace"]
