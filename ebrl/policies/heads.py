"""The action heads every actor-critic here shares: a diagonal Gaussian with a
state-independent log-std (Box actions, PPO's), a tanh-squashed Gaussian with a
state-dependent std (``action_head="squashed"``, SAC's), or a categorical (Discrete actions),
and the running mean/variance behind observation normalisation.

A policy using :class:`ActorCriticHeads` provides ``actor`` and ``critic`` (feature ->
outputs), ``_features(obs)``, ``discrete``, ``action_low``/``action_high`` (numpy or None) and
``seed``, and calls :meth:`ActorCriticHeads._init_head` once its networks are built (it makes
``log_std``, or the squashed head's action scale); :class:`~ebrl.policies.base.SeededSampling`
gives it its sampling stream.

The squashed head: the actor outputs ``2 * act_dim`` numbers, a mean ``mu`` and a raw log-std
mapped smoothly into ``[LOG_STD_MIN, LOG_STD_MAX]``; an action is ``bias + scale * tanh(u)``,
``u ~ N(mu, std)``, which stays inside the Box bounds (``scale``/``bias`` from them; ``(-1, 1)``
without finite bounds). Its log-prob is the Gaussian's minus the log-Jacobian of the squash
(SAC, Haarnoja et al. 2018, appendix C). :meth:`ActorCriticHeads.rsample` is the
reparameterised sample an off-policy algorithm differentiates through (an example is in
:mod:`ebrl.policies.mlp`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ebrl.policies.base import ActResult, SeededSampling

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # the squashed head's std range (CleanRL's SAC)
ACTION_HEADS = ("gaussian", "squashed")
SQUASH_EPS = 1e-6  # actions read back by evaluate() are kept this far inside the bounds


def head_outputs(action_head: str, discrete: bool, act_dim: int) -> int:
    """The actor's output size for ``action_head``; a ``ValueError`` naming it where it does not apply."""
    if action_head not in ACTION_HEADS:
        raise ValueError(f"action_head={action_head!r} is not one of {list(ACTION_HEADS)}")
    if action_head == "squashed":
        if discrete:
            raise ValueError("action_head='squashed' is for Box actions, not Discrete ones")
        return 2 * act_dim
    return act_dim


class ActorCriticHeads(SeededSampling):
    squashed = False  # action_head="squashed": SAC's tanh Gaussian

    def _init_head(self, action_head: str, init_log_std: float) -> None:
        """After ``actor`` and ``critic``: PPO's state-independent ``log_std`` parameter, or the
        squashed head's scale and bias (non-persistent buffers: they follow the policy's device
        and never enter its ``state_dict``) and the shift putting a raw output of 0 at ``init_log_std``."""
        self.squashed = action_head == "squashed"
        if self.discrete:
            return
        if not self.squashed:
            self.log_std = nn.Parameter(torch.full((self.act_dim,), float(init_log_std)))
            return
        if not LOG_STD_MIN < init_log_std < LOG_STD_MAX:
            raise ValueError(f"init_log_std={init_log_std!r}: the squashed head's must be in "
                             f"({LOG_STD_MIN}, {LOG_STD_MAX})")
        low, high = self.action_low, self.action_high
        bounded = low is not None and high is not None and bool(np.isfinite(low).all() and np.isfinite(high).all())
        scale = (high - low) / 2.0 if bounded else np.ones(self.act_dim, np.float32)
        bias = (high + low) / 2.0 if bounded else np.zeros(self.act_dim, np.float32)
        self.register_buffer("action_scale", torch.as_tensor(scale, dtype=torch.float32), persistent=False)
        self.register_buffer("action_bias", torch.as_tensor(bias, dtype=torch.float32), persistent=False)
        frac = (init_log_std - LOG_STD_MIN) / (LOG_STD_MAX - LOG_STD_MIN)
        self._log_std_shift = math.log(frac / (1.0 - frac))

    def features(self, obs) -> Tensor:
        """The ``[N, F]`` features the heads read (normalised vectors; for images the encoders'
        output), with gradients: what an off-policy algorithm's critics read too."""
        return self._features(obs)

    # ---- the squashed Gaussian ---------------------------------------------------------------

    def _squashed_params(self, out: Tensor) -> tuple[Tensor, Tensor]:
        mu, raw = out.chunk(2, -1)
        return mu, LOG_STD_MIN + (LOG_STD_MAX - LOG_STD_MIN) * torch.sigmoid(raw + self._log_std_shift)

    def _log_jacobian(self, u: Tensor) -> Tensor:
        """``sum log |d a / d u|`` of ``a = bias + scale * tanh(u)``, stable for large ``|u|``."""
        return (torch.log(self.action_scale) + 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))).sum(-1)

    def _squash(self, mu: Tensor, log_std: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        u = mu + noise * log_std.exp()
        logp = (-0.5 * noise.square() - log_std - LOG_SQRT_2PI).sum(-1) - self._log_jacobian(u)
        return self.action_bias + self.action_scale * torch.tanh(u), logp

    def rsample(self, features: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """A reparameterised sample of the squashed head on ``features [N, F]``: ``(actions [N,
        act_dim], logprob [N])``, differentiable in the actor's weights (``generator``: the noise's)."""
        if not self.squashed:
            raise ValueError(f"{type(self).__name__}.rsample needs action_head='squashed' (SAC's tanh Gaussian)")
        mu, log_std = self._squashed_params(self.actor(features))
        noise = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
        return self._squash(mu, log_std, noise)

    # ---- acting and scoring ------------------------------------------------------------------

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
        elif self.squashed:
            mu, log_std = self._squashed_params(out)
            noise = (torch.zeros_like(mu) if self.deterministic  # tanh of the mean
                     else torch.randn(mu.shape, generator=gen, device=x.device, dtype=mu.dtype))
            a, logp = self._squash(mu, log_std, noise)
            actions = a.cpu().numpy()
            env_actions = actions if self.action_low is None else np.clip(actions, self.action_low, self.action_high)
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
        """``(logprob [N], entropy [N], value [N])`` of ``actions`` on features ``x``, with gradients.

        The squashed head's entropy is its Gaussian's plus ``sum log scale``: an upper bound of
        the squashed distribution's (a squash never spreads a density)."""
        out = self.actor(x)
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            logp = logp_all.gather(-1, actions.reshape(-1, 1).long()).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        elif self.squashed:
            mu, log_std = self._squashed_params(out)
            t = ((actions.reshape(mu.shape).to(mu.dtype) - self.action_bias) / self.action_scale)
            u = torch.atanh(t.clamp(-1.0 + SQUASH_EPS, 1.0 - SQUASH_EPS))
            z = (u - mu) * torch.exp(-log_std)
            logp = (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1) - self._log_jacobian(u)
            entropy = (0.5 + LOG_SQRT_2PI + log_std + torch.log(self.action_scale)).sum(-1)
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
