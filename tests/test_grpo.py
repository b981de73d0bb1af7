"""GRPO: group-relative advantages, the clipped loss and its KL term, checked by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ebrl.algos import Batch
from ebrl.algos.grpo import GRPO, GRPOConfig, group_advantages
from ebrl.policies import MLPPolicy

torch.set_num_threads(1)


def make_batch(lengths, rewards, ends, groups, *, obs_dim=2, act_dim=1, policy=None, obs=None, actions=None,
               T=None, seed=0):
    """Segments ``s`` of ``lengths[s]`` valid steps (rewards given per valid step); ``ends[s]`` is
    how the last valid step ends: ``"term"``, ``"trunc"`` or ``None`` (cut mid-episode). Padded
    slots hold NaN rewards, which must never reach anything. Behaviour log-probs are ``policy``'s."""
    S, T = len(lengths), T or max(lengths) + 1
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(S, T, obs_dim, generator=g) if obs is None else obs
    if actions is None:
        actions = torch.randn(S, T, act_dim, generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    r = torch.full((S, T), math.nan)
    term = torch.zeros(S, T, dtype=torch.bool)
    trunc = torch.zeros(S, T, dtype=torch.bool)
    final_index = []
    for s, (n, rs, e) in enumerate(zip(lengths, rewards, ends)):
        r[s, :n] = torch.tensor(rs, dtype=torch.float32)
        if e == "term":
            term[s, n - 1] = True
        elif e == "trunc":
            trunc[s, n - 1] = True
            final_index.append((s, n - 1))
    if policy is not None:
        with torch.no_grad():
            flat_a = actions.reshape(S * T, *actions.shape[2:])
            logp, _, v = policy.evaluate(obs.reshape(S * T, obs_dim), flat_a)
        logp, v = logp.reshape(S, T), v.reshape(S, T)
    else:
        logp, v = torch.zeros(S, T), torch.zeros(S, T)
    fi = torch.tensor(final_index, dtype=torch.long).reshape(-1, 2)
    return Batch(obs, actions, logp, v, r, term, trunc, mask, torch.zeros(S, T, dtype=torch.long),
                 torch.zeros(S, obs_dim), torch.zeros(len(final_index), obs_dim), fi,
                 group=torch.tensor(groups, dtype=torch.long))


# ---- advantages -------------------------------------------------------------------------------


def _two_groups_batch(**kw):
    # group 11: returns 1, 0, 0 (sparse success); group 22: returns 2, 4, 6; then an incomplete
    # segment of group 11 (cut before its end), a continuation (-1) that does end, and a group 33
    # with a single complete member
    lengths = [3, 2, 4, 1, 3, 2, 4, 2, 2]
    rewards = [[0, 0, 1], [0, 0], [0, 0, 0, 0], [2], [1, 1, 2], [3, 3], [5, 5, 5, 5], [1, 1], [7, 0]]
    ends = ["term", "trunc", "trunc", "term", "term", "trunc", None, "term", "term"]
    groups = [11, 11, 11, 22, 22, 22, 11, -1, 33]
    return make_batch(lengths, rewards, ends, groups, **kw)


def test_group_advantages_match_a_hand_computed_example():
    batch = _two_groups_batch()
    adv, used = group_advantages(batch)
    # group 11: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    sd = math.sqrt(1 / 3) + 1e-6
    a11 = [(2 / 3) / sd, (-1 / 3) / sd, (-1 / 3) / sd]
    a22 = [-2 / (2 + 1e-6), 0.0, 2 / (2 + 1e-6)]  # mean 4, sample std 2
    per_segment = a11 + a22 + [0.0, 0.0, 0.0]
    assert used.tolist() == [True] * 6 + [False] * 3
    expected = torch.zeros_like(adv)
    for s, a in enumerate(per_segment):
        expected[s, :batch.mask[s].sum()] = a
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert adv.dtype == torch.float32 and bool(torch.isfinite(adv).all())

    adv, used = group_advantages(batch, norm_std=False)
    per_segment = [2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    for s, a in enumerate(per_segment):
        torch.testing.assert_close(adv[s, :batch.mask[s].sum()], torch.full((int(batch.mask[s].sum()),), a))
    assert (adv[~batch.mask] == 0).all()

    # min_group=4: no group has four complete members
    adv, used = group_advantages(batch, min_group=4)
    assert not used.any() and (adv == 0).all()


def test_unused_segments_are_counted_in_the_metrics_and_left_out_of_the_loss():
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    batch = _two_groups_batch(policy=policy)
    m = GRPO(update_epochs=1, minibatch_size=1000).update(policy, batch)
    assert m["num_steps"] == 23.0 and m["steps_used"] == 3 + 2 + 4 + 1 + 3 + 2
    assert (m["segments_used"], m["segments_unused"]) == (6.0, 3.0)
    assert (m["segments_no_reset"], m["segments_incomplete"]) == (1.0, 1.0)
    assert (m["groups"], m["groups_too_small"], m["groups_uniform"]) == (2.0, 1.0, 0.0)
    assert m["return_mean"] == pytest.approx((1 + 0 + 0 + 2 + 4 + 6) / 6)
    assert m["minibatches"] == 1.0 and m["nonfinite_loss"] == 0.0 and "kl_ref" not in m
    assert all(math.isfinite(m[k]) for k in ("policy_loss", "entropy", "approx_kl", "clipfrac"))
    for k in ("num_steps", "lag_mean", "lag_max", "policy_loss", "entropy", "approx_kl", "clipfrac",
              "nonfinite_loss", "minibatches"):
        assert isinstance(m[k], float)


def test_equal_returns_in_a_group_give_zero_advantages():
    batch = make_batch([2, 3, 1], [[0, 1], [0.5, 0.25, 0.25], [1]], ["term", "trunc", "term"], [5, 5, 5])
    adv, used = group_advantages(batch)
    assert used.all() and (adv == 0).all()
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    batch = make_batch([2, 3], [[0, 0], [0, 0, 0]], ["term", "term"], [5, 5], policy=policy)
    m = GRPO(update_epochs=1).update(policy, batch)
    assert m["groups_uniform"] == 1.0 and m["no_signal"] == 1.0 and m["minibatches"] == 0.0


def test_an_update_without_signal_leaves_the_policy_after_one_with_signal():
    # Adam's momentum from the first update would move the weights on the second's zero gradient
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    algo = GRPO(update_epochs=2, minibatch_size=2)
    useful = make_batch([2, 2], [[0, 1], [0, 0]], ["term", "term"], [5, 5], policy=policy)
    assert algo.update(policy, useful)["no_signal"] == 0.0
    before = copy.deepcopy(policy.state_dict())
    uniform = make_batch([2, 2], [[0, 0], [0, 0]], ["term", "term"], [6, 6], policy=policy, seed=1)
    m = algo.update(policy, uniform)
    assert m["no_signal"] == 1.0 and m["minibatches"] == 0.0 and m["steps_used"] == 4.0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    # an entropy term is a gradient of its own: the same batch then steps
    m = GRPO(update_epochs=1, ent_coef=0.01).update(policy, uniform)
    assert m["no_signal"] == 0.0 and m["minibatches"] == 1.0
    assert not all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_no_usable_segment_returns_nan_metrics_without_stepping():
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    before = copy.deepcopy(policy.state_dict())
    batch = make_batch([2, 2], [[0, 1], [0, 0]], [None, "term"], [3, -1], policy=policy)
    m = GRPO().update(policy, batch)
    assert m["steps_used"] == 0 and m["minibatches"] == 0 and m["nonfinite_loss"] == 0.0
    assert math.isnan(m["policy_loss"]) and m["num_steps"] == 4.0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_a_batch_without_groups_or_with_two_episodes_in_a_segment_is_refused():
    batch = make_batch([2, 2], [[0, 1], [0, 0]], ["term", "term"], [1, 1])
    batch.group = None
    with pytest.raises(ValueError, match=r"RunConfig\(segment_cut='episode'\).*reset groups"):
        group_advantages(batch)
    batch = make_batch([3, 2], [[0, 1, 0], [0, 0]], ["term", "term"], [1, 1])
    batch.terminated[0, 0] = True  # an episode end mid-segment: not one episode per segment
    with pytest.raises(ValueError, match=r"segments \[0\] hold an episode end before their last valid step"):
        group_advantages(batch)
    batch = make_batch([2, 2], [[0, 1], [0, 0]], ["term", "term"], [1, 1])
    batch.group = torch.tensor([1, 1, 1])
    with pytest.raises(ValueError, match=r"Batch.group has shape \(3,\), expected \(2,\)"):
        group_advantages(batch)


# ---- the loss ---------------------------------------------------------------------------------


def _ratio_batch(policy, ratios):
    """Two episodes of one group (returns 1 and 0: advantages +-1/sqrt(2)) whose behaviour
    log-probs make the importance ratios exactly ``ratios`` (segment-major)."""
    S, T = 2, 3
    batch = make_batch([T, T], [[0, 0, 1], [0, 0, 0]], ["term", "term"], [9, 9], policy=policy, T=T)
    batch.logprobs = batch.logprobs - torch.log(torch.tensor(ratios).reshape(S, T))
    return batch


def test_the_loss_matches_a_hand_computed_example():
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    ratios = [1.5, 1.0, 0.7, 1.5, 0.9, 0.5]
    batch = _ratio_batch(policy, ratios)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # returns 1, 0: mean 0.5, sample std sqrt(0.5)
    # A > 0: -A min(r, clip(r)) -> r = 1.5 counts 1.2; A < 0: a max(r, clip(r)) -> r = 0.5 counts 0.8
    pg = (-a * (1.2 + 1.0 + 0.7) + a * (1.5 + 0.9 + 0.8)) / 6
    approx_kl = sum((r - 1) - math.log(r) for r in ratios) / 6
    entropy = 0.5 + 0.5 * math.log(2 * math.pi)  # unit Gaussian (log_std 0), one action dim

    algo = GRPO(update_epochs=1, minibatch_size=64, ent_coef=0.01, clip_coef=0.2)
    adv, _ = group_advantages(batch)
    mb = {"obs": batch.obs.reshape(6, 2), "actions": batch.actions.reshape(6, 1),
          "logprobs": batch.logprobs.reshape(6), "advantages": adv.reshape(6)}
    loss, metrics = algo.loss(policy, mb)
    assert float(loss.detach()) == pytest.approx(pg - 0.01 * entropy, rel=1e-5)
    assert float(metrics["policy_loss"]) == pytest.approx(pg, rel=1e-5)
    assert float(metrics["clipfrac"]) == pytest.approx(4 / 6)
    assert float(metrics["approx_kl"]) == pytest.approx(approx_kl, rel=1e-4)
    assert float(metrics["entropy"]) == pytest.approx(entropy, rel=1e-6)

    # the KL term, k3 = e^d - d - 1 with d = ref - logp, added with kl_coef
    with torch.no_grad():
        logp, _, _ = policy.evaluate(mb["obs"], mb["actions"])
    d = torch.tensor([0.1, -0.2, 0.0, 0.3, 0.0, -1.0])
    k3 = sum(math.exp(x) - x - 1 for x in d.tolist()) / 6
    kl_algo = GRPO(kl_coef=0.5, ent_coef=0.01)
    loss, metrics = kl_algo.loss(policy, {**mb, "ref_logprobs": logp + d})
    assert float(metrics["kl_ref"]) == pytest.approx(k3, rel=1e-4)
    assert float(loss.detach()) == pytest.approx(pg - 0.01 * entropy + 0.5 * k3, rel=1e-4)

    # update() reports the same, measured before its single step; the critic is not trained
    critic = copy.deepcopy(policy.critic.state_dict())
    m = algo.update(policy, batch)
    assert m["policy_loss"] == pytest.approx(pg, rel=1e-5) and m["minibatches"] == 1.0
    assert m["clipfrac"] == pytest.approx(4 / 6)
    assert all(torch.equal(critic[k], v) for k, v in policy.critic.state_dict().items())


def test_the_kl_term_is_zero_against_an_equal_reference_and_grows_after_updates():
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    batch = _two_groups_batch(policy=policy)
    algo = GRPO(kl_coef=0.04, reference=copy.deepcopy(policy), update_epochs=1, minibatch_size=1000, lr=1e-2)
    m1 = algo.update(policy, batch)
    assert m1["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    m2 = algo.update(policy, batch)
    assert m2["kl_ref"] > 1e-6

    # no reference given: a frozen copy of the policy taken at the first update
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    initial = copy.deepcopy(policy.state_dict())
    algo = GRPO(kl_coef=0.04, update_epochs=2, minibatch_size=1000, lr=1e-2)
    assert algo.update(policy, batch)["kl_ref"] > 0  # the second epoch sees the first's step
    ref = algo.reference
    assert ref is not policy and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(initial[k], v) for k, v in ref.state_dict().items())
    assert not torch.equal(initial["log_std"], policy.state_dict()["log_std"])
    state = algo.state_dict()
    assert all(torch.equal(initial[k], v) for k, v in state["reference"].items())

    # restored: the saved reference, not a copy of the policy now
    again = GRPO(kl_coef=0.04, update_epochs=1, minibatch_size=1000)
    again.load_state_dict(state)
    assert again.state_dict()["reference"] is state["reference"]  # pending still counts
    m = again.update(policy, batch)
    assert m["kl_ref"] > 0 and all(torch.equal(initial[k], v) for k, v in again.reference.state_dict().items())
    assert again.optimizer.state_dict()["state"]  # the optimiser moments came back too


def test_an_update_raises_the_log_prob_of_the_action_that_earned_more():
    policy = MLPPolicy(2, discrete_actions=2, seed=0, normalize_obs=False)
    S, T = 6, 3
    obs = torch.ones(S, T, 2)
    actions = torch.tensor([1, 0, 1, 0, 0, 0]).reshape(S, 1).expand(S, T).contiguous()  # one action per episode
    rewards = [[0, 0, float(a)] for a in actions[:, 0].tolist()]
    batch = make_batch([T] * S, rewards, ["term"] * S, [4] * S, policy=policy, obs=obs, actions=actions, T=T)

    def logp(a):
        with torch.no_grad():
            return float(policy.evaluate(torch.ones(1, 2), torch.tensor([a]))[0])

    before = logp(1), logp(0)
    m = GRPO(lr=1e-2, update_epochs=4, minibatch_size=6).update(policy, batch)
    assert m["minibatches"] == 12 and m["nonfinite_loss"] == 0.0
    assert logp(1) > before[0] + 0.01 and logp(0) < before[1]


def test_episode_loss_agg_weighs_every_episode_alike():
    # a success that ended after 1 step and a failure run to 4 steps, one group: advantages +-a
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    batch = make_batch([1, 4], [[1], [0, 0, 0, 0]], ["term", "trunc"], [5, 5], policy=policy, T=4)
    steps = batch.mask.bool()
    algo = GRPO(loss_agg="episode", update_epochs=1, minibatch_size=64)
    w = algo._step_weights(steps)
    # n / (episodes * length): 5 / (2 * 1) for the success's step, 5 / (2 * 4) for each of the failure's
    torch.testing.assert_close(w, torch.tensor([2.5, 0.625, 0.625, 0.625, 0.625]))
    assert float(w.mean()) == pytest.approx(1.0)
    assert GRPO()._step_weights(steps) is None  # "step": no weights, a plain mean over steps

    adv, _ = group_advantages(batch)
    a = float(adv[0, 0])
    mb = {"obs": batch.obs[steps], "actions": batch.actions[steps], "logprobs": batch.logprobs[steps],
          "advantages": adv[steps]}
    # ratios are 1 (behaviour = current policy): the policy loss is -mean(A) under each aggregation
    _, by_step = GRPO().loss(policy, mb)
    _, by_episode = algo.loss(policy, {**mb, "weights": w})
    assert float(by_step["policy_loss"]) == pytest.approx(-(a - 4 * a) / 5, rel=1e-5)  # failures outweigh 4:1
    assert float(by_episode["policy_loss"]) == pytest.approx(-(a - a) / 2, abs=1e-6)  # one episode each

    # one update each way from the same weights: by episode the success's action gains more log-prob
    def gain(agg):
        p = copy.deepcopy(policy)
        with torch.no_grad():
            before, _, _ = p.evaluate(batch.obs[0, :1], batch.actions[0, :1])
        GRPO(loss_agg=agg, lr=1e-2, update_epochs=1, minibatch_size=64).update(p, batch)
        with torch.no_grad():
            after, _, _ = p.evaluate(batch.obs[0, :1], batch.actions[0, :1])
        return float(after - before)

    assert gain("episode") > gain("step")


# ---- config, failures, state ------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("lr", 0.0), ("lr", math.inf), ("clip_coef", 0), ("update_epochs", 0), ("update_epochs", 1.5),
    ("minibatch_size", 0), ("ent_coef", -0.1), ("kl_coef", -1.0), ("kl_coef", math.nan),
    ("max_grad_norm", 0.0), ("norm_std", 1), ("min_group", 1), ("seed", "0"), ("lr", True),
    ("loss_agg", "token"),
])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field}="):
        GRPOConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field}="):
        GRPO(**{field: value})


