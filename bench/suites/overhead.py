"""Runtime cost per env step: a no-op env and a no-op policy on one core, so everything
measured is the scheduler itself (coroutines, batching, rollout bookkeeping)."""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np

import ebrl
from ebrl.testing import MockPolicy, NoopAlgo

DESCRIPTION = "runtime cost per env step (no-op env and policy, one core)"


class NoopEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)

    def __init__(self):
        self._obs = np.zeros(4, np.float32)

    def reset(self, *, seed=None, options=None):
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


class NoopVectorEnv(gym.vector.VectorEnv):
    """``n`` no-op envs stepped in one call (a GPU simulator's shape, at no cost)."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, n: int):
        self.num_envs = n
        self.single_observation_space, self.single_action_space = NoopEnv.observation_space, NoopEnv.action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, n)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, n)
        self._obs, self._rew, self._flags = np.zeros((n, 4), np.float32), np.zeros(n), np.zeros(n, bool)

    def reset(self, *, seed=None, options=None):
        return self._obs, {}

    def step(self, actions):
        return self._obs, self._rew, self._flags, self._flags, {}


def measure(num_envs: int, steps: int, schedule: str, vector_size: int = 1) -> dict:
    env_fn = (lambda k: NoopVectorEnv(vector_size)) if vector_size > 1 else (lambda i: NoopEnv())
    trainer = ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(),
                           ebrl.RunConfig(num_envs=num_envs, segment_len=64, total_env_steps=steps,
                                          schedule=schedule, sim={"backend": "inline", "vector_size": vector_size}))
    t0 = time.perf_counter()
    result = ebrl.run_sync(trainer)
    wall = time.perf_counter() - t0
    return {"schedule": schedule, "num_envs": num_envs, "vector_size": vector_size, "env_steps": result.env_steps,
            "wall_s": wall, "steps_per_s": result.env_steps / wall, "us_per_step": wall / result.env_steps * 1e6,
            "gen_batch_mean": result.gen_batch_mean}


def run(quick: bool = False) -> dict:
    steps = 20_000 if quick else 400_000
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity:
        os.sched_setaffinity(0, {min(affinity)})  # one core: the claim is per core
    try:
        rows = [measure(n, steps, "async") for n in (16, 64, 256)]
        rows.append(measure(64, steps, "sync"))
        # vector envs (GPU simulators): one request and one sim call per vector env step
        rows += [measure(256, steps, "async", vector_size=64), measure(256, steps, "async", vector_size=256)]
    finally:
        if affinity:
            os.sched_setaffinity(0, affinity)
    best = max(r["steps_per_s"] for r in rows if r["schedule"] == "async" and r["vector_size"] == 1)
    return {"rows": rows, "meta": {"one_core": bool(affinity), "best_async_steps_per_s": best}}
