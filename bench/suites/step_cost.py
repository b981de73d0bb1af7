"""Single-env step cost of each simulator adapter, state and pixels: random actions in one
thread, no runtime, so the numbers say what one env costs on this machine. ``reset_s`` is one
reset after the first (robosuite rebuilds LIBERO's scene at every reset: the straggler of
embodied rollouts). A family whose simulator is not installed is reported as skipped."""

from __future__ import annotations

import time

DESCRIPTION = "single-env steps/s of each simulator adapter, state and pixels (random actions)"

CASES = [
    ("mujoco/HalfCheetah-v5", {}),
    ("mujoco/HalfCheetah-v5", {"pixels": 84, "fast_render": True}),
    ("mujoco/Ant-v5", {}),
    ("mujoco/Humanoid-v5", {}),
    ("robotics/FetchReachDense-v4", {}),
    ("robotics/FetchReachDense-v4", {"pixels": 84}),
    ("robotics/FetchPickAndPlace-v4", {}),
    ("robotics/HandManipulateBlock-v1", {}),
    ("robotics/AdroitHandDoor-v1", {}),
    ("robotics/AdroitHandDoor-v1", {"pixels": 84}),
    ("robotics/FrankaKitchen-v1", {}),
    ("dmc/cartpole-swingup", {}),
    ("dmc/walker-walk", {}),
    ("dmc/walker-walk", {"pixels": 84}),
    # the paper's simulators, real (ebrl[embodied]; ManiSkill on its CPU backend without CUDA)
    ("libero/libero_spatial/0", {"cameras": ()}),
    ("libero/libero_spatial/0", {"pixels": 128}),  # agentview + wrist, OpenVLA's layout
    ("maniskill/PickCube-v1", {}),
    ("maniskill/PushCube-v1", {}),
    ("maniskill/PickCube-v1", {"pixels": 128}),
    ("so101/PickCube", {}),
    ("so101/PickCube", {"pixels": 84}),
]


def measure(name: str, kwargs: dict, seconds: float) -> dict:
    from ebrl.envs import make

    obs = f"pixels {kwargs['pixels']}x{kwargs['pixels']}" if "pixels" in kwargs else "state"
    try:
        env = make(name, **kwargs)
        env.reset(seed=0)
    except (ImportError, RuntimeError) as exc:  # not installed, or no renderer/Vulkan device here
        return {"case": name, "runner": obs, "env": name, "observation": obs, "skipped": str(exc)[:300]}
    t0 = time.perf_counter()
    env.reset(seed=1)
    reset_s = time.perf_counter() - t0
    env.action_space.seed(0)
    for _ in range(5):  # warm-up: first renders and lazy initialisation
        env.step(env.action_space.sample())
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
        n += 1
    wall = time.perf_counter() - t0
    env.close()
    return {"case": name, "runner": obs, "env": name, "observation": obs, "env_steps": n, "steps_per_s": n / wall,
            "us_per_step": wall / n * 1e6, "reset_s": reset_s}


def run(quick: bool = False) -> dict:
    seconds, rounds = (0.2, 1) if quick else (2.0, 3)
    quick_names = ("mujoco/HalfCheetah-v5", "robotics/FetchReachDense-v4", "dmc/cartpole-swingup")
    cases = [(n, kw) for n, kw in CASES if n in quick_names and not kw] if quick else CASES
    rows = [{"round": r, **measure(name, kw, seconds)} for r in range(rounds) for name, kw in cases]
    return {"rows": rows, "meta": {"rounds": rounds, "seconds_per_case": seconds}}
