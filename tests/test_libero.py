"""The LIBERO adapter against fake ``libero`` modules that mimic LIBERO's API.

LIBERO cannot be installed here, so an import hook serves ``libero``, ``libero.libero``,
``libero.libero.benchmark`` and ``libero.libero.envs`` from the builders below. Like the real
``libero/libero/__init__.py``, the fake ``libero.libero`` reads ``$LIBERO_CONFIG_PATH/config.yaml``
when it is imported and calls ``input()`` when that file is missing; ``input`` fails the test.
"""

import builtins
import importlib
import importlib.abc
import importlib.util
import json
import math
import os
import sys
from typing import ClassVar, NamedTuple

import numpy as np
import pytest
import torch

import ebrl
from ebrl.config import RunConfig, SimConfig
from ebrl.envs import make
from ebrl.envs.libero import MAX_STEPS, SUITES, make_libero, task_names
from ebrl.testing import MockPolicy, NoopAlgo

TASKS = {
    "libero_spatial": ["pick_up_the_black_bowl_on_the_plate_and_place_it_on_the_plate",
                       "pick_up_the_black_bowl_next_to_the_ramekin_and_place_it_on_the_plate",
                       "pick_up_the_black_bowl_on_the_stove_and_place_it_on_the_plate"],
    "libero_object": ["pick_up_the_ketchup_and_place_it_in_the_basket"],
    "libero_goal": ["open_the_middle_drawer_of_the_cabinet"],
    "libero_10": ["LIVING_ROOM_SCENE2_put_both_the_alphabet_soup_and_the_tomato_sauce_in_the_basket"],
    "libero_90": ["KITCHEN_SCENE1_open_the_bottom_drawer_of_the_cabinet"],
}
N_INIT = 5  # init states per task; state k is [k, k, k, k]
NOOP = [0, 0, 0, 0, 0, 0, -1]


class Task(NamedTuple):  # libero.libero.benchmark.Task
    name: str
    language: str
    problem: str
    problem_folder: str
    bddl_file: str
    init_states_file: str


class FakeRenderEnv:
    """LIBERO's OffScreenRenderEnv: images of H x W with (row, column, 100 + camera) per pixel.
    The task succeeds after ``success_after`` non-no-op steps from init states whose first entry is 0."""

    instances: ClassVar[list["FakeRenderEnv"]] = []
    success_after = 3

    def __init__(self, bddl_file_name, robots=("Panda",), camera_names=("agentview", "robot0_eye_in_hand"),
                 camera_heights=128, camera_widths=128, horizon=1000, **kwargs):
        assert os.path.exists(bddl_file_name), f"[error] {bddl_file_name} does not exist!"
        self.bddl_file_name, self.cams, self.horizon = bddl_file_name, list(camera_names), horizon
        self.h, self.w, self.kwargs = camera_heights, camera_widths, kwargs
        self.seeds, self.actions, self.state, self.t, self.moves, self.closed = [], [], None, 0, 0, False
        FakeRenderEnv.instances.append(self)

    def _obs(self):
        rows, cols = np.meshgrid(np.arange(self.h), np.arange(self.w), indexing="ij")
        obs = {f"{cam}_image": np.stack([rows, cols, np.full_like(rows, 100 + k)], -1).astype(np.uint8)
               for k, cam in enumerate(self.cams)}
        obs["robot0_eef_pos"] = np.array([0.1, 0.2, 0.3])
        obs["robot0_eef_quat"] = np.array([0.0, 0.0, math.sin(math.pi / 4), math.cos(math.pi / 4)])  # x, y, z, w
        obs["robot0_gripper_qpos"] = np.array([0.04, -0.04])
        return obs

    def seed(self, seed):
        self.seeds.append(seed)

    def reset(self):
        self.state, self.t, self.moves = None, 0, 0
        return self._obs()

    def set_init_state(self, init_state):
        self.state = np.asarray(init_state)
        return self._obs()

    def check_success(self):
        return self.state is not None and self.state[0] == 0 and self.moves >= self.success_after

    def step(self, action):
        if self.t >= self.horizon:  # robosuite's own limit
            raise ValueError("executing action in terminated episode")
        self.t += 1
        self.actions.append(np.asarray(action, np.float64))
        self.moves += not np.array_equal(action, NOOP)
        done = self.check_success()
        return self._obs(), float(done), done, {}

    def close(self):
        self.closed = True


