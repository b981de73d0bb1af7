"""Single-env step cost of each simulator adapter, state and pixels: random actions in one
thread, no runtime, so the numbers say what one env costs on this machine."""

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
]


def measure(name: str, kwargs: dict, seconds: float) -> dict:
    from ebrl.envs import make

    env = make(name, **kwargs)
    env.reset(seed=0)
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
    obs = "pixels 84x84" if "pixels" in kwargs else "state"
    return {"case": name, "runner": obs, "env": name, "observation": obs, "env_steps": n, "steps_per_s": n / wall, "us_per_step": wall / n * 1e6}


def run(quick: bool = False) -> dict:
    seconds, rounds = (0.2, 1) if quick else (2.0, 3)
    quick_names = ("mujoco/HalfCheetah-v5", "robotics/FetchReachDense-v4", "dmc/cartpole-swingup")
    cases = [(n, kw) for n, kw in CASES if n in quick_names and not kw] if quick else CASES
    rows = [{"round": r, **measure(name, kw, seconds)} for r in range(rounds) for name, kw in cases]
    return {"rows": rows, "meta": {"rounds": rounds, "seconds_per_case": seconds}}
