"""gymnasium-robotics: Fetch (Reach, Push, PickAndPlace, Slide), Shadow hand, Adroit, Franka
kitchen, as ``make("robotics/FetchReachDense-v4")``.

Goal-conditioned envs return dict observations (``observation``, ``achieved_goal``,
``desired_goal``); ``flatten=True`` (default) concatenates them into one Box with
gymnasium's ``FlattenObservation``, ``flatten=False`` keeps the dict. ``info["is_success"]``
is passed through; the runtime turns it into ``success_once`` and ``success_at_end``.

Install with ``pip install 'ebrl[sims]'`` (gymnasium-robotics on mujoco 3.11).

    >>> from ebrl.envs import make
    >>> env = make("robotics/FetchReachDense-v4")
    >>> env.observation_space.shape
    (16,)
"""

from __future__ import annotations

import gymnasium as gym

INSTALL = "pip install 'ebrl[sims]' (gymnasium-robotics, dm_control and mujoco 3.11 together)"


def _register() -> None:
    try:
        import gymnasium_robotics
    except ImportError:
        raise ImportError(f"robotics envs need gymnasium-robotics: {INSTALL}") from None
    gym.register_envs(gymnasium_robotics)


def task_names() -> list[str]:
    """The registered gymnasium-robotics ids (empty when it is not installed)."""
    try:
        _register()
    except ImportError:
        return []
    prefixes = ("Fetch", "HandManipulate", "HandReach", "AdroitHand", "FrankaKitchen")
    return sorted(n for n in gym.registry if n.startswith(prefixes))


def make_robotics(task: str, *, flatten: bool = True, **kwargs) -> gym.Env:
    _register()
    env = gym.make(task, **kwargs)
    if flatten and isinstance(env.observation_space, gym.spaces.Dict):
        env = gym.wrappers.FlattenObservation(env)
    return env
