"""A convolutional actor-critic for observations with images: any number of cameras, and vectors beside them.

The observation is read by :class:`~ebrl.policies.encoders.ObsEncoder`: every image entry (a
``uint8`` Box ``(H, W, C)`` or ``(C, H, W)``, any key, nested dicts included) gets its own
NatureCNN-style encoder (three conv layers, then a linear layer), scaled by 1/255 inside the
network so observations stay ``uint8`` until they reach the policy's device; every other Box is
flattened, normalised by running mean/variance buffers (as in :class:`~ebrl.policies.MLPPolicy`)
and concatenated to the image features, Discrete and MultiBinary entries one-hot. Actor and
critic share the encoders and an MLP trunk; Box actions get a diagonal Gaussian with a
state-independent log-std (``action_head="squashed"``: SAC's tanh Gaussian, :mod:`ebrl.policies.heads`),
Discrete actions a categorical.

Example::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies import CNNPolicy
    >>> obs_space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)})
    >>> policy = CNNPolicy.from_spaces(obs_space, gym.spaces.Box(-3.0, 3.0, (1,)), seed=0)
    >>> out = policy.act({"pixels": np.zeros((2, 32, 32, 3), np.uint8), "state": np.zeros((2, 4), np.float32)})
    >>> out.actions.shape, out.values.shape, bool(np.abs(out.env_actions).max() <= 3.0)
    ((2, 1), (2,), True)

Any other names work alike, e.g. a LeRobot-style dict with two cameras, channels first::

    >>> lerobot = gym.spaces.Dict({"observation.images.top": gym.spaces.Box(0, 255, (3, 24, 24), np.uint8),
    ...                            "observation.images.wrist": gym.spaces.Box(0, 255, (3, 24, 24), np.uint8),
    ...                            "observation.state": gym.spaces.Box(-1, 1, (6,), np.float32)})
    >>> policy = CNNPolicy.from_spaces(lerobot, gym.spaces.Box(-1, 1, (2,)), feature_dim=64)
    >>> [(d["key"], d["as"]) for d in policy.describe_inputs()]
    [('observation.images.top', 'image'), ('observation.images.wrist', 'image'), ('observation.state', 'vector')]
    >>> policy.obs_encoder.out_dim  # 64 features per camera, then the state
    134
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import ObsEncoder, ObsEntry, ObsLayout, Read, ReadsObservations
from ebrl.policies.expects import ActionSpec, PolicySpaces
from ebrl.policies.heads import ActorCriticHeads, action_bounds, head_outputs
from ebrl.policies.mlp import _init, _mlp

NATURE_CONV = ((32, 8, 4), (64, 4, 2), (64, 3, 1))  # (out_channels, kernel, stride): 84 px Atari
SMALL_CONV = ((32, 3, 2), (64, 3, 2), (64, 3, 1))  # for images under 36 px


def image_cnn(entry: ObsEntry, conv: Sequence[Sequence[int]] | None, feature_dim: int,
              gen: torch.Generator) -> nn.Sequential:
    """One camera's encoder, ``[N, C, H, W] -> [N, feature_dim]``: conv layers ``(out_channels,
    kernel, stride)`` with ReLUs (NatureCNN's from 36 px, a 3x3 stack below), flattened, then a
    linear layer and a ReLU; orthogonal init from ``gen``."""
    c, h, w = entry.chw
    if conv is None:
        conv = NATURE_CONV if min(h, w) >= 36 else SMALL_CONV
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
            raise ValueError(f"images of {h}x{w} px ({entry.name}) are too small for conv layers "
                             f"{[tuple(layer) for layer in conv]}; pass a smaller conv= stack") from exc
    return nn.Sequential(conv_stack, _init(nn.Linear(flat, feature_dim), math.sqrt(2.0), gen), nn.ReLU())


class CNNPolicy(ReadsObservations, ActorCriticHeads, nn.Module):
    """Actor-critic on observations with images (:mod:`ebrl.policies.encoders` finds them).

    ``from_spaces`` builds it for any observation space with at least one image; ``image_keys``
    and ``state_keys`` choose the entries. Built directly, ``pixels_shape`` ``(H, W, C)`` and
    ``state_dim`` describe a ``{"pixels", "state"}`` observation, or ``obs_layout`` (an
    :class:`~ebrl.policies.encoders.ObsLayout`) any other. ``conv`` lists ``(out_channels, kernel,
    stride)`` layers; by default the NatureCNN stack for images of at least 36 px and a 3x3 stack
    below. ``feature_dim`` is each camera's embedding size, ``hidden`` the shared trunk after
    concatenating the vectors. Give ``act_dim`` (Gaussian, with ``env_actions`` clipped to
    ``[action_low, action_high]``; ``action_head="squashed"`` for SAC's tanh Gaussian) or
    ``discrete_actions=n``. ``seed`` fixes the initial weights
    and the sampling stream.
    """

    def __init__(self, pixels_shape: Sequence[int] | None = None, act_dim: int | None = None, *, state_dim: int = 0,
                 obs_layout: ObsLayout | Sequence[dict[str, Any]] | None = None,
                 discrete_actions: int | None = None, action_low=None, action_high=None,
                 conv: Sequence[tuple[int, int, int]] | None = None, feature_dim: int = 256,
                 hidden: Sequence[int] = (256,), init_log_std: float = 0.0, normalize_state: bool = True,
                 action_head: str = "gaussian", seed: int = 0):
        super().__init__()
        if (act_dim is None) == (discrete_actions is None):
            raise ValueError(f"give exactly one of act_dim (Gaussian) or discrete_actions (categorical), "
                             f"got act_dim={act_dim!r}, discrete_actions={discrete_actions!r}")
        if (pixels_shape is None) == (obs_layout is None):
            raise ValueError("give exactly one of pixels_shape (a {'pixels', 'state'} observation) or obs_layout")
        if obs_layout is None:
            if len(pixels_shape) != 3:
                raise ValueError(f"pixels_shape must be (H, W, C), got {tuple(pixels_shape)}")
            pixels = ObsEntry(("pixels",), Read.IMAGE, tuple(int(d) for d in pixels_shape), "uint8")
            layout = ObsLayout(images=(pixels,),
                               vectors=(ObsEntry(("state",), Read.VECTOR, (int(state_dim),)),) if state_dim else ())
        else:
            layout = ObsLayout.from_config(obs_layout)
        if not layout.images:
            raise ValueError("CNNPolicy needs an image entry; use MLPPolicy for observations without images")
        self.discrete = discrete_actions is not None
        self.act_dim = int(discrete_actions if self.discrete else act_dim)
        self.seed = int(seed)

        gen = torch.Generator().manual_seed(self.seed)
        # first: the camera encoders draw their initial weights before the trunk and heads
        self.obs_encoder = ObsEncoder(layout, image_net=lambda e: image_cnn(e, conv, feature_dim, gen),
                                      normalize=normalize_state, owner="CNNPolicy")
        self.normalize_state = self.obs_encoder.normalize
        trunk_in = self.obs_encoder.out_dim
        self.trunk = _mlp(trunk_in, hidden[:-1], hidden[-1], nn.ReLU, math.sqrt(2.0), gen) if hidden else None
        head_in = hidden[-1] if hidden else trunk_in
        outputs = head_outputs(action_head, self.discrete, self.act_dim)
        self.actor = _init(nn.Linear(head_in, outputs), 0.01, gen)
        self.critic = _init(nn.Linear(head_in, 1), 1.0, gen)
        self.action_low, self.action_high = action_bounds(action_low, action_high, self.act_dim)
        self._init_head(action_head, init_log_std)  # log_std, or the squashed head's scale
        self._start_sampling()

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, image_keys: Sequence[str] | None = None,
                    state_keys: Sequence[str] | None = None, **kw) -> CNNPolicy:
        """Build from an observation space with at least one image (see :mod:`ebrl.policies.encoders`;
        ``image_keys``/``state_keys`` choose the entries) and a 1-D Box or Discrete action space."""
        from gymnasium import spaces

        layout = ObsLayout.from_space(observation_space, image_keys=image_keys, state_keys=state_keys)
        if not layout.images:
            raise ValueError(f"CNNPolicy needs an image entry (a uint8 Box (H, W, C) or (C, H, W)), and "
                             f"{observation_space} has none: name float images in image_keys=[...], or use "
                             "MLPPolicy (policy.kind=mlp)")
        if isinstance(action_space, spaces.Discrete):
            if int(action_space.start) != 0:
                raise ValueError(f"CNNPolicy needs a Discrete action space starting at 0, got {action_space!r}")
            return cls(discrete_actions=int(action_space.n), obs_layout=layout, **kw)
        if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            return cls(None, int(action_space.shape[0]), obs_layout=layout, action_low=action_space.low,
                       action_high=action_space.high, **kw)
        raise ValueError(f"CNNPolicy supports 1-D Box or Discrete action spaces, got {action_space!r}")

    def expected_spaces(self) -> PolicySpaces:
        """What this policy was built for (``ebrl.run`` checks env 0's spaces against it): the
        entries of its layout (uint8 images of their shapes, vectors of their sizes);
        ``Discrete(n)`` or ``Box(act_dim,)`` actions."""
        action = ActionSpec(discrete=self.act_dim) if self.discrete else ActionSpec(shape=(self.act_dim,))
        return PolicySpaces(self.obs_layout.expected(), action)

    # ---- observations --------------------------------------------------------------------

    def _features(self, obs: Any) -> Tensor:
        """``[N, head_in]`` features: the encoded cameras, the normalised vectors, then the trunk."""
        x = self.obs_encoder(obs, self.actor.weight)
        return torch.relu(self.trunk(x)) if self.trunk is not None else x

    # ---- acting (runtime) ----------------------------------------------------------------

    @torch.no_grad()
    def act(self, obs: Any) -> ActResult:
        """Sample actions for a batch of observations (numpy arrays ``[B, ...]``, nested dicts or
        keys joined by ``/``); numpy out, no autograd."""
        return self._sample(self._features(obs))

    # ---- training (algorithm) ------------------------------------------------------------

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]`` for a dict of tensors ``[N, ...]``, with gradients."""
        return self.critic(self._features(obs)).squeeze(-1)

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [N], entropy [N], value [N])`` of ``actions`` under the current weights."""
        return self._evaluate(self._features(obs), actions)

