"""Benchmark suites: one declaration, every schedule and peer measured the same way.

A suite file in ``bench/suites/`` defines ``SUITE = Suite(...)`` (or, for a custom
measurement, ``DESCRIPTION`` and ``run(quick) -> dict``). The runner:

1. runs each case's schedules in alternating rounds (async, pipelined, sync, async, ...)
   on the same envs, policy, algorithm and seeds, so drift in machine speed cancels;
2. runs the peers: the same env, policy and PPO in a plain gymnasium ``SyncVectorEnv``
   and ``AsyncVectorEnv`` loop (``bench/peers/gym_vector.py``);
3. measures the physical limit: each stage alone with the whole machine (simulation with
   every core, generation at its best batch, training alone), and reports efficiency =
   achieved end-to-end env steps/s over the bottleneck stage's capacity.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import ebrl
from ebrl.runtime.sim_pool import single_spaces

PEERS_FILE = Path(__file__).resolve().parent.parent / "bench" / "peers" / "gym_vector.py"


@dataclass
class Suite:
    """What a benchmark runs. ``cases`` maps a case name to ``env_fn(i)``."""

    description: str
    cases: dict[str, Callable[[int], Any]]
    policy_fn: Callable[[Any, Any, int], Any]  # (observation_space, action_space, seed) -> policy
    algo_fn: Callable[[int], Any]  # seed -> algorithm
    num_envs: int
    steps: int  # env steps per measured run
    quick_steps: int
    segment_len: int = 32
    rounds: int = 2
    schedules: tuple[str, ...] = ("async", "pipelined", "sync")
    peers: tuple[str, ...] = ("sync", "async")  # gymnasium vector-env loops
    run_config: dict = field(default_factory=dict)  # extra RunConfig fields (sim backend, ...)
    targets: dict[str, float] = field(default_factory=dict)  # e.g. {"async/sync": 2.0}
    quick_num_envs: int = 8  # --quick is a smoke test: few envs, few steps

    def sized(self, quick: bool) -> "Suite":
        if not quick:
            return self
        from dataclasses import replace

        return replace(self, num_envs=min(self.num_envs, self.quick_num_envs), segment_len=min(self.segment_len, 16))


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure_schedule(suite: Suite, env_fn, schedule: str, steps: int, seed: int, timeline=None) -> dict:
    probe = env_fn(0)  # an env, or a vector env when run_config sets sim.vector_size
    policy = suite.policy_fn(*single_spaces(probe), seed)
    probe.close()
    cfg = ebrl.RunConfig(num_envs=suite.num_envs, segment_len=suite.segment_len, total_env_steps=steps,
                         schedule=schedule, seed=seed, **suite.run_config)
    trainer = ebrl.Trainer(env_fn, policy, suite.algo_fn(seed), cfg)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    result = ebrl.run_sync(trainer, timeline=timeline)
    wall = time.perf_counter() - t0
    # lockstep schedules (and lag 0) stop generating while they train: that time is not rollout
    paused = result.learner_busy_s if schedule != "async" or cfg.max_policy_lag == 0 else 0.0
    return {
        "runner": f"ebrl-{schedule}", "env_steps": result.env_steps, "wall_s": wall,
        "steps_per_s": result.env_steps / wall,
        "rollout_steps_per_s": result.env_steps / max(wall - paused, 1e-9),
        "updates": result.updates, "mean_return": result.mean_return,
        "busy_generator": result.generator_busy_s / wall, "busy_learner": result.learner_busy_s / wall,
        "cpu_util": (_cpu_seconds() - cpu0) / (wall * (os.cpu_count() or 1)),
        "gen_batch_mean": result.gen_batch_mean, "gen_batch_hist": result.gen_batch_hist,
        "lag_mean": result.lag_mean, "lag_hist": result.lag_hist,
        "sim_backend": result.sim_backend, "learner": result.learner_mode,
    }


def _load_peers():
    spec = importlib.util.spec_from_file_location("ebrl_bench_peers", PEERS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_peer(suite: Suite, env_fn, kind: str, steps: int, seed: int) -> dict:
    peers = _load_peers()
    probe = env_fn(0)
    policy = suite.policy_fn(probe.observation_space, probe.action_space, seed)
    probe.close()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    out = peers.run_peer(kind, env_fn, policy, suite.algo_fn(seed), num_envs=suite.num_envs,
                         segment_len=suite.segment_len, total_env_steps=steps, seed=seed)
    wall = time.perf_counter() - t0
    return {"runner": out["peer"], "env_steps": out["env_steps"], "wall_s": out["wall_s"],
            "steps_per_s": out["steps_per_s"], "rollout_steps_per_s": out["rollout_steps_per_s"],
            "updates": out["updates"], "mean_return": out["mean_return"],
            "cpu_util": (_cpu_seconds() - cpu0) / (wall * (os.cpu_count() or 1))}


# ---------------------------------------------------------------- the physical limit


def _step_envs(env_fn, ids: list[int], seconds: float, counter: list[int], slot: int) -> None:
    envs = [env_fn(i) for i in ids]
    for k, env in enumerate(envs):
        env.reset(seed=ids[k])
        env.action_space.seed(ids[k])
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for env in envs:
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc:
                env.reset()
            n += 1
    counter[slot] = n
    for env in envs:
        env.close()


def _proc_entry(env_fn, ids, seconds, queue):
    counter = [0]
    _step_envs(env_fn, ids, seconds, counter, 0)
    queue.put(counter[0])


def sim_capacity(env_fn, num_envs: int, seconds: float) -> float:
    """Env steps/s of simulation alone with the whole machine: the better of one process per
    core (CPU-bound envs) and one thread per env (envs that release the GIL while stepping)."""
    import multiprocessing as mp

    cpus = os.cpu_count() or 1
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    shares = [list(range(w, num_envs, cpus)) for w in range(min(cpus, num_envs))]
    procs = [ctx.Process(target=_proc_entry, args=(env_fn, ids, seconds, queue)) for ids in shares]
    for p in procs:
        p.start()
    by_process = sum(queue.get() for _ in procs) / seconds
    for p in procs:
        p.join()
    counter = [0] * num_envs
    threads = [threading.Thread(target=_step_envs, args=(env_fn, [i], seconds, counter, i)) for i in range(num_envs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_thread = sum(counter) / seconds
    return max(by_process, by_thread)


def generation_capacity(suite: Suite, env_fn, seed: int = 0) -> tuple[float, int]:
    """Actions/s of the policy alone at its best batch size (batch sizes up to num_envs)."""
    from ebrl.runtime.generation import stack_obs

    env = env_fn(0)
    policy = suite.policy_fn(env.observation_space, env.action_space, seed)
    obs, _ = env.reset(seed=seed)
    env.close()
    best = (0.0, 1)
    for size in sorted({1, 4, 16, suite.num_envs}):
        batch = stack_obs([obs] * size)
        policy.act(batch)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            policy.act(batch)
            n += 1
        rate = n * size / (time.perf_counter() - t0)
        best = max(best, (rate, size))
    return best


def training_capacity(suite: Suite, env_fn, seed: int = 0) -> float:
    """Env steps/s the algorithm trains on alone (one update on a batch of num_envs x T steps)."""
    from ebrl.runtime.learner import update_once
    from ebrl.runtime.rollout import Segment

    env = env_fn(0)
    policy = suite.policy_fn(env.observation_space, env.action_space, seed)
    algo = suite.algo_fn(seed)
    obs, _ = env.reset(seed=seed)
    segments = []
    for s in range(suite.num_envs):
        seg = Segment(s, s, suite.segment_len)
        for _ in range(suite.segment_len):
            act = policy.act(np.asarray(obs)[None] if not isinstance(obs, dict)
                             else {k: np.asarray(v)[None] for k, v in obs.items()})
            nxt, r, term, trunc, _ = env.step(act.env_actions[0])
            seg.add(obs, act.actions[0], act.logprobs[0], act.values[0], 0, r, term, trunc, nxt, nxt)
            obs = env.reset()[0] if term or trunc else nxt
        segments.append(seg)
    env.close()
    update_once(policy, algo, segments, 0)  # warm-up: optimiser state, lazy imports
    t0 = time.perf_counter()
    update_once(policy, algo, segments, 1)
    return suite.num_envs * suite.segment_len / (time.perf_counter() - t0)


def physical_limit(suite: Suite, env_fn, quick: bool) -> dict:
    sim = sim_capacity(env_fn, suite.num_envs, 0.5 if quick else 5.0)
    gen, gen_batch = generation_capacity(suite, env_fn)
    train = training_capacity(suite, env_fn)
    caps = {"sim": sim, "generation": gen, "training": train}
    bottleneck = min(caps, key=caps.get)
    return {"capacity_steps_per_s": caps, "bottleneck": bottleneck, "bottleneck_steps_per_s": caps[bottleneck],
            "generation_best_batch": gen_batch,
            # every stage time-shares the same cores on a CPU host: the serial bound is tighter
            "shared_cpu_bound_steps_per_s": 1.0 / sum(1.0 / c for c in caps.values())}


# ---------------------------------------------------------------- a whole suite


def run_suite_rounds(suite: Suite, quick: bool) -> dict:
    suite = suite.sized(quick)
    steps = suite.quick_steps if quick else suite.steps
    rounds = 1 if quick else suite.rounds
    rows, ratios, limits = [], {}, {}
    for case, env_fn in suite.cases.items():
        case_rows = []
        # untimed warm-up: imports, lazy initialisation and first-call costs would otherwise
        # land on whichever runner goes first
        if not quick:
            measure_schedule(suite, env_fn, suite.schedules[0], min(steps, 2 * suite.num_envs * suite.segment_len), 99)
        for r in range(rounds):
            for schedule in suite.schedules:
                case_rows.append({"case": case, "round": r, **measure_schedule(suite, env_fn, schedule, steps, seed=r)})
            for kind in suite.peers:
                case_rows.append({"case": case, "round": r, **measure_peer(suite, env_fn, kind, steps, seed=r)})
        mean = {name: statistics.mean(x["steps_per_s"] for x in case_rows if x["runner"] == name)
                for name in dict.fromkeys(x["runner"] for x in case_rows)}
        if "ebrl-async" in mean:
            for other in mean:
                if other != "ebrl-async":
                    ratios[f"{case}: async/{other.removeprefix('ebrl-')}"] = mean["ebrl-async"] / mean[other]
            peers = [v for k, v in mean.items() if k.startswith("gym-")]
            if peers:
                ratios[f"{case}: async/best peer"] = mean["ebrl-async"] / max(peers)
        limit = physical_limit(suite, env_fn, quick)
        for name, value in mean.items():
            limit.setdefault("efficiency", {})[name] = value / limit["bottleneck_steps_per_s"]
        limits[case] = limit
        rows += case_rows
    return {"rows": rows, "ratios": ratios, "limits": limits, "targets": suite.targets,
            "meta": {"num_envs": suite.num_envs, "steps_per_run": steps, "rounds": rounds,
                     "segment_len": suite.segment_len, "description": suite.description}}


def finite_ratios(report: dict) -> bool:
    return all(math.isfinite(v) and v > 0 for v in report.get("ratios", {}).values())
