"""One schema of a transition's per-step fields, from the env's spaces (:func:`transition_fields`).

A :class:`Field` is a per-step attribute of :class:`~ebrl.algos.batch.Batch`: where it comes from
(the observation acted on; the env's step, a ``Block`` attribute; the policy's behaviour output,
an ``ActResult`` attribute kept by ``RolloutQueue.begin``; the run: the acting weights' version),
how a step is stored (a space, or a dtype and shape; the policy's actions as the policy gives
them: a flow policy's chain, a token policy's bin ids) and the padding of cut segments.
``StepRows`` allocates the env's columns from it, ``RolloutQueue`` its rows and slots, and
``collate`` builds the ``Batch`` from it.

    >>> import gymnasium as gym
    >>> fields = transition_fields(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (4, 2)))
    >>> " ".join(f.name for f in fields)
    'obs actions logprobs values rewards terminated truncated versions chunk_rewards chunk_steps'
    >>> fields[0].alloc((2, 5)).shape, fields[-2].alloc((2, 5)).shape
    ((2, 5, 3), (2, 5, 4))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.spaces import tree_map

OBS, ENV, POLICY, RUN = "obs", "env", "policy", "run"  # Field.source
LEARNER_VERSION = "learner_version"  # Field.fill: the learner's version (a padded step has lag 0)
F32, I64 = np.dtype(np.float32), np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class Field:
    name: str  # the Batch attribute
    source: str  # OBS, ENV, POLICY or RUN
    attr: str = ""  # the Block (ENV) or ActResult (POLICY) attribute it is read from
    dtype: Any = None  # one step: an array of dtype and shape, or a value of space
    shape: tuple[int, ...] = ()
    space: gym.Space | None = None
    fill: Any = 0  # collate's padding (LEARNER_VERSION: the learner's version)
    step_dtype: Any = None  # ENV: the dtype of the env's column (StepRows, Block); None: a flag bit

    def alloc(self, lead: tuple[int, ...], like: Any = None) -> Any:
        """Zeroed storage with leading dims ``lead``; the policy's own field shaped like rows
        ``like`` (its first output), None without them."""
        if self.space is not None:
            return space_rows(self.space, lead)
        if self.dtype is not None:
            return np.zeros((*lead, *self.shape), self.dtype)
        if like is None:
            return None
        return tree_map(lambda a: np.zeros((*lead, *np.shape(a)[1:]), np.asarray(a).dtype), like)

    def pad(self, learner_version: int) -> Any:
        return learner_version if self.fill == LEARNER_VERSION else self.fill


def transition_fields(obs_space: gym.Space, act_space: gym.Space) -> tuple[Field, ...]:
    """The per-step fields of a transition for these spaces; ``chunk_rewards`` (zero-padded) and
    ``chunk_steps`` (0: the env reported none) where the action space may be an action chunk
    (:mod:`ebrl.envs.chunks`: a ``Box(K, ...)`` of two or more dimensions)."""
    k = act_space.shape[0] if isinstance(act_space, gym.spaces.Box) and len(act_space.shape) >= 2 else 0
    chunks = (Field("chunk_rewards", ENV, "chunk_rewards", F32, (k,), step_dtype=F32),
              Field("chunk_steps", ENV, "chunk_steps", I64, step_dtype=I64)) if k else ()
    return (Field("obs", OBS, space=obs_space), Field("actions", POLICY, "actions"),
            Field("logprobs", POLICY, "logprobs", F32), Field("values", POLICY, "values", F32),
            Field("rewards", ENV, "reward", F32, step_dtype=np.dtype(np.float64)),  # exact episode returns
            Field("terminated", ENV, "terminated", np.dtype(bool), fill=False),
            Field("truncated", ENV, "truncated", np.dtype(bool), fill=False),
            Field("versions", RUN, dtype=I64, fill=LEARNER_VERSION), *chunks)


def space_rows(space: gym.Space, lead: int | tuple[int, ...],
               alloc: Callable[[tuple, np.dtype], np.ndarray] | None = None) -> Any:
    """Storage for values of ``space`` with leading dims ``lead`` (an int: ``(lead,)``): an array
    ``[*lead, *shape]``, or a dict of them for a ``Dict`` space (one array per key).
    ``alloc(shape, dtype)`` makes each array (default ``np.zeros``; the process pool passes
    shared memory).

        >>> rows = space_rows(gym.spaces.Dict({"img": gym.spaces.Box(0, 255, (2, 2), np.uint8),
        ...                                    "pos": gym.spaces.Box(-1, 1, (3,))}), 4)
        >>> rows["img"].shape, rows["img"].dtype, rows["pos"].shape
        ((4, 2, 2), dtype('uint8'), (4, 3))
    """
    alloc = alloc or (lambda shape, dtype: np.zeros(shape, dtype))
    lead = (lead,) if isinstance(lead, int) else lead
    if isinstance(space, gym.spaces.Dict):
        return {k: space_rows(s, lead, alloc) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Box):
        return alloc((*lead, *space.shape), space.dtype)
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        return alloc((*lead, *space.shape), I64)  # Discrete: shape ()
    raise TypeError(f"{type(space).__name__} spaces cannot be stored in rows: the runtime supports Box, "
                    "Discrete, MultiDiscrete, MultiBinary and Dicts of them (wrap the env to flatten others)")
