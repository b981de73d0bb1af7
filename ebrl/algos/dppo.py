"""Decoupled PPO (Hilton, Cobbe & Schulman 2021, "Batch size-invariance for policy optimization",
https://arxiv.org/abs/2110.00641): the proximal policy is separate from the behaviour policy.

PPO's "old" policy does two jobs: importance sampling (it must be the behaviour policy ``mu``
that acted) and bounding the step (any recent policy does: the *proximal* policy). Under policy
lag ``mu`` is several updates old, and clipping ``pi_theta/mu`` around 1 gives no gradient for
samples whose lag already moved the policy past the clip. Here the proximal policy is the
learner's weights at the start of the update, ``pi_prox``, and each step's loss is::

    w * min(r * A, clip(r, 1 - eps, 1 + eps) * A),   r = pi_theta / pi_prox,
    w = min(max_is_weight, pi_prox / mu)   (a constant)

so every update moves the policy as far as PPO's does at lag 0, whatever the lag.

:class:`~ebrl.algos.ppo.PPO` does this by itself on every batch that holds lagged samples
(``PPOConfig.lag_correction``, on by default); ``DecoupledPPO`` does it on every batch, lag-0
ones included (where ``w = 1`` and ``pi_prox = mu`` up to rounding).

Example::

    >>> import torch
    >>> from ebrl.algos import Batch
    >>> from ebrl.algos.dppo import DecoupledPPO
    >>> from ebrl.policies import MLPPolicy
    >>> policy = MLPPolicy(3, 2, seed=0)
    >>> S, T = 2, 5
    >>> obs = torch.randn(S, T, 3); acts = torch.randn(S, T, 2)
    >>> with torch.no_grad():
    ...     logp, _, v = policy.evaluate(obs.reshape(-1, 3), acts.reshape(-1, 2))
    >>> no = torch.zeros(S, T, dtype=torch.bool)
    >>> batch = Batch(obs, acts, logp.reshape(S, T) - 1.0, v.reshape(S, T), torch.randn(S, T), no, no,
    ...               torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
    ...               torch.randn(S, 3), torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long),
    ...               learner_version=3)
    >>> algo = DecoupledPPO(lr=1e-3, minibatch_size=10, update_epochs=1, max_is_weight=2.0)
    >>> metrics = algo.update(policy, batch)  # pi_prox/mu = e: every weight truncated to 2
    >>> metrics["clipfrac"], metrics["is_weight_mean"]
    (0.0, 2.0)
"""

from __future__ import annotations

from dataclasses import dataclass

from ebrl.algos.batch import Batch
from ebrl.algos.ppo import PPO, PPOConfig
from ebrl.algos.vtrace import _make_config


@dataclass
class DecoupledPPOConfig(PPOConfig):
    """PPO's fields (``max_is_weight``, the truncation of ``pi_prox / mu``, among them): the
    ``[dppo]`` table of a config file."""


class DecoupledPPO(PPO):
    """PPO with a proximal policy decoupled from the behaviour policy on every batch.

    ``DecoupledPPO(max_is_weight=4.0)`` overrides fields of :class:`DecoupledPPOConfig`.
    Advantages and returns are PPO's (GAE on the behaviour values). At the start of each update
    (no gradient) the current weights are evaluated once on the batch
    (:meth:`~ebrl.algos.ppo.PPO.proximal`): their log-probs are ``pi_prox``, their values the
    centre of value clipping (the critic's proximal values, for the same reason as the
    policy's). ``approx_kl`` and ``clipfrac`` are measured against ``pi_prox``;
    ``is_weight_mean`` is the mean of ``w``, ``lag_kl`` the KL from ``mu`` to ``pi_prox``.

    In the minibatches ``mb["logprobs"]`` holds the proximal log-probs and
    ``mb["is_weights"]`` the truncated weights ``w`` (so a custom ``loss_fn`` sees those).

    Equivalence: on lag-0 data (behaviour log-probs and values equal to the current policy's)
    ``w = 1`` and ``pi_prox = mu``, so an update gives PPO's weights.
    """

    config: DecoupledPPOConfig

    def __init__(self, config: DecoupledPPOConfig | PPOConfig | None = None, *, loss_fn=None, demos=None,
                 **overrides):
        super().__init__(_make_config(DecoupledPPOConfig, "DecoupledPPO", config, overrides), loss_fn=loss_fn,
                         demos=demos)

    def decouples(self, batch: Batch) -> bool:
        return True
