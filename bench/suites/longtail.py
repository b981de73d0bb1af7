"""Long-tail step latency: MockEnv steps sleep a lognormal time (median 2 ms, sigma 1), the
straggler pattern of embodied simulators. The same envs, MLP policy and PPO run under
async, pipelined and sync, alternating in rounds (A B C A B C) so drift cancels; end-to-end
env steps/s includes training."""

from __future__ import annotations

import statistics
import time

import ebrl
from ebrl.algos import PPO
from ebrl.policies import MLPPolicy
from ebrl.testing import Latency, MockEnv

DESCRIPTION = "async vs pipelined vs sync on lognormal step latency, training included"
SCHEDULES = ("async", "pipelined", "sync")


def env_fn(i: int) -> MockEnv:
    return MockEnv(dim=8, latency=Latency.lognormal(0.002, 1.0))


def measure(schedule: str, num_envs: int, steps: int, seed: int) -> dict:
    probe = env_fn(0)
    policy = MLPPolicy.from_spaces(probe.observation_space, probe.action_space, seed=seed)
    cfg = ebrl.RunConfig(num_envs=num_envs, segment_len=32, total_env_steps=steps, schedule=schedule, seed=seed,
                         sim={"backend": "thread", "num_threads": num_envs})  # sleeping lanes cost no CPU
    t0 = time.perf_counter()
    result = ebrl.run_sync(ebrl.Trainer(env_fn, policy, PPO(minibatch_size=512, seed=seed), cfg))
    wall = time.perf_counter() - t0
    return {"schedule": schedule, "env_steps": result.env_steps, "wall_s": wall,
            "steps_per_s": result.env_steps / wall, "updates": result.updates,
            "gen_batch_mean": result.gen_batch_mean, "lag_mean": result.lag_mean,
            "mean_return": result.mean_return}


def run(quick: bool = False) -> dict:
    num_envs, steps, rounds = (16, 2_000, 1) if quick else (32, 30_000, 2)
    rows = []
    for r in range(rounds):
        for schedule in SCHEDULES:
            rows.append({"round": r, **measure(schedule, num_envs, steps, seed=r)})
    mean = {s: statistics.mean(x["steps_per_s"] for x in rows if x["schedule"] == s) for s in SCHEDULES}
    return {"rows": rows,
            "ratios": {"async/sync": mean["async"] / mean["sync"],
                       "async/pipelined": mean["async"] / mean["pipelined"],
                       "pipelined/sync": mean["pipelined"] / mean["sync"]},
            "meta": {"num_envs": num_envs, "steps_per_run": steps, "rounds": rounds,
                     "latency": "lognormal(median=2ms, sigma=1.0), slept"}}
