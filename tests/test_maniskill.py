"""ManiSkill3 adapter. The GPU vector path (:class:`ManiSkillEnvs`: batched torch tensors,
partial resets by ``env_idx``, per-env success) runs on a fake ManiSkill, as if CUDA were there;
the CPU path runs the real ManiSkill 3.0.1 on SAPIEN's CPU backend, which needs a Vulkan device
(Mesa's lavapipe here: ``.ci/install-system``); its tests skip, saying why, without one."""

import functools
import os
import subprocess
import sys
import textwrap
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.envs import make, make_vector, maniskill, natively_vectorised
from ebrl.testing import NoopAlgo

TASK = "PickCube-v1"
# ManiSkill's CPU backend checks each action with np.isnan(a torch tensor): NumPy 2 deprecates that
ARRAY_WRAP = r"__array_wrap__ must accept context"
pytestmark = pytest.mark.filterwarnings(f"ignore:{ARRAY_WRAP}:DeprecationWarning")


class FakeManiSkillEnv(gym.Env):
    """ManiSkill's API in miniature: an agent point moving to a goal, ``num_envs`` at once."""

    def __init__(self, num_envs=1, obs_mode="state", sensor_configs=None, max_episode_steps=10, fail=None,
                 sim_backend="physx_cuda", enhanced_determinism=False):
        if fail:
            raise RuntimeError(fail)
        self.num_envs, self.obs_mode, self.device = num_envs, obs_mode, torch.device("cpu")
        self.size = (sensor_configs or {}).get("height", 16), (sensor_configs or {}).get("width", 16)
        self.max_steps = max_episode_steps
        self.single_action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.pos = torch.zeros(num_envs, 2)
        self.goal = torch.zeros(num_envs, 2)
        self.elapsed = torch.zeros(num_envs, dtype=torch.int64)
        self.resets = []  # env_idx of every reset, for the tests
        self.gen = torch.Generator().manual_seed(0)

    def _obs(self):
        state = torch.cat([self.pos, self.goal], 1)
        if self.obs_mode == "state":
            return state
        h, w = self.size
        img = torch.full((self.num_envs, h, w, 3), 7, dtype=torch.uint8)
        return {"agent": {"qpos": self.pos, "qvel": torch.zeros(self.num_envs, 2)},
                "extra": {"goal_pos": self.goal},
                "sensor_param": {"base_camera": {"cam2world_gl": torch.eye(4).repeat(self.num_envs, 1, 1)}},
                "sensor_data": {"base_camera": {"rgb": img}, "hand_camera": {"rgb": img + 1}}}

    def reset(self, seed=None, options=None):
        idx = (options or {}).get("env_idx")
        idx = torch.arange(self.num_envs) if idx is None else torch.as_tensor(idx)
        if seed is not None:
            self.gen.manual_seed(int(seed[0] if isinstance(seed, list) else seed))
        self.resets.append(idx.tolist())
        self.pos[idx] = 0.0
        self.goal[idx] = torch.rand(len(idx), 2, generator=self.gen) * 0.5 + 0.25
        self.elapsed[idx] = 0
        return self._obs(), {"reconfigure": False}

    def step(self, action):
        assert isinstance(action, torch.Tensor) and action.shape == (self.num_envs, 2)
        self.pos += 0.1 * action.clamp(-1, 1)
        self.elapsed += 1
        dist = (self.pos - self.goal).norm(dim=1)
        success = dist < 0.1
        truncated = self.elapsed >= self.max_steps
        return self._obs(), -dist, success, truncated, {"success": success, "elapsed_steps": self.elapsed.clone()}


@pytest.fixture
def fake_maniskill(monkeypatch):
    monkeypatch.setattr(maniskill, "cuda_available", lambda: True)  # the fake is ManiSkill's GPU backend
    pkg = types.ModuleType("mani_skill")
    pkg.__path__ = []
    envs = types.ModuleType("mani_skill.envs")
    monkeypatch.setitem(sys.modules, "mani_skill", pkg)
    monkeypatch.setitem(sys.modules, "mani_skill.envs", envs)
    def registration_make(env_id, **kwargs):  # ManiSkill registers partial(its make, env_id=...)
        return FakeManiSkillEnv(**kwargs)

    registration_make.__module__ = "mani_skill.utils.registration"
    real = gym.registry.pop(TASK, None)  # the real ManiSkill's, once a real test imported it
    gym.register(TASK, entry_point=functools.partial(registration_make, env_id=TASK), disable_env_checker=True,
                 order_enforce=False)
    yield
    if real is None:
        gym.registry.pop(TASK, None)
    else:
        gym.registry[TASK] = real


