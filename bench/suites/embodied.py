"""The paper's regime on this machine: real ManiSkill3 ``PickCube-v1`` from state (42 numbers),
16 envs on SAPIEN's CPU backend (one env per instance; a CUDA machine would vectorise them),
MLP + PPO, every schedule at its defaults, each run in a fresh process.

Runners: EBRL ``async`` (every env independent), ``pipelined`` (RLinf-style: the env groups
of a lockstep rollout pipelined with generation) and ``sync`` (lockstep, then train). Reported:
end-to-end env steps/s, which is RLinf's metric (env steps / iteration time, an iteration
being rollout and training), and rollout env steps/s (time paused for training excluded).
Training is included in every number. No gymnasium/CleanRL peers here: they have no ManiSkill
CPU path of their own beyond what the sync schedule already measures. LIBERO, whose steps and
resets cost seconds, is the ``libero`` suite.
"""

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.envs import make
from ebrl.policies import MLPPolicy


def maniskill_env(i: int):
    return make("maniskill/PickCube-v1")


SUITE = Suite(
    description="real ManiSkill3 PickCube (state, 16 envs, MLP): async vs pipelined vs sync, fresh processes, "
                "training included",
    cases={"maniskill-pickcube": maniskill_env},
    policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(seed=seed),
    num_envs=16,
    steps=16_000,
    quick_steps=64,
    schedules=("async", "pipelined", "sync"),
    peers=(),
    limits=False,
    targets={"async/best schedule": 0.97, "async/sync": 1.3},
    quick_num_envs=2,
    quick_schedules=("async", "sync"),
)
