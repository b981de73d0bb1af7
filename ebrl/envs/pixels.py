"""Pixel observations for rendering envs: ``{"pixels": uint8 [H, W, 3k], "state": float32}``.

:class:`PixelObservation` wraps an env built with ``render_mode="rgb_array"`` and returns the
rendered frame (the ``k`` most recent ones stacked along the channels) as its observation,
optionally next to the original state vector. Frames stay ``uint8``; the policy scales them
(see :class:`ebrl.policies.CNNPolicy`).

Example (headless MuJoCo rendering; ``ebrl.envs.make`` calls :func:`ensure_gl` for you)::

    >>> from ebrl.envs import make
    >>> env = make("mujoco/InvertedPendulum-v5", pixels=32, frame_stack=2)
    >>> obs, _ = env.reset(seed=0)
    >>> obs["pixels"].shape, obs["pixels"].dtype, obs["state"].dtype
    ((32, 32, 6), dtype('uint8'), dtype('float32'))
    >>> env.close()

Offscreen MuJoCo rendering needs an OpenGL backend chosen by ``MUJOCO_GL`` *before* the first
render: ``egl`` (GPU, or CPU through Mesa's llvmpipe; Debian packages ``libegl1 libegl-mesa0
libgl1-mesa-dri``) or ``osmesa`` (CPU; ``libosmesa6``), plus the ``PyOpenGL`` Python package.

Threads: an OpenGL context is current in one thread at a time, and gymnasium's MuJoCo renderer
makes it current only once, in the thread that created it. A pool thread rendering another
thread's env would silently get black frames, so this wrapper makes the env's context current
before each render and releases it afterwards (~20 us), which makes the env safe to step from
any thread (one at a time), as the ``thread`` sim backend does.
"""

from __future__ import annotations

import ctypes.util
import os
from collections import deque

import gymnasium as gym
import numpy as np
from gymnasium import spaces

_INSTALL_HINT = (
    "Offscreen MuJoCo rendering needs an OpenGL backend, chosen by the MUJOCO_GL environment "
    "variable before the first render: MUJOCO_GL=egl (Debian/Ubuntu: apt-get install libegl1 "
    "libegl-mesa0 libgl1-mesa-dri; works without a GPU through Mesa's llvmpipe) or "
    "MUJOCO_GL=osmesa (apt-get install libosmesa6); both also need the PyOpenGL package. "
    "PYOPENGL_PLATFORM, if set, must match MUJOCO_GL."
)


def ensure_gl() -> str:
    """Pick a headless OpenGL backend for MuJoCo if ``MUJOCO_GL`` is unset; returns the one in use.

    Sets ``MUJOCO_GL=egl`` when libEGL is on the system, else ``osmesa`` when libOSMesa is, else
    ``egl`` (rendering will then fail with an error saying what to install). An existing
    ``MUJOCO_GL`` is left alone. Call it before the first render (``ebrl.envs.make`` does).

    Also sets ``LP_NUM_THREADS=0`` if unset: Mesa's software rasteriser (llvmpipe, what EGL and
    OSMesa use without a GPU) then draws in the calling thread instead of a thread pool. That
    pool does not survive ``fork``: a process that rendered once and then forked (the ``process``
    sim backend) would hang in the child's first render. It also avoids oversubscribing the
    cores when many envs render at once; a GPU driver ignores the variable.

        >>> from ebrl.envs.pixels import ensure_gl
        >>> ensure_gl() in ("egl", "osmesa", "glfw", "glx")
        True
    """
    os.environ.setdefault("LP_NUM_THREADS", "0")
    current = os.environ.get("MUJOCO_GL")
    if current:
        return current
    backend = "egl"
    if ctypes.util.find_library("EGL") is None and ctypes.util.find_library("OSMesa") is not None:
        backend = "osmesa"
    os.environ["MUJOCO_GL"] = backend
    return backend


def _release_context(backend: str | None) -> None:
    """Make no context current in this thread, so another thread may take the env's context."""
    if backend == "egl":
        from mujoco import egl

        egl.EGL.eglMakeCurrent(egl.EGL_DISPLAY, egl.EGL.EGL_NO_SURFACE, egl.EGL.EGL_NO_SURFACE,
                               egl.EGL.EGL_NO_CONTEXT)
    elif backend == "osmesa":
        from OpenGL import GL, osmesa

        osmesa.OSMesaMakeCurrent(None, None, GL.GL_FLOAT, 0, 0)
    elif backend == "glfw":
        import glfw

        glfw.make_context_current(None)


