"""V-trace and Decoupled PPO: hand-checked numbers, reductions to GAE / PPO at lag 0, and the
proximal clip under stale data."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from ebrl.algos import PPO, Batch, PPOConfig, gae
from ebrl.algos.advantages import build_next_values
from ebrl.algos.dppo import DecoupledPPO, DecoupledPPOConfig
from ebrl.algos.vtrace import VTrace, VTraceConfig, vtrace
from ebrl.policies import MLPPolicy

torch.set_num_threads(1)
NAN = math.nan


# ---- vtrace() --------------------------------------------------------------------------------


def test_vtrace_hand_computed():
    # One segment, 5 valid steps and a padded slot full of NaN. gamma = 0.9, lam = 0.8,
    # rho_bar = 1.5, c_bar = 1.0; behaviour log-probs 0, so ratio = exp(target).
    #   t  r  V  next_V  pi/mu   rho   c           episode
    #   0  1  1  2       2.0     1.5   0.8*1.0     continues
    #   1  0  2  1       0.5     0.5   0.8*0.5     continues
    #   2  2  1  (5)     1.0     1.0   0.8         terminated: next_V ignored
    #   3  1  0  4       1.25    1.25  0.8         truncated, final value 4
    #   4  2  1  3       0.25    0.25  0.2         last valid step, bootstrap 3
    # delta = rho (r + 0.9 next_V' - V):
    #   d4 = 0.25 (2 + 2.7 - 1) = 0.925     d3 = 1.25 (1 + 3.6) = 5.75     d2 = 1 (2 - 1) = 1
    #   d1 = 0.5 (0.9 - 2) = -0.55          d0 = 1.5 (1 + 1.8 - 1) = 2.7
    # vs - V: a4 = 0.925, a3 = 5.75, a2 = 1 (episode ends stop the trace)
    #   a1 = -0.55 + 0.9 * 0.4 * 1 = -0.19   a0 = 2.7 + 0.9 * 0.8 * (-0.19) = 2.5632
    # vs = [3.5632, 1.81, 2, 5.75, 1.925]
    # A = rho (r + 0.9 vs_next - V), vs_next = [vs1, vs2, 0 (terminated), 4 (final), 3 (bootstrap)]:
    #   A0 = 1.5 (1 + 1.629 - 1) = 2.4435   A1 = 0.5 (1.8 - 2) = -0.1   A2 = 1 (2 - 1) = 1
    #   A3 = 1.25 (1 + 3.6) = 5.75          A4 = 0.25 (2 + 2.7 - 1) = 0.925
    t = lambda *x: torch.tensor([x], dtype=torch.float64)
    b = lambda *x: torch.tensor([x], dtype=torch.bool)
    mu = t(0.0, 0.0, 0.0, 0.0, 0.0, NAN)
    pi = t(math.log(2.0), math.log(0.5), 0.0, math.log(1.25), math.log(0.25), NAN)
    rewards = t(1.0, 0.0, 2.0, 1.0, 2.0, NAN)
    values = t(1.0, 2.0, 1.0, 0.0, 1.0, NAN)
    next_values = t(2.0, 1.0, 5.0, 4.0, 3.0, NAN)
    terminated = b(False, False, True, False, False, False)
    truncated = b(False, False, False, True, False, False)
    mask = b(True, True, True, True, True, False)

    vs, adv = vtrace(mu, pi, rewards, values, next_values, terminated, terminated | truncated, mask,
                     gamma=0.9, lam=0.8, rho_bar=1.5, c_bar=1.0)
    torch.testing.assert_close(vs, t(3.5632, 1.81, 2.0, 5.75, 1.925, 0.0))
    torch.testing.assert_close(adv, t(2.4435, -0.1, 1.0, 5.75, 0.925, 0.0))

    # next_values as build_next_values makes them from V, the final value and the bootstrap
    nv = build_next_values(values, torch.tensor([3.0]), torch.tensor([4.0]), torch.tensor([[0, 3]]),
                           truncated, mask)
    torch.testing.assert_close(nv, t(2.0, 1.0, 0.0, 4.0, 3.0, 0.0))  # step 2 gets V3 = 0: ignored anyway
    vs2, adv2 = vtrace(mu, pi, rewards, values, nv, terminated, terminated | truncated, mask,
                       gamma=0.9, lam=0.8, rho_bar=1.5, c_bar=1.0)
    torch.testing.assert_close((vs2, adv2), (vs, adv))


def _vtrace_reference(mu, pi, r, v, nv, term, end, lengths, gamma, lam, rho_bar, c_bar):
    """Per-step Python V-trace straight from the definition, one segment at a time."""
    S, T = r.shape
    vs, adv = np.zeros((S, T)), np.zeros((S, T))
    for s in range(S):
        for t in reversed(range(lengths[s])):
            ratio = math.exp(pi[s, t] - mu[s, t])
            rho, c = min(rho_bar, ratio), lam * min(c_bar, ratio)
            nxt = 0.0 if term[s, t] else nv[s, t]
            stop = end[s, t] or t == lengths[s] - 1
            delta = rho * (r[s, t] + gamma * nxt - v[s, t])
            vs[s, t] = v[s, t] + delta + (0.0 if stop else gamma * c * (vs[s, t + 1] - v[s, t + 1]))
            adv[s, t] = rho * (r[s, t] + gamma * (nxt if stop else vs[s, t + 1]) - v[s, t])
    return vs, adv


def _random_segments(rng, S=9, T=13):
    lengths = rng.integers(0, T + 1, S)
    lengths[0], lengths[1] = T, 0  # a full and an empty segment
    mask = np.arange(T)[None, :] < lengths[:, None]
    r, v = rng.normal(size=(S, T)), rng.normal(size=(S, T))
    term = (rng.random((S, T)) < 0.15) & mask
    trunc = (rng.random((S, T)) < 0.15) & mask & ~term
    idx = np.argwhere(trunc)
    nv = build_next_values(torch.tensor(v), torch.tensor(rng.normal(size=S)), torch.tensor(rng.normal(size=len(idx))),
                           torch.tensor(idx, dtype=torch.long).reshape(-1, 2), torch.tensor(trunc), torch.tensor(mask))
    return lengths, mask, r, v, nv.numpy(), term, trunc


def _nan_pad(x, mask):
    return torch.tensor(np.where(mask, x, np.nan))


@pytest.mark.parametrize("lam,rho_bar,c_bar", [(1.0, 1.0, 1.0), (0.9, 1.3, 0.7), (0.5, math.inf, math.inf)])
def test_vtrace_matches_per_step_reference(lam, rho_bar, c_bar):
    rng = np.random.default_rng(1)
    lengths, mask, r, v, nv, term, trunc = _random_segments(rng)
    mu = rng.normal(size=r.shape) * 0.5
    pi = mu + rng.normal(size=r.shape) * 0.7  # ratios on both sides of 1: truncation active
    gamma = 0.97
    vs, adv = vtrace(*(_nan_pad(x, mask) for x in (mu, pi, r, v, nv)), torch.tensor(term),
                     torch.tensor(term | trunc), torch.tensor(mask), gamma, lam, rho_bar, c_bar)
    ref_vs, ref_adv = _vtrace_reference(mu, pi, r, v, nv, term, term | trunc, lengths, gamma, lam, rho_bar, c_bar)
    np.testing.assert_allclose(vs.numpy(), ref_vs, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lam", [0.0, 0.9, 1.0])
def test_vtrace_on_policy_is_gae(lam):
    """target == behaviour: rho = 1, c = lam, so vs == GAE(lam) returns; at lam = 1 the pg
    advantages are GAE(1)'s advantages too."""
    rng = np.random.default_rng(2)
    _, mask, r, v, nv, term, trunc = _random_segments(rng)
    logp = rng.normal(size=r.shape)
    args = [_nan_pad(x, mask) for x in (r, v, nv)] + [torch.tensor(term), torch.tensor(term | trunc), torch.tensor(mask)]
    vs, pg_adv = vtrace(_nan_pad(logp, mask), _nan_pad(logp, mask), *args, gamma=0.97, lam=lam)
    adv, ret = gae(*args, gamma=0.97, lam=lam)
    torch.testing.assert_close(vs, ret, rtol=1e-12, atol=1e-12)
    if lam == 1.0:
        torch.testing.assert_close(pg_adv, adv, rtol=1e-12, atol=1e-12)
    else:
        assert not torch.allclose(pg_adv, adv)  # the one-step V-trace advantage is not GAE's


