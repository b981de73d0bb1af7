"""GPU-simulator shape: 4 vector envs of 64 envs each, where one call steps all 64 and sleeps
a lognormal time (median 4 ms, sigma 0.5), releasing the GIL like a GPU simulator's step.
async lets each vector env run on its own (simulation of one overlaps generation for the
others, training overlaps both); sync steps all four in lockstep and trains in between.
MLP policy, PPO; training included in every number."""

from __future__ import annotations

import threading
import time

import gymnasium as gym
import numpy as np

from ebrl.algos import PPO
from ebrl.benchmark import Suite, measure_schedule, summarize_rows
from ebrl.benchmark.figures import suite_ratios
from ebrl.policies import MLPPolicy
from ebrl.testing import Latency, MockEnv

DESCRIPTION = "vector envs shaped like a GPU simulator (4 x 64 envs, one sleeping call each): async vs sync"
VECTORS, SIZE = 4, 64
LATENCY = Latency.lognormal(0.004, 0.5)


class SleepingVectorEnv(gym.vector.SyncVectorEnv):
    """``SIZE`` MockEnvs stepped in one call that also sleeps ``LATENCY`` (the device's time)."""

    def __init__(self, seed: int):
        super().__init__([lambda: MockEnv(dim=8)] * SIZE, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        self._lat_rng = np.random.default_rng(seed)

    def step(self, actions):
        time.sleep(LATENCY.sample(self._lat_rng))
        return super().step(actions)


def env_fn(k: int) -> SleepingVectorEnv:
    return SleepingVectorEnv(seed=k)


def suite(quick: bool) -> Suite:
    return Suite(
        description=DESCRIPTION, cases={"sleeping-vector": env_fn},
        policy_fn=lambda obs_space, act_space, seed: MLPPolicy.from_spaces(obs_space, act_space, seed=seed),
        algo_fn=lambda seed: PPO(minibatch_size=1024, seed=seed),
        num_envs=VECTORS * SIZE, steps=200_000, quick_steps=4_096, segment_len=32, schedules=("async", "pipelined", "sync"),
        run_config={"sim": {"vector_size": SIZE}})  # every other knob at its default


def sim_alone(seconds: float) -> float:
    """Env steps/s of the four vector envs alone, each stepping in its own thread."""
    counts = [0] * VECTORS

    def spin(k: int) -> None:
        venv = env_fn(k)
        venv.reset(seed=k)
        actions = np.zeros((SIZE, 8), np.float32)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            venv.step(actions)
            counts[k] += SIZE
        venv.close()

    threads = [threading.Thread(target=spin, args=(k,)) for k in range(VECTORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def run(quick: bool = False) -> dict:
    s = suite(quick)
    steps, rounds = (s.quick_steps, 1) if quick else (s.steps, s.rounds)
    if not quick:
        measure_schedule(s, env_fn, "async", 2 * s.num_envs * s.segment_len, seed=99)  # untimed warm-up
    rows = [{"case": "sleeping-vector", "round": r, **measure_schedule(s, env_fn, schedule, steps, seed=r)}
            for r in range(rounds) for schedule in s.schedules]
    summary = summarize_rows(rows)
    sim = sim_alone(0.5 if quick else 3.0)
    return {"rows": rows, "summary": summary, "ratios": suite_ratios(rows),
            "meta": {"num_envs": s.num_envs, "vector_size": SIZE, "steps_per_run": steps, "rounds": rounds,
                     "sim_alone_steps_per_s": sim,
                     "async_of_sim_alone": summary["sleeping-vector"]["ebrl-async"]["steps_per_s"]["median"] / sim,
                     "description": DESCRIPTION}}
