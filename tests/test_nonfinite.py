"""NaN and inf beyond step observations: reset observations, actions, losses and weights."""

import math

import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO
from ebrl.policies.base import ActResult
from ebrl.runtime.errors import NonFiniteError
from ebrl.testing import MockEnv, MockPolicy, NoopAlgo, run_virtual

RESETS: dict[int, int] = {}  # env id -> resets so far, over rebuilds (a rebuilt env does not fail again)


class NaNReset(MockEnv):
    """Env ``bad``'s reset number ``which`` observes NaN (1: the run's first; 2: the one that
    begins its second episode, inside the step that ends the first)."""

    def __init__(self, env_id, bad=2, which=1, **kw):
        super().__init__(dim=3, episode_len=10, **kw)
        self.env_id, self.bad, self.which = env_id, bad, which

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        RESETS[self.env_id] = RESETS.get(self.env_id, 0) + 1
        if self.env_id == self.bad and RESETS[self.env_id] == self.which:
            obs = np.full_like(obs, np.nan)
        return obs, info


def _cfg(nonfinite, **kw):
    return ebrl.RunConfig(**{"num_envs": 4, "segment_len": 8, "total_env_steps": 400,
                             "faults": {"nonfinite": nonfinite}, **kw})


def test_a_nan_reset_observation_raises_naming_the_env_or_rebuilds_it():
    RESETS.clear()
    with pytest.raises(NonFiniteError, match="env 2's reset observation has NaN/inf"):
        run_virtual(ebrl.Trainer(NaNReset, MockPolicy(act_dim=3), NoopAlgo(), _cfg("raise")))
    # rather than raise: the env's reset counts as a failed one; it is rebuilt and reset again
    RESETS.clear()
    res = run_virtual(ebrl.Trainer(NaNReset, MockPolicy(act_dim=3), NoopAlgo(), _cfg("drop")))
    assert res.accounting_ok() and res.env_failures == 1 and res.env_steps == 400


def test_a_nan_observation_from_an_autoreset_is_caught_with_the_step_that_ended_the_episode():
    second = lambda i: NaNReset(i, which=2)  # noqa: E731
    RESETS.clear()
    with pytest.raises(NonFiniteError, match="env 2 produced NaN/inf at step"):
        run_virtual(ebrl.Trainer(second, MockPolicy(act_dim=3), NoopAlgo(), _cfg("raise")))
    RESETS.clear()
    res = run_virtual(ebrl.Trainer(second, MockPolicy(act_dim=3), NoopAlgo(), _cfg("drop")))
    assert res.accounting_ok() and res.dropped["nonfinite"] >= 1


class NaNActions(MockPolicy):
    """Acts NaN for env 1's rows in its third batch."""

    def __init__(self):
        super().__init__(act_dim=3)
        self.calls = 0

    def act(self, obs):
        res = super().act(obs)
        self.calls += 1
        if self.calls == 3:
            a = res.actions.copy()
            a[1] = np.nan
            return ActResult(actions=a, env_actions=a, logprobs=res.logprobs, values=res.values)
        return res


def test_nan_actions_never_reach_an_env_and_raise_or_drop_the_segment():
    env = lambda i: MockEnv(dim=3, episode_len=10)  # noqa: E731
    with pytest.raises(NonFiniteError, match=r"produced NaN/inf actions for envs \[1\]"):
        run_virtual(ebrl.Trainer(env, NaNActions(), NoopAlgo(), _cfg("raise")))
    res = run_virtual(ebrl.Trainer(env, NaNActions(), NoopAlgo(), _cfg("drop")))
    assert res.accounting_ok() and res.env_steps == 400
    assert res.dropped.get("nonfinite", 0) >= 1  # env 1's open segment (it had stepped twice)


class Weighted(MockPolicy):
    """A MockPolicy with a real tensor in its weights."""

    def __init__(self):
        super().__init__(act_dim=3)
        self.w = torch.zeros(2)

    def state_dict(self):
        return {**super().state_dict(), "w": self.w.clone()}

    def load_state_dict(self, state, strict=True):
        super().load_state_dict(state)
        self.w = state["w"].clone()


class GoesNaN(NoopAlgo):
    """Update 2 leaves NaN weights (``weights``) or reports a NaN loss as PPO does (``loss``)."""

    def __init__(self, how):
        super().__init__()
        self.how, self.n, self.resets = how, 0, 0

    def update(self, policy, batch):
        out = super().update(policy, batch)
        self.n += 1
        policy.w = policy.w + 1.0
        if self.n == 2:
            if self.how == "weights":
                policy.w = policy.w * math.nan
            else:
                out["nonfinite_loss"] = 1.0
        return out

    def reset_optimizer(self):
        self.resets += 1


@pytest.mark.parametrize("how, says", [("weights", "update 2 produced NaN/inf weights in w"),
                                       ("loss", "update 2's loss was NaN/inf")])
def test_an_update_with_nan_raises_or_is_undone_and_never_published(how, says):
    env = lambda i: MockEnv(dim=3, episode_len=10)  # noqa: E731
    with pytest.raises(NonFiniteError, match=says):
        run_virtual(ebrl.Trainer(env, Weighted(), GoesNaN(how), _cfg("raise")))
    policy, algo = Weighted(), GoesNaN(how)
    res = run_virtual(ebrl.Trainer(env, policy, algo, _cfg("drop")))
    assert res.accounting_ok() and res.skipped_updates == 1 and algo.resets == 1
    assert res.dropped["nonfinite_update"] > 0
    assert res.updates == algo.n - 1  # every update but the undone one counted, and published
    # the weights went on from update 1's: one step each for the updates kept
    assert torch.equal(policy.w, torch.full((2,), float(algo.n - 1)))


def test_ppo_stops_an_update_at_a_nan_loss_without_stepping_on_it():
    from ebrl.policies import MLPPolicy

    env = MockEnv(dim=3, episode_len=10)
    policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    nan_loss = lambda p, mb: (p.value(mb["obs"]).sum() * math.nan, {})  # noqa: E731
    algo = PPO(loss_fn=nan_loss, minibatch_size=8)
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=10), policy, algo,
                           ebrl.RunConfig(num_envs=2, segment_len=8, total_env_steps=64,
                                          faults={"nonfinite": "drop"}))
    res = ebrl.run_sync(trainer)
    assert res.accounting_ok() and res.skipped_updates == res.updates + res.skipped_updates > 0
    after = trainer.policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k in after and before[k].is_floating_point())