def test_state_obs_are_host_numpy_with_vector_spaces(fake_maniskill):
    envs = make(f"maniskill/{TASK}", num_envs=4)
    assert envs.metadata["autoreset_mode"] is gym.vector.AutoresetMode.SAME_STEP
    assert envs.single_observation_space.shape == (4,) and envs.single_action_space.shape == (2,)
    obs, _ = envs.reset(seed=[1, 2, 3, 4])
    assert isinstance(obs, np.ndarray) and obs.shape == (4, 4) and obs.dtype == np.float32
    obs, rew, term, trunc, info = envs.step(np.zeros((4, 2), np.float32))
    assert rew.shape == (4,) and term.dtype == bool and info["success"].shape == (4,)
    envs.close()


def test_finished_envs_reset_in_the_same_step_and_only_they(fake_maniskill):
    envs = make(f"maniskill/{TASK}", num_envs=3)
    envs.reset(seed=0)
    base = envs.env.unwrapped
    base.goal[1] = torch.tensor([0.05, 0.0])  # env 1 succeeds at its first step
    obs, _, term, trunc, info = envs.step(np.array([[0, 0], [0.5, 0], [0, 0]], np.float32))
    assert term.tolist() == [False, True, False] and info["_final_obs"].tolist() == [False, True, False]
    assert base.resets[-1] == [1]  # ManiSkill's partial reset, env_idx = the finished env
    assert np.allclose(info["final_obs"][1][:2], [0.05, 0.0])  # the last observation of that episode
    assert np.allclose(obs[1][:2], 0.0) and info["final_info"]["success"][1]  # the next episode's first


def test_ignore_terminations_runs_a_successful_episode_to_the_time_limit(fake_maniskill):
    envs = make(f"maniskill/{TASK}", num_envs=2, ignore_terminations=True, max_episode_steps=3)
    envs.reset(seed=0)
    base = envs.env.unwrapped
    base.goal[1] = torch.tensor([0.05, 0.0])  # env 1 succeeds at its first step and stays there
    act = np.array([[0, 0], [0.5, 0]], np.float32)
    for t in (1, 2, 3):
        obs, _, term, trunc, info = envs.step(act if t == 1 else np.zeros((2, 2), np.float32))
        assert not term.any() and info["success"].tolist() == [False, True]  # success reported, the episode goes on
        assert trunc.tolist() == [t == 3, t == 3]
    assert base.resets[-1] == [0, 1]  # no partial reset at the success: both ended at the limit
    with pytest.raises(ValueError, match="ignore_terminations='yes'"):
        make(f"maniskill/{TASK}", num_envs=2, ignore_terminations="yes")


def test_pixels_give_uint8_cameras_on_channels_and_a_flat_state(fake_maniskill):
    envs = make(f"maniskill/{TASK}", num_envs=2, pixels=24)
    space = envs.single_observation_space
    assert space["pixels"].shape == (24, 24, 6) and space["pixels"].dtype == np.uint8
    assert space["state"].shape == (6,)  # qpos, qvel (agent) and goal_pos (extra)
    obs, _ = envs.reset(seed=0)
    assert obs["pixels"].shape == (2, 24, 24, 6) and obs["pixels"][0, 0, 0].tolist() == [7, 7, 7, 8, 8, 8]  # cameras by name
    one = make(f"maniskill/{TASK}", num_envs=2, pixels=24, camera="hand_camera")
    assert one.single_observation_space["pixels"].shape == (24, 24, 3)
    with pytest.raises(ValueError, match="'wrist'.*base_camera"):
        make(f"maniskill/{TASK}", num_envs=2, pixels=24, camera="wrist")