# ---- the losses, by hand -------------------------------------------------------------------


class _KnownPolicy(nn.Module):
    """``evaluate(obs=indices)`` gives fixed, known log-probs, entropies and values."""

    def __init__(self, logp, value, entropy):
        super().__init__()
        self.logp = nn.Parameter(torch.tensor(logp, dtype=torch.float64))
        self.v = nn.Parameter(torch.tensor(value, dtype=torch.float64))
        self.register_buffer("ent", torch.tensor(entropy, dtype=torch.float64))

    def evaluate(self, obs, actions):
        i = obs.long()
        return self.logp[i], self.ent[i], self.v[i]


def _hand_minibatch():
    # current log-probs 0, reference ("logprobs") log-probs chosen so r = [0.5, 1, 1.25, 2];
    # clip 0.2 -> clip(r) = [0.8, 1, 1.2, 1.2]
    policy = _KnownPolicy([0.0] * 4, value=[1.0, 0.0, 2.0, -1.0], entropy=[0.1, 0.2, 0.3, 0.4])
    f = lambda *x: torch.tensor(x, dtype=torch.float64)
    mb = {"obs": torch.arange(4), "actions": torch.zeros(4),
          "logprobs": f(math.log(2.0), 0.0, math.log(0.8), math.log(0.5)),
          "values": f(0.9, 0.5, 2.0, 0.0), "advantages": f(1.0, -1.0, 2.0, -0.5),
          "returns": f(2.0, 0.0, 1.0, -1.0), "is_weights": f(1.0, 2.0, 0.5, 1.5)}
    return policy, mb


