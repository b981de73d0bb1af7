"""Meta-World v3 tasks, MT1-style (one task, goals randomised per episode):
``make("metaworld/reach-v3")``. ``info["success"]`` feeds the runtime's ``success_once`` and
``success_at_end``.

Meta-World pins mujoco 3.3.0, which gymnasium-robotics and dm_control (``[sims]``, mujoco
3.11) do not share: install it in its own environment with ``pip install 'ebrl[metaworld]'``.
"""

from __future__ import annotations

import gymnasium as gym

INSTALL = ("Meta-World pins mujoco 3.3.0, so it lives in an environment of its own: "
           "pip install 'ebrl[metaworld]' in a fresh virtualenv (without ebrl[sims])")


def make_metaworld(task: str, *, seed: int | None = None, **kwargs) -> gym.Env:
    try:
        import metaworld  # noqa: F401  (importing registers the Meta-World/* ids)
    except ImportError:
        raise ImportError(f"metaworld envs need Meta-World: {INSTALL}") from None
    if seed is not None:
        kwargs["seed"] = seed
    try:
        return gym.make("Meta-World/MT1", env_name=task, **kwargs)
    except (ValueError, KeyError) as exc:  # Meta-World names unknown tasks in its own error
        raise ValueError(f"unknown Meta-World task {task!r} ({exc})") from None