class PixelObservation(gym.ObservationWrapper, gym.utils.RecordConstructorArgs):
    """Observations ``{"pixels": Box(0, 255, (H, W, 3 * frame_stack), uint8), "state": Box float32}``.

    ``env`` must render ``rgb_array`` frames (``render_mode="rgb_array"``; for gymnasium's MuJoCo
    envs pass ``width=``/``height=`` and optionally ``camera_id=``/``camera_name=`` to
    ``gym.make``). Channels ``[3i:3i+3]`` hold the ``i``-th oldest of the ``frame_stack`` most
    recent frames; after a reset all of them are the first frame. ``keep_state=False`` drops
    the ``"state"`` entry. Every observation is a fresh array (nothing is reused in place).

    ``fast_render=True`` (MuJoCo only) turns off multisampling, shadows and reflections: on a CPU
    (Mesa llvmpipe) HalfCheetah at 84 px steps 30-50x faster (~15 -> 500-900 steps/s measured
    on 2 cores), at the cost of plainer images. The default keeps the env's own look.

    The wrapper records its constructor arguments (``RecordConstructorArgs``), so ``env.spec``
    describes it and ``env.spec.make()`` rebuilds the same pixel env, as gymnasium's
    ``check_env`` does.
    """

    def __init__(self, env: gym.Env, *, frame_stack: int = 1, keep_state: bool = True,
                 fast_render: bool = False):
        gym.utils.RecordConstructorArgs.__init__(self, frame_stack=frame_stack, keep_state=keep_state,
                                                 fast_render=fast_render)
        gym.ObservationWrapper.__init__(self, env)
        self.fast_render = bool(fast_render)
        if not isinstance(frame_stack, int) or isinstance(frame_stack, bool) or frame_stack < 1:
            raise ValueError(f"frame_stack must be an int >= 1, got {frame_stack!r}")
        if env.render_mode != "rgb_array":
            raise ValueError(f"PixelObservation needs an env made with render_mode='rgb_array', "
                             f"got render_mode={env.render_mode!r}")
        if keep_state and not isinstance(env.observation_space, spaces.Box):
            raise ValueError(f"keep_state=True needs a Box observation space, got {env.observation_space!r}"
                             "; pass keep_state=False")
        self.frame_stack = frame_stack
        self.keep_state = keep_state
        # the env's other render modes ("human", "depth_array", ...) give no pixel observations
        self.metadata = {**env.metadata, "render_modes": ["rgb_array"]}
        self._frames: deque[np.ndarray] = deque(maxlen=frame_stack)
        self._renderer = getattr(env.unwrapped, "mujoco_renderer", None)
        self._rendered = False
        if self.fast_render and self._renderer is not None:
            env.unwrapped.model.vis.quality.offsamples = 0  # read when the render context is made
        h, w = self._frame_size()
        entries = {"pixels": spaces.Box(0, 255, (h, w, 3 * frame_stack), np.uint8)}
        if keep_state:
            box = env.observation_space
            entries["state"] = spaces.Box(box.low.astype(np.float32), box.high.astype(np.float32),
                                          box.shape, np.float32)
        self.observation_space = spaces.Dict(entries)

    def _frame_size(self) -> tuple[int, int]:
        r = self._renderer
        if r is not None and getattr(r, "width", None) and getattr(r, "height", None):
            return int(r.height), int(r.width)
        frame = self._render()  # not MuJoCo: ask for one frame to learn the size
        return int(frame.shape[0]), int(frame.shape[1])

    def _render(self) -> np.ndarray:
        r = self._renderer
        if r is None:
            frame = self.env.render()
        else:
            viewer = getattr(r, "viewer", None)
            try:
                if viewer is not None:
                    viewer.make_context_current()
                frame = self.env.render()
                if self.fast_render and viewer is None:  # the scene exists now: plain look, render again
                    import mujoco

                    for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
                        r.viewer.scn.flags[flag] = 0
                    frame = self.env.render()
            except Exception as exc:
                if self._rendered:
                    raise
                raise RuntimeError(f"rendering failed with MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}: "
                                   f"{type(exc).__name__}: {exc}. {_INSTALL_HINT}") from exc
            finally:
                viewer = getattr(r, "viewer", None)
                if viewer is not None:
                    _release_context(getattr(viewer, "backend", None))
        if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[-1] != 3:
            raise RuntimeError(f"expected an rgb_array frame [H, W, 3], got "
                               f"{getattr(frame, 'shape', type(frame).__name__)}")
        self._rendered = True
        # always a copy: MuJoCo's frames are flipped views, and another renderer may hand out its own buffer
        return np.array(frame, dtype=np.uint8, order="C")

    def reset(self, *, seed=None, options=None):
        self._frames.clear()
        return super().reset(seed=seed, options=options)

    def observation(self, observation):
        frame = self._render()
        if not self._frames:
            self._frames.extend([frame] * self.frame_stack)
        else:
            self._frames.append(frame)
        pixels = frame if self.frame_stack == 1 else np.concatenate(self._frames, axis=-1)
        out = {"pixels": pixels}
        if self.keep_state:
            out["state"] = np.array(observation, dtype=np.float32)  # a copy: never the env's buffer
        return out
