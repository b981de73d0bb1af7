"""What a policy was built to read and to emit, and the check against an env's spaces.

A policy says so with ``expected_spaces() -> PolicySpaces`` (the policies of
:mod:`ebrl.policies` and :class:`ebrl.testing.MockPolicy` do); a policy without that method is
not checked. ``ebrl.run`` calls :func:`check_policy_spaces` with env 0's spaces before it
starts anything, so a policy built for other spaces fails at once, with one error naming both
sides, instead of mid-run in a numpy broadcast::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies import MLPPolicy
    >>> box = gym.spaces.Box(-1.0, 1.0, (8,), np.float32)
    >>> check_policy_spaces(MLPPolicy(8, 8), box, box)
    >>> check_policy_spaces(MLPPolicy(8, act_dim=4), box, box)
    Traceback (most recent call last):
    ...
    ebrl.config.ConfigError: policy='MLPPolicy': acts in a Box of shape (4,), but env 0's action space is ...
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
from gymnasium import spaces

from ebrl.config import ConfigError


class DType(enum.StrEnum):
    """The dtype class an input must have (None in an :class:`ObsSpec`: any number)."""

    FLOAT = "float"  # any floating-point dtype
    UINT8 = "uint8"  # images: 0..255, scaled by the policy itself
    CATEGORICAL = "categorical"  # Discrete, MultiDiscrete or MultiBinary entries; size: their one-hot width


@dataclass(frozen=True)
class ObsSpec:
    """One input a policy reads: the observation (a Box), or entries of a Dict observation."""

    # None: the whole observation; else these Dict entries (nested ones by keys joined with "/"), flattened and joined
    keys: tuple[str, ...] | None = None
    size: int | None = None  # elements, flattened; None: not checked
    shape: tuple[int, ...] | None = None  # the exact shape (one entry); None: any shape of `size` elements
    dtype: DType | None = None  # None: any numeric dtype (the policy casts)

    def describe(self) -> str:
        what = "a Box observation" if self.keys is None else f"Dict entries {list(self.keys)}"
        if self.shape is not None:
            what += f" of shape {self.shape}"
        elif self.size is not None:
            what += f" of {self.size} elements (flattened)"
        return what + (f", {self.dtype.value}" if self.dtype is not None else "")


@dataclass(frozen=True)
class ActionSpec:
    """The actions a policy emits: ``Discrete(n)`` from 0, or a Box of one shape."""

    discrete: int | None = None  # n of Discrete(n)
    shape: tuple[int, ...] | None = None  # (A,), or (K, A) for chunks of K actions

    def describe(self) -> str:
        return f"Discrete({self.discrete})" if self.discrete is not None else f"a Box of shape {self.shape}"


@dataclass(frozen=True)
class PolicySpaces:
    """What :meth:`expected_spaces` returns; empty parts are not checked."""

    observation: tuple[ObsSpec, ...] = ()
    action: ActionSpec | None = None


def check_policy_spaces(policy: object, observation_space: spaces.Space, action_space: spaces.Space) -> None:
    """Raise one :class:`~ebrl.config.ConfigError` (field ``policy``) listing every way
    ``policy.expected_spaces()`` disagrees with the env's single-env spaces: observation shape
    or size, dtype class (uint8 images against floats), Box against Discrete, the action shape
    (chunks ``(K, A)`` included). A policy without ``expected_spaces`` passes unchecked."""
    expected = getattr(policy, "expected_spaces", None)
    if not callable(expected):
        return
    want = expected()
    problems = [p for spec in want.observation for p in _observation_problems(spec, observation_space)]
    if want.action is not None:
        problems += _action_problems(want.action, action_space)
    if problems:
        name = type(policy).__name__
        hint = (f" (build the policy from the env's spaces: {name}.from_spaces(observation_space, action_space))"
                if callable(getattr(policy, "from_spaces", None)) else "")
        raise ConfigError("policy", name, "; ".join(problems) + hint)


def _observation_problems(spec: ObsSpec, space: spaces.Space) -> list[str]:
    reads = f"reads {spec.describe()}"
    if spec.keys is None:
        entries, theirs = [space], f"env 0's observation space is {space}"
    else:
        if not isinstance(space, spaces.Dict):
            return [f"{reads}, but env 0's observation space is {space}"]
        found = {k: _entry(space, k) for k in spec.keys}
        missing = [k for k, e in found.items() if e is None]
        if missing:
            return [f"{reads}, but env 0's observation space has no {missing} (it has {_keys(space)})"]
        entries, theirs = list(found.values()), f"env 0's are {found}"
    if spec.dtype is DType.CATEGORICAL:
        fits = all(isinstance(e, _CATEGORICAL) for e in entries) and (
            spec.size is None or sum(_one_hot_width(e) for e in entries) == spec.size)
        return [] if fits else [f"{reads}, but {theirs}"]
    if not all(isinstance(e, spaces.Box) for e in entries):
        return [f"{reads}, but {theirs}"]
    return _array_problems(spec, entries, reads, theirs)


_CATEGORICAL = (spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _one_hot_width(space: spaces.Space) -> int:
    if isinstance(space, spaces.Discrete):
        return int(space.n)
    if isinstance(space, spaces.MultiDiscrete):
        return int(np.sum(space.nvec))
    return math.prod(space.shape)


def _entry(space: spaces.Dict, key: str) -> spaces.Space | None:
    """The entry ``key`` names: a key of ``space``, or a path through nested Dicts joined by "/"."""
    if key in space.spaces:
        return space.spaces[key]
    head, sep, rest = key.partition("/")
    while sep:
        sub = space.spaces.get(head)
        if isinstance(sub, spaces.Dict):
            found = _entry(sub, rest)
            if found is not None:
                return found
        more, sep, rest = rest.partition("/")
        head = f"{head}/{more}"
    return None


def _keys(space: spaces.Space, prefix: str = "") -> list[str]:
    """Every leaf's key, nested ones joined by "/"."""
    if not isinstance(space, spaces.Dict):
        return [prefix]
    return [k for key, sub in space.spaces.items() for k in _keys(sub, f"{prefix}{key}" if not prefix
                                                                  else f"{prefix}/{key}")]


def _array_problems(spec: ObsSpec, boxes: list[spaces.Box], reads: str, theirs: str) -> list[str]:
    if spec.shape is not None:
        fits = len(boxes) == 1 and tuple(boxes[0].shape) == spec.shape
    else:
        fits = spec.size is None or sum(math.prod(b.shape) for b in boxes) == spec.size
    dtypes = [np.dtype(b.dtype) for b in boxes]
    if spec.dtype is DType.UINT8:
        fits = fits and all(d == np.uint8 for d in dtypes)
    elif spec.dtype is DType.FLOAT:
        fits = fits and all(np.issubdtype(d, np.floating) for d in dtypes)
    return [] if fits else [f"{reads}, but {theirs}"]


def _action_problems(spec: ActionSpec, space: spaces.Space) -> list[str]:
    if spec.discrete is not None:
        ok = isinstance(space, spaces.Discrete) and int(space.n) == spec.discrete and int(space.start) == 0
    else:
        ok = isinstance(space, spaces.Box) and tuple(space.shape) == spec.shape
    return [] if ok else [f"acts in {spec.describe()}, but env 0's action space is {space}"]
