"""Action chunks: execute K actions in one simulation call (one trip to the sim pool).

Policies that emit action chunks (flow-matching and VLA policies predict K future actions
at once) step the env K times per decision. ``ActionChunk`` makes that one ``step`` of a
``Box(K, *action_shape)`` action: it stops early when the episode ends, returns the summed
reward, and puts the per-step rewards and the number of steps taken in ``info``
(``chunk_rewards``, ``chunk_steps``). ``chunk_rewards`` always has ``k`` entries, zero past
``chunk_steps`` (a fixed shape stacks in gymnasium's vector infos). The runtime carries both to
the algorithm (``Batch.chunk_rewards``/``chunk_steps``), which discounts inside the chunk:
a decision's reward is ``sum_j gamma**j * r_j`` and the next decision's value is discounted
by ``gamma**chunk_steps``.

    >>> import numpy as np
    >>> from ebrl.envs.chunks import ActionChunk
    >>> from ebrl.testing import MockEnv
    >>> env = ActionChunk(MockEnv(dim=2, episode_len=5), k=4)
    >>> _ = env.reset(seed=0)
    >>> _, _, _, truncated, info = env.step(np.zeros((4, 2), np.float32))
    >>> info["chunk_steps"], truncated
    (4, False)
    >>> _, _, _, truncated, info = env.step(np.zeros((4, 2), np.float32))
    >>> info["chunk_steps"], truncated       # the episode ended after one more step
    (1, True)
    >>> info["chunk_rewards"].shape
    (4,)

A policy that acts in chunks on an env that steps one action at a time needs no wrapper from
the user: ``ebrl.run`` and ``ebrl.evaluation.evaluate`` wrap each env with :func:`for_policy`,
which adds ``ActionChunk`` exactly when the policy's ``expected_spaces()`` says ``(K, A)`` and
the env's Box is ``(A,)``:

    >>> import gymnasium as gym
    >>> from ebrl.envs.chunks import for_policy
    >>> from ebrl.policies import FlowPolicy
    >>> policy = FlowPolicy.from_spaces(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Box(-1, 1, (3, 2)), hidden=(8,))
    >>> env = for_policy(MockEnv(dim=2), policy)
    >>> type(env).__name__, env.action_space.shape
    ('ActionChunk', (3, 2))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np


class ActionChunk(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """``k`` actions per ``step``; records ``k`` so that ``env.spec.make()`` rebuilds the wrapper."""

    def __init__(self, env: gym.Env, k: int):
        gym.utils.RecordConstructorArgs.__init__(self, k=k)
        gym.Wrapper.__init__(self, env)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"ActionChunk k={k!r}: must be an integer >= 1")
        space = env.action_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"ActionChunk needs a Box action space, got {space!r}")
        self.k = k
        self.action_space = gym.spaces.Box(np.broadcast_to(space.low, (k, *space.shape)),
                                           np.broadcast_to(space.high, (k, *space.shape)), dtype=space.dtype)

    def step(self, chunk):
        chunk = np.asarray(chunk)
        if chunk.shape[0] != self.k:
            raise ValueError(f"ActionChunk expected {self.k} actions, got an array of shape {chunk.shape}")
        rewards = []
        for action in chunk:
            obs, reward, terminated, truncated, info = self.env.step(action)
            rewards.append(float(reward))
            if terminated or truncated:
                break
        padded = np.zeros(self.k, np.float32)
        padded[:len(rewards)] = rewards
        info = dict(info, chunk_rewards=padded, chunk_steps=len(rewards))
        return obs, float(sum(rewards)), terminated, truncated, info


def policy_chunk(policy: Any) -> tuple[int, tuple[int, ...]] | None:
    """``(K, (A,))`` for a policy whose ``expected_spaces()`` acts in chunks ``(K, A)``, else None."""
    expected = getattr(policy, "expected_spaces", None)
    action = expected().action if callable(expected) else None
    shape = getattr(action, "shape", None)
    if shape is None or len(shape) != 2:
        return None
    return int(shape[0]), tuple(shape[1:])


def for_policy(env: Any, policy: Any) -> Any:
    """``env`` wrapped in :class:`ActionChunk` when ``policy`` acts in chunks of ``K`` actions
    and ``env`` takes one action of that shape per step; otherwise ``env`` itself (already
    chunked, a vector env, or a mismatch that the space check then reports)."""
    chunk = policy_chunk(policy)
    if chunk is None or not isinstance(env, gym.Env):
        return env
    k, one = chunk
    space = env.action_space
    if isinstance(space, gym.spaces.Box) and tuple(space.shape) == one:
        return ActionChunk(env, k)
    return env


class ChunkedEnvFn:
    """An ``env_fn`` whose envs execute a chunking policy's ``K`` actions per decision
    (:func:`for_policy` on each env it builds). A module-level class, so that it pickles to
    worker processes with the user's ``env_fn`` inside."""

    def __init__(self, env_fn: Callable[[int], Any], k: int, action_shape: tuple[int, ...]):
        self.env_fn, self.k, self.action_shape = env_fn, k, action_shape

    def __call__(self, i: int) -> Any:
        env = self.env_fn(i)
        space = getattr(env, "action_space", None)
        if isinstance(env, gym.Env) and isinstance(space, gym.spaces.Box) and tuple(space.shape) == self.action_shape:
            return ActionChunk(env, self.k)
        return env


def chunked_env_fn(env_fn: Callable[[int], Any], policy: Any) -> Callable[[int], Any]:
    """``env_fn`` itself, or a :class:`ChunkedEnvFn` where ``policy`` acts in chunks."""
    chunk = policy_chunk(policy)
    return env_fn if chunk is None else ChunkedEnvFn(env_fn, *chunk)