# value loss: v_clip = V_old + clamp(v - V_old, +-0.2) = [1.0, 0.3, 2.0, -0.2]
#   max((v - R)^2, (v_clip - R)^2) = [max(1, 1), max(0, 0.09), max(1, 1), max(0, 0.64)] -> mean 0.6825
V_LOSS = 0.5 * 0.6825
APPROX_KL = ((0.5 - 1 - math.log(0.5)) + 0.0 + (1.25 - 1 - math.log(1.25)) + (2 - 1 - math.log(2))) / 4
KW = {"clip_coef": 0.2, "ent_coef": 0.01, "vf_coef": 0.5, "clip_vloss": True}


def test_decoupled_ppo_loss_hand_computed():
    # max(-A r, -A clip(r)) = [max(-0.5, -0.8), max(1, 1), max(-2.5, -2.4), max(1, 0.6)] = [-0.5, 1, -2.4, 1]
    # weighted by w = [1, 2, 0.5, 1.5]: [-0.5, 2, -1.2, 1.5] -> mean 0.45
    policy, mb = _hand_minibatch()
    loss, m = DecoupledPPO(**KW).loss(policy, mb)
    assert float(m["policy_loss"]) == pytest.approx(0.45)
    assert float(m["value_loss"]) == pytest.approx(V_LOSS)
    assert float(m["entropy"]) == pytest.approx(0.25)
    assert float(loss.detach()) == pytest.approx(0.45 - 0.01 * 0.25 + 0.5 * V_LOSS)  # 0.618125
    assert float(m["clipfrac"]) == 0.75  # |r - 1| > 0.2 at steps 0, 2, 3: against the proximal policy
    assert float(m["approx_kl"]) == pytest.approx(APPROX_KL)
    assert float(m["is_weight_mean"]) == pytest.approx(1.25)
    loss.backward()
    # d/dlogp of w * (-A r) / 4 where the unclipped term is the max, 0 where the clipped one is
    torch.testing.assert_close(policy.logp.grad, torch.tensor([-0.125, 0.5, 0.0, 0.375], dtype=torch.float64))


