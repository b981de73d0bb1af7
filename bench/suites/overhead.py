"""Runtime cost per env step: a no-op env and a no-op policy on one core, so everything
measured is the scheduler itself (coroutines, batching, rollout bookkeeping)."""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np

import ebrl
from ebrl.benchmark import Target, check_targets, summarize_rows
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
    runner = f"{schedule} {num_envs} envs" + (f" as vector envs of {vector_size}" if vector_size > 1 else "")
    return {"case": "noop", "runner": runner, "schedule": schedule, "num_envs": num_envs, "vector_size": vector_size,
            "env_steps": result.env_steps, "wall_s": wall, "steps_per_s": result.env_steps / wall,
            "us_per_step": wall / result.env_steps * 1e6, "gen_batch_mean": result.gen_batch_mean}


CONFIGS = [(16, "async", 1), (64, "async", 1), (256, "async", 1), (64, "sync", 1),
           # vector envs (GPU simulators): one request and one sim call per vector env step
           (256, "async", 64), (256, "async", 256)]
# the hot-path issue's targets: per-env overhead and vector-env overhead, wall µs per env step
TARGETS = {"noop: async 64 envs": Target(6.0, lower_is_better=True),
           "noop: async 256 envs as vector envs of 64": Target(3.0, lower_is_better=True)}


def run(quick: bool = False) -> dict:
    steps, rounds = (20_000, 1) if quick else (400_000, 3)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity:
        os.sched_setaffinity(0, {min(affinity)})  # one core: the claim is per core
    try:
        rows = [{"round": r, **measure(n, steps, schedule, v)} for r in range(rounds) for n, schedule, v in CONFIGS]
    finally:
        if affinity:
            os.sched_setaffinity(0, affinity)
    summary = summarize_rows(rows)
    figures = {f"noop: {runner}": figs["us_per_step"] for runner, figs in summary["noop"].items()}
    return {"rows": rows, "summary": summary, "targets": check_targets(figures, TARGETS, unit=" µs"),
            "meta": {"one_core": bool(affinity), "rounds": rounds, "steps_per_run": steps}}
