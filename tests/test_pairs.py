"""Every policy and algorithm pair runs under every schedule, with nothing lost."""

import pytest

import ebrl
from ebrl.algos import GRPO, PPO, DecoupledPPO, VTrace
from ebrl.envs.chunks import ActionChunk
from ebrl.policies import FlowPolicy, MLPPolicy, TokenPolicy
from ebrl.testing import MockEnv

POLICIES = {
    "mlp": (lambda o, a: MLPPolicy.from_spaces(o, a, hidden=(16, 16)), lambda i: MockEnv(dim=2, episode_len=8)),
    "token": (lambda o, a: TokenPolicy.from_spaces(o, a, d_model=16, layers=1, heads=2),
              lambda i: MockEnv(dim=2, episode_len=8)),
    "flow": (lambda o, a: FlowPolicy.from_spaces(o, a, hidden=(16, 16)),
             lambda i: ActionChunk(MockEnv(dim=2, episode_len=8), k=2)),
}
ALGOS = {"ppo": PPO, "dppo": DecoupledPPO, "vtrace": VTrace, "grpo": GRPO}


@pytest.mark.parametrize("schedule", ["async", "pipelined", "sync"])
@pytest.mark.parametrize("algo", sorted(ALGOS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pair_runs_under_schedule(policy, algo, schedule):
    make_policy, env_fn = POLICIES[policy]
    env = env_fn(0)
    run = {"segment_cut": "episode", "reset_group": 2} if algo == "grpo" else {}
    cfg = ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=160, schedule=schedule,
                         sim={"backend": "inline"}, learner="thread", **run)
    trainer = ebrl.Trainer(env_fn, make_policy(env.observation_space, env.action_space),
                           ALGOS[algo](minibatch_size=16), cfg)
    res = ebrl.run_sync(trainer)
    assert res.accounting_ok() and res.env_steps == 160 and res.updates >= 2
    assert all(h.get("nonfinite_loss", 0.0) == 0.0 for h in res.history)
