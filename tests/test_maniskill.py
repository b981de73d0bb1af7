"""ManiSkill3 adapter, tested with a fake ManiSkill: batched torch tensors, partial resets by
``env_idx``, per-env success. (ManiSkill needs a Vulkan GPU, which this machine lacks.)"""

import functools
import sys
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.envs import make
from ebrl.testing import NoopAlgo

TASK = "PickCube-v1"


class FakeManiSkillEnv(gym.Env):
    """ManiSkill's API in miniature: an agent point moving to a goal, ``num_envs`` at once."""

    def __init__(self, num_envs=1, obs_mode="state", sensor_configs=None, max_episode_steps=10, fail=None):
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
    pkg = types.ModuleType("mani_skill")
    pkg.__path__ = []
    envs = types.ModuleType("mani_skill.envs")
    monkeypatch.setitem(sys.modules, "mani_skill", pkg)
    monkeypatch.setitem(sys.modules, "mani_skill.envs", envs)
    def registration_make(env_id, **kwargs):  # ManiSkill registers partial(its make, env_id=...)
        return FakeManiSkillEnv(**kwargs)

    registration_make.__module__ = "mani_skill.utils.registration"
    gym.register(TASK, entry_point=functools.partial(registration_make, env_id=TASK), disable_env_checker=True,
                 order_enforce=False)
    yield
    gym.registry.pop(TASK, None)


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


@pytest.mark.parametrize("error, match", [  # the messages SAPIEN 3.0.3 gives on this machine
    ("vk::createInstanceUnique: ErrorIncompatibleDriver", "Vulkan-capable GPU"),
    ("failed to find a rendering device", "Vulkan-capable GPU"),
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
    from ebrl.cli import build_spec, build_trainer, main

    trainer = build_trainer(build_spec(None, [f"env=maniskill/{TASK}", "run.num_envs=8"]))
    assert trainer.config.sim.vector_size == 8  # one GPU simulator for all envs unless told otherwise
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", f"env=maniskill/{TASK}",
                 "--set", "run.num_envs=8", "--set", "run.sim.vector_size=4", "--set", "run.segment_len=10",
                 "--set", "run.total_env_steps=320", "--set", "ppo.minibatch_size=40"])
    assert code == 0
