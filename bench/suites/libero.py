"""LIBERO-spatial on this machine: 8 envs over 4 of its tasks (two envs per task, ``env i``
runs task ``i // 2``), each observing its end-effector state, the objects' state, the task's
instruction (its index in the suite) and one 32x32 ``agentview`` camera, with the suite's real
episode length (220 steps). ``TokenPolicy`` (OpenVLA's 256-bin action tokens, a CNN for the
camera) + PPO, every schedule at its defaults, each run in a fresh process. Steps cost about
0.1 s (robosuite renders through Mesa's software EGL) and resets 2-4 s (robosuite rebuilds the
scene): the reset is the straggler that a lockstep group waits for. Runners and figures as in
the ``embodied`` suite.
"""

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.envs import make
from ebrl.policies import TokenPolicy

TASKS = 4  # tasks of libero_spatial in the run; env i runs task i // 2


def libero_env(i: int):
    return make(f"libero/libero_spatial/{(i // 2) % TASKS}", cameras=("agentview",), pixels=32,
                object_state=True, instruction=True)


SUITE = Suite(
    description="real LIBERO-spatial (state + 32px camera + instruction, 8 envs, 4 tasks, token policy): async vs "
                "pipelined vs sync, fresh processes, training included",
    cases={"libero-spatial": libero_env},
    policy_fn=lambda obs_space, act_space, seed: TokenPolicy.from_spaces(obs_space, act_space, seed=seed),
    algo_fn=lambda seed: PPO(seed=seed),
    num_envs=8,
    steps=2_400,  # 300 steps each: every env resets once mid-run
    quick_steps=64,
    schedules=("async", "pipelined", "sync"),
    peers=(),
    limits=False,  # each stage alone would cost minutes more of resets
    targets={"async/sync": 1.3, "async/pipelined": 1.5},
    quick_num_envs=2,  # --quick: a smoke test of the real path (steps 0.1 s, resets seconds)
    quick_schedules=("async", "sync"),
)
