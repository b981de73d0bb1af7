"""GRPO's dynamic sampling (DAPO): groups whose members all scored alike are dropped, the others
held until an update has a batch's worth, and GRPO then learns a sparse reach from near zero.

:class:`SparseReach` pays 1 only on reaching a target 0.6 away within 20 small steps; an
untrained MLPPolicy wanders there in about 3.5% of its episodes. With dynamic sampling GRPO
reaches 0.52 in 40k steps here (seed 0); plain GRPO, which steps Adam only on batches with a
signal, reaches 1.0 on the same budget: in this runtime dynamic sampling trains less often
(it waits for a batch's worth of informative groups), so it is off by default. On the thread
and the process learner alike, the steps it trains, drops by reason and holds add up to those
simulated, held ones counted in flight at a stop.
"""

from __future__ import annotations

import asyncio

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import Batch
from ebrl.algos.batch import concat_segments, select_segments
from ebrl.algos.grpo import GRPO
from ebrl.policies import MLPPolicy
from ebrl.testing import run_virtual, torch_threads


class SparseReach(gym.Env):
    """A point at the origin moved by ``0.1 a`` (``a`` clipped to ``[-1, 1]^2``) towards a target
    0.6 away in a direction the reset seed picks; reward 1 and the end of the episode within 0.1
    of it, else 0; 20 steps. Observation: position and target."""

    RADIUS, REACH, STEPS = 0.6, 0.1, 20

    def __init__(self):
        self.observation_space = gym.spaces.Box(-2.0, 2.0, (4,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.virtual_step_cost = 1e-3
        self.pos, self.target, self.t = np.zeros(2), np.zeros(2), 0

    def _obs(self):
        return np.concatenate([self.pos, self.target]).astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        angle = self.np_random.uniform(0, 2 * np.pi)
        self.pos, self.t = np.zeros(2), 0
        self.target = self.RADIUS * np.array([np.cos(angle), np.sin(angle)])
        return self._obs(), {}

    def step(self, action):
        self.pos = self.pos + 0.1 * np.clip(np.asarray(action, np.float64), -1.0, 1.0)
        self.t += 1
        hit = bool(np.linalg.norm(self.pos - self.target) < self.REACH)
        return self._obs(), float(hit), hit, self.t >= self.STEPS and not hit, {"success": hit}


def success_rate(policy, episodes: int = 200, seed: int = 50_000) -> float:
    """The share of ``episodes`` (fixed seeds) the policy's samples reach the target in."""
    env, wins = SparseReach(), 0
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done = False
        while not done:
            act = policy.act(obs[None])
            obs, reward, term, trunc, _ = env.step(act.env_actions[0])
            done = term or trunc
        wins += reward > 0
    return wins / episodes


def _batch(returns: list[float], groups: list[int], T: int = 3) -> Batch:
    """One episode per segment, of ``T`` steps, paying its return at its last step."""
    S = len(returns)
    rewards = torch.zeros(S, T)
    rewards[:, -1] = torch.tensor(returns)
    term = torch.zeros(S, T, dtype=torch.bool)
    term[:, -1] = True
    no = torch.zeros(S, T, dtype=torch.bool)
    return Batch(torch.randn(S, T, 4), torch.randn(S, T, 2), torch.zeros(S, T), torch.zeros(S, T), rewards, term,
                 no, torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long), torch.zeros(S, 4),
                 torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.long), group=torch.tensor(groups))


def test_select_and_concat_keep_segments_and_their_truncations():
    b = _batch([1, 0, 0, 0], [5, 5, 6, 6])
    b.final_obs, b.final_index = torch.arange(8.0).reshape(2, 4), torch.tensor([[1, 1], [3, 0]])
    part = select_segments(b, torch.tensor([False, True, False, True]))
    assert part.mask.shape == (2, 3) and part.group.tolist() == [5, 6]
    assert part.final_index.tolist() == [[0, 1], [1, 0]] and torch.equal(part.final_obs, b.final_obs)
    both = concat_segments([part, _batch([2.0], [9], T=5)])
    assert both.mask.shape == (3, 5) and both.mask.sum() == 2 * 3 + 5
    assert both.final_index.tolist() == [[0, 1], [1, 0]] and both.group.tolist() == [5, 6, 9]


def test_dynamic_sampling_drops_uniform_groups_and_holds_the_rest_until_a_batch_is_full():
    torch.manual_seed(0)
    policy = MLPPolicy(4, 2, seed=0)
    algo = GRPO(dynamic_sampling=True, update_epochs=1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    # two groups a batch: the first batch brings one informative group (5) and one uniform (6)
    m = algo.update(policy, _batch([1, 0, 0, 0], [5, 5, 6, 6]))
    assert m["deferred"] == 1 and m["groups_held"] == 1 and m["steps_trained"] == 0 and m["steps_held"] == 6
    assert m["dropped/grpo_uniform_group"] == 6 and m["dropped/grpo_unused_segment"] == 0
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())  # nothing trained yet
    # the second brings another informative group (its key equal to the first's: held apart)
    m = algo.update(policy, _batch([0, 0, 2, 0], [5, 5, 7, 7]))
    assert m["deferred"] == 0 and m["resample_batches"] == 2 and m["resample_capped"] == 0
    assert m["steps_trained"] == 12 and m["segments_used"] == 4 and m["groups"] == 2 and m["minibatches"] >= 1
    assert m["dropped/grpo_uniform_group"] == 6
    assert not all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())


