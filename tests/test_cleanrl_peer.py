"""The CleanRL-style PPO peer (bench/peers/cleanrl_ppo.py): counts and keys, Box-only observations,
Discrete actions, that it learns, and that it leaves torch's threads and NumPy's global RNG alone."""

import importlib.util
import math
from pathlib import Path
from typing import ClassVar

import gymnasium as gym
import numpy as np
import pytest
import torch

from ebrl.testing import MockEnv

# Loaded by path without a sys.modules entry, as ebrl.benchmark loads its peers.
_path = Path(__file__).parent.parent / "bench/peers/cleanrl_ppo.py"
_spec = importlib.util.spec_from_file_location("ebrl_bench_peers_cleanrl_ppo", _path)
cleanrl_ppo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cleanrl_ppo)

KEYS = {"peer", "env_steps", "wall_s", "steps_per_s", "rollout_s", "train_s", "rollout_steps_per_s", "updates",
        "mean_return", "first_step_s", "first_update_s", "steady_steps_per_s"}  # the keys of gym_vector.run_peer's result
N, T = 4, 8


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The peer leaves torch at its default (one thread per core), and on a 2-core machine shared with
    other work torch's second thread spin-waits: the same runs take 10x longer. The tests run on one
    thread (the peer never changes it; test_leaves_torch_threads... checks that)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def run(env_fn, total_env_steps=N * T * 3 - 5, **kw):
    kw = {"num_envs": N, "segment_len": T, "minibatch_size": 16, "seed": 3, **kw}
    return cleanrl_ppo.run_cleanrl(env_fn, total_env_steps=total_env_steps, **kw)


class OnesEnv(MockEnv):
    """Earns exactly 1 a step, so every finished episode returns ``episode_len``; records closes."""

    closed: ClassVar[list[int]] = []

    def step(self, action):
        obs, _, term, trunc, info = super().step(action)
        return obs, 1.0, term, trunc, info

    def close(self):
        OnesEnv.closed.append(id(self))


class DictObsEnv(OnesEnv):
    def __init__(self):
        super().__init__(dim=3)
        self.observation_space = gym.spaces.Dict({"state": self.observation_space})

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        return {"state": obs}, info

    def step(self, action):
        obs, *rest = super().step(action)
        return {"state": obs}, *rest


@pytest.mark.parametrize("action", ["box", "discrete"])
def test_counts_keys_and_returns_on_mockenv(action):
    OnesEnv.closed.clear()
    out = run(lambda i: OnesEnv(dim=3, action=action, episode_len=12))  # episodes end mid-segment
    assert set(out) == KEYS and out["peer"] == "cleanrl"
    assert out["updates"] == 3 and out["env_steps"] == 3 * N * T  # whole iterations: the first reaching 91
    assert out["mean_return"] == 12.0  # raw returns of finished episodes
    assert 0 < out["rollout_s"] and 0 < out["train_s"] and out["rollout_s"] + out["train_s"] <= out["wall_s"]
    assert out["steps_per_s"] == pytest.approx(out["env_steps"] / out["wall_s"])
    assert out["rollout_steps_per_s"] == pytest.approx(out["env_steps"] / out["rollout_s"])
    assert len(OnesEnv.closed) == N  # every env closed


def test_halfcheetah_v5_tiny_run():
    pytest.importorskip("mujoco")
    out = cleanrl_ppo.run_cleanrl(lambda i: gym.make("HalfCheetah-v5"), num_envs=2, segment_len=8,
                                  total_env_steps=17, minibatch_size=8, seed=0)
    assert set(out) == KEYS
    assert out["updates"] == 2 and out["env_steps"] == 2 * 2 * 8
    assert math.isnan(out["mean_return"])  # 1000-step episodes: none finished


def test_dict_observations_raise_a_clear_error_and_close_the_envs():
    OnesEnv.closed.clear()
    with pytest.raises(ValueError, match="CleanRL peer takes Box observations"):
        run(lambda i: DictObsEnv())
    assert len(OnesEnv.closed) == N