def test_trains_under_the_runtime_as_vector_envs_with_success_stats(fake_maniskill):
    class Toward:  # acts toward the goal: obs = [pos, goal]
        def act(self, obs):
            from ebrl.policies.base import ActResult
            a = np.clip((obs[:, 2:] - obs[:, :2]) * 5, -1, 1).astype(np.float32)
            n = len(obs)
            return ActResult(a, a, np.zeros(n, np.float32), np.zeros(n, np.float32))

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    cfg = ebrl.RunConfig(num_envs=8, segment_len=10, total_env_steps=800, sim={"vector_size": 4}, learner="thread")
    res = ebrl.run_sync(ebrl.Trainer(lambda k: make(f"maniskill/{TASK}", num_envs=4), Toward(), NoopAlgo(), cfg))
    assert res.env_steps == 800 and res.accounting_ok()
    assert res.episodes > 8 and res.success_once == 1.0  # every episode reaches its goal
    assert res.gen_batch_hist.keys() <= {4, 8}  # whole vector envs per batch


def test_unknown_task_suggests_close_matches(fake_maniskill):
    with pytest.raises(ValueError, match="did you mean PickCube-v1"):
        make("maniskill/PickCub-v1", num_envs=2)


@pytest.mark.parametrize("error, match", [  # the messages SAPIEN 3.0.3 gives (no Vulkan driver; no CUDA)
    ("vk::createInstanceUnique: ErrorIncompatibleDriver", "no Vulkan device.*mesa-vulkan-drivers"),
    ("failed to find a rendering device", "no Vulkan device.*mesa-vulkan-drivers"),
    ('failed to find device "cuda"', "needs a CUDA GPU"),
])
def test_missing_gpu_says_what_is_needed(fake_maniskill, error, match):
    with pytest.raises(RuntimeError, match=match):
        make(f"maniskill/{TASK}", num_envs=2, fail=error)


def test_list_envs_finds_maniskill_ids_registered_as_partials(fake_maniskill):
    from ebrl.envs import list_envs

    assert f"maniskill/{TASK}" in list_envs("maniskill")


def test_missing_maniskill_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mani_skill", None)
    with pytest.raises(ImportError, match=r"ebrl\[maniskill\]"):
        make(f"maniskill/{TASK}", num_envs=2)


def test_ebrl_train_runs_a_maniskill_task_as_one_vector_env(fake_maniskill, tmp_path):
    from ebrl.cli import main
    from ebrl.runs import build_spec, build_trainer

    trainer = build_trainer(build_spec(None, [f"env=maniskill/{TASK}", "run.num_envs=8"]))
    assert trainer.config.sim.vector_size == 8  # one GPU simulator for all envs unless told otherwise
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", f"env=maniskill/{TASK}",
                 "--set", "run.num_envs=8", "--set", "run.sim.vector_size=4", "--set", "run.segment_len=10",
                 "--set", "run.total_env_steps=320", "--set", "ppo.minibatch_size=40"])
    assert code == 0


# ---- the real ManiSkill on its CPU backend (SAPIEN through a Vulkan driver) --------------------


def real_env(**kwargs) -> gym.Env:
    """``maniskill/PickCube-v1`` on ManiSkill's CPU backend, or a skip naming what is missing."""
    pytest.importorskip("mani_skill", reason="ManiSkill3 is not installed: pip install 'ebrl[maniskill]'")
    try:
        return make(f"maniskill/{TASK}", sim_backend="physx_cpu", **kwargs)
    except RuntimeError as exc:
        if "no Vulkan device" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="module")
def cpu_env():
    env = real_env()
    yield env
    env.close()


def test_cpu_env_is_a_plain_env_with_flat_float32_state(cpu_env):
    assert isinstance(cpu_env, gym.Env) and not isinstance(cpu_env.unwrapped, gym.vector.VectorEnv)
    assert type(cpu_env.unwrapped).__name__ == "ManiSkillEnv"
    assert cpu_env.observation_space == gym.spaces.Box(-np.inf, np.inf, (42,), np.float32)
    assert cpu_env.action_space == gym.spaces.Box(-1, 1, (8,), np.float32)
    assert cpu_env.spec.id == f"maniskill/{TASK}" and cpu_env.spec.max_episode_steps == 50
    obs, info = cpu_env.reset(seed=0)
    assert obs.dtype == np.float32 and obs.shape == (42,) and obs.flags.c_contiguous
    obs, reward, terminated, truncated, info = cpu_env.step(cpu_env.action_space.sample())
    assert obs in cpu_env.observation_space and isinstance(reward, float)
    assert type(terminated) is bool and type(truncated) is bool
    assert type(info["success"]) is bool and info["elapsed_steps"] == 1


