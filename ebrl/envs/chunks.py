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
"""

from __future__ import annotations

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