def test_envs_closed_when_an_env_fails():
    class Failing(OnesEnv):
        pass

    OnesEnv.closed.clear()
    with pytest.raises(RuntimeError, match="injected fault"):
        run(lambda i: Failing(dim=3, fail_at_step=5 if i == 1 else None))
    assert len(OnesEnv.closed) == N


def test_normalize_wrappers_keep_mean_return_in_raw_reward():
    out = run(lambda i: OnesEnv(dim=3, episode_len=12), normalize=True)
    assert out["mean_return"] == 12.0  # from RecordEpisodeStatistics, beneath NormalizeReward
    with pytest.raises(TypeError):
        run(lambda i: OnesEnv(dim=3), no_such_arg=1)


def test_leaves_torch_threads_and_numpy_global_rng_alone(monkeypatch):
    torch.set_num_threads(3)  # not the default: a peer that set or reset the count would change it
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    np_state = np.random.get_state()
    run(lambda i: MockEnv(dim=3, episode_len=12))
    assert torch.get_num_threads() == 3 and calls == []  # CleanRL never sets them: torch's default
    after = np.random.get_state()
    assert after[0] == np_state[0] and (after[1] == np_state[1]).all() and after[2:] == np_state[2:]


def test_seeded_runs_repeat():
    env_fn = lambda i: MockEnv(dim=3, episode_len=12)
    a, b, c = run(env_fn, seed=7), run(env_fn, seed=7), run(env_fn, seed=8)
    assert a["mean_return"] == b["mean_return"] != c["mean_return"]


@pytest.mark.parametrize("action, steps, gain", [("box", 10240, 2.5), ("discrete", 10240, 5.0)])
def test_learns_mockenv(action, steps, gain):
    """MockEnv rewards matching the target: the trained policy's returns (last 100 episodes) are
    well above the initial policy's (the first iteration's episodes) on the same seed. Measured
    over seeds 0-4 (each repeats bit for bit: seeded, one torch thread): box 3.7-4.1 -> 7.2-7.6
    of 16 (gain 3.27-3.75), discrete 5.1-5.5 -> 13.9-14.2 (gain 8.54-9.11)."""
    env_fn = lambda i: MockEnv(dim=3, action=action, episode_len=16)
    kw = {"num_envs": 64, "segment_len": 16, "minibatch_size": 256, "lr": 1e-3, "seed": 0}
    start = cleanrl_ppo.run_cleanrl(env_fn, total_env_steps=64 * 16, **kw)["mean_return"]
    end = cleanrl_ppo.run_cleanrl(env_fn, total_env_steps=steps, **kw)["mean_return"]
    print(f"cleanrl peer {action}: {start:.3f} -> {end:.3f}")  # with -s
    assert end > start + gain, (start, end)


class CountEnv(gym.Env):
    """Observes the steps since reset; ends (terminated or truncated) after ``episode_len`` steps."""

    def __init__(self, episode_len=12, terminate=False):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.episode_len, self.terminate, self._t = episode_len, terminate, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return np.array([0.0, 1.0], np.float32), {}

    def step(self, action):
        self._t += 1
        end = self._t >= self.episode_len
        return np.array([self._t, 1.0], np.float32), 1.0, end and self.terminate, end and not self.terminate, {}


@pytest.mark.parametrize("terminate", [False, True])
def test_time_limit_ends_bootstrap_from_the_final_observation(monkeypatch, terminate):
    """Same-step autoreset: the value of ``info["final_obs"]`` (t == episode_len, never a rollout
    observation: the env has reset) is computed once per truncation, and never for a termination."""
    seen = []

    class SpyAgent(cleanrl_ppo.Agent):
        def get_value(self, x):
            seen.append(x.detach().clone())
            return super().get_value(x)

    monkeypatch.setattr(cleanrl_ppo, "Agent", SpyAgent)
    run(lambda i: CountEnv(episode_len=12, terminate=terminate))  # 24 steps per env: 2 episode ends each
    rows = torch.cat(seen)
    assert int((rows[:, 0] == 12).sum()) == (0 if terminate else 2 * N)
