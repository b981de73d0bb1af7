"""An MLP actor-critic for flat (or flattened) observations, CleanRL ``ppo_continuous_action`` style.

Box actions get a diagonal Gaussian with a state-independent log-std parameter (with
``action_head="squashed"``, SAC's tanh Gaussian with a state-dependent std, :mod:`ebrl.policies.heads`);
Discrete actions a categorical. Observations are normalised by a running mean/variance kept in *buffers*, so the
statistics travel with ``state_dict`` to the runtime's inference copy. A Box observation is
flattened whole; a Dict of vectors (nested ones too) is read by
:class:`~ebrl.policies.encoders.ObsEncoder`: Box entries flattened and concatenated, Discrete and
MultiBinary entries one-hot. Images need :class:`~ebrl.policies.CNNPolicy`.

Example::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies import MLPPolicy
    >>> obs_space = gym.spaces.Box(-1.0, 1.0, (3,))
    >>> act_space = gym.spaces.Box(-2.0, 2.0, (2,))
    >>> policy = MLPPolicy.from_spaces(obs_space, act_space, seed=0)
    >>> out = policy.act(np.zeros((4, 3), np.float32))
    >>> out.actions.shape, bool(out.env_actions.max() <= 2.0), out.logprobs.dtype
    ((4, 2), True, dtype('float32'))
    >>> goals = gym.spaces.Dict({"observation": gym.spaces.Box(-1, 1, (10,)),
    ...                          "desired_goal": gym.spaces.Box(-1, 1, (3,))})
    >>> MLPPolicy.from_spaces(goals, act_space).obs_dim  # a Fetch task's dict, without flattening it first
    13

SAC's actor, the squashed head: samples inside the bounds, differentiable through ``rsample``::

    >>> import torch
    >>> policy = MLPPolicy.from_spaces(obs_space, act_space, action_head="squashed", seed=0)
    >>> a, logp = policy.rsample(policy.features(torch.zeros(5, 3)))
    >>> a.shape, logp.shape, bool(a.abs().max() < 2.0)
    (torch.Size([5, 2]), torch.Size([5]), True)
    >>> lp, _, _ = policy.evaluate(torch.zeros(5, 3), a.detach())  # the same density, read back
    >>> bool(torch.allclose(lp, logp, atol=1e-3))
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import EPS, OBS_CLIP, ObsEncoder, ObsLayout, ReadsObservations
from ebrl.policies.expects import ActionSpec, PolicySpaces
from ebrl.policies.heads import LOG_SQRT_2PI, LOG_STD_MAX, LOG_STD_MIN, ActorCriticHeads, action_bounds, head_outputs

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU}
_NP_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda h: np.maximum(h, 0.0)}


def _mlp(in_dim: int, hidden: Sequence[int], out_dim: int, act: type[nn.Module], out_gain: float,
         gen: torch.Generator) -> nn.Sequential:
    """Linear layers with orthogonal init: gain sqrt(2) on hidden layers, ``out_gain`` on the output."""
    layers: list[nn.Module] = []
    dims = [in_dim, *hidden]
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        layers += [_init(nn.Linear(d_in, d_out), math.sqrt(2.0), gen), act()]
    layers.append(_init(nn.Linear(dims[-1], out_dim), out_gain, gen))
    return nn.Sequential(*layers)


def _init(layer: nn.Linear, gain: float, gen: torch.Generator) -> nn.Linear:
    # on one thread: the orthogonal init's QR (LAPACK) rounds differently on two threads than on
    # one, so the "same seed" gave other initial weights wherever torch had another thread count
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nn.init.orthogonal_(layer.weight, gain, generator=gen)
    finally:
        torch.set_num_threads(old)
    nn.init.zeros_(layer.bias)
    return layer


class MLPPolicy(ReadsObservations, ActorCriticHeads, nn.Module):
    """Separate actor and critic MLPs on (normalised) flat observations.

    ``obs_dim`` elements of a Box of ``obs_shape``, or of the vector entries of ``obs_layout``
    (an :class:`~ebrl.policies.encoders.ObsLayout` without images; ``from_spaces`` builds it for
    Dict observations). Give ``act_dim`` for a Gaussian policy over ``R^act_dim`` (``env_actions`` clipped to
    ``[action_low, action_high]`` when given; ``action_head="squashed"``: inside them by a tanh,
    for SAC), or ``discrete_actions=n`` for a categorical policy over ``{0..n-1}``. ``seed`` fixes both the initial weights and the sampling stream:
    two policies built with the same arguments act identically on identical inputs.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int | None = None,
        *,
        hidden: Sequence[int] = (64, 64),
        activation: str = "tanh",
        discrete_actions: int | None = None,
        action_low=None,
        action_high=None,
        init_log_std: float = 0.0,
        action_head: str = "gaussian",
        normalize_obs: bool = True,
        seed: int = 0,
        obs_shape: Sequence[int] | None = None,
        obs_layout: ObsLayout | Sequence[dict] | None = None,
        inference: str = "auto",
    ):
        super().__init__()
        if (act_dim is None) == (discrete_actions is None):
            raise ValueError(
                f"give exactly one of act_dim (Gaussian) or discrete_actions (categorical), "
                f"got act_dim={act_dim!r}, discrete_actions={discrete_actions!r}"
            )
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {sorted(_ACTIVATIONS)}")
        if inference not in ("auto", "torch", "numpy"):
            raise ValueError(f"inference={inference!r} must be 'auto', 'torch' or 'numpy'")
        if inference == "numpy" and activation not in _NP_ACTIVATIONS:
            raise ValueError(f"inference='numpy' supports activations {sorted(_NP_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.inference = inference
        self.obs_shape = tuple(obs_shape) if obs_shape is not None else (int(obs_dim),)
        if obs_layout is None and math.prod(self.obs_shape) != obs_dim:
            raise ValueError(f"obs_shape={self.obs_shape} does not flatten to obs_dim={obs_dim}")
        layout = ObsLayout.vector(self.obs_shape) if obs_layout is None else ObsLayout.from_config(obs_layout)
        if layout.flat_dim != obs_dim and not layout.images:
            raise ValueError(f"obs_layout reads {layout.flat_dim} elements, not obs_dim={obs_dim}")
        self.obs_dim = int(obs_dim)
        self.discrete = discrete_actions is not None
        self.act_dim = int(discrete_actions if self.discrete else act_dim)
        self.normalize_obs = bool(normalize_obs)
        self.seed = int(seed)

        self.obs_encoder = ObsEncoder(layout, normalize=normalize_obs, owner="MLPPolicy")  # no weights: no draws
        init_gen = torch.Generator().manual_seed(self.seed)
        act = _ACTIVATIONS[activation]
        self.critic = _mlp(self.obs_dim, hidden, 1, act, 1.0, init_gen)
        outputs = head_outputs(action_head, self.discrete, self.act_dim)
        self.actor = _mlp(self.obs_dim, hidden, outputs, act, 0.01, init_gen)
        self.action_low, self.action_high = action_bounds(action_low, action_high, self.act_dim)
        self._init_head(action_head, init_log_std)  # log_std, or the squashed head's scale

        # Plain attributes (not buffers), so they never enter state_dict.
        self._start_sampling()
        self._np_rng = np.random.default_rng(self.seed)
        self._np_cache: tuple | None = None  # numpy mirror of the weights for CPU inference
        self._np_versions: tuple | None = None
        self._np_tensors: list | None = None

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, state_keys: Sequence[str] | None = None,
                    **kw) -> MLPPolicy:
        """Build from gymnasium spaces: a Box observation of any shape (flattened), or a Dict of
        vectors (``state_keys`` chooses them; see :mod:`ebrl.policies.encoders`); 1-D Box or
        Discrete actions."""
        from gymnasium import spaces

        if isinstance(observation_space, spaces.Box):
            layout = ObsLayout.vector(observation_space.shape)  # read whole, images too
        else:
            # it has no image encoder: cameras are refused by name unless state_keys chose the entries
            layout = ObsLayout.from_space(observation_space, state_keys=state_keys,
                                          image_keys=() if state_keys is not None else None)
        shape = {"obs_shape": tuple(observation_space.shape)} if isinstance(observation_space, spaces.Box) else {}
        if isinstance(action_space, spaces.Discrete):
            if int(action_space.start) != 0:
                raise ValueError(f"MLPPolicy needs a Discrete action space starting at 0, got {action_space!r}")
            return cls(layout.flat_dim, discrete_actions=int(action_space.n), obs_layout=layout, **shape, **kw)
        if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            return cls(layout.flat_dim, int(action_space.shape[0]), obs_layout=layout, **shape,
                       action_low=action_space.low, action_high=action_space.high, **kw)
        raise ValueError(
            f"MLPPolicy supports 1-D Box or Discrete action spaces, got {action_space!r}"
        )

    def expected_spaces(self) -> PolicySpaces:
        """What this policy was built for (``ebrl.run`` checks env 0's spaces against it): Box
        observations of ``obs_dim`` elements, any shape and number dtype (they are flattened and
        cast), or the entries of its layout; ``Discrete(n)`` or ``Box(act_dim,)`` actions."""
        action = ActionSpec(discrete=self.act_dim) if self.discrete else ActionSpec(shape=(self.act_dim,))
        return PolicySpaces(self.obs_layout.expected(), action)

    # ---- observation normalisation -------------------------------------------------------

    def _features(self, obs: Any) -> Tensor:
        """``[N, obs_dim]`` float: flattened (and joined) and normalised (clipped to [-10, 10])."""
        return self.obs_encoder.vector(obs, self.critic[0].weight)

    # ---- acting (runtime) ----------------------------------------------------------------

    def _use_numpy(self) -> bool:
        if self.inference == "auto":
            return (self.activation in _NP_ACTIVATIONS and self.critic[0].weight.device.type == "cpu"
                    and self.critic[0].weight.dtype == torch.float32 and not self.obs_layout.categorical)
        return self.inference == "numpy"

    def _numpy_weights(self) -> tuple:
        """The weights as numpy arrays, rebuilt whenever any tensor was modified in place
        (optimiser steps and ``load_state_dict`` bump torch's per-tensor version counters)."""
        # the tensor list is taken once: walking the module tree costs more than the forward pass
        # itself at small batches (load_state_dict and optimisers write in place, keeping identity)
        tensors = self._np_tensors
        if tensors is None:
            tensors = self._np_tensors = [*self.parameters(), *self.buffers()]
        versions = tuple(t._version for t in tensors)
        if self._np_cache is None or versions != self._np_versions:
            def layers(seq):
                return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy())
                        for m in seq if isinstance(m, nn.Linear)]

            norm, enc = None, self.obs_encoder
            if enc.normalize:
                norm = (enc.obs_mean.numpy().astype(np.float32),
                        (1.0 / np.sqrt(enc.obs_var.numpy() + EPS)).astype(np.float32))
            log_std = None if self.discrete or self.squashed else self.log_std.detach().numpy().copy()
            self._np_cache = (layers(self.actor), layers(self.critic), norm, log_std)
            self._np_versions = versions
        return self._np_cache

    def _act_numpy(self, obs: np.ndarray) -> ActResult:
        """The same distribution as the torch path, in numpy: for small CPU batches a policy
        call costs ~25 us instead of ~250 us, and holds the GIL once instead of per torch op."""
        actor, critic, norm, log_std = self._numpy_weights()
        f = _NP_ACTIVATIONS[self.activation]
        x = self.obs_encoder.vector_numpy(obs)
        if norm is not None:
            x = np.clip((x - norm[0]) * norm[1], -OBS_CLIP, OBS_CLIP)

        def mlp(layers, h):
            for w, b in layers[:-1]:
                h = f(h @ w + b)
            w, b = layers[-1]
            return h @ w + b

        values = mlp(critic, x)[:, 0]
        out = mlp(actor, x)
        if self.discrete:
            z = out - out.max(1, keepdims=True)
            logp_all = z - np.log(np.exp(z).sum(1, keepdims=True))
            cdf = np.cumsum(np.exp(logp_all), 1)
            if self.deterministic:
                actions = logp_all.argmax(1).astype(np.int64)
            else:
                u = self._np_rng.random((len(x), 1), dtype=np.float32) * cdf[:, -1:]
                actions = np.minimum((u > cdf).sum(1), self.act_dim - 1).astype(np.int64)
            logp = np.take_along_axis(logp_all, actions[:, None], 1)[:, 0]
            env_actions = actions
        elif self.squashed:
            actions, logp = self._squashed_numpy(out)
            env_actions = actions if self.action_low is None else np.clip(actions, self.action_low, self.action_high)
        else:
            noise = (np.zeros(out.shape, np.float32) if self.deterministic
                     else self._np_rng.standard_normal(out.shape, dtype=np.float32))
            actions = out + noise * np.exp(log_std)
            logp = (-0.5 * noise * noise - log_std - LOG_SQRT_2PI).sum(1, dtype=np.float32)
            env_actions = actions
            if self.action_low is not None or self.action_high is not None:
                env_actions = np.clip(actions, self.action_low, self.action_high)
        return ActResult(actions=actions, env_actions=env_actions,
                         logprobs=logp.astype(np.float32), values=values.astype(np.float32))

    def _squashed_numpy(self, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The squashed head (:mod:`ebrl.policies.heads`) in numpy: ``(actions, logprob)``."""
        mu, raw = np.split(out, 2, axis=1)
        log_std = LOG_STD_MIN + (LOG_STD_MAX - LOG_STD_MIN) / (1.0 + np.exp(-(raw + self._log_std_shift)))
        noise = (np.zeros(mu.shape, np.float32) if self.deterministic
                 else self._np_rng.standard_normal(mu.shape, dtype=np.float32))
        u = mu + noise * np.exp(log_std)
        scale, bias = self.action_scale.numpy(), self.action_bias.numpy()
        log_jac = (np.log(scale) + 2.0 * (math.log(2.0) - u - np.logaddexp(0.0, -2.0 * u))).sum(1)
        logp = (-0.5 * noise * noise - log_std - LOG_SQRT_2PI).sum(1) - log_jac
        return (bias + scale * np.tanh(u)).astype(np.float32), logp.astype(np.float32)

    @torch.no_grad()
    def act(self, obs: Any) -> ActResult:
        """Sample actions for ``obs [B, *obs_shape]`` (or a dict of such arrays); numpy in, numpy
        out, no autograd.

        On the CPU (``inference="auto"``) this runs a numpy mirror of the weights; elsewhere torch.
        """
        if self._use_numpy():
            return self._act_numpy(obs)
        return self._sample(self._features(obs))

    # ---- training (algorithm) ------------------------------------------------------------

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]`` for ``obs [N, *obs_shape]``, with gradients."""
        return self.critic(self._features(obs)).squeeze(-1)

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [N], entropy [N], value [N])`` of ``actions`` under the current weights."""
        return self._evaluate(self._features(obs), actions)
