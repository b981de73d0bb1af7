"""A convolutional actor-critic for pixel observations ``{"pixels": uint8 [H, W, C], "state": ...}``.

A NatureCNN-style encoder (three conv layers, then a linear layer) reads the pixels, scaled by
1/255 inside the network so observations stay ``uint8`` until they reach the policy's device.
An optional ``"state"`` vector is normalised by running mean/variance buffers (as in
:class:`~ebrl.policies.MLPPolicy`) and concatenated to the image features. Actor and critic
share the encoder and an MLP trunk; Box actions get a diagonal Gaussian with a
state-independent log-std, Discrete actions a categorical.

Example::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies import CNNPolicy
    >>> obs_space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)})
    >>> policy = CNNPolicy.from_spaces(obs_space, gym.spaces.Box(-3.0, 3.0, (1,)), seed=0)
    >>> out = policy.act({"pixels": np.zeros((2, 32, 32, 3), np.uint8), "state": np.zeros((2, 4), np.float32)})
    >>> out.actions.shape, out.values.shape, bool(np.abs(out.env_actions).max() <= 3.0)
    ((2, 1), (2,), True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.expects import ActionSpec, DType, ObsSpec, PolicySpaces
from ebrl.policies.heads import (
    ActorCriticHeads,
    action_bounds,
    merge_moments,
    register_moments,
)
from ebrl.policies.mlp import _EPS, _OBS_CLIP, _init, _mlp

NATURE_CONV = ((32, 8, 4), (64, 4, 2), (64, 3, 1))  # (out_channels, kernel, stride): 84 px Atari
SMALL_CONV = ((32, 3, 2), (64, 3, 2), (64, 3, 1))  # for images under 36 px


class CNNPolicy(ActorCriticHeads, nn.Module):
    """Actor-critic on ``pixels [N, H, W, C] uint8`` (+ optional ``state [N, state_dim]``).

    ``conv`` lists ``(out_channels, kernel, stride)`` layers; by default the NatureCNN stack for
    images of at least 36 px and a 3x3 stack below. ``feature_dim`` is the image embedding size,
    ``hidden`` the shared trunk after concatenating the state. Give ``act_dim`` (Gaussian, with
    ``env_actions`` clipped to ``[action_low, action_high]``) or ``discrete_actions=n``. ``seed``
    fixes the initial weights and the sampling stream.
    """

    def __init__(self, pixels_shape: Sequence[int], act_dim: int | None = None, *, state_dim: int = 0,
                 discrete_actions: int | None = None, action_low=None, action_high=None,
                 conv: Sequence[tuple[int, int, int]] | None = None, feature_dim: int = 256,
                 hidden: Sequence[int] = (256,), init_log_std: float = 0.0, normalize_state: bool = True,
                 seed: int = 0):
        super().__init__()
        if (act_dim is None) == (discrete_actions is None):
            raise ValueError(f"give exactly one of act_dim (Gaussian) or discrete_actions (categorical), "
                             f"got act_dim={act_dim!r}, discrete_actions={discrete_actions!r}")
        if len(pixels_shape) != 3:
            raise ValueError(f"pixels_shape must be (H, W, C), got {tuple(pixels_shape)}")
        self.pixels_shape = tuple(int(d) for d in pixels_shape)
        h, w, c = self.pixels_shape
        self.state_dim = int(state_dim)
        self.discrete = discrete_actions is not None
        self.act_dim = int(discrete_actions if self.discrete else act_dim)
        self.normalize_state = bool(normalize_state) and self.state_dim > 0
        self.seed = int(seed)
        if conv is None:
            conv = NATURE_CONV if min(h, w) >= 36 else SMALL_CONV

        gen = torch.Generator().manual_seed(self.seed)
        layers: list[nn.Module] = []
        in_ch = c
        for out_ch, kernel, stride in conv:
            layers += [_init(nn.Conv2d(in_ch, out_ch, kernel, stride), math.sqrt(2.0), gen), nn.ReLU()]
            in_ch = out_ch
        layers.append(nn.Flatten())
        conv_stack = nn.Sequential(*layers)
        with torch.no_grad():  # the flattened size for this input size
            try:
                flat = conv_stack(torch.zeros(1, c, h, w)).shape[1]
            except RuntimeError as exc:
                raise ValueError(f"images of {h}x{w} px are too small for conv layers {list(conv)}; "
                                 f"pass a smaller conv= stack") from exc
        self.encoder = nn.Sequential(conv_stack, _init(nn.Linear(flat, feature_dim), math.sqrt(2.0), gen),
                                     nn.ReLU())
        trunk_in = feature_dim + self.state_dim
        self.trunk = _mlp(trunk_in, hidden[:-1], hidden[-1], nn.ReLU, math.sqrt(2.0), gen) if hidden else None
        head_in = hidden[-1] if hidden else trunk_in
        self.actor = _init(nn.Linear(head_in, self.act_dim), 0.01, gen)
        self.critic = _init(nn.Linear(head_in, 1), 1.0, gen)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.full((self.act_dim,), float(init_log_std)))
        self.action_low, self.action_high = action_bounds(action_low, action_high, self.act_dim)
        if self.normalize_state:
            register_moments(self, self.state_dim)
        self._gen = torch.Generator().manual_seed(self.seed)  # not a buffer: never in state_dict

    @classmethod
    def from_spaces(cls, observation_space, action_space, **kw) -> CNNPolicy:
        """Build from a Dict space with ``"pixels"`` (uint8 ``[H, W, C]``) and optional ``"state"``
        (Box) entries, and a 1-D Box or Discrete action space."""
        from gymnasium import spaces

        if not isinstance(observation_space, spaces.Dict) or "pixels" not in observation_space.spaces:
            raise ValueError(f"CNNPolicy needs a Dict observation space with a 'pixels' entry, got {observation_space!r}")
        extra = set(observation_space.spaces) - {"pixels", "state"}
        if extra:
            raise ValueError(f"CNNPolicy reads only 'pixels' and 'state'; the space also has {sorted(extra)}")
        pix = observation_space["pixels"]
        state = observation_space.spaces.get("state")
        kw.setdefault("state_dim", math.prod(state.shape) if state is not None else 0)
        if isinstance(action_space, spaces.Discrete):
            if int(action_space.start) != 0:
                raise ValueError(f"CNNPolicy needs a Discrete action space starting at 0, got {action_space!r}")
            return cls(pix.shape, discrete_actions=int(action_space.n), **kw)
        if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            return cls(pix.shape, int(action_space.shape[0]), action_low=action_space.low,
                       action_high=action_space.high, **kw)
        raise ValueError(f"CNNPolicy supports 1-D Box or Discrete action spaces, got {action_space!r}")

    def expected_spaces(self) -> PolicySpaces:
        """What this policy was built for (``ebrl.run`` checks env 0's spaces against it): Dict
        observations with uint8 ``pixels`` of ``pixels_shape`` (and a ``state`` of ``state_dim``
        elements when it has one); ``Discrete(n)`` or ``Box(act_dim,)`` actions."""
        obs = [ObsSpec(keys=("pixels",), shape=self.pixels_shape, dtype=DType.UINT8)]
        if self.state_dim:
            obs.append(ObsSpec(keys=("state",), size=self.state_dim))
        action = ActionSpec(discrete=self.act_dim) if self.discrete else ActionSpec(shape=(self.act_dim,))
        return PolicySpaces(tuple(obs), action)

    # ---- observations --------------------------------------------------------------------

    @torch.no_grad()
    def update_obs_stats(self, obs: dict) -> None:
        """Merge a batch of ``obs["state"]`` into the running mean/var (parallel Welford)."""
        if not self.normalize_state:
            return
        merge_moments(self.obs_mean, self.obs_var, self.obs_count,
                      torch.as_tensor(obs["state"], device=self.obs_mean.device).reshape(-1, self.state_dim))

    def _features(self, obs: dict) -> Tensor:
        """``[N, head_in]`` features: the encoded pixels, the normalised state, then the trunk."""
        weight = self.actor.weight
        pixels = torch.as_tensor(obs["pixels"]).to(weight.device, non_blocking=True)
        x = pixels.reshape(-1, *self.pixels_shape).permute(0, 3, 1, 2).to(weight.dtype) * (1.0 / 255.0)
        x = self.encoder(x)
        if self.state_dim:
            s = torch.as_tensor(obs["state"]).to(weight.device).reshape(-1, self.state_dim).to(weight.dtype)
            if self.normalize_state:
                s = ((s - self.obs_mean) / torch.sqrt(self.obs_var + _EPS)).clamp(-_OBS_CLIP, _OBS_CLIP)
            x = torch.cat([x, s], -1)
        return torch.relu(self.trunk(x)) if self.trunk is not None else x

    # ---- acting (runtime) ----------------------------------------------------------------

    @torch.no_grad()
    def act(self, obs: dict) -> ActResult:
        """Sample actions for a dict of numpy arrays ``[B, ...]``; numpy out, no autograd."""
        tensors = {}
        for k, v in obs.items():
            v = np.ascontiguousarray(v)
            tensors[k] = torch.from_numpy(v if v.flags.writeable else v.copy())
        return self._sample(self._features(tensors))

    # ---- training (algorithm) ------------------------------------------------------------

    def value(self, obs: dict) -> Tensor:
        """State values ``[N]`` for a dict of tensors ``[N, ...]``, with gradients."""
        return self.critic(self._features(obs)).squeeze(-1)

    def evaluate(self, obs: dict, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [N], entropy [N], value [N])`` of ``actions`` under the current weights."""
        return self._evaluate(self._features(obs), actions)
