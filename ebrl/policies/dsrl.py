"""DSRL: steer a frozen flow policy through the noise it denoises from (Wagenmaker et al. 2025,
"Steering Your Diffusion Policy with Latent Space Reinforcement Learning", https://arxiv.org/abs/2506.15799).

The flow policy (:class:`~ebrl.policies.flow.FlowPolicy`, π0 or SmolVLA) stays as it was
trained: frozen, in eval mode, run forward only, its chain the plain ODE (``method="ode"``), so
the chunk the env executes is a deterministic function of the observation and the initial
noise ``x_0``. A small actor picks ``x_0``'s executed block (the chunk's first ``execute``
actions and the env's action dims; the rest of ``x_0`` is 0, the prior's mode) from the flow
policy's own features of the observation, inside ``[-noise_bound, noise_bound]``. To an RL
algorithm the noise is the action: :class:`~ebrl.algos.SAC` trains the actor and its critics in
that space, with no gradient through the flow policy, whose weights stay bit for bit as they were.

The actor is an :class:`~ebrl.policies.MLPPolicy` with SAC's squashed head; what the runtime
publishes after an update is its weights alone (kilobytes, whatever the VLA's size). Each
decision costs one forward pass of the flow policy, and each SAC gradient step one more of its
observation features for the minibatch (``features``).

    >>> import numpy as np, torch
    >>> from ebrl.policies import FlowPolicy
    >>> from ebrl.policies.dsrl import DSRLPolicy
    >>> flow = FlowPolicy(3, (4, 2), -1.0, 1.0, seed=0)
    >>> policy = DSRLPolicy(flow, noise_bound=1.0, hidden=(32, 32))
    >>> out = policy.act(np.zeros((5, 3), np.float32))
    >>> out.actions.shape, out.env_actions.shape, policy.act_dim  # the noise, the chunk the env runs
    ((5, 8), (5, 4, 2), 8)
    >>> again = flow.act(np.zeros((5, 3), np.float32), noise=torch.as_tensor(out.actions).reshape(5, 4, 2))
    >>> bool(np.allclose(again.env_actions, out.env_actions))  # a deterministic function of the noise
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.mlp import MLPPolicy


class DSRLPolicy(nn.Module):
    """A frozen flow policy ``base`` and the actor steering its initial noise (module docstring)."""

    action_head = "squashed"
    squashed = True

    def __init__(self, base: nn.Module, *, noise_bound: float = 1.0, hidden: Sequence[int] = (256, 256),
                 seed: int = 0):
        super().__init__()
        missing = [a for a in ("chain", "value_features", "feature_width") if not hasattr(base, a)]
        if missing:
            raise ValueError(f"DSRLPolicy steers a flow policy (FlowPolicy, PI0Policy, SmolVLAPolicy); "
                             f"{type(base).__name__} has no {', '.join(missing)}")
        if not noise_bound > 0:
            raise ValueError(f"noise_bound={noise_bound!r} must be > 0")
        base.method = "ode"  # the env sees a deterministic function of the noise
        base.requires_grad_(False)
        base.eval()
        self.base = base
        self.noise_shape = tuple(base.chain.shape)
        self.block = tuple(base.chain.block)
        self.act_dim = self.block[0] * self.block[1]
        self.noise_bound = float(noise_bound)
        self.steer = MLPPolicy(int(base.feature_width), self.act_dim, hidden=hidden, action_head="squashed",
                               action_low=-self.noise_bound, action_high=self.noise_bound, normalize_obs=False,
                               activation="relu", seed=seed)

    def train(self, mode: bool = True) -> DSRLPolicy:
        """Only the steering actor changes mode: the flow policy stays in eval mode."""
        self.training = mode
        self.steer.train(mode)
        return self

    # ---- what the runtime and the evaluation read ----------------------------------------------

    @property
    def deterministic(self) -> bool:
        return self.steer.deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self.steer.deterministic = value  # the mode: tanh of the actor's mean

    def expected_spaces(self):
        return self.base.expected_spaces()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("obs_layout", "chunk_shape", "execute", "instructions"):  # what the base was built for
                return getattr(super().__getattr__("base"), name)
            raise

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What a publication carries: the steering actor's tensors (the flow policy never changes)."""
        return {f"steer.{k}": v for k, v in self.steer.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        self.steer.load_state_dict({k.removeprefix("steer."): v for k, v in state.items()})

    # ---- what SAC reads ---------------------------------------------------------------------------

    @property
    def action_scale(self) -> Tensor:
        return self.steer.action_scale

    @property
    def action_bias(self) -> Tensor:
        return self.steer.action_bias

    @torch.no_grad()
    def _base_features(self, obs: Any) -> Tensor:
        return self.base.value_features(obs).float()

    def features(self, obs: Any) -> Tensor:
        """``[N, feature_width]``: the flow policy's features of ``obs``, without gradients."""
        return self.steer.features(self._base_features(obs))

    def rsample(self, features: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        return self.steer.rsample(features, generator)

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob, entropy, value)`` of noise ``actions`` under the steering actor."""
        return self.steer.evaluate(self._base_features(obs), actions)

    # ---- acting ---------------------------------------------------------------------------------

    def noise(self, steer: np.ndarray | Tensor) -> Tensor:
        """The flow's ``x_0 [B, K, A]`` for steering actions ``[B, act_dim]``: the block, zeros elsewhere."""
        steer = torch.as_tensor(np.asarray(steer, np.float32))
        x0 = torch.zeros(steer.shape[0], *self.noise_shape)
        x0[:, :self.block[0], :self.block[1]] = steer.reshape(-1, *self.block)
        return x0

    @torch.no_grad()
    def act(self, obs: Any) -> ActResult:
        """``actions``: the noise block the actor chose (what SAC stores); ``env_actions``: the chunk
        the flow policy denoises from it."""
        steer = self.steer.act(self._base_features(obs).cpu().numpy())
        chunk = self.base.act(obs, noise=self.noise(steer.actions))
        return ActResult(actions=steer.actions, env_actions=chunk.env_actions, logprobs=steer.logprobs,
                         values=steer.values)