def _build_libero_libero(mod):  # libero/libero/__init__.py: the config is read at import
    if FakeLiberoImporter.package_file:
        mod.__file__ = FakeLiberoImporter.package_file
    mod.libero_config_path = os.environ.get("LIBERO_CONFIG_PATH", os.path.expanduser("~/.libero"))
    mod.config_file = os.path.join(mod.libero_config_path, "config.yaml")

    def get_libero_path(query_key):
        with open(mod.config_file) as f:  # a YAML mapping of strings; the adapter writes JSON strings
            config = {k: json.loads(v) for k, v in (line.split(": ", 1) for line in f.read().splitlines())}
        return config[query_key]

    mod.get_libero_path = get_libero_path
    if not os.path.exists(mod.config_file):
        input("Do you want to specify a custom path for the dataset folder? (Y/N): ")


def _build_benchmark(mod):  # libero/libero/benchmark/__init__.py
    get_libero_path = sys.modules["libero.libero"].get_libero_path

    class Benchmark:
        name = ""

        def __init__(self, task_order_index=0):
            self.tasks = [Task(n, n.replace("_", " "), "Libero", self.name, f"{n}.bddl", f"{n}.pruned_init")
                          for n in TASKS[self.name]]
            self.n_tasks = len(self.tasks)

        def get_num_tasks(self):
            return self.n_tasks

        def get_task_names(self):
            return [t.name for t in self.tasks]

        def get_task(self, i):
            return self.tasks[i]

        def get_task_init_states(self, i):
            t = self.tasks[i]
            return torch.load(os.path.join(get_libero_path("init_states"), t.problem_folder, t.init_states_file))

    mapping = {name: type(name.upper(), (Benchmark,), {"name": name}) for name in TASKS}
    mod.Task, mod.Benchmark, mod.get_benchmark_dict = Task, Benchmark, lambda help=False: mapping


def _build_envs(mod):  # libero/libero/envs/__init__.py
    mod.OffScreenRenderEnv = FakeRenderEnv


class FakeLiberoImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    builders: ClassVar[dict] = {"libero": lambda mod: None, "libero.libero": _build_libero_libero,
                "libero.libero.benchmark": _build_benchmark, "libero.libero.envs": _build_envs}
    package_file = None  # libero.libero.__file__, when a test wants one

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self, is_package=True) if name in self.builders else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.builders[module.__name__](module)


