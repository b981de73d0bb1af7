"""The gymnasium vector-env peer baselines (bench/peers/gym_vector.py): counts, cleanup, and
that the "sync" peer is the same computation as EBRL's sync schedule at lag 0."""

import importlib.util
import math
import multiprocessing
import os
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import ebrl
from ebrl.algos import PPO
from ebrl.policies import MLPPolicy
from ebrl.testing import MockEnv

_path = Path(__file__).parent.parent / "bench/peers/gym_vector.py"
_spec = importlib.util.spec_from_file_location("ebrl_bench_peers_gym_vector", _path)
gym_vector = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gym_vector)

N, T, UPDATES, SEED = 4, 8, 3, 5


def make_env(i=0, episode_len=12):
    return MockEnv(dim=3, episode_len=episode_len)  # episodes end mid-segment: truncation bootstraps are exercised


def fresh():
    probe = make_env()
    return MLPPolicy.from_spaces(probe.observation_space, probe.action_space, seed=1), PPO(minibatch_size=64, seed=2)


def run_peer(kind, env_fn=make_env, policy=None):
    p, algo = fresh()
    policy = policy or p
    out = gym_vector.run_peer(kind, env_fn, policy, algo, num_envs=N, segment_len=T,
                              total_env_steps=N * T * UPDATES, seed=SEED)
    return out, policy


def new_children(before):
    return [p for p in multiprocessing.active_children() if p.pid not in before]


class PidEnv(MockEnv):
    """Records the id of the process it was built in, to see where the vector env runs it;
    earns exactly 1 a step, so every finished episode returns ``episode_len``."""

    def __init__(self, log_dir, episode_len=12):
        super().__init__(dim=3, episode_len=episode_len)
        (Path(log_dir) / str(os.getpid())).touch()

    def step(self, action):
        obs, _, term, trunc, info = super().step(action)
        return obs, 1.0, term, trunc, info


class NoGcCloseAsync(gym.vector.AsyncVectorEnv):
    """gymnasium terminates the workers when the vector env is garbage collected; without
    that, only the peer's own ``close()`` ends them."""

    def __del__(self):
        pass


@pytest.fixture
def no_gc_close(monkeypatch):
    monkeypatch.setitem(gym_vector.KINDS, "async", NoGcCloseAsync)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_peer_counts_rates_and_cleanup(kind, tmp_path, no_gc_close):
    before = {p.pid for p in multiprocessing.active_children()}
    threads = torch.get_num_threads()
    out, _ = run_peer(kind, env_fn=lambda i: PidEnv(tmp_path))
    assert out["peer"] == f"gym-{kind}"
    assert out["env_steps"] == N * T * UPDATES == 96 and out["updates"] == UPDATES
    for k in ("wall_s", "rollout_s", "train_s", "steps_per_s", "rollout_steps_per_s"):
        assert math.isfinite(out[k]) and out[k] > 0, (k, out[k])
    assert out["rollout_s"] + out["train_s"] <= out["wall_s"]
    assert out["rollout_steps_per_s"] > out["steps_per_s"]
    assert out["mean_return"] == 12.0  # 24 steps an env: 8 finished 12-step episodes earning 1 a step
    assert torch.get_num_threads() == threads  # restored
    assert not new_children(before)
    pids = {int(f.name) for f in tmp_path.iterdir()}
    if kind == "sync":
        assert pids == {os.getpid()}
    else:
        assert len(pids - {os.getpid()}) == N  # one worker process an env (the parent builds a probe env)


def test_no_finished_episode_gives_nan_return(tmp_path):
    out, _ = run_peer("sync", env_fn=lambda i: PidEnv(tmp_path, episode_len=100))
    assert math.isnan(out["mean_return"])


@pytest.mark.parametrize("episode_len", [12, 3])  # 3: several time-limit ends per env per segment
def test_sync_peer_equals_ebrl_sync_schedule_at_lag_0(episode_len):
    torch.set_num_threads(1)
    env_fn = lambda i: make_env(i, episode_len)
    _, reference = run_peer("sync", env_fn=env_fn)
    policy, algo = fresh()
    cfg = ebrl.RunConfig(num_envs=N, segment_len=T, total_env_steps=N * T * UPDATES, schedule="sync",
                         max_policy_lag=0, seed=SEED, sim={"backend": "inline"}, learner="thread")
    res = ebrl.run_sync(ebrl.Trainer(env_fn, policy, algo, cfg))
    assert res.updates == UPDATES and res.lag_max == 0
    for (name, a), b in zip(reference.state_dict().items(), policy.state_dict().values()):
        assert torch.equal(a, b), name


def test_async_peer_equals_sync_peer():
    """Only the vector env differs: the same trajectories, so the same weights."""
    _, a = run_peer("async")
    _, s = run_peer("sync")
    for (name, x), y in zip(a.state_dict().items(), s.state_dict().values()):
        assert torch.equal(x, y), name


class FailingPolicy(MLPPolicy):
    def act(self, obs):
        raise RuntimeError("policy failed")


def test_async_workers_are_closed_when_the_loop_fails(no_gc_close):
    before = {p.pid for p in multiprocessing.active_children()}
    probe = make_env()
    policy = FailingPolicy.from_spaces(probe.observation_space, probe.action_space, seed=1)
    with pytest.raises(RuntimeError, match="policy failed"):
        run_peer("async", policy=policy)
    assert not new_children(before)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind='subproc'"):
        run_peer("subproc")
