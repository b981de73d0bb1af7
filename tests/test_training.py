"""Training through the runtime: equal to plain synchronous PPO at lag 0, and it learns."""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO, Batch
from ebrl.policies import MLPPolicy
from ebrl.testing import MockEnv, run_virtual

N, T, UPDATES, SEED = 4, 8, 3, 5


def make_env(i=0):
    return MockEnv(dim=3, episode_len=12)  # episodes end mid-segment: truncation bootstraps are exercised


def fresh():
    return MLPPolicy(3, 3, action_low=-1.0, action_high=1.0, seed=1), PPO(minibatch_size=8, update_epochs=2, seed=2)


def plain_sync_ppo():
    """The textbook loop: a gymnasium vector env, T steps, then one PPO update, repeated."""
    policy, algo = fresh()
    actor = copy.deepcopy(policy)
    envs = gym.vector.SyncVectorEnv([make_env] * N, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=[SEED + i for i in range(N)])
    for update in range(UPDATES):
        buf = {k: [] for k in ("obs", "actions", "logprobs", "values", "rewards", "terminated", "truncated")}
        finals = []
        for t in range(T):
            out = actor.act(obs)
            nxt, rew, term, trunc, info = envs.step(out.env_actions)
            for k, v in zip(buf, (obs, out.actions, out.logprobs, out.values, rew, term, trunc)):
                buf[k].append(torch.as_tensor(np.asarray(v)))
            for i in np.flatnonzero(trunc & ~term):
                finals.append((i, t, info["final_obs"][i]))
            obs = nxt
        col = {k: torch.stack(v, 1) for k, v in buf.items()}  # [N, T, ...]
        finals.sort(key=lambda f: (f[0], f[1]))
        batch = Batch(
            obs=col["obs"], actions=col["actions"], logprobs=col["logprobs"], values=col["values"],
            rewards=col["rewards"].float(), terminated=col["terminated"], truncated=col["truncated"],
            mask=torch.ones(N, T, dtype=torch.bool), versions=torch.full((N, T), update),
            bootstrap_obs=torch.as_tensor(obs),
            final_obs=torch.as_tensor(np.stack([f[2] for f in finals])) if finals else torch.zeros(0, 3),
            final_index=torch.tensor([(f[0], f[1]) for f in finals], dtype=torch.int64).reshape(-1, 2),
            learner_version=update)
        algo.update(policy, batch)
        actor.load_state_dict(policy.state_dict())
    return policy


@pytest.mark.parametrize("backend, learner", [("inline", "thread"), ("thread", "thread"), ("process", "process")])
def test_sync_schedule_at_lag_0_equals_plain_synchronous_ppo(backend, learner):
    torch.set_num_threads(1)
    reference = plain_sync_ppo()
    policy, algo = fresh()
    cfg = ebrl.RunConfig(num_envs=N, segment_len=T, total_env_steps=N * T * UPDATES, schedule="sync",
                         max_policy_lag=0, seed=SEED, sim={"backend": backend}, learner=learner)
    res = ebrl.run_sync(ebrl.Trainer(make_env, policy, algo, cfg))
    assert res.updates == UPDATES and res.lag_max == 0 and res.learner_mode == learner
    for (name, a), b in zip(reference.state_dict().items(), policy.state_dict().values()):
        assert torch.equal(a, b), name


def test_ppo_learns_the_mock_task_through_the_async_runtime():
    env_fn = lambda i: MockEnv(dim=2, episode_len=16)  # noqa: E731
    probe = env_fn(0)
    policy = MLPPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0)
    cfg = ebrl.RunConfig(num_envs=8, segment_len=32, total_env_steps=60_000)
    # virtual time: deterministic interleaving, so the threshold is not at the mercy of thread timing
    res = run_virtual(ebrl.Trainer(env_fn, policy, PPO(lr=3e-3, minibatch_size=128, ent_coef=0.0), cfg))
    first = [h["mean_return"] for h in res.history[:3]]
    # random actions earn ~2.4 a 16-step episode, a perfect policy 16
    assert max(first) < 8
    assert res.mean_return > 12, res.mean_return
    assert res.lag_max <= 1 and res.accounting_ok()
