"""PPO, GAE and MLPPolicy: reference checks, contracts, and a tiny learning problem."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from ebrl.algos import PPO, Batch, PPOConfig, gae
from ebrl.algos.advantages import build_next_values
from ebrl.policies import ActResult, MLPPolicy, Policy

torch.set_num_threads(1)


# ---- GAE -------------------------------------------------------------------------------------


def _gae_reference(r, v, nv, term, end, lengths, gamma, lam):
    """Per-step Python GAE straight from the definition, one segment at a time."""
    S, T = r.shape
    adv = np.zeros((S, T))
    for s in range(S):
        last = 0.0
        for t in reversed(range(lengths[s])):
            delta = r[s, t] + gamma * nv[s, t] * (1.0 - term[s, t]) - v[s, t]
            if end[s, t] or t == lengths[s] - 1:
                last = delta
            else:
                last = delta + gamma * lam * last
            adv[s, t] = last
    valid = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    return adv, np.where(valid, adv + v, 0.0)


def test_gae_matches_per_step_reference():
    rng = np.random.default_rng(0)
    S, T, gamma, lam = 9, 13, 0.97, 0.9
    lengths = rng.integers(0, T + 1, S)
    lengths[0], lengths[1] = T, 0  # a full and an empty segment
    mask = np.arange(T)[None, :] < lengths[:, None]
    r, v, nv = (rng.normal(size=(S, T)) for _ in range(3))
    term = rng.random((S, T)) < 0.15
    trunc = (rng.random((S, T)) < 0.15) & ~term
    # Garbage (even NaN) in padded slots must not leak into valid ones.
    r_t, v_t, nv_t = (torch.tensor(np.where(mask, x, np.nan)) for x in (r, v, nv))
    adv, ret = gae(r_t, v_t, nv_t, torch.tensor(term), torch.tensor(term | trunc), torch.tensor(mask), gamma, lam)
    ref_adv, ref_ret = _gae_reference(r, v, nv, term, term | trunc, lengths, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-10, atol=1e-12)


def test_build_next_values_hand_checked():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    truncated = torch.tensor([[False, True, False, False], [False, True, False, False]])
    bootstrap = torch.tensor([10.0, 20.0])
    final_values = torch.tensor([100.0, 200.0])
    final_index = torch.tensor([[0, 1], [1, 1]])  # seg 1's truncation is also its last valid step
    nv = build_next_values(values, bootstrap, final_values, final_index, truncated, mask)
    expected = torch.tensor([[2.0, 100.0, 4.0, 10.0], [6.0, 200.0, 0.0, 0.0]])
    torch.testing.assert_close(nv, expected)

    with pytest.raises(ValueError, match="truncated"):  # a truncated step with no final value
        build_next_values(values, bootstrap, final_values[:1], final_index[:1], truncated, mask)


def test_gae_stops_at_truncation_but_bootstraps_through_final_value():
    # One segment, gamma = lam = 1: step 0 truncates (final V = 100), step 1 is the last valid step.
    r = torch.tensor([[1.0, 1.0]])
    v = torch.tensor([[0.0, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    trunc = torch.tensor([[True, False]])
    no = torch.zeros(1, 2, dtype=torch.bool)
    nv = build_next_values(v, torch.tensor([7.0]), torch.tensor([100.0]), torch.tensor([[0, 0]]), trunc, mask)
    adv, _ = gae(r, v, nv, no, trunc, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[101.0, 8.0]]))


# ---- MLPPolicy -------------------------------------------------------------------------------


def _box_policy(seed=0, **kw):
    obs_space = gym.spaces.Box(-5.0, 5.0, (2, 3), np.float64)
    act_space = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 0.5], np.float32))
    return MLPPolicy.from_spaces(obs_space, act_space, seed=seed, init_log_std=1.0, **kw)


def test_mlp_box_shapes_dtypes_bounds_and_evaluate():
    policy = _box_policy()
    assert isinstance(policy, Policy)
    obs = np.random.default_rng(0).normal(size=(64, 2, 3))  # float64, 2-D obs: flattened inside
    out = policy.act(obs)
    assert isinstance(out, ActResult)
    assert out.actions.shape == (64, 2) and out.actions.dtype == np.float32
    assert out.env_actions.shape == (64, 2) and out.env_actions.dtype == np.float32
    assert out.logprobs.shape == (64,) and out.logprobs.dtype == np.float32
    assert out.values.shape == (64,) and out.values.dtype == np.float32
    assert (out.env_actions >= [-1.0, 0.0]).all() and (out.env_actions <= [1.0, 0.5]).all()
    assert (out.actions != out.env_actions).any()  # std e^1: raw samples leave the box
    logp, ent, val = policy.evaluate(torch.from_numpy(obs), torch.from_numpy(out.actions))
    assert logp.shape == ent.shape == val.shape == (64,)
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.value(torch.from_numpy(obs)).detach().numpy(), out.values, rtol=1e-5, atol=1e-5)
    logp.sum().backward()
    assert policy.log_std.grad is not None


def test_mlp_discrete():
    policy = MLPPolicy.from_spaces(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), seed=1)
    obs = np.random.default_rng(1).uniform(-1, 1, (50, 4)).astype(np.float32)
    out = policy.act(obs)
    for a in (out.actions, out.env_actions):
        assert a.shape == (50,) and a.dtype == np.int64 and a.min() >= 0 and a.max() < 3
    assert out.logprobs.dtype == np.float32 and (out.logprobs <= 0).all()
    logp, ent, _ = policy.evaluate(torch.from_numpy(obs), torch.from_numpy(out.actions))
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ent, torch.full_like(ent, math.log(3)), atol=1e-3)  # near-uniform at init


def test_unsupported_spaces_raise_naming_the_space():
    with pytest.raises(ValueError, match="MultiDiscrete"):
        MLPPolicy.from_spaces(gym.spaces.Box(-1, 1, (4,)), gym.spaces.MultiDiscrete([2, 2]))
    with pytest.raises(ValueError, match="cannot read the observation, Text"):
        MLPPolicy.from_spaces(gym.spaces.Text(5), gym.spaces.Discrete(2))
    # Discrete observations are read one-hot (ebrl.policies.encoders)
    one_hot = MLPPolicy.from_spaces(gym.spaces.Discrete(4), gym.spaces.Discrete(2))
    assert one_hot.obs_dim == 4 and one_hot.act(np.array([0, 3])).actions.shape == (2,)


def test_same_seed_same_actions_different_seed_differs():
    obs = np.random.default_rng(2).normal(size=(16, 2, 3)).astype(np.float32)
    a, b, c = _box_policy(seed=5), _box_policy(seed=5), _box_policy(seed=6)
    for _ in range(3):
        ra, rb, rc = a.act(obs), b.act(obs), c.act(obs)
        np.testing.assert_array_equal(ra.actions, rb.actions)
        np.testing.assert_array_equal(ra.logprobs, rb.logprobs)
        assert not np.array_equal(ra.actions, rc.actions)


def test_state_dict_carries_obs_stats_not_generator():
    src = _box_policy(seed=0)
    src.update_obs_stats(torch.randn(100, 2, 3, dtype=torch.float64) * 3 + 1)
    state = src.state_dict()
    # the observation encoder's buffers (ebrl.policies.encoders; older names load too, see tests/test_obs_encoder.py)
    assert {"obs_encoder.obs_mean", "obs_encoder.obs_var", "obs_encoder.obs_count"} <= set(state)
    assert not any(isinstance(v, torch.Generator) or "gen" in k for k, v in state.items())
    dst = _box_policy(seed=1)
    dst.load_state_dict(state)
    obs = np.random.default_rng(3).normal(size=(8, 2, 3))
    np.testing.assert_array_equal(src.act(obs).values, dst.act(obs).values)
    # and the stats are what a one-shot mean/var gives (parallel Welford merge)
    x = torch.randn(1000, 6, dtype=torch.float64)
    p = MLPPolicy(6, 1)
    for chunk in x.split(137):
        p.update_obs_stats(chunk)
    torch.testing.assert_close(p.obs_encoder.obs_mean.double(), x.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.obs_encoder.obs_var.double(), x.var(0, unbiased=False), rtol=1e-3, atol=1e-3)
    assert not any("obs_mean" in k for k in MLPPolicy(6, 1, normalize_obs=False).state_dict())


# ---- PPO -------------------------------------------------------------------------------------


def _bandit_batch(policy, rng, S=8, T=64, version=0):
    """Contextual bandit: obs in [-1, 1]^2, reward -|a - obs|_1, every step terminates."""
    obs = rng.uniform(-1, 1, (S * T, 2)).astype(np.float32)
    out = policy.act(obs)
    reward = -np.abs(out.env_actions - obs).sum(1)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).reshape(S, T, *x.shape[1:])  # noqa: E731
    batch = Batch(
        obs=t(obs), actions=t(out.actions), logprobs=t(out.logprobs), values=t(out.values),
        rewards=t(reward.astype(np.float32)),
        terminated=torch.ones(S, T, dtype=torch.bool), truncated=torch.zeros(S, T, dtype=torch.bool),
        mask=torch.ones(S, T, dtype=torch.bool), versions=torch.full((S, T), version),
        bootstrap_obs=torch.from_numpy(rng.uniform(-1, 1, (S, 2)).astype(np.float32)),
        final_obs=torch.zeros(0, 2), final_index=torch.zeros(0, 2, dtype=torch.long),
        learner_version=version,
    )
    return batch, float(reward.mean())


def _train_bandit(updates, seed=0, **ppo_kw):
    policy = MLPPolicy(2, 2, action_low=-1, action_high=1, seed=seed)
    algo = PPO(seed=seed, **ppo_kw)
    rng = np.random.default_rng(seed)
    rewards, metrics = [], []
    for i in range(updates):
        batch, r = _bandit_batch(policy, rng)
        rewards.append(r)
        metrics.append(algo.update(policy, batch))
    return policy, rewards, metrics


def test_ppo_learns_contextual_bandit():
    # deterministic (seeded, one torch thread: this module's); over seeds 0-4 the gain is 0.71-0.82
    _, rewards, metrics = _train_bandit(40, lr=3e-3, minibatch_size=128)
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    print(f"bandit: {first:.3f} -> {last:.3f}")  # with -s
    assert last > first + 0.5, (first, last)
    m = metrics[-1]
    expected = {"policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance",
                "lag_mean", "lag_max", "num_steps", "reward_scale"}
    assert expected <= set(m) and all(isinstance(v, float) for v in m.values())
    assert m["num_steps"] == 8 * 64 and m["lag_max"] == 0.0
    assert m["entropy"] < metrics[0]["entropy"]  # the Gaussian narrowed


def test_ppo_same_seeds_same_weights():
    a, _, ma = _train_bandit(3, seed=3, minibatch_size=100)
    b, _, mb = _train_bandit(3, seed=3, minibatch_size=100)
    c, _, _ = _train_bandit(3, seed=4, minibatch_size=100)
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k
    assert ma == mb
    assert not torch.equal(a.actor[0].weight, c.actor[0].weight)


def test_critic_warmup_trains_the_critic_alone_then_both():
    policy = MLPPolicy(2, 2, action_low=-1, action_high=1, seed=0, normalize_obs=False)
    algo = PPO(seed=0, critic_warmup_updates=2, minibatch_size=128)
    rng = np.random.default_rng(0)

    def snapshot():
        return {k: v.clone() for k, v in policy.state_dict().items()}

    def moved(before):
        return {k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])}

    for i in range(2):  # the warm-up: only the critic's weights move, the policy acts as it did
        before = snapshot()
        m = algo.update(policy, _bandit_batch(policy, rng)[0])
        assert m["critic_warmup"] == 1.0 and moved(before) and all(k.startswith("critic") for k in moved(before))
    before = snapshot()
    m = algo.update(policy, _bandit_batch(policy, rng)[0])
    assert m["critic_warmup"] == 0.0 and any(k.startswith("actor") for k in moved(before)) and "log_std" in moved(before)
    # a resumed run does not warm up again
    again = PPO(seed=0, critic_warmup_updates=2)
    again.load_state_dict(algo.state_dict())
    assert again.updates == 3
    with pytest.raises(ValueError, match="critic_warmup_updates"):
        PPO(critic_warmup_updates=-1)


def test_ppo_config_overrides_and_validation():
    assert PPO(lr=1e-3).config.lr == 1e-3
    assert PPO(PPOConfig(gamma=0.9), lr=1e-3).config.gamma == 0.9
    with pytest.raises(ValueError, match="gae_lambda"):
        PPO(gae_lambda=1.5)
    with pytest.raises(ValueError, match="minibatch_size"):
        PPOConfig(minibatch_size=0)
    with pytest.raises(TypeError, match="learning_rate.*lr"):
        PPO(learning_rate=1e-3)


def test_ppo_custom_loss_is_used():
    calls = []

    class Counting(PPO):
        def loss(self, policy, mb):
            calls.append(len(mb["obs"]))
            return super().loss(policy, mb)

    policy = MLPPolicy(2, 2, seed=0)
    batch, _ = _bandit_batch(policy, np.random.default_rng(0), S=2, T=10, version=3)
    batch.versions[0] = 1  # half the steps acted two versions ago
    m = Counting(update_epochs=2, minibatch_size=8).update(policy, batch)
    assert calls == [8, 8, 4] * 2
    assert m["lag_max"] == 2.0 and m["lag_mean"] == 1.0

    seen = []

    def zero_loss(policy, mb):
        seen.append(mb["advantages"].shape[0])
        return policy.log_std.sum() * 0.0, {"custom": 1.0}

    before = {k: v.clone() for k, v in policy.state_dict().items() if not k.startswith("obs_")}
    m = PPO(loss_fn=zero_loss, update_epochs=1, minibatch_size=20).update(policy, batch)
    assert seen == [20] and m["custom"] == 1.0
    for k, v in before.items():
        assert torch.equal(v, policy.state_dict()[k]), k


def test_ppo_ratio_uses_behaviour_logprobs():
    # Without obs normalisation the policy is unchanged until the first step, so a fresh batch
    # has ratio 1 (KL 0) while a batch acted by an older policy does not.
    policy = MLPPolicy(2, 2, seed=0, normalize_obs=False)
    old = MLPPolicy(2, 2, seed=9, normalize_obs=False, init_log_std=0.5)
    rng = np.random.default_rng(0)
    fresh, _ = _bandit_batch(policy, rng, S=2, T=8)
    stale, _ = _bandit_batch(old, rng, S=2, T=8)
    kw = dict(update_epochs=1, minibatch_size=16, scale_rewards=False)
    m_fresh = PPO(**kw).update(policy, fresh)
    assert m_fresh["approx_kl"] == pytest.approx(0.0, abs=1e-6) and m_fresh["clipfrac"] == 0.0
    policy = MLPPolicy(2, 2, seed=0, normalize_obs=False)
    m_stale = PPO(**kw).update(policy, stale)
    assert m_stale["approx_kl"] > 1e-3


@pytest.mark.parametrize("discrete", [False, True])
def test_numpy_inference_matches_the_torch_distribution(discrete):
    """The CPU fast path acts from the same distribution: its log-probs and values agree with evaluate()."""
    kw = {"discrete_actions": 3} if discrete else {"act_dim": 2, "action_low": -1.0, "action_high": 1.0}
    policy = MLPPolicy(5, **kw, seed=3)
    policy.update_obs_stats(torch.randn(100, 5) * 3 + 1)
    obs = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32)
    out = policy.act(obs)
    assert policy._use_numpy()
    logp, _, value = policy.evaluate(torch.from_numpy(obs), torch.as_tensor(out.actions))
    np.testing.assert_allclose(out.logprobs, logp.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.values, value.detach().numpy(), rtol=1e-4, atol=1e-4)


def test_numpy_inference_sees_in_place_weight_changes():
    policy = MLPPolicy(3, 2, seed=0)
    obs = np.ones((4, 3), np.float32)
    before = policy.act(obs).values
    with torch.no_grad():
        policy.critic[-1].bias.add_(1.0)  # an optimiser step or load_state_dict does this
    np.testing.assert_allclose(policy.act(obs).values, before + 1.0, rtol=1e-5)