def _unset(monkeypatch, name):
    monkeypatch.setenv(name, "-")  # recorded, so that teardown also undoes what the adapter sets
    monkeypatch.delenv(name)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A LIBERO asset root on disk, the fake modules importable, no config anywhere, no stdin."""
    root = tmp_path / "LIBERO" / "libero" / "libero"
    for suite, names in TASKS.items():
        (root / "bddl_files" / suite).mkdir(parents=True)
        (root / "init_files" / suite).mkdir(parents=True)
        for n in names:
            (root / "bddl_files" / suite / f"{n}.bddl").write_text(f"(define (problem LIBERO_{n}))")
            # as LIBERO ships them: a pickled numpy array (which torch >= 2.6 refuses by default)
            torch.save(np.repeat(np.arange(N_INIT, dtype=np.float64)[:, None], 4, 1), root / "init_files" / suite /
                       f"{n}.pruned_init")
    (root / "assets").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.libero/config.yaml to fall back on
    _unset(monkeypatch, "LIBERO_CONFIG_PATH")
    _unset(monkeypatch, "EBRL_LIBERO_ASSETS")

    def no_prompt(prompt=""):
        raise AssertionError(f"LIBERO prompted for its config: {prompt!r}")

    monkeypatch.setattr(builtins, "input", no_prompt)
    monkeypatch.setattr(sys, "meta_path", [FakeLiberoImporter(), *sys.meta_path])
    FakeRenderEnv.instances = []
    yield root
    for name in [m for m in sys.modules if m == "libero" or m.startswith("libero.")]:
        del sys.modules[name]


def test_builds_and_steps_with_the_right_spaces_and_rotated_images(root):
    env = make_libero("libero_spatial/0", assets=root, image_size=16)
    assert FakeRenderEnv.instances == []  # the simulator is built at the first reset, where it runs
    assert env.observation_space["pixels"].shape == (16, 16, 6) and env.observation_space["state"].shape == (8,)
    assert env.action_space.shape == (7,) and env.max_episode_steps == 220
    obs, info = env.reset(seed=0)
    sim = FakeRenderEnv.instances[0]
    assert sim.bddl_file_name == str(root / "bddl_files" / "libero_spatial" / f"{TASKS['libero_spatial'][0]}.bddl")
    assert (sim.h, sim.w, sim.cams) == (16, 16, ["agentview", "robot0_eye_in_hand"])
    assert sim.horizon >= 220 + 10 and len(sim.seeds) == 1
    assert [a.tolist() for a in sim.actions] == [NOOP] * 10  # settle steps
    assert info["language"].startswith("pick up the black bowl") and 0 <= info["init_state"] < N_INIT
    assert env.observation_space.contains(obs)
    px, state = obs["pixels"], obs["state"]
    assert px.dtype == np.uint8 and state.dtype == np.float32
    assert px[0, 0].tolist() == [15, 15, 100, 15, 15, 101]  # rotated 180 degrees, cameras on channels
    assert px[-1, 0].tolist() == [0, 15, 100, 0, 15, 101]
    np.testing.assert_allclose(state, [0.1, 0.2, 0.3, 0, 0, math.pi / 2, 0.04, -0.04], atol=1e-6)
    obs, reward, terminated, truncated, info = env.step(np.full(7, 2.0, np.float32))
    assert sim.actions[-1].tolist() == [1.0] * 7  # clipped to the action space
    assert env.observation_space.contains(obs) and info == {"is_success": False}
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert env.render().shape == (16, 16, 3)
    env.close()
    assert sim.closed


def test_success_terminates_and_says_so(root):
    env = make_libero("spatial/0", assets=root, init_state=0)
    env.reset(seed=1)
    outs = [env.step(np.zeros(7, np.float32)) for _ in range(3)]
    assert [o[2] for o in outs] == [False, False, True] and [o[4]["is_success"] for o in outs] == [False, False, True]
    assert outs[-1][1] == 1.0 and not outs[-1][3]


@pytest.mark.parametrize("suite", SUITES)
def test_episodes_are_truncated_at_the_suite_limit(root, suite):
    env = make_libero(f"{suite}/0", assets=root, image_size=8, init_state=1)  # init state 1 never succeeds
    assert env.max_episode_steps == MAX_STEPS[suite] == {"libero_spatial": 220, "libero_object": 280,
                                                         "libero_goal": 300, "libero_10": 520, "libero_90": 400}[suite]
    env.reset(seed=0)
    ends = [env.step(np.zeros(7))[2:4] for _ in range(env.max_episode_steps)]
    assert ends[-1] == (False, True) and not any(any(e) for e in ends[:-1])


def test_short_limit_and_the_robosuite_horizon(root):
    env = make_libero("goal/0", assets=root, max_episode_steps=5, init_state=2, settle_steps=0, horizon=50)
    env.reset()
    assert [env.step(np.zeros(7))[3] for _ in range(5)] == [False] * 4 + [True]
    assert FakeRenderEnv.instances[0].horizon == 50 and FakeRenderEnv.instances[0].actions[0].tolist() == [0] * 7
    long = make_libero("goal/0", assets=root, max_episode_steps=2000)
    long.reset()
    assert FakeRenderEnv.instances[1].horizon >= 2010  # LIBERO's default 1000 would stop it early


def test_seeded_resets_are_reproducible(root):
    def run(env, seed):
        first = env.reset(seed=seed)[1]["init_state"]
        return [first] + [env.reset()[1]["init_state"] for _ in range(7)]

    a, b, c = (make_libero("spatial/1", assets=root) for _ in range(3))
    assert run(a, 7) == run(b, 7) != run(c, 8)
    sims = FakeRenderEnv.instances
    assert sims[0].seeds == sims[1].seeds != sims[2].seeds  # LIBERO's own (numpy global) seed too
    assert len(set(run(a, 7))) > 1  # init states vary over episodes
    d = make_libero("spatial/1", assets=root, seed=7)  # seed= seeds the first reset
    assert run(d, None) == run(b, 7)
    fixed = make_libero("spatial/1", assets=root, init_state=3)
    assert {fixed.reset(seed=s)[1]["init_state"] for s in range(4)} == {3}
    assert FakeRenderEnv.instances[-1].state.tolist() == [3, 3, 3, 3]
    assert fixed.reset(options={"init_state": 4})[1]["init_state"] == 4


def test_assets_from_the_environment_variable_or_the_argument(root, monkeypatch, tmp_path):
    monkeypatch.setenv("EBRL_LIBERO_ASSETS", str(root))
    make_libero("object/0").reset()
    assert FakeRenderEnv.instances[-1].bddl_file_name.startswith(str(root / "bddl_files" / "libero_object"))
    monkeypatch.setenv("EBRL_LIBERO_ASSETS", str(tmp_path / "elsewhere"))
    make_libero("object/0", assets=str(root)).reset()  # the argument wins
    assert FakeRenderEnv.instances[-1].bddl_file_name.startswith(str(root))


def test_libero_config_is_private_and_nothing_prompts(root, tmp_path):
    with pytest.raises(AssertionError, match="prompted"):  # the fake does prompt without a config
        importlib.import_module("libero.libero")
    sys.modules.pop("libero.libero", None)
    make_libero("spatial/0", assets=root)
    config_dir = os.environ["LIBERO_CONFIG_PATH"]
    pkg = sys.modules["libero.libero"]
    assert pkg.config_file == os.path.join(config_dir, "config.yaml") and os.path.isfile(pkg.config_file)
    assert not config_dir.startswith(str(tmp_path / "home")) and not os.path.exists(tmp_path / "home" / ".libero")
    assert pkg.get_libero_path("bddl_files") == str(root / "bddl_files")
    assert pkg.get_libero_path("init_states") == str(root / "init_files")
    assert pkg.get_libero_path("assets") == str(root / "assets")


def test_a_libero_install_without_its_meshes_is_flagged(root, monkeypatch, tmp_path):
    monkeypatch.setattr(FakeLiberoImporter, "package_file", str(tmp_path / "site" / "libero" / "__init__.py"))
    with pytest.warns(UserWarning, match=r"no assets/ folder.*pip install -e LIBERO"):
        make_libero("spatial/0", assets=root)


def test_task_names_and_suites(root, monkeypatch):
    assert SUITES == ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
    assert task_names("spatial") == TASKS["libero_spatial"] == task_names("libero_spatial")  # no assets needed
    env = make_libero(f"90/{TASKS['libero_90'][0]}", assets=root)
    assert env.task == f"libero_90/{TASKS['libero_90'][0]}"
    env = make_libero("spatial/pick up the black bowl on the stove and place it on the plate", assets=root)
    assert env.task.endswith("on_the_stove_and_place_it_on_the_plate")
    monkeypatch.setitem(sys.modules, "libero", None)
    assert task_names("spatial") == []


def test_missing_libero_says_what_to_install(root, monkeypatch):
    monkeypatch.setitem(sys.modules, "libero", None)  # import now fails, as when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'ebrl\[libero\]'.*not on PyPI.*Lifelong-Robot-Learning/LIBERO"):
        make_libero("spatial/0", assets=root)


def test_missing_or_incomplete_assets_are_named(root, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"assets= or set EBRL_LIBERO_ASSETS.*never downloaded"):
        make_libero("spatial/0")
    partial = tmp_path / "partial"
    (partial / "bddl_files").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"assets= .*partial lacks init_files/, assets/"):
        make_libero("spatial/0", assets=partial)
    monkeypatch.setenv("EBRL_LIBERO_ASSETS", str(partial))
    with pytest.raises(FileNotFoundError, match=r"\$EBRL_LIBERO_ASSETS .*lacks init_files/"):
        make_libero("spatial/0")
    (root / "init_files" / "libero_goal" / f"{TASKS['libero_goal'][0]}.pruned_init").unlink()
    with pytest.raises(FileNotFoundError, match=r"pruned_init is missing"):
        make_libero("goal/0", assets=root)


def test_unknown_suites_and_tasks_suggest_close_matches(root):
    with pytest.raises(ValueError, match=r"unknown LIBERO suite 'libero_spacial'; did you mean libero_spatial"):
        make_libero("libero_spacial/0", assets=root)
    with pytest.raises(ValueError, match=r"did you mean libero_object"):
        make_libero("objcet/0", assets=root)
    with pytest.raises(ValueError, match=r"did you mean pick_up_the_black_bowl_on_the_plate_and_place_it_on_the_plate"):
        make_libero("spatial/pick_up_the_black_bowl_on_the_plat_and_place_it_on_the_plate", assets=root)
    with pytest.raises(ValueError, match=r"unknown LIBERO task '3' in libero_spatial \(tasks 0\.\.2"):
        make_libero("spatial/3", assets=root)
    with pytest.raises(ValueError, match="expected '<suite>/<task index or name>'"):
        make_libero("spatial", assets=root)
    with pytest.raises(ValueError, match=r"init_state=9: .* init states 0\.\.4"):
        make_libero("spatial/0", assets=root, init_state=9)


def test_runs_under_the_runtime_and_success_reaches_the_stats(root):
    # env 0 starts from init state 0 and succeeds after 3 steps; env 1 never does and is truncated at 10
    res = ebrl.run_sync(ebrl.Trainer(
        lambda i: make("libero/libero_spatial/0", assets=root, pixels=8, max_episode_steps=10, init_state=i),
        MockPolicy(act_dim=7), NoopAlgo(),
        RunConfig(num_envs=2, total_env_steps=40, segment_len=10, sim=SimConfig(backend="inline"))))
    assert res.env_steps == 40 and res.accounting_ok() and res.steps_per_env == [20, 20]
    assert res.episodes == 8  # 6 successes of 3 steps, 2 truncations of 10
    assert res.success_once == res.success_at_end == 0.75


@pytest.mark.filterwarnings("ignore:.*observation space m.* value is .*infinity")  # the proprio is unbounded
def test_passes_gymnasiums_env_checker(root):
    from gymnasium.utils.env_checker import check_env

    check_env(make_libero("spatial/1", assets=root, image_size=8), skip_render_check=True)
