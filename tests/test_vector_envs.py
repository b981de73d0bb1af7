"""Vectorised envs (``sim.vector_size > 1``): one simulator stepping many envs, one task each."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.config import ConfigError
from ebrl.runtime.sim import StepRows
from ebrl.runtime.sim.stepping import reset_unit, step_unit
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, mock_vector_env, run_virtual
from tests.test_training import SEED, UPDATES, N, T, fresh, make_env, plain_sync_ppo

SAME, DISABLED = gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.DISABLED


@pytest.mark.parametrize("size, mode, backend", [(N, SAME, "inline"), (2, SAME, "thread"), (2, DISABLED, "inline")])
def test_vectorised_sync_at_lag_0_equals_plain_synchronous_ppo(size, mode, backend):
    """The same training, bit for bit, whether the envs are stepped one by one or as vector envs."""
    torch.set_num_threads(1)
    reference = plain_sync_ppo()
    policy, algo = fresh()
    cfg = ebrl.RunConfig(num_envs=N, segment_len=T, total_env_steps=N * T * UPDATES, schedule="sync",
                         max_policy_lag=0, seed=SEED, learner="thread",
                         sim={"backend": backend, "vector_size": size})
    res = ebrl.run_sync(ebrl.Trainer(lambda k: gym.vector.SyncVectorEnv([make_env] * size, autoreset_mode=mode),
                                     policy, algo, cfg))
    assert res.updates == UPDATES and res.accounting_ok()
    assert res.gen_batch_hist == {N: N * T * UPDATES // N}  # one policy call per lockstep step
    for (name, a), b in zip(reference.state_dict().items(), policy.state_dict().values()):
        assert torch.equal(a, b), name


def vec_trainer(schedule="async", units=4, size=4, slow=None, total=8000, lag=1, **cfg):
    def env_fn(k):
        latency = Latency.constant(0.010 if k == slow else 0.001)
        return mock_vector_env(size, latency=latency)

    return ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(base_cost_s=0.002),
                        ebrl.RunConfig(num_envs=units * size, segment_len=16, total_env_steps=total,
                                       schedule=schedule, max_policy_lag=lag,
                                       sim={"vector_size": size, "num_threads": units}, **cfg))


def test_async_vector_envs_do_not_wait_for_each_other():
    res = run_virtual(vec_trainer("async", slow=0))
    per_unit = [res.steps_per_env[k * 4:(k + 1) * 4] for k in range(4)]
    assert all(len(set(u)) == 1 for u in per_unit)  # a vector env steps its envs together
    assert min(u[0] for u in per_unit[1:]) >= 5 * per_unit[0][0]  # the slow one (10x) holds nobody back
    assert res.accounting_ok() and res.env_steps == 8000


def test_sync_vector_envs_are_held_to_the_slowest():
    res = run_virtual(vec_trainer("sync", slow=0))
    assert len(set(res.steps_per_env)) == 1 and res.accounting_ok()


def test_pipelined_splits_whole_vector_envs_into_groups():
    res = run_virtual(vec_trainer("pipelined", slow=0, num_groups=2))
    steps = res.steps_per_env
    assert len(set(steps[:8])) == 1 and len(set(steps[8:])) == 1  # vector envs 0+1 and 2+3 in lockstep
    assert steps[8] > steps[0]  # the second group does not wait for the first one's slow vector env
    assert res.accounting_ok()


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_vector_envs_respect_the_policy_lag_bound(lag):
    res = run_virtual(vec_trainer("async", lag=lag, total=6000))
    assert res.lag_max <= lag and res.accounting_ok()


def test_one_vector_env_request_is_one_batch_row_block():
    res = run_virtual(vec_trainer("async", units=1, size=8, total=800))
    assert res.gen_batch_hist == {8: 100}


def test_a_failing_vector_env_is_rebuilt_whole_and_accounted():
    made = []

    def env_fn(k):
        made.append(k)
        first = made.count(k) == 1
        return gym.vector.SyncVectorEnv(
            [lambda j=j: MockEnv(latency=Latency.constant(0.001),
                                 fail_at_step=5 if (k == 1 and j == 2 and first) else None) for j in range(4)],
            autoreset_mode=SAME)

    cfg = ebrl.RunConfig(num_envs=8, segment_len=8, total_env_steps=800, sim={"vector_size": 4})
    res = run_virtual(ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(), cfg))
    assert made.count(1) == 2 and res.env_failures == 1
    assert res.dropped == {"env_error": 16}  # steps 1-4 of each of the 4 envs' open segments
    assert res.env_steps == 800 and res.accounting_ok()


def test_nonfinite_in_one_row_drops_and_resets_only_that_env():
    def env_fn(k):
        return gym.vector.SyncVectorEnv(
            [lambda j=j: MockEnv(nan_at_step=7 if (k == 0 and j == 1) else None) for j in range(4)],
            autoreset_mode=SAME)

    cfg = ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=800, sim={"vector_size": 4},
                         faults={"nonfinite": "drop"})
    res = run_virtual(ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(), cfg))
    assert res.dropped == {"nonfinite": 7}  # env 1's six good steps and the bad one
    assert res.env_failures == 0 and res.accounting_ok()


def test_real_mujoco_vector_env_under_the_async_runtime(no_leaks):
    def env_fn(k):
        return gym.make_vec("HalfCheetah-v5", num_envs=4, vectorization_mode="sync",
                            vector_kwargs={"autoreset_mode": SAME}, max_episode_steps=50)

    cfg = ebrl.RunConfig(num_envs=8, segment_len=25, total_env_steps=800, sim={"vector_size": 4}, learner="thread")
    res = ebrl.run_sync(ebrl.Trainer(env_fn, MockPolicy(act_dim=6), NoopAlgo(), cfg))
    assert res.sim_backend == "thread" and res.env_steps == 800 and res.accounting_ok()
    assert res.episodes == sum(n // 50 for n in res.steps_per_env)  # 50-step episodes, reset in the step


def test_a_vector_env_steps_into_its_rows_and_resets_some():
    venv = mock_vector_env(3, dim=2, episode_len=2)
    rows, ids = StepRows(3, venv.single_observation_space, venv.single_action_space), np.arange(3)
    obs, _ = reset_unit(venv, [0, 1, 2], vector_size=3)
    assert sorted(obs) == [0, 1, 2] and obs[0].shape == (2,)
    rows.set_actions(ids, np.zeros((3, 2), np.float32))
    step_unit(venv, rows, 0, vector_size=3)
    partial, _ = reset_unit(venv, {1: 7}, vector_size=3)
    assert list(partial) == [1]
    step_unit(venv, rows, 0, vector_size=3)  # row 1 was reset: one step behind
    block = rows.block(ids)
    assert block.truncated.tolist() == [True, False, True]
    assert sorted(block.final_obs) == [0, 2]  # the rows whose episode ended carry their last observation


@pytest.mark.parametrize("env_fn, cfg, match", [
    (lambda k: MockEnv(), {"num_envs": 8, "sim": {"vector_size": 4}}, "returned MockEnv"),
    (lambda k: mock_vector_env(2), {"num_envs": 8, "sim": {"vector_size": 4}}, "VectorEnv of 2 envs"),
    (lambda k: gym.vector.SyncVectorEnv([MockEnv] * 4), {"num_envs": 8, "sim": {"vector_size": 4}}, "NEXT_STEP"),
])
def test_what_cannot_be_a_vector_env_is_refused_with_the_reason(env_fn, cfg, match):
    with pytest.raises((TypeError, ValueError), match=match):
        run_virtual(ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(), ebrl.RunConfig(**cfg)))


def test_vector_size_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="num_envs.*multiple of sim.vector_size"):
        ebrl.RunConfig(num_envs=10, sim={"vector_size": 4})
    with pytest.raises(ConfigError, match="sim.backend"):
        ebrl.run_sync(ebrl.Trainer(lambda k: mock_vector_env(2), MockPolicy(act_dim=4), NoopAlgo(),
                                   ebrl.RunConfig(num_envs=4, sim={"vector_size": 2, "backend": "process"})))