def test_vtrace_loss_is_ppo_clipped_loss_against_the_given_logprobs():
    # unweighted: [-0.5, 1, -2.4, 1] -> mean -0.225
    policy, mb = _hand_minibatch()
    del mb["is_weights"]
    loss, m = VTrace(**KW).loss(policy, mb)
    assert float(m["policy_loss"]) == pytest.approx(-0.225)
    assert float(loss.detach()) == pytest.approx(-0.225 - 0.01 * 0.25 + 0.5 * V_LOSS)  # -0.056875
    assert float(m["clipfrac"]) == 0.75 and float(m["approx_kl"]) == pytest.approx(APPROX_KL)
    loss.backward()
    torch.testing.assert_close(policy.logp.grad, torch.tensor([-0.125, 0.25, 0.0, 0.25], dtype=torch.float64))


# ---- batches ---------------------------------------------------------------------------------


def _policy(seed=0, **kw):
    return MLPPolicy(3, 2, seed=seed, normalize_obs=False, **kw)


def _batch(behaviour, rng, S=6, T=12, learner_version=0):
    """Segments with terminations, truncations (with final observations) and NaN padding; the
    behaviour log-probs and values are ``behaviour``'s."""
    lengths = rng.integers(3, T + 1, S)
    lengths[0] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    term = (rng.random((S, T)) < 0.1) & mask
    trunc = (rng.random((S, T)) < 0.1) & mask & ~term
    final_index = torch.tensor(np.argwhere(trunc), dtype=torch.long).reshape(-1, 2)
    obs = torch.tensor(rng.normal(size=(S, T, 3)), dtype=torch.float32)
    acts = torch.tensor(rng.normal(size=(S, T, 2)), dtype=torch.float32)
    with torch.no_grad():
        logp, _, v = behaviour.evaluate(obs.reshape(-1, 3), acts.reshape(-1, 2))
    m = torch.tensor(mask)
    pad = lambda x: torch.where(m, x.reshape(S, T), torch.tensor(NAN))
    return Batch(obs=torch.where(m[..., None], obs, torch.tensor(NAN)), actions=acts, logprobs=pad(logp),
                 values=pad(v), rewards=pad(torch.tensor(rng.normal(size=(S, T)), dtype=torch.float32)),
                 terminated=torch.tensor(term), truncated=torch.tensor(trunc), mask=m,
                 versions=torch.zeros(S, T, dtype=torch.long),
                 bootstrap_obs=torch.tensor(rng.normal(size=(S, 3)), dtype=torch.float32),
                 final_obs=torch.tensor(rng.normal(size=(len(final_index), 3)), dtype=torch.float32),
                 final_index=final_index, learner_version=learner_version)


def _train_data(algo, policy, batch):
    mask = batch.mask
    return algo.train_data(policy, batch, batch.obs[mask], batch.rewards)


def test_vtrace_train_data_targets_the_current_policy_and_critic():
    rng = np.random.default_rng(3)
    policy, stale = _policy(0), _policy(9, init_log_std=0.5)
    batch = _batch(stale, rng, learner_version=2)
    algo = VTrace(gamma=0.95, gae_lambda=0.9, rho_bar=1.5, c_bar=0.7, scale_rewards=False, minibatch_size=7)
    flat = _train_data(algo, policy, batch)

    mask = batch.mask
    with torch.no_grad():
        logp, _, v = policy.evaluate(batch.obs[mask], batch.actions[mask])
        values = torch.zeros(mask.shape)
        values[mask] = v
        target = torch.zeros(mask.shape)
        target[mask] = logp
        nv = build_next_values(values, policy.value(batch.bootstrap_obs), policy.value(batch.final_obs),
                               batch.final_index, batch.truncated, mask)
    vs, adv = vtrace(batch.logprobs, target, batch.rewards, values, nv, batch.terminated,
                     batch.terminated | batch.truncated, mask, 0.95, 0.9, 1.5, 0.7)
    expected = {"logprobs": logp, "values": v, "returns": vs[mask], "advantages": adv[mask]}
    for k, x in expected.items():
        torch.testing.assert_close(flat[k], x, msg=k)
    assert torch.isfinite(flat["advantages"]).all()  # NaN padding stayed out


