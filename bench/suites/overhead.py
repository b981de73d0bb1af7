"""Runtime cost per env step: a no-op env and a no-op policy, so everything measured is the
scheduler itself (coroutines, batching, rollout bookkeeping, transport to the sim pool).

Two figures per row: wall µs per env step, and the main process's CPU µs per env step
(``time.process_time`` over the run: the event loop and its threads, not the sim worker
processes). Inline and vector-env rows run pinned to one core (the claim is per core); the
thread and process rows run on the whole machine, where the workers need their own cores,
and their CPU figure is the one that says what the event loop spends per step.

Every row is a fresh Python process (imports outside the timer, start-up inside it), as a
user's script runs; every knob is at its default (the resource controller, its profiler and
the system sampler on) except the sim backend the row names. The process backend is also
measured "stripped", with the controller off (``resources.adapt=false``), beside the
defaults: the price of the default path."""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np

import ebrl
from ebrl.benchmark import Target, check_targets, summarize_rows
from ebrl.benchmark.fresh import call_fresh
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


def measure(num_envs: int, steps: int, schedule: str, vector_size: int = 1, backend: str = "inline",
            adapt: bool = True) -> dict:
    env_fn = (lambda k: NoopVectorEnv(vector_size)) if vector_size > 1 else (lambda i: NoopEnv())
    trainer = ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(),
                           ebrl.RunConfig(num_envs=num_envs, segment_len=64, total_env_steps=steps, schedule=schedule,
                                          sim={"backend": backend, "vector_size": vector_size},
                                          resources={"adapt": adapt}))
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = ebrl.run_sync(trainer)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    runner = (f"{schedule} {num_envs} envs" + (f" as vector envs of {vector_size}" if vector_size > 1 else "")
              + f", {backend}" + ("" if adapt else ", controller off"))
    return {"case": "noop", "runner": runner, "schedule": schedule, "backend": backend, "adapt": adapt,
            "num_envs": num_envs, "vector_size": vector_size, "env_steps": result.env_steps, "wall_s": wall,
            "steps_per_s": result.env_steps / wall, "us_per_step": wall / result.env_steps * 1e6,
            "cpu_us_per_step": cpu / result.env_steps * 1e6, "gen_batch_mean": result.gen_batch_mean}


# (num_envs, schedule, vector_size, backend, controller on, env steps); one core for these:
ONE_CORE = [(16, "async", 1, "inline", True, 400_000), (64, "async", 1, "inline", True, 400_000),
            (256, "async", 1, "inline", True, 400_000), (64, "sync", 1, "inline", True, 400_000),
            # vector envs (GPU simulators): one request and one sim call per vector env step
            (256, "async", 64, "inline", True, 400_000), (256, "async", 256, "inline", True, 400_000)]
# the process rows at 200k steps, start-up included: the figure a user's short script gets
WHOLE_MACHINE = [(64, "async", 1, "thread", True, 400_000), (64, "async", 1, "process", True, 200_000),
                 (64, "async", 1, "process", False, 200_000)]
# the hot-path issue's targets: wall µs per env step (inline, vector) and main-process CPU µs (process)
WALL_TARGETS = {"noop: async 64 envs, inline": Target(6.0, lower_is_better=True),
                "noop: async 256 envs as vector envs of 64, inline": Target(3.0, lower_is_better=True)}
CPU_TARGETS = {"noop: async 64 envs, process (main-process CPU)": Target(5.0, lower_is_better=True)}
FIELDS = ("steps_per_s", "us_per_step", "cpu_us_per_step")


def run(quick: bool = False, in_process: bool = False) -> dict:
    rounds = 1 if quick else 3
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def one(n, sch, v, b, adapt, steps) -> dict:
        kwargs = dict(num_envs=n, steps=20_000 if quick else steps, schedule=sch, vector_size=v, backend=b, adapt=adapt)
        return measure(**kwargs) if in_process else call_fresh("suite:overhead:measure", kwargs)

    rows = []
    for r in range(rounds):  # alternating: every configuration once per round
        if affinity:  # the child processes inherit the one core
            os.sched_setaffinity(0, {min(affinity)})
        try:
            rows += [{"round": r, **one(*row)} for row in ONE_CORE]
        finally:
            if affinity:
                os.sched_setaffinity(0, affinity)
        rows += [{"round": r, **one(*row)} for row in WHOLE_MACHINE]
    summary = summarize_rows(rows, FIELDS)
    noop = summary["noop"]
    targets = (check_targets({f"noop: {k}": f["us_per_step"] for k, f in noop.items()}, WALL_TARGETS, unit=" µs")
               + check_targets({f"noop: {k} (main-process CPU)": f["cpu_us_per_step"] for k, f in noop.items()},
                               CPU_TARGETS, unit=" µs"))
    return {"rows": rows, "summary": summary, "targets": targets,
            "meta": {"one_core": bool(affinity), "rounds": rounds, "steps_per_run": 400_000, "process_steps_per_run": 200_000,
                     "fresh_processes": not in_process}}
