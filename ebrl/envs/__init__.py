"""Environment construction: ``make("suite/task")``.

This is the seed of the registry (the simulators issue adds dm_control, robotics,
Meta-World, ManiSkill and LIBERO adapters). Today: ``mujoco/<Task>`` for gymnasium's MuJoCo
envs, ``mock/<dim>`` for :class:`ebrl.testing.MockEnv`, and any registered gymnasium id.
``pixels=`` turns a rendering env into a pixel env (:class:`PixelObservation`).

    >>> from ebrl.envs import make
    >>> make("mujoco/HalfCheetah-v5").observation_space.shape
    (17,)
    >>> env = make("mujoco/HalfCheetah-v5", pixels=84)
    >>> env.observation_space["pixels"].shape, env.observation_space["state"].shape
    ((84, 84, 3), (17,))
    >>> env.close()
"""

from __future__ import annotations

import difflib

import gymnasium as gym

from ebrl.envs.pixels import PixelObservation, ensure_gl


def make(name: str, *, pixels: int | tuple[int, int] | None = None, frame_stack: int = 1,
         camera: str | int | None = None, keep_state: bool = True, fast_render: bool = False,
         **kwargs) -> gym.Env:
    """Build an env by registry name; unknown names get an error listing close matches.

    ``pixels=84`` (or ``(height, width)``) renders ``rgb_array`` frames of that size and returns
    ``{"pixels": uint8 [H, W, 3 * frame_stack], "state": float32}`` observations
    (``keep_state=False`` drops ``"state"``). ``camera`` is a camera name (``str``) or id
    (``int``) of the MuJoCo model; ``fast_render`` trades looks for speed (see
    :class:`PixelObservation`). Other keyword arguments go to the env's constructor.
    """
    suite, _, task = name.partition("/")
    if pixels is None:
        if frame_stack != 1 or camera is not None or keep_state is not True or fast_render:
            raise ValueError("frame_stack=, camera=, keep_state= and fast_render= apply to pixel envs: "
                             "pass pixels= too")
    else:
        height, width = (pixels, pixels) if isinstance(pixels, int) else tuple(pixels)
        if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
            raise ValueError(f"pixels must be a positive int or (height, width), got {pixels!r}")
        ensure_gl()
        kwargs.update(render_mode="rgb_array", width=width, height=height)
        if isinstance(camera, str):
            kwargs["camera_name"] = camera
        elif camera is not None:
            kwargs["camera_id"] = int(camera)
    if suite == "mock" and task:
        from ebrl.testing import MockEnv

        env = MockEnv(int(task), **kwargs)
    else:
        env_id = task if suite == "mujoco" and task else name
        try:
            env = gym.make(env_id, **kwargs)
        except gym.error.Error as exc:
            known = sorted(gym.registry)
            close = difflib.get_close_matches(env_id, known, n=5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown env {name!r}{hint} ({exc})") from None
    if pixels is not None:
        env = PixelObservation(env, frame_stack=frame_stack, keep_state=keep_state, fast_render=fast_render)
    return env


__all__ = ["PixelObservation", "ensure_gl", "make"]