def test_decoupled_train_data_weights_are_truncated_prox_over_behaviour():
    rng = np.random.default_rng(4)
    policy, stale = _policy(0), _policy(9, init_log_std=0.5)
    batch = _batch(stale, rng, learner_version=2)
    algo = DecoupledPPO(max_is_weight=1.5, scale_rewards=False, minibatch_size=7)
    flat = _train_data(algo, policy, batch)

    mask = batch.mask
    with torch.no_grad():
        prox, _, prox_v = policy.evaluate(batch.obs[mask], batch.actions[mask])
        nv = build_next_values(batch.values, policy.value(batch.bootstrap_obs), policy.value(batch.final_obs),
                               batch.final_index, batch.truncated, mask)
    adv, ret = gae(batch.rewards, batch.values, nv, batch.terminated, batch.terminated | batch.truncated,
                   mask, algo.config.gamma, algo.config.gae_lambda)
    w = torch.minimum(torch.tensor(1.5), (prox - batch.logprobs[mask]).exp())
    assert (w == 1.5).any() and (w < 1.0).any()  # truncation active, and weights on both sides of 1
    expected = {"logprobs": prox, "values": prox_v, "is_weights": w, "advantages": adv[mask], "returns": ret[mask]}
    for k, x in expected.items():
        torch.testing.assert_close(flat[k], x, msg=k)


# ---- lag 0: both reduce to PPO ---------------------------------------------------------------


def _one_update(algo, batch, seed=0):
    policy = _policy(seed)
    metrics = algo.update(policy, batch)
    return policy, metrics


def _assert_same_weights(a, b):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=k)


COMMON = {"lr": 3e-3, "update_epochs": 2, "minibatch_size": 16, "scale_rewards": False, "ent_coef": 0.01, "seed": 5}


