"""Stragglers: envs of one task with different step costs. HalfCheetah-v5 where a quarter of
the envs simulate 4x the physics per step (frame_skip 20 instead of 5), the mix of fast and
slow envs that lockstep schedules wait on. MLP policy, PPO; training included.

The slow envs sit at seeded random indices, not at a regular stride: a stride would line up
with the process backend's round-robin placement (env i on worker i % W) and put every slow
env on one worker, and the ratio would partly measure that placement."""

import gymnasium as gym
import numpy as np

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.policies import MLPPolicy


NUM_ENVS = 64
SLOW = frozenset(np.random.default_rng(2026).choice(NUM_ENVS, NUM_ENVS // 4, replace=False).tolist())


def env_fn(i: int) -> gym.Env:
    return gym.make("HalfCheetah-v5", frame_skip=20 if i in SLOW else 5)


SUITE = Suite(
    description="HalfCheetah-v5 with a quarter of the envs (random indices) 4x costlier per step: stragglers",
    cases={"HalfCheetah-mixed-cost": env_fn},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(minibatch_size=512, seed=seed),
    num_envs=NUM_ENVS,
    steps=100_000,
    quick_steps=1_024,
    targets={"async/best schedule": 0.97, "async/sync": 2.0},
)
