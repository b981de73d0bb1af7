"""Demonstrations kept in RL's loss (DAPG's decaying BC term): the weight, the pull, the CLI."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from ebrl.algos import GRPO, PPO
from ebrl.algos.demo_loss import DemoLoss
from ebrl.config import ConfigError
from ebrl.demos import Demos
from ebrl.evaluation import acting_mode
from ebrl.policies import MLPPolicy
from test_ppo import _bandit_batch

OBS, ACT = gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Box(-1, 1, (2,), np.float32)


def _expert(n=512, seed=1) -> Demos:
    """The bandit's expert: the action equal to the observation."""
    obs = np.random.default_rng(seed).uniform(-1, 1, (n, 2)).astype(np.float32)
    return Demos({"observation.state": obs, "action": obs.copy()}, [(0, n)], ["match"], 10.0)


def _train(demos, updates=15):
    """PPO on bandit batches whose rewards are all 0 (no RL signal); returns the mean's error to
    the expert on fresh observations, and each update's metrics."""
    policy = MLPPolicy(2, 2, action_low=-1, action_high=1, seed=0)
    algo = PPO(seed=0, lr=3e-3, minibatch_size=128, demos=demos)
    rng = np.random.default_rng(0)
    metrics = []
    for _ in range(updates):
        batch, _ = _bandit_batch(policy, rng, S=4, T=64)
        batch.rewards.zero_()
        metrics.append(algo.update(policy, batch))
    x = torch.from_numpy(np.random.default_rng(2).uniform(-1, 1, (256, 2)).astype(np.float32))
    with acting_mode(policy, deterministic=True):
        mean = policy.act(x.numpy()).env_actions
    return float(np.abs(mean - x.numpy()).mean()), metrics, algo


def test_the_demonstrations_pull_the_policy_to_them_with_a_decaying_weight():
    plain_err, plain, _ = _train(None)
    err, metrics, algo = _train(DemoLoss(_expert(), OBS, ACT, coef=1.0, decay=0.9))
    assert err < 0.5 * plain_err, (err, plain_err)  # only the demonstrations carry a signal here
    assert "demo_loss" not in plain[0] and algo.updates == 15
    assert [m["demo_weight"] for m in metrics] == pytest.approx([0.9 ** k for k in range(15)])
    assert metrics[-1]["demo_loss"] < metrics[0]["demo_loss"]


def test_a_weight_decayed_past_a_thousandth_of_coef_is_dropped():
    demos = DemoLoss(_expert(), OBS, ACT, coef=0.1, decay=1e-4)
    assert demos.weight(0) == 0.1 and demos.weight(1) == 0.0
    _, metrics, _ = _train(demos, updates=2)
    assert metrics[0]["demo_weight"] == pytest.approx(0.1) and "demo_loss" in metrics[0]
    assert metrics[1]["demo_weight"] == 0.0 and "demo_loss" not in metrics[1]


@pytest.mark.parametrize("kw, match", [({"coef": 0}, "demo_coef"), ({"decay": 1.5}, "demo_decay")])
def test_bad_weights_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DemoLoss(_expert(), OBS, ACT, **kw)


def test_grpo_adds_the_term_and_keeps_its_update_count_in_its_state():
    from test_grpo import _two_groups_batch

    policy = MLPPolicy(2, 1, seed=0)
    expert = Demos({"observation.state": np.zeros((8, 2), np.float32), "action": np.ones((8, 1), np.float32)},
                   [(0, 8)], ["one"], 10.0)
    algo = GRPO(lr=1e-3, demos=DemoLoss(expert, OBS, gym.spaces.Box(-1, 1, (1,)), coef=0.5, decay=0.5))
    weights = [algo.update(policy, _two_groups_batch(policy=policy))["demo_weight"] for _ in range(3)]
    assert weights == [0.5, 0.25, 0.125] and algo.updates == 3
    again = GRPO(lr=1e-3)
    again.load_state_dict(algo.state_dict())
    assert again.updates == 3


def test_the_cli_builds_the_demonstrations_from_a_dataset_and_names_bad_keys(tmp_path):
    from ebrl.runs import build_spec, build_trainer
    from ebrl.demos import collect, read_lerobot

    collect("mock/reach", tmp_path / "demos", episodes=2)
    base = ["env=mock/reach", f"ppo.demos={tmp_path / 'demos'}"]
    algo = build_trainer(build_spec(None, base + ["ppo.demo_coef=0.5"])).algo
    assert isinstance(algo.demos, DemoLoss) and algo.demos.coef == 0.5 and algo.demos.decay == 0.995
    assert len(algo.demos.actions) == len(read_lerobot(tmp_path / "demos"))
    with pytest.raises(ConfigError, match="ppo.demo_coef"):  # a weight without demonstrations
        build_trainer(build_spec(None, ["env=mock/reach", "ppo.demo_coef=0.5"]))
    with pytest.raises(ConfigError, match="grpo.demo_decay"):
        build_trainer(build_spec(None, ["env=mock/reach", "algo.kind=grpo", f"grpo.demos={tmp_path / 'demos'}",
                                        "grpo.demo_decay=2"]))
    with pytest.raises(ConfigError, match="ppo.demos"):
        build_trainer(build_spec(None, ["env=mock/reach", f"ppo.demos={tmp_path / 'nothing'}"]))
