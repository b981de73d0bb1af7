"""Environment construction: ``make("suite/task")``.

This is the seed of the registry (the simulators issue adds dm_control, robotics,
Meta-World, ManiSkill and LIBERO adapters). Today: ``mujoco/<Task>`` for gymnasium's MuJoCo
envs, ``mock/<dim>`` for :class:`ebrl.testing.MockEnv`, and any registered gymnasium id.

    >>> from ebrl.envs import make
    >>> make("mujoco/HalfCheetah-v5").observation_space.shape
    (17,)
"""

from __future__ import annotations

import difflib

import gymnasium as gym


def make(name: str, **kwargs) -> gym.Env:
    """Build an env by registry name; unknown names get an error listing close matches."""
    suite, _, task = name.partition("/")
    if suite == "mock" and task:
        from ebrl.testing import MockEnv

        return MockEnv(int(task), **kwargs)
    env_id = task if suite == "mujoco" and task else name
    try:
        return gym.make(env_id, **kwargs)
    except gym.error.Error as exc:
        known = sorted(gym.registry)
        close = difflib.get_close_matches(env_id, known, n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown env {name!r}{hint} ({exc})") from None


__all__ = ["make"]
