"""Long-tail step latency: MockEnv steps sleep a lognormal time (median 2 ms, sigma 1), the
straggler pattern of embodied simulators; the sleep releases the GIL like a C++ or GPU
simulator. MLP policy, PPO; training included in every number.

Every knob is at its default: the suite measures what a user gets, not a hand-set pool.
The AUTO probe sees a step whose CPU time is far under its wall time and gives the thread
backend a lane per env (``sim.num_threads`` unset)."""

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.policies import MLPPolicy
from ebrl.testing import Latency, MockEnv


def env_fn(i: int) -> MockEnv:
    return MockEnv(dim=8, latency=Latency.lognormal(0.002, 1.0))


SUITE = Suite(
    description="async vs pipelined vs sync vs gymnasium loops on lognormal step latency, training included",
    cases={"mock-lognormal": env_fn},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(minibatch_size=512, seed=seed),
    num_envs=32,
    steps=30_000,
    quick_steps=1_024,
    targets={"async/best schedule": 0.97, "async/sync": 3.5},
)
