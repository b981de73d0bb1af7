"""LIBERO tabletop manipulation (robosuite, Franka Panda): ``make_libero("libero_spatial/0")``.

Install it in an environment of its own (LIBERO needs robosuite 1.4: its env wrapper calls
``load_controller_config``, gone in 1.5). Its authors do not publish it on PyPI (PyPI's
``libero`` and ``hf-libero`` are Hugging Face's fork)::

    pip install 'ebrl[libero]'        # robosuite 1.4 and LIBERO's other runtime dependencies
    git clone https://github.com/Lifelong-Robot-Learning/LIBERO && pip install -e LIBERO
    export EBRL_LIBERO_ASSETS=$PWD/LIBERO/libero/libero   # holds bddl_files/ init_files/ assets/

Nothing is downloaded: the asset root (``assets=`` or ``$EBRL_LIBERO_ASSETS``) must hold
``bddl_files/``, ``init_files/`` and ``assets/``. (Upstream LIBERO loads meshes from its own
package folder, ``libero/libero/assets``, which an editable install of the clone has.)

Tasks are ``<suite>/<task index or name>``, suites ``libero_spatial|object|goal|10|90`` or
``spatial|object|goal|10|90``; see :class:`LiberoEnv` for observations, actions and episodes.

    >>> env = make_libero("spatial/0", assets="/data/LIBERO/libero/libero")  # doctest: +SKIP
    >>> obs, info = env.reset(seed=0)              # doctest: +SKIP
    >>> obs["pixels"].shape, obs["state"].shape, info["language"]   # doctest: +SKIP
    ((128, 128, 6), (8,), 'pick up the black bowl between the plate and the ramekin and place it on the plate')
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from ebrl.envs import did_you_mean

ASSETS_ENV = "EBRL_LIBERO_ASSETS"
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
# step limits of the OpenVLA LIBERO eval (run_libero_eval.py): a little over the longest demo
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # hold still, gripper open
INSTALL = ("pip install 'ebrl[libero]' (robosuite 1.4) in an environment of its own, then LIBERO "
           "itself, which is not on PyPI: git clone https://github.com/Lifelong-Robot-Learning/LIBERO "
           "&& pip install -e LIBERO")
_REQUIRED = ("bddl_files", "init_files", "assets")
try:  # what a pickled numeric numpy array refers to (numpy 2 moved the module)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct
NUMPY_ARRAY_GLOBALS = (_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(t)) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64)})
_config_dir: Path | None = None


def suite_name(name: str) -> str:
    """``"spatial"`` or ``"libero_spatial"`` -> ``"libero_spatial"``; unknown -> ValueError."""
    full = name if name.startswith("libero_") else f"libero_{name}"
    if full not in SUITES:
        hint = did_you_mean(full, SUITES, n=3, cutoff=0.5)
        raise ValueError(f"unknown LIBERO suite {name!r}{hint} (suites: {', '.join(SUITES)})")
    return full


def asset_root(assets: str | os.PathLike | None = None) -> Path:
    """The local asset root from ``assets=`` or ``$EBRL_LIBERO_ASSETS``, checked; never downloaded."""
    where = "assets=" if assets is not None else f"${ASSETS_ENV}"
    raw = assets if assets is not None else os.environ.get(ASSETS_ENV)
    if not raw:
        raise FileNotFoundError(f"LIBERO needs its assets on disk: pass assets= or set {ASSETS_ENV} to the "
                                f"folder holding {', '.join(f'{d}/' for d in _REQUIRED)} (LIBERO/libero/libero "
                                "in a clone); they are never downloaded")
    root = Path(raw).expanduser().resolve()
    missing = [d for d in _REQUIRED if not (root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"{where} {root} lacks {', '.join(f'{d}/' for d in missing)}: it must be "
                                "LIBERO's asset root (LIBERO/libero/libero in a clone)")
    return root


def _write_config(root: Path | None) -> None:
    """Point LIBERO at ``root`` through a private config: importing ``libero.libero`` without a
    config file asks questions with input(), which would hang a worker process."""
    global _config_dir
    if _config_dir is None:
        _config_dir = Path(tempfile.mkdtemp(prefix="ebrl-libero-"))
        pid = os.getpid()  # a forked child exiting must not take its parent's config along
        atexit.register(lambda d=_config_dir: os.getpid() == pid and shutil.rmtree(d, ignore_errors=True))
    config = _config_dir / "config.yaml"
    if root is not None or not config.exists():  # task_names() needs no files: keep an env's config
        root = root or _config_dir
        datasets = root / "datasets" if (root / "datasets").is_dir() else root  # LIBERO warns on missing paths
        paths = {"benchmark_root": root, "bddl_files": root / "bddl_files", "init_states": root / "init_files",
                 "datasets": datasets, "assets": root / "assets"}
        # JSON strings are valid YAML scalars: no PyYAML needed here
        config.write_text("".join(f"{k}: {json.dumps(str(v))}\n" for k, v in paths.items()))
    # read once, when libero.libero is first imported; ours wins over a user's, since assets= was given
    os.environ["LIBERO_CONFIG_PATH"] = str(_config_dir)


def _check_installed() -> None:
    try:
        import libero  # noqa: F401  (the bare package: the part that reads the config is libero.libero)
    except ImportError:
        raise ImportError(f"libero envs need LIBERO: {INSTALL}") from None


def _import_libero(root: Path | None) -> tuple[Any, Any]:
    _check_installed()
    _write_config(root)
    from ebrl.envs.pixels import ensure_gl

    ensure_gl()  # robosuite picks its OpenGL backend from MUJOCO_GL at import
    try:
        import libero.libero as pkg
        from libero.libero import benchmark
        from libero.libero.envs import OffScreenRenderEnv
    except ImportError as exc:
        raise ImportError(f"LIBERO failed to import ({exc}): {INSTALL}") from None
    pkg_file = getattr(pkg, "__file__", None)
    if pkg_file and not (Path(pkg_file).parent / "assets").is_dir():
        warnings.warn(f"LIBERO at {Path(pkg_file).parent} has no assets/ folder, where it loads meshes from: "
                      "install LIBERO editable from a clone (pip install -e LIBERO)", stacklevel=3)
    return benchmark, OffScreenRenderEnv


def task_names(suite: str) -> list[str]:
    """The suite's task names, in LIBERO's order (its index is the task's index); [] without LIBERO."""
    full = suite_name(suite)
    try:
        root: Path | None = asset_root()
    except FileNotFoundError:
        root = None
    try:
        benchmark, _ = _import_libero(root)
    except ImportError:
        return []
    return list(benchmark.get_benchmark_dict()[full]().get_task_names())


def make_libero(task: str, *, assets: str | os.PathLike | None = None, image_size: int = 128,
                cameras: tuple[str, ...] | list[str] = ("agentview", "robot0_eye_in_hand"),
                max_episode_steps: int | None = None, init_state: int | None = None, seed: int | None = None,
                settle_steps: int = 10, **kwargs: Any) -> LiberoEnv:
    """Build one LIBERO task; other keyword arguments go to LIBERO's ``OffScreenRenderEnv``."""
    suite, _, which = task.partition("/")
    suite = suite_name(suite)
    if not which:
        raise ValueError(f"LIBERO task {task!r}: expected '<suite>/<task index or name>'")
    _check_installed()  # say what to install before asking for the assets
    root = asset_root(assets)
    benchmark, render_env = _import_libero(root)
    bench = benchmark.get_benchmark_dict()[suite]()
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
    # the same paths as Benchmark.get_task_bddl_file_path / get_task_init_states, from our root
    bddl = root / "bddl_files" / info.problem_folder / info.bddl_file
    init_file = root / "init_files" / info.problem_folder / info.init_states_file
    for path in (bddl, init_file):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the asset root {root} is incomplete")
    from ebrl.checkpoint import load_safely

    # LIBERO's init files are torch-saved numpy arrays: allow exactly what an array needs to
    # load (a downloaded file's pickle never runs code here)
    init_states = np.asarray(load_safely(init_file, allow=NUMPY_ARRAY_GLOBALS))
    steps = MAX_STEPS[suite] if max_episode_steps is None else max_episode_steps
    # robosuite refuses to step past its horizon (1000 by default), settle steps included
    kwargs.setdefault("horizon", max(1000, steps + settle_steps + 1))
    env_kwargs = dict(bddl_file_name=str(bddl), camera_names=list(cameras), camera_heights=image_size,
                      camera_widths=image_size, **kwargs)
    return LiberoEnv(lambda: render_env(**env_kwargs), init_states, cameras=tuple(cameras), image_size=image_size,
                     max_episode_steps=steps, init_state=init_state, settle_steps=settle_steps,
                     task=f"{suite}/{info.name}", language=info.language, seed=seed)


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """robosuite's (x, y, z, w) quaternion -> axis * angle, as robosuite's transform_utils does."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = math.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return np.asarray(quat[:3], np.float64) * 2.0 * math.acos(w) / den


class LiberoEnv(gym.Env):
    """LIBERO's ``OffScreenRenderEnv`` (old 4-tuple step API) as a gymnasium env.

    Observations: ``"pixels"``, uint8 ``[H, W, 3 * len(cameras)]``, each camera's image rotated
    180 degrees (``img[::-1, ::-1]``: robosuite renders bottom-up, and OpenVLA's and openpi's
    LIBERO evals and data rotate it so), concatenated on channels; ``"state"``, float32 ``[8]``:
    end-effector position, orientation as axis-angle (no quaternion sign ambiguity) and the two
    gripper finger positions, the proprio of OpenVLA-OFT and openpi. Actions: 7-d OSC delta pose
    and gripper (-1 open, +1 close), clipped to ``[-1, 1]``. ``terminated`` is success (LIBERO's
    ``done`` is its goal predicate), with ``info["is_success"]`` at every step; ``truncated`` comes
    after ``max_episode_steps``. Reward: LIBERO's sparse 1.0 on success.

    ``reset(seed=)`` seeds ``np_random``, from which each reset draws the init state (unless
    ``init_state`` or ``options={"init_state": k}`` picks one) and LIBERO's seed (numpy's global
    RNG, which moves objects even from a saved init state), so seeded resets and the unseeded
    ones after them are reproducible. ``settle_steps`` no-op steps then let dropped objects come
    to rest, as the eval scripts do, outside ``max_episode_steps``. The simulator is built at the
    first reset, in the process that steps it: an OpenGL context does not survive ``fork``.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"]}

    def __init__(self, build: Callable[[], Any], init_states: np.ndarray, *, cameras: tuple[str, ...], image_size: int,
                 max_episode_steps: int, init_state: int | None, settle_steps: int, task: str, language: str,
                 seed: int | None = None):
        if init_state is not None and not 0 <= init_state < len(init_states):
            raise ValueError(f"init_state={init_state}: {task} has init states 0..{len(init_states) - 1}")
        self._build, self._env = build, None
        self.init_states, self.cameras = init_states, cameras
        self.max_episode_steps, self.init_state, self.settle_steps = max_episode_steps, init_state, settle_steps
        self.task, self.language = task, language
        size = (image_size, image_size, 3 * len(cameras))
        self.observation_space = gym.spaces.Dict({
            "pixels": gym.spaces.Box(0, 255, size, np.uint8),
            "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)})
        self.action_space = gym.spaces.Box(-1.0, 1.0, (7,), np.float32)
        self._t, self._first_seed = 0, seed  # seed= seeds the first reset, unless it brings its own
        self._last: dict[str, np.ndarray] | None = None

    def _observe(self, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = np.concatenate([raw[f"{cam}_image"][::-1, ::-1] for cam in self.cameras], axis=-1)
        state = np.concatenate([raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]),
                                raw["robot0_gripper_qpos"]])
        self._last = {"pixels": pixels.astype(np.uint8, copy=False), "state": state.astype(np.float32)}
        return self._last

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
        raw, reward, done, _ = self._env.step(np.clip(np.asarray(action, np.float64), -1.0, 1.0))
        self._t += 1
        success = bool(done)  # LIBERO's done is its task predicate: success, nothing else
        truncated = not success and self._t >= self.max_episode_steps
        return self._observe(raw), float(reward), success, truncated, {"is_success": success}

    def render(self) -> np.ndarray | None:
        return None if self._last is None else self._last["pixels"][..., :3].copy()

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
