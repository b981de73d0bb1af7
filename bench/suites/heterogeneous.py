"""Stragglers: envs of one task with different step costs. HalfCheetah-v5 where every
fourth env simulates 4x the physics per step (frame_skip 20 instead of 5), the mix of
fast and slow envs that lockstep schedules wait on. MLP policy, PPO; training included."""

import gymnasium as gym

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.policies import MLPPolicy


def env_fn(i: int) -> gym.Env:
    return gym.make("HalfCheetah-v5", frame_skip=20 if i % 4 == 3 else 5)


SUITE = Suite(
    description="HalfCheetah-v5 with every 4th env 4x costlier per step: straggler envs",
    cases={"HalfCheetah-mixed-cost": env_fn},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(minibatch_size=512, seed=seed),
    num_envs=64,
    steps=100_000,
    quick_steps=1_024,
    targets={"async/sync": 2.0},
)