def test_decoupled_ppo_at_lag_0_is_ppo():
    batch = _batch(_policy(0), np.random.default_rng(5))  # behaviour = the learner's weights
    ppo, m_ppo = _one_update(PPO(**COMMON), batch)
    dppo, m_dppo = _one_update(DecoupledPPO(**COMMON, max_is_weight=1.0), batch)  # even the tightest cap
    _assert_same_weights(dppo, ppo)
    assert not torch.equal(ppo.actor[0].weight, _policy(0).actor[0].weight)  # it did move
    for k in ("policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy", "explained_variance"):
        assert m_dppo[k] == pytest.approx(m_ppo[k], rel=1e-4, abs=1e-6), k
    assert m_dppo["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_vtrace_at_lag_0_with_lambda_1_is_ppo_with_lambda_1():
    """rho_bar, c_bar >= 1 and target == behaviour: advantages and returns are GAE(1)'s."""
    batch = _batch(_policy(0), np.random.default_rng(6))
    ppo, m_ppo = _one_update(PPO(**COMMON, gae_lambda=1.0), batch)
    vt, m_vt = _one_update(VTrace(**COMMON, gae_lambda=1.0, rho_bar=1.0, c_bar=1.0), batch)
    _assert_same_weights(vt, ppo)
    for k in ("policy_loss", "value_loss", "approx_kl", "clipfrac", "explained_variance"):
        assert m_vt[k] == pytest.approx(m_ppo[k], rel=1e-4, abs=1e-6), k


def test_vtrace_at_lag_0_value_targets_are_gae_returns_for_any_lambda():
    batch = _batch(_policy(0), np.random.default_rng(7))
    policy = _policy(0)
    vt = _train_data(VTrace(gae_lambda=0.9, scale_rewards=False), policy, batch)
    ppo = _train_data(DecoupledPPO(gae_lambda=0.9, scale_rewards=False), policy, batch)  # PPO's GAE
    torch.testing.assert_close(vt["returns"], ppo["returns"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(vt["advantages"], ppo["advantages"], atol=1e-3)


# ---- stale data: the clip is around the proximal policy --------------------------------------


def _first_minibatch_metrics(algo, batch):
    seen = []

    def record(policy, mb):
        loss, m = algo.loss(policy, mb)
        seen.append({k: float(v) for k, v in m.items()})
        return loss, m

    algo.loss_fn = record
    _one_update(algo, batch)
    return seen[0]


def test_stale_data_clipfrac_is_against_the_proximal_policy():
    old = _policy(9, init_log_std=0.5)  # a far behaviour policy, 3 versions back
    batch = _batch(old, np.random.default_rng(8), learner_version=3)
    assert float(batch.lags.min()) == 3.0
    kw = {"update_epochs": 2, "minibatch_size": 16, "scale_rewards": False}
    m_ppo = _first_minibatch_metrics(PPO(**kw, lag_correction=False), batch)  # clipped around mu
    assert m_ppo["clipfrac"] > 0.3 and m_ppo["approx_kl"] > 1e-2
    for algo in (PPO(**kw), DecoupledPPO(**kw), VTrace(**kw)):  # PPO corrects lagged batches by default
        m = _first_minibatch_metrics(algo, batch)
        assert m["clipfrac"] == 0.0, type(algo).__name__
        assert m["approx_kl"] == pytest.approx(0.0, abs=1e-6), type(algo).__name__
    # PPO reports how far the lag moved the policy: KL(mu || pi_prox), which PPO's own approx_kl was
    assert float(_first_minibatch_metrics(PPO(**kw), batch)["lag_kl"]) == pytest.approx(float(m_ppo["approx_kl"]))


# ---- config and robustness -------------------------------------------------------------------


def test_config_validation_names_the_field():
    for bad in (0.0, -1.0, math.nan, True, "1"):
        with pytest.raises(ValueError, match="VTraceConfig.rho_bar"):
            VTraceConfig(rho_bar=bad)
        with pytest.raises(ValueError, match="VTraceConfig.c_bar"):
            VTrace(c_bar=bad)
    for bad in (0.5, 0.0, math.nan, False, None):
        with pytest.raises(ValueError, match="DecoupledPPOConfig.max_is_weight"):
            DecoupledPPO(max_is_weight=bad)
    with pytest.raises(ValueError, match="VTraceConfig.gae_lambda"):  # inherited fields, subclass named
        VTrace(gae_lambda=1.5)
    with pytest.raises(ValueError, match="DecoupledPPOConfig.clip_coef"):
        DecoupledPPOConfig(clip_coef=0)
    with pytest.raises(TypeError, match="rhobar.*rho_bar"):
        VTrace(rhobar=1.0)
    with pytest.raises(TypeError, match="max_is.*max_is_weight"):
        DecoupledPPO(max_is=1.0)
    assert VTrace(rho_bar=math.inf, c_bar=math.inf).config.rho_bar == math.inf
    assert DecoupledPPO(max_is_weight=math.inf).config.max_is_weight == math.inf
    lifted = VTrace(PPOConfig(gamma=0.9), rho_bar=2.0).config  # a plain PPOConfig is lifted
    assert isinstance(lifted, VTraceConfig) and lifted.gamma == 0.9 and lifted.rho_bar == 2.0
    assert DecoupledPPO(DecoupledPPOConfig(max_is_weight=3.0), lr=1e-3).config.max_is_weight == 3.0


@pytest.mark.parametrize("cls", [VTrace, DecoupledPPO])
def test_nonfinite_reward_stops_the_update_and_empty_batch(cls):
    batch = _batch(_policy(0), np.random.default_rng(9))
    batch.rewards[0, 0] = NAN  # a valid step
    policy = _policy(0)
    before = copy.deepcopy(policy.state_dict())
    m = cls(scale_rewards=False).update(policy, batch)
    assert m["nonfinite_loss"] == 1.0 and m["minibatches"] == 0.0
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())

    batch.mask[:] = False
    m = cls().update(policy, batch)
    assert m["num_steps"] == 0.0 and math.isnan(m["policy_loss"])