def test_cpu_seeded_reset_repeats_and_returns_arrays_of_its_own(cpu_env):
    first, info = cpu_env.reset(seed=7)
    steps = info["elapsed_steps"]
    again, _ = cpu_env.reset(seed=7)
    other, _ = cpu_env.reset(seed=8)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)  # the cube's pose is drawn from the seed
    cpu_env.step(np.zeros(8, np.float32))
    # ManiSkill's CPU backend updates its tensors in place: what was handed out must not change
    np.testing.assert_array_equal(first, again)
    assert steps == 0 and not np.shares_memory(first, again)


def test_cpu_episode_is_truncated_at_the_task_time_limit(cpu_env):
    cpu_env.reset(seed=0)
    for t in range(1, 51):  # zero actions: the arm stays, the cube is never placed
        _, _, terminated, truncated, info = cpu_env.step(np.zeros(8, np.float32))
        assert not terminated and truncated == (t == 50) and not info["success"]


def test_without_cuda_each_env_is_its_own_instance(monkeypatch):
    monkeypatch.setattr(maniskill, "cuda_available", lambda: False)
    pytest.importorskip("mani_skill", reason="ManiSkill3 is not installed")
    assert not natively_vectorised(f"maniskill/{TASK}")
    assert natively_vectorised(f"maniskill/{TASK}", sim_backend="physx_cuda")
    assert not natively_vectorised(f"maniskill/{TASK}", sim_backend="physx_cpu")
    with pytest.raises(ValueError, match=r"num_envs=4: .*one env per instance.*RunConfig\(num_envs=N\).*make_vector"):
        make(f"maniskill/{TASK}", num_envs=4)


def test_make_vector_on_the_cpu_is_a_sync_vector_env_of_cpu_envs(cpu_env):
    venv = make_vector(f"maniskill/{TASK}", 2, sim_backend="physx_cpu")
    try:
        assert isinstance(venv, gym.vector.SyncVectorEnv)
        assert venv.metadata["autoreset_mode"] is gym.vector.AutoresetMode.SAME_STEP
        obs, _ = venv.reset(seed=[1, 2])
        assert obs.shape == (2, 42) and obs.dtype == np.float32
        _, _, _, _, info = venv.step(np.zeros((2, 8), np.float32))
        assert info["success"].shape == (2,) and info["success"].dtype == bool
    finally:
        venv.close()


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_cpu_envs_train_under_the_runtime(backend, cpu_env, no_leaks):
    from ebrl.algos import PPO
    from ebrl.policies import MLPPolicy

    policy = MLPPolicy.from_spaces(cpu_env.observation_space, cpu_env.action_space)
    cfg = ebrl.RunConfig(num_envs=2, segment_len=25, total_env_steps=200, sim={"backend": backend, "num_workers": 2})
    res = await ebrl.run(ebrl.Trainer(lambda i: make(f"maniskill/{TASK}", sim_backend="physx_cpu"), policy, PPO(),
                                      cfg))
    assert res.sim_backend == backend and res.env_steps == 200 and res.trained == 200 and res.accounting_ok()
    assert res.episodes >= 2  # 100 steps an env, episodes of 50 (truncated)
    assert res.success_once is not None and res.success_at_end is not None  # ManiSkill's flag was read


def test_cpu_pixels_render_the_sensor_cameras_and_a_flat_state():
    env = real_env(pixels=64)
    try:
        space = env.observation_space
        assert space["pixels"] == gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)  # PickCube's one camera
        assert space["state"].shape == (29,) and space["state"].dtype == np.float32  # agent and extra
        obs, _ = env.reset(seed=0)
        assert obs in space and obs["pixels"].flags.c_contiguous and obs["pixels"].std() > 5  # a scene, not blank
        obs, *_ = env.step(np.zeros(8, np.float32))
        assert obs in space
    finally:
        env.close()


def test_missing_vulkan_driver_says_what_to_install(tmp_path):
    pytest.importorskip("mani_skill", reason="ManiSkill3 is not installed")
    code = textwrap.dedent(f"""
        from ebrl.envs import make
        try:
            make("maniskill/{TASK}", sim_backend="physx_cpu")
        except RuntimeError as exc:
            print("ERROR:", exc)
    """)
    none = str(tmp_path / "no_icd.json")  # the Vulkan loader then finds no driver at all
    env = {**os.environ, "VK_ICD_FILENAMES": none, "VK_DRIVER_FILES": none}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("ERROR:")]
    assert "ManiSkill found no Vulkan device (" in line and "mesa-vulkan-drivers" in line and "nvidia_icd" in line
