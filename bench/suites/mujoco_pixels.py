"""Pixels: the heavy-simulation case of embodied RL. HalfCheetah-v5 rendered offscreen
(MUJOCO_GL=egl, CPU rendering through Mesa here) at 84x84 with the state beside it, a small
CNN policy, PPO; training included in every number. Rendering dominates the step.

``fast_render=True`` turns off multisampling, shadows and reflections: with them, Mesa's
software renderer manages 15-17 frames/s per env here, which would make one run take
many minutes; without them 500-900 frames/s, still ~10x the cost of the physics."""

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.envs import make
from ebrl.policies import CNNPolicy


def env_fn(i: int):
    return make("mujoco/HalfCheetah-v5", pixels=84, fast_render=True)


SUITE = Suite(
    description="HalfCheetah-v5 rendered at 84x84 (offscreen EGL), CNN policy: the heavy-simulation case",
    cases={"HalfCheetah-pixels84": env_fn},
    policy_fn=lambda obs_space, act_space, seed: CNNPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(minibatch_size=256, update_epochs=2, seed=seed),
    num_envs=16,
    segment_len=32,
    steps=8_192,
    quick_steps=128,
    quick_num_envs=2,
    peers=("sync", "async"),  # the CleanRL-style peer takes Box observations (an MLP), not pixels
    targets={"async/sync": 1.5},
)
