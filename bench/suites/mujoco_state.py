"""Gymnasium MuJoCo locomotion from state: the common case of CPU-bound Python simulation.
HalfCheetah-v5 and Ant-v5, 64 envs, MLP policy, PPO; training included in every number."""

import gymnasium as gym

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.policies import MLPPolicy


def half_cheetah(i: int) -> gym.Env:
    return gym.make("HalfCheetah-v5")


def ant(i: int) -> gym.Env:
    return gym.make("Ant-v5")


SUITE = Suite(
    description="HalfCheetah-v5 and Ant-v5 from state: EBRL schedules vs gymnasium vector-env loops",
    cases={"HalfCheetah-v5": half_cheetah, "Ant-v5": ant},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(minibatch_size=512, seed=seed),
    num_envs=64,
    steps=100_000,
    quick_steps=1_024,
    # the hot-path issue's targets against CleanRL's loop (what a user would otherwise run)
    targets={"async/best schedule": 0.97, "async/sync": 1.3, "async/best peer": 1.3, "HalfCheetah-v5: async/best peer": 1.5,
             "HalfCheetah-v5: async/cleanrl": 1.6, "Ant-v5: async/cleanrl": 1.4},
)
