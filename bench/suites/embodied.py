"""The paper's regime on this machine: the real ManiSkill3 and LIBERO simulators, every
schedule at its defaults, each run in a fresh process.

- ``maniskill-pickcube``: ManiSkill3 ``PickCube-v1`` from state (42 numbers), 16 envs on
  SAPIEN's CPU backend (one env per instance; a CUDA machine would vectorise them), MLP + PPO.
- ``libero-spatial``: LIBERO-spatial, 8 envs over 4 of its tasks (two envs per task, ``env i``
  runs task ``i // 2``), each observing its end-effector state, the objects' state, the task's
  instruction (its index in the suite) and one 32x32 ``agentview`` camera, with the suite's
  real episode length (220 steps). ``TokenPolicy`` (OpenVLA's 256-bin action tokens, a CNN for
  the camera) + PPO. Steps cost about 0.1 s (robosuite renders through Mesa's software EGL)
  and resets 2-4 s (robosuite rebuilds the scene): the reset is the straggler that a lockstep
  group waits for.

Runners: EBRL ``async`` (every env independent), ``pipelined`` (RLinf-style: the env groups
of a lockstep rollout pipelined with generation) and ``sync`` (lockstep, then train). Reported:
end-to-end env steps/s, which is RLinf's metric (env steps / iteration time, an iteration
being rollout and training), and rollout env steps/s (time paused for training excluded).
Training is included in every number. No gymnasium/CleanRL peers here: they have no LIBERO
or ManiSkill CPU path of their own beyond what the sync schedule already measures.
"""

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.envs import make
from ebrl.policies import MLPPolicy, TokenPolicy

LIBERO_TASKS = 4  # tasks of libero_spatial in the run; env i runs task i // 2


def maniskill_env(i: int):
    return make("maniskill/PickCube-v1")


def libero_env(i: int):
    return make(f"libero/libero_spatial/{(i // 2) % LIBERO_TASKS}", cameras=("agentview",), pixels=32,
                object_state=True, instruction=True)


def policy_fn(obs_space, act_space, seed):
    if "pixels" in getattr(obs_space, "spaces", {}):
        return TokenPolicy.from_spaces(obs_space, act_space, seed=seed)
    return MLPPolicy.from_spaces(obs_space, act_space, seed=seed)


SUITE = Suite(
    description="real ManiSkill3 PickCube (state, 16 envs) and LIBERO-spatial (state + 32px camera + instruction, "
                "8 envs, 4 tasks, token policy): async vs pipelined vs sync, fresh processes, training included",
    cases={"maniskill-pickcube": maniskill_env, "libero-spatial": libero_env},
    policy_fn=policy_fn,
    algo_fn=lambda seed: PPO(seed=seed),
    num_envs=16,
    steps=16_000,
    quick_steps=64,
    schedules=("async", "pipelined", "sync"),
    peers=(),
    limits=False,  # each stage alone would cost minutes more of LIBERO resets
    targets={"async/best schedule": 0.97, "async/sync": 1.3, "libero-spatial: async/pipelined": 1.5},
    quick_num_envs=2,  # --quick: a smoke test of the real path (LIBERO steps 0.1 s) ...
    quick_schedules=("async", "sync"),  # ... and of the figure (async/sync); LIBERO resets take seconds
    # LIBERO steps about 50x slower: 8 envs, 300 steps each, so every env resets once mid-run
    case_sizes={"libero-spatial": (8, 2_400)},
)