def test_dynamic_sampling_trains_on_what_it_holds_at_the_cap_and_reports_it():
    policy = MLPPolicy(4, 2, seed=0)
    algo = GRPO(dynamic_sampling=True, resample_cap=3, update_epochs=1)
    seen = [algo.update(policy, _batch(r, [1, 1, 2, 2])) for r in ([0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0])]
    assert [m["deferred"] for m in seen] == [1, 1, 0]
    assert seen[-1]["resample_capped"] == 1 and seen[-1]["steps_trained"] == 6 and seen[-1]["groups"] == 1
    empty = [algo.update(policy, _batch([0, 0, 0, 0], [1, 1, 2, 2])) for _ in range(3)]
    assert empty[-1]["no_signal"] == 1 and empty[-1]["resample_capped"] == 1 and empty[-1]["steps_trained"] == 0


def _run_grpo(dynamic: bool, steps: int, seed: int = 0):
    policy = MLPPolicy(4, 2, seed=seed)
    algo = GRPO(dynamic_sampling=dynamic, lr=3e-3, seed=seed)
    cfg = ebrl.RunConfig(num_envs=16, total_env_steps=steps, seed=seed, reset_group=8)
    with torch_threads(1):
        result = run_virtual(ebrl.Trainer(lambda i: SparseReach(), policy, algo, cfg))
    return policy, result


def test_grpo_with_dynamic_sampling_learns_a_sparse_reach_from_near_zero():
    start = success_rate(MLPPolicy(4, 2, seed=0))
    policy, result = _run_grpo(True, 40_000)
    end = success_rate(policy)
    print(f"sparse reach success {start:.3f} -> {end:.3f}")
    assert start < 0.1
    assert end > 0.3
    # the runtime counts what dynamic sampling dropped, and every step adds up
    assert result.dropped["grpo_uniform_group"] > 0 and result.trained < result.env_steps
    assert result.accounting_ok()


class Payout(gym.Env):
    """Episodes of ``length`` steps that pay 1 at their last step if ``pays``, whatever the actions."""

    def __init__(self, length: int, pays: bool):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.virtual_step_cost = 1e-3
        self.length, self.pays, self.t = length, pays, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        end = self.t >= self.length
        return np.array([self.t / self.length, 0.0], np.float32), float(end and self.pays), False, end, {}


@pytest.mark.parametrize("learner", ["thread", "process"])
def test_held_and_dropped_steps_add_up_on_either_learner(learner):
    """Three reset groups of 4 envs, each sync round one segment per env (at most 8 steps): in
    the first, episodes of 4 steps of which one pays (informative), in the second none pays
    (uniform: dropped), in the third episodes of 10 steps (cut at 8: unused, dropped). Dynamic
    sampling holds the first group's 16 steps a round and trains on two rounds' worth. Stopped
    while it holds some (the algorithm in the learner process, or in the learner's thread): the
    steps trained, dropped by reason and held in flight add up to those simulated."""
    policy = MLPPolicy(2, 1, seed=0)
    algo = GRPO(dynamic_sampling=True, update_epochs=1)
    cfg = ebrl.RunConfig(num_envs=12, segment_len=8, total_env_steps=100_000, reset_group=4, schedule="sync",
                         learner=learner, sim={"backend": "inline"}, log_every_s=0.001)
    stop, last = asyncio.Event(), {}

    def progress(stats, learner):  # every millisecond, and at the end
        last.update(held=learner.held, version=learner.version)
        if stats.trained and learner.held:
            stop.set()

    with torch_threads(1):
        res = ebrl.run_sync(ebrl.Trainer(lambda i: Payout(4, i == 0) if i < 8 else Payout(10, False), policy, algo,
                                         cfg), stop=stop, progress=progress)
    assert res.learner_mode == learner and res.accounting_ok()
    rows = res.history
    assert [r["deferred"] for r in rows] == [1.0, 0.0, 1.0] and last == {"held": 16, "version": 3}
    assert rows[-1]["steps_held"] == 16 and res.in_flight_at_stop >= 16  # the held steps, and any simulated since
    assert res.trained == sum(r["steps_trained"] for r in rows) == 32
    assert res.dropped["grpo_uniform_group"] == sum(r["dropped/grpo_uniform_group"] for r in rows) == 3 * 16
    assert res.dropped["grpo_unused_segment"] == sum(r["dropped/grpo_unused_segment"] for r in rows) > 0
