"""A user's own long-tail env, embedded in the user's own event loop: 16 MockEnvs whose steps
sleep a lognormal time (median 1 ms, sigma 1), 6,000 env steps, MLP policy and PPO at their
defaults, run as a research script runs it: ``asyncio.run(main())`` awaiting ``ebrl.run``
(asyncio's own loop, not uvloop), each run a fresh Python process. The short run weighs
start-up (the probe, the forks, the first update) as much as the steady state."""

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.config import RunConfig
from ebrl.policies import MLPPolicy
from ebrl.testing import Latency, MockEnv


def env_fn(i: int) -> MockEnv:
    return MockEnv(dim=8, latency=Latency.lognormal(0.001, 1.0))


SUITE = Suite(
    description="a user's long-tail env (16 envs, 1 ms lognormal), 6k steps, embedded in asyncio.run",
    cases={"user-lognormal-6k": env_fn},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(seed=seed),
    num_envs=16,
    steps=6_000,
    quick_steps=1_024,
    segment_len=RunConfig.segment_len,  # the user's default
    schedules=("async", "sync"),
    peers=(),
    embedded=True,  # limits: each stage alone, the ceiling the async/sync target is read against
    targets={"async/best schedule": 0.97, "async/sync": 2.5},
)