def test_unknown_keywords_are_refused():
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['gamma'\]"):
        GRPO(gamma=0.99)
    assert GRPO(GRPOConfig(lr=1e-3), clip_coef=0.3).config == GRPOConfig(lr=1e-3, clip_coef=0.3)


def test_a_nonfinite_loss_stops_the_update_without_a_step():
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    before = copy.deepcopy(policy.state_dict())
    batch = _two_groups_batch(policy=policy)
    batch.rewards[0, 1] = math.nan  # a used episode's return is NaN: its whole group's advantages are
    m = GRPO(minibatch_size=4).update(policy, batch)
    assert m["nonfinite_loss"] == 1.0 and m["minibatches"] == 0.0 and math.isnan(m["policy_loss"])
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())

    # through loss_fn, on the second minibatch: the first step stands, the rest is skipped
    calls = []

    def loss_fn(p, mb):
        calls.append(1)
        loss, metrics = algo.loss(p, mb)
        return (loss * math.nan if len(calls) == 2 else loss), metrics

    algo = GRPO(minibatch_size=4, loss_fn=loss_fn)
    m = algo.update(policy, _two_groups_batch(policy=policy))
    assert m["nonfinite_loss"] == 1.0 and m["minibatches"] == 1.0 and len(calls) == 2
    assert math.isfinite(m["policy_loss"])


def test_state_dict_round_trip_and_reset_optimizer():
    policy = MLPPolicy(2, 1, seed=0, normalize_obs=False)
    batch = _two_groups_batch(policy=policy)
    algo = GRPO(minibatch_size=4)
    assert algo.state_dict()["optimizer"] is None and algo.state_dict()["reference"] is None
    algo.update(policy, batch)
    state = algo.state_dict()
    twin_policy = copy.deepcopy(policy)
    twin = GRPO(minibatch_size=4)
    twin.load_state_dict(copy.deepcopy(state))
    assert twin.state_dict()["optimizer"] is not None  # loaded, not yet applied: still reported
    m1, m2 = algo.update(policy, batch), twin.update(twin_policy, batch)
    assert m1 == m2
    assert all(torch.equal(v, twin_policy.state_dict()[k]) for k, v in policy.state_dict().items())
    algo.reset_optimizer()
    assert algo.optimizer is None and algo.state_dict()["optimizer"] is None
    assert algo.update(policy, batch)["nonfinite_loss"] == 0.0
