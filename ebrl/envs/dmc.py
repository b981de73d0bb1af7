"""dm_control suite tasks as gymnasium envs: ``make("dmc/cartpole-swingup")``.

Observations: the task's observation dict flattened into one float32 vector (keys in
sorted order), or with ``pixels=84`` a dict ``{"pixels": uint8 [H, W, 3], "state": ...}``
rendered offscreen (``MUJOCO_GL=egl``). Actions: a Box from the task's action spec.
Episode ends: a last step with discount 0 is ``terminated``, with discount > 0
(dm_control's time limit) ``truncated``. Seeding: ``reset(seed=s)`` reseeds the task's
random state, so episodes are reproducible per env.

    >>> from ebrl.envs import make
    >>> env = make("dmc/cartpole-swingup")
    >>> env.observation_space.shape, env.action_space.shape
    ((5,), (1,))
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import did_you_mean
from ebrl.envs.robotics import INSTALL


def _suite():
    from ebrl.envs.pixels import ensure_gl

    # dm_control picks its OpenGL backend once, when it is first imported (GLFW first when
    # MUJOCO_GL is unset, which needs a display): a state-only env made first would leave every
    # later pixel env or render() of the process without a headless context
    ensure_gl()
    try:
        from dm_control import suite
    except ImportError:
        raise ImportError(f"dmc envs need dm_control: {INSTALL}") from None
    return suite


def task_names() -> list[str]:
    try:
        suite = _suite()
    except ImportError:
        return []
    return sorted(f"{d}-{t}" for d, t in suite.ALL_TASKS)


class DMCEnv(gym.Env):
    """One dm_control task behind gymnasium's API.

    ``env.spec`` (id ``dmc/<domain>-<task>``, the constructor's arguments as kwargs) rebuilds
    the env with ``env.spec.make()``, as gymnasium's ``check_env`` does. ``render_mode`` may be
    ``"rgb_array"`` (gymnasium's convention) or ``None``; ``render()`` draws a 240x320 frame
    either way.
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, domain: str, task: str, *, pixels: int | None = None, camera: int = 0, seed: int = 0,
                 render_mode: str | None = None):
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"DMCEnv render_mode={render_mode!r}: must be None or 'rgb_array'")
        suite = _suite()
        if (domain, task) not in suite.ALL_TASKS:
            known = [f"{d}-{t}" for d, t in suite.ALL_TASKS]
            raise ValueError(f"unknown dm_control task {domain + '-' + task!r}"
                             + did_you_mean(f"{domain}-{task}", known))
        self._env = suite.load(domain, task, task_kwargs={"random": seed})
        self.render_mode = render_mode
        self.metadata = {**self.metadata, "render_fps": round(1.0 / self._env.control_timestep())}
        self.spec = gym.envs.registration.EnvSpec(
            f"dmc/{domain}-{task}", entry_point=f"{__name__}:DMCEnv", nondeterministic=False,
            order_enforce=False, disable_env_checker=True,
            kwargs={"domain": domain, "task": task, "pixels": pixels, "camera": camera, "seed": seed,
                    **({"render_mode": render_mode} if render_mode is not None else {})})
        self._pixels, self._camera = pixels, camera
        spec = self._env.action_spec()
        self.action_space = gym.spaces.Box(spec.minimum.astype(np.float32), spec.maximum.astype(np.float32),
                                           dtype=np.float32)
        size = sum(int(np.prod(v.shape)) for v in self._env.observation_spec().values())
        state = gym.spaces.Box(-np.inf, np.inf, (size,), np.float32)
        self.observation_space = state if pixels is None else gym.spaces.Dict(
            {"pixels": gym.spaces.Box(0, 255, (pixels, pixels, 3), np.uint8), "state": state})

    def _observe(self, ts) -> Any:
        state = np.concatenate([np.asarray(ts.observation[k], np.float32).ravel()
                                for k in sorted(ts.observation)])
        if self._pixels is None:
            return state
        frame = self._env.physics.render(self._pixels, self._pixels, camera_id=self._camera)
        return {"pixels": np.ascontiguousarray(frame, np.uint8), "state": state}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._env.task.random.seed(seed)
        return self._observe(self._env.reset()), {}

    def step(self, action):
        ts = self._env.step(np.asarray(action, np.float64))
        last = ts.last()
        terminated = bool(last and ts.discount == 0)
        return self._observe(ts), float(ts.reward or 0.0), terminated, bool(last and not terminated), {}

    def render(self):
        return self._env.physics.render(240, 320, camera_id=self._camera)

    def close(self) -> None:
        self._env.close()
