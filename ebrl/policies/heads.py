"""The action heads every actor-critic here shares: a diagonal Gaussian with a
state-independent log-std (Box actions) or a categorical (Discrete actions), and the
running mean/variance behind observation normalisation.

A policy using :class:`ActorCriticHeads` provides ``actor`` and ``critic`` (feature ->
outputs), ``discrete``, ``log_std`` (Gaussian only), ``action_low``/``action_high`` (numpy
or None) and ``seed``; :class:`~ebrl.policies.base.SeededSampling` gives it its sampling stream.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ebrl.policies.base import ActResult, SeededSampling

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class ActorCriticHeads(SeededSampling):
    def _sample(self, x: Tensor) -> ActResult:
        """Sample from the heads on features ``x [B, F]`` (call under ``torch.no_grad``)."""
        gen = self._generator(x.device)
        values = self.critic(x).squeeze(-1)
        out = self.actor(x)
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            a = (logp_all.argmax(-1, keepdim=True) if self.deterministic
                 else torch.multinomial(logp_all.exp(), 1, generator=gen))
            logp = logp_all.gather(-1, a).squeeze(-1)
            actions = env_actions = a.squeeze(-1).cpu().numpy()  # nothing to clip
        else:
            noise = (torch.zeros_like(out) if self.deterministic  # the mean
                     else torch.randn(out.shape, generator=gen, device=x.device, dtype=out.dtype))
            # log N(a; mu, sigma) with (a - mu) / sigma == noise exactly
            logp = (-0.5 * noise.square() - self.log_std - LOG_SQRT_2PI).sum(-1)
            actions = env_actions = (out + noise * self.log_std.exp()).cpu().numpy()
            if self.action_low is not None or self.action_high is not None:
                env_actions = np.clip(actions, self.action_low, self.action_high)
        return ActResult(actions=actions, env_actions=env_actions, logprobs=logp.cpu().numpy(),
                         values=values.cpu().numpy())

    def _evaluate(self, x: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [N], entropy [N], value [N])`` of ``actions`` on features ``x``, with gradients."""
        out = self.actor(x)
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            logp = logp_all.gather(-1, actions.reshape(-1, 1).long()).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        else:
            log_std = self.log_std.expand_as(out)
            z = (actions.reshape(out.shape).to(out.dtype) - out) * torch.exp(-log_std)
            logp = (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1)
            entropy = (0.5 + LOG_SQRT_2PI + log_std).sum(-1)
        return logp, entropy, self.critic(x).squeeze(-1)


def action_bounds(low, high, act_dim: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Clipping bounds as float32 numpy arrays (clipping happens on act()'s numpy output)."""
    def one(b):
        return None if b is None else np.broadcast_to(np.asarray(b, np.float32), (act_dim,)).copy()

    return one(low), one(high)


def register_moments(module: torch.nn.Module, dim: int) -> None:
    """Running mean/var buffers for normalisation: in state_dict (so they reach the inference
    copy) but not in the optimiser. Updated by :func:`merge_moments`."""
    module.register_buffer("obs_mean", torch.zeros(dim))
    module.register_buffer("obs_var", torch.ones(dim))
    module.register_buffer("obs_count", torch.tensor(1e-4, dtype=torch.float64))


@torch.no_grad()
def merge_moments(mean: Tensor, var: Tensor, count: Tensor, x: Tensor) -> None:
    """Merge a batch ``x [N, D]`` into running mean/var buffers in place (parallel Welford, as SB3).

    In a data-parallel update (:mod:`ebrl.distributed`) the batch is every rank's: each rank's
    sums of deviations from the shared running mean are all-reduced first, so every rank
    merges the same moments (and every rank must call this, with ``N = 0`` if it has no rows).
    """
    from ebrl.distributed import active, reduce_moments

    x = x.double()
    n = x.shape[0]
    m, v = mean.double(), var.double()
    if active() is not None:
        d = x - m
        n, s, sq = reduce_moments(n, d.sum(0), d.square().sum(0))
        if n == 0:
            return
        b_mean = m + s / n
        b_var = (sq / n - (s / n).square()).clamp_min(0.0)
    elif n == 0:
        return
    else:
        b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
    tot = count + n
    delta = b_mean - m
    mean.copy_(m + delta * n / tot)
    var.copy_((v * count + b_var * n + delta.square() * count * n / tot) / tot)
    count.copy_(tot)
