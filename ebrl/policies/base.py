"""The policy contract between the runtime and the algorithms.

The runtime only ever calls :meth:`Policy.act` (on the generator's inference copy)
and moves weights with ``state_dict``/``load_state_dict``. Algorithms call
:meth:`Policy.evaluate` and :meth:`Policy.value` with gradients on the learner's copy.
A policy may also say which spaces it was built for, ``expected_spaces()``
(:mod:`ebrl.policies.expects`): ``ebrl.run`` then checks env 0's spaces against it before it
starts anything. ``describe_inputs()`` (the policies here: :mod:`ebrl.policies.encoders`) lists
the observation entries it reads, which ``ebrl.run`` logs as ``policy_inputs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@dataclass
class ActResult:
    """One batch of actions, numpy arrays with the batch first.

    ``actions`` are what the log-probs refer to (stored for training);
    ``env_actions`` are what the simulator receives (e.g. clipped to the Box bounds).
    """

    actions: np.ndarray
    env_actions: np.ndarray
    logprobs: np.ndarray  # [B] float32
    values: np.ndarray  # [B] float32


@runtime_checkable
class Policy(Protocol):
    """What the runtime needs from a policy (a ``torch.nn.Module`` in practice)."""

    def act(self, obs: np.ndarray) -> ActResult:
        """Sample actions for a batch of observations ``[B, *obs_shape]`` without gradients."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, strict: bool = True): ...


class SeededSampling:
    """A policy's sampling stream ``_gen``, seeded by ``seed``: a plain attribute (never in a
    ``state_dict``) that restarts from the seed on whatever device the policy's tensors move to."""

    seed: int
    _gen: torch.Generator

    def _start_sampling(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._gen.device != device:  # moved to another device: restart the stream there
            self._gen = torch.Generator(device).manual_seed(self.seed)
        return self._gen


# ------------------------------------------------------------------ what weight publication moves
#
# A policy with a frozen part (a pretrained backbone under LoRA) says which tensors train with
# ``trainable_state_dict()`` / ``load_trainable_state_dict(state)``; the generator's copy then
# shares the frozen part. Publication moves only what trains, and the frozen part is loaded once
# per process. Other policies publish their whole state_dict.


def critic_parameters(policy) -> list:
    """The trainable parameters of a policy's value head (named ``critic*`` or ``value*``): what
    SFT's value pass fits and what PPO's critic warm-up trains alone."""
    return [p for n, p in policy.named_parameters() if p.requires_grad and n.startswith(("critic", "value"))]


def published_state(policy) -> dict:
    """The tensors a weight publication carries: the trainable ones where the policy names them."""
    trainable = getattr(policy, "trainable_state_dict", None)
    return trainable() if callable(trainable) else policy.state_dict()


def load_published(policy, state: dict) -> None:
    """Load what :func:`published_state` gave (on the acting copy, or back on the training copy)."""
    load = getattr(policy, "load_trainable_state_dict", None)
    if callable(load):
        load(state)
    else:
        policy.load_state_dict(state)


def acting_copy(policy):
    """The generator's copy of the policy: a deep copy that, for a policy naming its trainable
    tensors, shares the frozen parameters (they never change, so one copy of a pretrained
    backbone serves both)."""
    import copy

    memo: dict = {}
    if callable(getattr(policy, "trainable_state_dict", None)) and hasattr(policy, "parameters"):
        memo = {id(p): p for p in policy.parameters() if not p.requires_grad}  # deepcopy hands these back as they are
    return copy.deepcopy(policy, memo)


def state_nbytes(state: dict) -> int:
    """Bytes of a state dict's tensors (what one publication moves)."""
    return int(sum(v.numel() * v.element_size() for v in state.values() if hasattr(v, "element_size")))
