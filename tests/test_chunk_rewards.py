"""Action chunks: the per-step rewards inside each chunk reach the algorithm on every sim
backend, and PPO discounts inside a chunk and by its length."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO
from ebrl.algos.advantages import build_next_values, chunk_discounting, gae
from ebrl.envs.chunks import ActionChunk
from ebrl.policies.flow import FlowPolicy
from ebrl.testing import MockEnv

K, EPISODE = 4, 10  # 10 = 4 + 4 + 2: every episode ends with a short chunk


class Recording(PPO):
    def __init__(self):
        super().__init__(minibatch_size=32, update_epochs=1)
        self.batches = []

    def update(self, policy, batch):
        self.batches.append(batch)
        return super().update(policy, batch)


def chunk_env(i=0):
    return ActionChunk(MockEnv(dim=2, episode_len=EPISODE), k=K)


def vector_chunk_env(i=0):
    return gym.vector.SyncVectorEnv([chunk_env, chunk_env], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


@pytest.mark.parametrize("backend,vector", [("inline", 1), ("thread", 1), ("process", 1), ("mixed", 1),
                                            ("thread", 2)])
def test_chunk_rewards_reach_the_algorithm(backend, vector, no_leaks):
    probe = chunk_env()
    policy = FlowPolicy.from_spaces(probe.observation_space, probe.action_space, hidden=(32,), noise_hidden=(16,), critic_hidden=(32,))
    algo = Recording()
    sim = {"backend": backend, "vector_size": vector}
    if backend == "process":
        sim["num_workers"] = 2
    res = ebrl.run_sync(ebrl.Trainer(vector_chunk_env if vector > 1 else chunk_env, policy, algo, ebrl.RunConfig(
        num_envs=4, segment_len=6, total_env_steps=240, learner="thread", sim=sim)))
    assert res.accounting_ok() and res.trained > 0
    decisions = 0
    for b in algo.batches:
        assert b.chunk_rewards is not None and b.chunk_rewards.shape == (*b.mask.shape, K)
        m = b.mask
        n = b.chunk_steps[m]
        # the episode's decisions are 4, 4, 2 env steps; the short one ends it
        end = (b.terminated | b.truncated)[m]
        assert torch.equal(n, torch.where(end, 2, 4))
        # the summed reward is the per-step rewards' sum, and the padding is zero
        torch.testing.assert_close(b.rewards[m], b.chunk_rewards[m].sum(-1))
        pad = torch.arange(K)[None, :] >= n[:, None]
        assert not b.chunk_rewards[m][pad].any() and b.chunk_rewards[m][~pad].any()
        decisions += int(m.sum())
    assert decisions == res.trained  # every trained decision carried its chunk


def test_envs_without_chunk_info_count_one_step_each():
    # a Box(K, A) action space that is not an ActionChunk: chunk_steps 0, PPO uses rewards and gamma
    r = torch.tensor([[1.0, 2.0]])
    out, disc = chunk_discounting(r, torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), gamma=0.9)
    torch.testing.assert_close(out, r)
    torch.testing.assert_close(disc, torch.full((1, 2), 0.9))


def test_chunked_returns_equal_the_per_step_returns_at_decision_boundaries():
    # lam=1 returns of decisions that each ran a chunk equal the discounted return of the
    # underlying per-step rewards, read at the steps where each decision started
    gamma = 0.9
    inner = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # one episode, terminated after 7 steps
    sizes = [3, 3, 1]
    starts = [0, 3, 6]
    per_step = torch.zeros(7)
    g = 0.0
    for t in reversed(range(7)):
        g = inner[t] + gamma * g
        per_step[t] = g
    cr = torch.zeros(1, 3, 3)
    for d, (s0, n) in enumerate(zip(starts, sizes)):
        cr[0, d, :n] = inner[s0:s0 + n]
    steps = torch.tensor([sizes])
    rewards, disc = chunk_discounting(cr.sum(-1), cr, steps, gamma)
    mask = torch.ones(1, 3, dtype=torch.bool)
    term = torch.tensor([[False, False, True]])
    values = torch.zeros(1, 3)
    nv = build_next_values(values, torch.zeros(1), torch.zeros(0), torch.zeros(0, 2, dtype=torch.long),
                           torch.zeros_like(mask), mask)
    _, ret = gae(rewards, values, nv, term, term, mask, disc, lam=1.0)
    torch.testing.assert_close(ret[0], per_step[starts])


def test_chunk_discounting_changes_ppo_targets():
    # the same batch with and without chunk info: the chunked one discounts by gamma**n
    probe = chunk_env()
    policy = FlowPolicy.from_spaces(probe.observation_space, probe.action_space, hidden=(32,), noise_hidden=(16,), critic_hidden=(32,))
    S, T = 1, 3
    obs = torch.zeros(S, T, *probe.observation_space.shape)
    out = policy.act(obs.reshape(-1, *probe.observation_space.shape).numpy())
    no = torch.zeros(S, T, dtype=torch.bool)
    from ebrl.algos import Batch
    cr = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]])
    batch = Batch(obs, torch.from_numpy(out.actions).reshape(S, T, *out.actions.shape[1:]),
                  torch.from_numpy(out.logprobs).reshape(S, T), torch.zeros(S, T), cr.sum(-1), no, no,
                  torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
                  torch.zeros(S, *probe.observation_space.shape), torch.zeros(0, *probe.observation_space.shape),
                  torch.zeros(0, 2, dtype=torch.long), chunk_rewards=cr, chunk_steps=torch.tensor([[4, 4, 2]]))
    algo = PPO(scale_rewards=False, gamma=0.5, gae_lambda=1.0)
    flat = algo.train_data(policy, batch, obs[0], *chunk_discounting(batch.rewards, cr, batch.chunk_steps, 0.5))
    plain = algo.train_data(policy, batch, obs[0], batch.rewards)
    assert not torch.allclose(flat["returns"], plain["returns"])
    # the first decision's reward is 1 + .5 + .25 + .125 = 1.875 (values are 0 besides the bootstrap)
    boot = float(policy.value(batch.bootstrap_obs)[0].detach())
    r1, r2, r3 = 1.875, 1.875, 1.5
    expect = r1 + 0.5 ** 4 * (r2 + 0.5 ** 4 * (r3 + 0.5 ** 2 * boot))
    assert float(flat["returns"][0]) == pytest.approx(expect, rel=1e-4)


def test_bad_chunk_info_is_a_clear_error():
    from ebrl.runtime.sim import StepRows
    from ebrl.runtime.sim.stepping import step_unit

    class BadChunks(gym.Env):
        observation_space, action_space = gym.spaces.Box(-1, 1, (2,)), gym.spaces.Box(-1, 1, (K, 2))

        def step(self, action):
            return np.zeros(2, np.float32), 1.0, False, False, {"chunk_rewards": np.zeros(3), "chunk_steps": 2}

    env = BadChunks()
    rows = StepRows(1, env.observation_space, env.action_space)
    with pytest.raises(ValueError, match="chunk_rewards"):
        step_unit(env, rows, 0)
