"""A π0-style flow-matching policy over action chunks, trainable with PPO ("Flow-Noise").

A flow policy turns Gaussian noise into an action chunk by integrating a learned velocity field
``v_theta(x, tau, obs)`` from ``tau = 0`` (noise) to ``tau = 1`` (actions). Plain Euler
integration is deterministic given ``x_0``, so the chunk has no tractable density and PPO has
no log-prob to form a ratio from. Following πRL's Flow-Noise (Chen et al. 2025, "πRL: Online
RL fine-tuning for flow-based VLA models"), a learned, state- and time-dependent noise
``sigma_theta(x, tau, obs)`` is injected at every one of the ``N`` denoising steps, which makes
each step a Gaussian transition (``tau_k = k / N``, ``dt = 1 / N``)::

    x_0 ~ N(0, I)
    x_{k+1} = x_k + dt * v_theta(x_k, tau_k, obs) + sigma_theta(x_k, tau_k, obs) * eps_k
    log p(chain) = log N(x_0; 0, I) + sum_k log N(x_{k+1}; mean_k, diag(sigma_k^2))

By default (``predict="action"``) the network predicts the final chunk ``x1_hat(x, tau, obs)``
and the velocity is ``(x1_hat - x) / (1 - tau)``: the same family of flows (this is only how
the velocity is parameterised, and the flow-matching loss becomes ``|x1_hat - target|^2``), but
the last step's mean is exactly ``x1_hat``, so a freshly built policy acts like a Gaussian policy
of std ``init_sigma`` around its prediction. ``predict="velocity"`` (π0's) starts as the
identity flow instead: the chunk is ``x_0``'s unit noise, which no weight controls and no
log-prob ratio sees, and PPO must learn to contract it through steps of small noise. On
FetchReachDense-v4 in chunks of 4, PPO from scratch reached success_once 0.15 in 80 s with
``"velocity"`` and 0.5 with ``"action"``. ``init_sigma = 0.5`` (in ``[-1, 1]`` units) for
the same reason: the clipped ratio lets a step move the mean by about a fraction of sigma, so
sigma 0.1 (πRL's range, for fine-tuning a pretrained flow) leaves PPO from scratch nearly stuck.

The whole chain ``[x_0 .. x_N]`` is the "action" PPO stores and scores (``ActResult.actions``,
``[B, N + 1, K * A]``); the env receives ``x_N`` reshaped to the chunk ``(K, A)`` and mapped
from the normalised space ``[-1, 1]`` to the action Box. Wrap the env in
:class:`ebrl.envs.chunks.ActionChunk` to execute a ``K``-action chunk per decision.
:meth:`FlowPolicy.flow_matching_loss` is the rectified-flow behaviour-cloning loss, for warm
starts from demonstrations before RL.

Example::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.flow import FlowPolicy
    >>> obs_space = gym.spaces.Box(-1.0, 1.0, (3,))
    >>> chunk_space = gym.spaces.Box(-2.0, 2.0, (4, 2))   # K=4 actions of dim 2
    >>> policy = FlowPolicy.from_spaces(obs_space, chunk_space, hidden=(32, 32), seed=0)
    >>> out = policy.act(np.zeros((5, 3), np.float32))
    >>> out.actions.shape, out.env_actions.shape, out.logprobs.shape   # chain: N + 1 = 5 states
    ((5, 5, 8), (5, 4, 2), (5,))
    >>> bool(np.abs(out.env_actions).max() <= 2.0), out.actions.dtype
    (True, dtype('float32'))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult, SeededSampling
from ebrl.policies.cnn import image_cnn
from ebrl.policies.encoders import ObsEncoder, ObsEntry, ObsLayout, Read, ReadsObservations, as_tensor
from ebrl.policies.expects import ActionSpec, PolicySpaces
from ebrl.policies.flow_chain import ChunkSpace, FlowChain, HasChain, SigmoidSigma, TimeEmbedding, Velocity, chunk_2d
from ebrl.policies.mlp import _mlp
from ebrl.policies.pretrained import Pretrained

ObsLike = Any  # a Tensor/array [N, ...], or a (nested) dict of them for Dict observation spaces


class FlowPolicy(HasChain, ChunkSpace, ReadsObservations, SeededSampling, Pretrained, nn.Module):
    """Flow-matching actor (velocity field + learned noise head) and an MLP critic.

    ``obs_dim`` is the size of the observation features the networks read: with ``obs_layout``
    (an :class:`~ebrl.policies.encoders.ObsLayout`, which ``from_spaces`` builds; ``obs_dim``
    None counts them) each camera's CNN features (``feature_dim``, ``conv`` as
    :class:`~ebrl.policies.CNNPolicy`'s) then the normalised vectors; without it the flattened
    Box observation or, with ``obs_keys``, those dict
    entries flattened and concatenated in that order.
    ``chunk_shape`` is the action Box's shape, ``(K, A)`` or ``(A,)``; ``action_low`` and
    ``action_high`` (finite, broadcastable to it) define the map from the normalised ``[-1, 1]``
    space the flow lives in. ``sigma`` is bounded in ``[sigma_min, sigma_max]`` by a sigmoid and
    starts near ``init_sigma``. ``predict`` is ``"action"`` (the network predicts the final
    chunk) or ``"velocity"`` (it predicts the velocity field). ``seed`` fixes the initial
    weights and the sampling stream.
    """

    def __init__(
        self,
        obs_dim: int | None,
        chunk_shape: Sequence[int],
        action_low: Any,
        action_high: Any,
        *,
        hidden: Sequence[int] = (256, 256),
        noise_hidden: Sequence[int] = (128,),
        critic_hidden: Sequence[int] = (256, 256),
        time_dim: int = 32,
        denoise_steps: int = 4,
        predict: str = "action",
        sigma_min: float = 0.01,
        sigma_max: float = 1.0,
        init_sigma: float = 0.5,
        normalize_obs: bool = True,
        obs_keys: Sequence[str] | None = None,
        obs_layout: ObsLayout | Sequence[dict[str, Any]] | None = None,
        conv: Sequence[Sequence[int]] | None = None,
        feature_dim: int = 256,
        seed: int = 0,
    ):
        super().__init__()
        self.chunk_shape = tuple(int(d) for d in chunk_shape)
        if len(self.chunk_shape) not in (1, 2) or min(self.chunk_shape) < 1:
            raise ValueError(f"chunk_shape={self.chunk_shape} must be (K, A) or (A,) with positive sizes")
        self.chain = FlowChain(denoise_steps, chunk_2d(self.chunk_shape), predict=predict)
        self.sigma = SigmoidSigma(sigma_min, init_sigma, sigma_max)
        if time_dim < 2 or time_dim % 2:
            raise ValueError(f"time_dim={time_dim!r} must be an even int >= 2 (sin and cos pairs)")
        low = np.broadcast_to(np.asarray(action_low, np.float32), self.chunk_shape).copy()
        high = np.broadcast_to(np.asarray(action_high, np.float32), self.chunk_shape).copy()
        if not (np.isfinite(low).all() and np.isfinite(high).all() and (high > low).all()):
            raise ValueError("FlowPolicy needs finite action bounds with high > low (the flow lives in "
                             f"[-1, 1] and is mapped onto them), got low={low.tolist()}, high={high.tolist()}")
        if obs_layout is not None and obs_keys:
            raise ValueError("give obs_layout, or obs_keys, not both")
        if obs_layout is None and obs_dim is None:
            raise ValueError("give obs_dim, or obs_layout")
        if obs_layout is not None:
            layout = ObsLayout.from_config(obs_layout)
        elif obs_keys:  # only their total size is known: entries of unknown shape
            layout = ObsLayout(vectors=tuple(ObsEntry((k,), Read.VECTOR, None) for k in obs_keys),
                               group_dim=int(obs_dim))
        else:
            layout = ObsLayout.vector((int(obs_dim),))
        init_gen = torch.Generator().manual_seed(int(seed))
        # first: camera CNNs (if any) draw their initial weights before the flow's networks
        self.obs_encoder = ObsEncoder(layout, image_net=lambda e: image_cnn(e, conv, feature_dim, init_gen),
                                      normalize=normalize_obs, owner="FlowPolicy")
        if obs_dim is not None and self.obs_encoder.out_dim != obs_dim:
            raise ValueError(f"obs_dim={obs_dim}, but the observation gives {self.obs_encoder.out_dim} features")
        self.obs_dim = self.obs_encoder.out_dim
        self.chunk_dim = math.prod(self.chunk_shape)
        self.normalize_obs, self.seed = bool(normalize_obs), int(seed)
        self.action_low, self.action_high = low, high
        # what from_pretrained needs to rebuild this module (JSON-able)
        self.config = {"obs_dim": self.obs_dim, "chunk_shape": list(self.chunk_shape),
                       "action_low": low.tolist(), "action_high": high.tolist(), "hidden": list(hidden),
                       "noise_hidden": list(noise_hidden), "critic_hidden": list(critic_hidden),
                       "time_dim": int(time_dim), "denoise_steps": denoise_steps, "predict": predict,
                       "sigma_min": self.sigma.sigma_min, "sigma_max": self.sigma.sigma_max,
                       "init_sigma": self.sigma.init_sigma,
                       "normalize_obs": self.normalize_obs, "obs_keys": list(obs_keys) if obs_keys else None,
                       "obs_layout": layout.to_config() if obs_layout is not None else None,
                       "conv": None if conv is None else [list(c) for c in conv], "feature_dim": int(feature_dim),
                       "seed": self.seed}

        d_in = self.chunk_dim + self.obs_dim + time_dim
        self.velocity = _mlp(d_in, hidden, self.chunk_dim, nn.SiLU, 0.01, init_gen)
        # separate from the velocity field, as in Flow-Noise: BC warm starts shape the velocity
        # only, and RL can grow or shrink exploration per state and step without disturbing it
        self.noise = _mlp(d_in, noise_hidden, self.chunk_dim, nn.SiLU, 0.01, init_gen)
        self.sigma.init_bias(self.noise[-1].bias)
        self.critic = _mlp(self.obs_dim, critic_hidden, 1, nn.Tanh, 1.0, init_gen)
        self.time_embedding = TimeEmbedding(time_dim)
        self._start_sampling()

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, image_keys: Sequence[str] | None = None,
                    state_keys: Sequence[str] | None = None, **kw) -> FlowPolicy:
        """Build from gymnasium spaces: any observation space :mod:`ebrl.policies.encoders` reads
        (``image_keys``/``state_keys`` choose the entries; cameras get CNNs); a Box action of
        shape ``(K, A)`` (an :class:`~ebrl.envs.chunks.ActionChunk`) or ``(A,)`` (K = 1)."""
        from gymnasium import spaces

        if not isinstance(action_space, spaces.Box) or len(action_space.shape) not in (1, 2):
            raise ValueError(f"FlowPolicy needs a Box action space of shape (K, A) or (A,), got {action_space!r}")
        if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError(f"FlowPolicy needs finite action bounds (actions are mapped from [-1, 1] onto "
                             f"them), got {action_space!r}")
        layout = ObsLayout.from_space(observation_space, image_keys=image_keys, state_keys=state_keys)
        return cls(None, action_space.shape, action_space.low, action_space.high, obs_layout=layout, **kw)

    def expected_spaces(self) -> PolicySpaces:
        """What this policy was built for (``ebrl.run`` checks env 0's spaces against it): the
        entries of its layout (or ``obs_dim`` elements of a Box, or of the ``obs_keys`` entries,
        joined); Box actions of ``chunk_shape``."""
        return PolicySpaces(self.obs_layout.expected(), ActionSpec(shape=self.chunk_shape))

    # ---- observations ----------------------------------------------------------------------

    def _features(self, obs: ObsLike) -> Tensor:
        """``[N, obs_dim]``: the cameras' features, then the normalised vectors."""
        return self.obs_encoder(obs, self.critic[0].weight)

    # ---- the flow --------------------------------------------------------------------------

    def _time_embed(self, tau: Tensor) -> Tensor:
        return self.time_embedding(tau)

    def _velocity(self, feat: Tensor) -> Velocity:
        """The chain's velocity for observation features ``feat [R, obs_dim]``: the velocity
        network's output and the noise head's sigma at ``S`` flow states per row."""

        def velocity(x: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
            r, s = tau.shape
            inp = torch.cat([x.reshape(r * s, self.chunk_dim), feat.repeat_interleave(s, 0),
                             self._time_embed(tau.reshape(r * s))], -1)
            sigma = self.sigma(self.noise(inp))
            return self.velocity(inp).reshape(x.shape), sigma.reshape(x.shape)

        return velocity

    # ---- acting (runtime) ------------------------------------------------------------------

    @torch.no_grad()
    def act(self, obs: ObsLike, noise: Tensor | np.ndarray | None = None) -> ActResult:
        """Sample chains for a batch of observations; numpy in, numpy out, no autograd.

        ``actions`` is the chain ``[B, N + 1, K * A]`` (float32) the log-prob refers to;
        ``env_actions`` is ``x_N`` as a ``[B, *chunk_shape]`` chunk inside the Box. ``noise``
        (``[B, K, A]``) is ``x_0``, drawn from the policy's stream when None.
        """
        feat = self._features(obs)
        states, logp = self.chain.sample(self._velocity(feat), feat.shape[0], self._generator(feat.device),
                                         device=feat.device, dtype=feat.dtype, x0=noise,
                                         deterministic=self.deterministic)
        actions = states.float().cpu().numpy()
        return ActResult(actions=actions, env_actions=self.to_env(actions[:, -1]),
                         logprobs=logp.float().cpu().numpy(),
                         values=self.critic(feat).squeeze(-1).float().cpu().numpy())

    # ---- training (algorithm) --------------------------------------------------------------

    @property
    def feature_width(self) -> int:
        """The width of :meth:`value_features`."""
        return self.obs_dim

    def value_features(self, obs: ObsLike) -> Tensor:
        """What the value head reads for ``obs``, ``[N, feature_width]``."""
        return self._features(obs)

    def value(self, obs: ObsLike) -> Tensor:
        """State values ``[N]``, with gradients."""
        return self.critic(self._features(obs)).squeeze(-1)

    def evaluate(self, obs: ObsLike, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [M], entropy [M], value [M])`` of stored chains ``actions [M, N + 1, K * A]``.

        All ``M * N`` transitions go through the networks as one batch. The entropy is the
        chain's: ``N(0, I)``'s (a constant) plus every step's diagonal Gaussian's, given the
        stored states.
        """
        feat = self._features(obs)
        logp, entropy = self.chain.score(self._velocity(feat), actions.to(feat.device, feat.dtype))
        return logp, entropy, self.critic(feat).squeeze(-1)

    def flow_matching_loss(self, obs: ObsLike, chunks: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Rectified-flow behaviour cloning on demonstration chunks ``[B, *chunk_shape]`` (env space).

        With ``x_tau = (1 - tau) * noise + tau * target`` (``tau ~ U(0, 1)``, targets normalised
        to ``[-1, 1]``), regress ``v(x_tau, tau, obs)`` onto ``target - noise``: the straight-line
        velocity the Euler sampler integrates. With ``predict="action"`` the network's output
        ``x1_hat`` is regressed onto ``target`` instead (the same loss divided by
        ``(1 - tau)^2``). Trains the velocity network only (the noise head is for RL). Call
        :meth:`update_obs_stats` on the demonstrations first when normalising.
        """
        feat = self._features(obs)
        target = self.normalize_actions(as_tensor(chunks, feat.device).to(feat.dtype))
        return self.chain.flow_matching_loss(self._velocity(feat), target.reshape(-1, *self.chain.shape),
                                             generator or self._generator(feat.device))
