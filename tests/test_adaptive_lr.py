"""The mechanisms behind tests/test_learning_reach.py, checked fast: PPO's adaptive learning rate
(``PPOConfig.desired_kl``) and HFTokenPolicy's bin head (zero at the start, one readout per action
dimension, the same logits on the KV-cache decoder and the teacher-forced pass, saved and loaded
with the adapters)."""

from __future__ import annotations

import itertools
import json
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from ebrl.algos import PPO, Batch
from ebrl.policies import MLPPolicy
from tests.policy_helpers import token_logits


def batch_for(policy, seed: int = 0, S: int = 4, T: int = 16) -> Batch:
    """Behaviour data of ``policy`` itself (lag 0) on random observations, with random rewards."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(S, T, 3, generator=g)
    out = policy.act(obs.reshape(-1, 3).numpy())
    no = torch.zeros(S, T, dtype=torch.bool)
    return Batch(obs, torch.from_numpy(out.actions).reshape(S, T, 2), torch.from_numpy(out.logprobs).reshape(S, T),
                 torch.from_numpy(out.values).reshape(S, T), torch.randn(S, T, generator=g), no, no,
                 torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long), torch.randn(S, 3, generator=g),
                 torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long))


def lrs(algo: PPO, policy, updates: int) -> list[float]:
    out = []
    for i in range(updates):
        out.append(algo.update(policy, batch_for(policy, seed=i))["lr"])
    return out + [algo.current_lr]


def test_the_lr_rises_while_the_policy_barely_moves_up_to_ten_times():
    policy = MLPPolicy(3, 2, seed=0)
    seen = lrs(PPO(lr=1e-7, minibatch_size=16), policy, 8)  # approx_kl ~ 0: under desired_kl / 2
    assert seen[0] == 1e-7
    for a, b in itertools.pairwise(seen):
        assert b == pytest.approx(min(a * 1.5, 1e-6))
    assert seen[-1] == pytest.approx(1e-6)  # capped at 10 x lr


def test_the_lr_falls_while_updates_move_the_policy_too_far():
    policy = MLPPolicy(3, 2, seed=0)
    algo = PPO(lr=0.05, minibatch_size=8, update_epochs=8, desired_kl=0.001)
    metrics = [algo.update(policy, batch_for(policy, seed=i)) for i in range(3)]
    assert metrics[0]["approx_kl"] > 0.002
    assert algo.current_lr < 0.05 and algo.optimizer.param_groups[0]["lr"] == algo.current_lr
    assert algo.current_lr >= 0.05 / 100  # the floor


def test_desired_kl_zero_keeps_the_lr_and_the_warm_up_does_not_move_it():
    policy = MLPPolicy(3, 2, seed=0)
    assert set(lrs(PPO(lr=1e-7, minibatch_size=16, desired_kl=0.0), policy, 3)) == {1e-7}
    warm = PPO(lr=1e-7, minibatch_size=16, critic_warmup_updates=2)
    assert lrs(warm, policy, 2) == [1e-7, 1e-7, 1e-7]  # the policy is held: its KL says nothing
    assert warm.update(policy, batch_for(policy, seed=5))["lr"] == 1e-7 and warm.current_lr == 1.5e-7
    with pytest.raises(ValueError, match="desired_kl"):
        PPO(desired_kl=-1.0)


def test_the_adapted_lr_survives_a_checkpoint_and_an_optimiser_reset():
    policy = MLPPolicy(3, 2, seed=0)
    algo = PPO(lr=1e-7, minibatch_size=16)
    lrs(algo, policy, 3)
    state = algo.state_dict()
    assert state["lr"] == pytest.approx(1e-7 * 1.5**3)
    restored = PPO(lr=1e-7, minibatch_size=16)
    restored.load_state_dict(state)
    assert restored.update(policy, batch_for(policy, seed=9))["lr"] == pytest.approx(1e-7 * 1.5**3)
    algo.reset_optimizer()  # after a NaN/inf update
    assert algo.update(policy, batch_for(policy, seed=9))["lr"] == pytest.approx(1e-7 * 1.5**3)
    without = dict(state)
    del without["lr"]
    with pytest.raises(KeyError, match="lr"):
        restored.load_state_dict(without)


def test_a_custom_loss_without_approx_kl_keeps_the_lr():
    policy = MLPPolicy(3, 2, seed=0)

    def loss_fn(policy, mb):
        logp, _, value = policy.evaluate(mb["obs"], mb["actions"])
        return -(logp * mb["advantages"]).mean() + (value - mb["returns"]).square().mean(), {}

    algo = PPO(lr=1e-7, minibatch_size=16, loss_fn=loss_fn)
    assert set(lrs(algo, policy, 3)) == {1e-7}


# ---- HFTokenPolicy's bin head ------------------------------------------------------------------

OBS = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
ACT = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)


@pytest.mark.usefixtures("hf_offline")
def test_the_bin_head_starts_at_zero_and_reads_each_dimension_on_its_own(tiny_llama):
    from ebrl.policies.hf_token import HFTokenPolicy

    policy = HFTokenPolicy.from_pretrained(tiny_llama, OBS, ACT, instruction="reach the target", lora_rank=4)
    plain = HFTokenPolicy.from_pretrained(tiny_llama, OBS, ACT, instruction="reach the target", lora_rank=4,
                                          bin_basis=0)
    assert plain.bin_head is None and policy.bin_head.weight.shape == (3 * 32, policy.hidden)
    obs = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    actions = torch.from_numpy(policy.act(obs).actions)
    with torch.no_grad():  # zero-initialised: exactly the model's own logits
        torch.testing.assert_close(token_logits(policy, torch.as_tensor(obs), actions)[0],
                                   token_logits(plain, torch.as_tensor(obs), actions)[0])
        # the LM head's rows cap the model's own logits; the head moves them past it
        assert float(token_logits(plain, torch.as_tensor(obs), actions)[0].abs().max()) < 1.0
        for p in policy.bin_head.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        logits, _ = token_logits(policy, torch.as_tensor(obs), actions)
    assert float(logits.abs().max()) > 5.0
    # the KV-cache decoder reads dimension j with readout j, as the teacher-forced pass does
    out = policy.act(obs)
    _, cached, _ = policy.decode(obs, torch.from_numpy(out.actions))
    with torch.no_grad():
        forced, _ = token_logits(policy, torch.as_tensor(obs), torch.from_numpy(out.actions))
        logp = policy.evaluate(torch.as_tensor(obs), torch.from_numpy(out.actions))[0]
    torch.testing.assert_close(cached, forced, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.logprobs, logp.numpy(), atol=1e-4)
    # each dimension's readout: changing the second one's moves the second dimension's logits only
    with torch.no_grad():
        policy.bin_head.weight.view(3, 32, -1)[1] += 1.0
        moved, _ = token_logits(policy, torch.as_tensor(obs), torch.from_numpy(out.actions))
    changed = (moved - forced).abs().amax(dim=(0, 2))
    assert changed[1] > 1e-3 and changed[0] == 0 and changed[2] == 0


@pytest.mark.usefixtures("hf_offline")
def test_adapters_keep_their_bin_head_and_a_description_without_it_is_refused(tiny_llama, tmp_path):
    from ebrl.policies.hf_token import HFTokenPolicy

    plain = HFTokenPolicy.from_pretrained(tiny_llama, OBS, ACT, instruction="reach the target", lora_rank=4,
                                          bin_basis=0)
    plain.save_adapters(tmp_path / "plain")
    assert HFTokenPolicy.load_adapters(tmp_path / "plain").bin_head is None
    new = HFTokenPolicy.from_pretrained(tiny_llama, OBS, ACT, instruction="reach the target", lora_rank=4)
    new.save_adapters(tmp_path / "new")
    again = HFTokenPolicy.load_adapters(tmp_path / "new")
    assert again.config["bin_basis"] == 32 and torch.equal(again.bin_head.weight, new.bin_head.weight)
    assert math.isfinite(float(again.act(np.zeros((2, 5), np.float32)).logprobs.sum()))
    # without the option, the constructor's default would give a bin head the adapters never trained
    config = json.loads((tmp_path / "plain" / "ebrl_policy.json").read_text())
    del config["bin_basis"]
    (tmp_path / "plain" / "ebrl_policy.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"ebrl_policy.json lacks options HFTokenPolicy saves: \['bin_basis'\]"):
        HFTokenPolicy.load_adapters(tmp_path / "plain")
    with pytest.raises(ValueError, match="bin_basis"):
        HFTokenPolicy.from_pretrained(tiny_llama, OBS, ACT, instruction="reach the target", bin_basis=-1)


def test_max_kl_stops_an_update_at_the_first_minibatch_past_it():
    """An lr far too large: the first minibatch steps (on-policy, KL 0), the next one measures the
    move and the update stops there; without max_kl every minibatch of every epoch steps."""
    def run(**kw):
        policy = MLPPolicy(3, 2, action_low=-1, action_high=1, seed=0, normalize_obs=False)
        return PPO(lr=0.05, desired_kl=0, minibatch_size=16, update_epochs=4, seed=0, **kw).update(
            policy, batch_for(policy))

    free, bounded = run(), run(max_kl=1e-3)
    assert free["minibatches"] == 16 and free["kl_stopped"] == 0.0
    assert bounded["kl_stopped"] == 1.0 and 1 <= bounded["minibatches"] < 16
    with pytest.raises(ValueError, match="max_kl"):
        PPO(max_kl=-1.0)


def test_the_critic_keeps_its_own_lr_while_the_adaptive_lr_moves_the_rest():
    policy = MLPPolicy(3, 2, action_low=-1, action_high=1, seed=0, normalize_obs=False)
    algo = PPO(lr=1e-6, critic_lr=1e-2, seed=0, minibatch_size=16)
    lrs(algo, policy, 3)  # a tiny lr barely moves the policy: the adaptive lr raises it
    groups = algo.optimizer.param_groups
    critic = {id(p) for p in policy.critic.parameters()}
    assert len(groups) == 2 and {id(p) for p in groups[1]["params"]} == critic
    assert groups[1]["lr"] == 1e-2 and groups[0]["lr"] == algo.current_lr > 1e-6
    restored = PPO(lr=1e-6, critic_lr=1e-2, seed=0, minibatch_size=16)
    restored.load_state_dict(algo.state_dict())
    restored.update(policy, batch_for(policy, seed=9))
    assert restored.optimizer.param_groups[1]["lr"] == 1e-2
    with pytest.raises(ValueError, match="critic_lr"):
        PPO(critic_lr=0.0)


def test_an_update_stopped_at_max_kl_lowers_the_next_lr():
    """The minibatches that stepped measured no KL (the first is on-policy): the one that stopped
    the update did, and it was past max_kl, so the lr goes down, not up."""
    policy = MLPPolicy(3, 2, action_low=-1, action_high=1, seed=0, normalize_obs=False)
    algo = PPO(lr=0.05, max_kl=1e-3, minibatch_size=64, update_epochs=4, seed=0)
    out = lrs(algo, policy, 3)
    assert out[0] == 0.05 and out[1] < out[0] and out[2] < out[1]
