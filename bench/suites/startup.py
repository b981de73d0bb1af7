"""Start-up included: a short run, where building the envs, forking the workers and the
learner and the first update weigh as much as the steady state. HalfCheetah-v5, 16 envs,
16k env steps, MLP policy, PPO, against CleanRL's one-process loop on the same envs (which
starts nothing). Every figure is the whole ``run()``, from the call to its return."""

import gymnasium as gym

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.policies import MLPPolicy


def half_cheetah(i: int) -> gym.Env:
    return gym.make("HalfCheetah-v5")


SUITE = Suite(
    description="HalfCheetah-v5, 16 envs, 16k steps: start-up and shutdown included",
    cases={"HalfCheetah-v5-16k": half_cheetah},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(minibatch_size=512, seed=seed),
    num_envs=16,
    steps=16_000,
    quick_steps=1_024,
    schedules=("async", "sync"),
    peers=("cleanrl",),
    limits=False,
    targets={"async/cleanrl": 1.0},
)
