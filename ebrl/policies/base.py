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
