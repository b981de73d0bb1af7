"""Benchmark suites: one declaration, every schedule and peer measured the same way.

A suite file in ``bench/suites/`` defines ``SUITE = Suite(...)`` (or, for a custom
measurement, ``DESCRIPTION`` and ``run(quick) -> dict``). For a ``Suite`` the runner:

1. runs each case's runners in alternating rounds (async, pipelined, sync, the peers,
   then again), at least 3 rounds (``--quick``: 1), on the same envs, policy, algorithm and
   seeds, so drift in machine speed lands on every runner alike; each run in a fresh Python
   process (:mod:`ebrl.benchmark.fresh`), imports outside its timer, as a user's script runs
   (``in_process=True``, ``ebrl bench --in-process``: all in this process, for profiling);
2. runs the peers: the same env, policy and PPO in plain gymnasium ``SyncVectorEnv`` and
   ``AsyncVectorEnv`` loops (``gym-sync``, ``gym-async``: the same-policy control, which
   measures scheduling alone) and a CleanRL-style PPO with its own networks (``cleanrl``:
   what a user would otherwise run; ``bench/peers/``);
3. reports each figure as the median over rounds with its min-max, ratios taken within
   each round, and every target as met or missed (:mod:`ebrl.benchmark.figures`);
4. measures the physical limit (:mod:`ebrl.benchmark.limits`).

Example (a tiny suite; ``ebrl bench SUITE`` runs the bundled ones)::

    >>> from ebrl.algos import PPO
    >>> from ebrl.policies import MLPPolicy
    >>> from ebrl.testing import MockEnv
    >>> suite = Suite("doc", {"mock": lambda i: MockEnv(dim=3)},
    ...               lambda o, a, seed: MLPPolicy.from_spaces(o, a, seed=seed), lambda seed: PPO(minibatch_size=64),
    ...               num_envs=4, steps=256, quick_steps=128, segment_len=16, schedules=("async", "sync"),
    ...               peers=(), targets={"async/sync": 1.0}, limits=False)
    >>> report = run_suite_rounds(suite, quick=True)
    >>> sorted(report["summary"]["mock"]), report["targets"][0]["figure"]
    (['ebrl-async', 'ebrl-sync'], 'mock: async/sync')
"""

from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import psutil

import ebrl
from ebrl.benchmark.figures import (MACHINE, STEADY_AT_MOST, Target, check_targets, steadiness, suite_ratios,
                                    summarize_rows)
from ebrl.benchmark.limits import physical_limit
from ebrl.benchmark.loader import load_suite
from ebrl.benchmark.spec import Suite
from ebrl.policies.base import state_nbytes
from ebrl.runtime.children import send_by_value
from ebrl.runtime.sim.stepping import single_spaces

PEERS_DIR = Path(__file__).resolve().parent.parent.parent / "bench" / "peers"


class CpuMeter:
    """CPU seconds of this process and its children, and per-core utilisation (psutil),
    from construction to :meth:`read`."""

    def __init__(self):
        self._t0, self._cpu0 = time.perf_counter(), self._cpu()
        self._cores0 = psutil.cpu_times(percpu=True)

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def read(self) -> dict:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        cores = []
        for a, b in zip(self._cores0, psutil.cpu_times(percpu=True)):
            busy = (b.user + b.system + getattr(b, "nice", 0.0)) - (a.user + a.system + getattr(a, "nice", 0.0))
            total = sum(b) - sum(a)
            cores.append(busy / total if total > 0 else 0.0)
        return {"cpu_util": (self._cpu() - self._cpu0) / (wall * (os.cpu_count() or 1)), "core_util": cores}


def median_call_s(fn, device, reps: int) -> float:
    """Seconds per call of ``fn`` on a torch ``device``: the median of ``reps`` after a warm-up,
    each between two synchronises of a CUDA device (its kernels run asynchronously)."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_schedule(suite: Suite, env_fn, schedule: str, steps: int, seed: int, timeline=None) -> dict:
    probe = env_fn(0)  # an env, or a vector env when run_config sets sim.vector_size
    policy = suite.policy_fn(*single_spaces(probe), seed)
    probe.close()
    cfg = ebrl.RunConfig(num_envs=suite.num_envs, segment_len=suite.segment_len, total_env_steps=steps,
                         schedule=schedule, seed=seed, **suite.run_config)
    trainer = ebrl.Trainer(env_fn, policy, suite.algo_fn(seed), cfg)
    meter, t0 = CpuMeter(), time.perf_counter()
    if suite.embedded:
        import asyncio

        async def main():  # a research script's own coroutine
            return await ebrl.run(trainer, timeline=timeline)

        result = asyncio.run(main())
    else:
        result = ebrl.run_sync(trainer, timeline=timeline)
    wall = time.perf_counter() - t0
    # lockstep schedules (and lag 0) stop generating while they train: that time is not rollout
    paused = result.learner_busy_s if schedule != "async" or cfg.max_policy_lag == 0 else 0.0
    return {
        "runner": f"ebrl-{schedule}", "env_steps": result.env_steps, "wall_s": wall,
        "steps_per_s": result.env_steps / wall,
        "rollout_steps_per_s": result.env_steps / max(wall - paused, 1e-9),
        "updates": result.updates, "mean_return": result.mean_return,
        # start-up: from the run() call (about when t0 was read) to the first env step and update
        "first_step_s": result.first_step_s, "first_update_s": result.first_update_s,
        "steady_steps_per_s": result.steady_env_steps_per_s,
        "busy_generator": result.generator_busy_s / wall, "busy_learner": result.learner_busy_s / wall,
        **meter.read(),
        "gen_batch_mean": result.gen_batch_mean, "gen_batch_hist": result.gen_batch_hist,
        "gen_costs": result.gen_costs,
        "lag_mean": result.lag_mean, "lag_hist": result.lag_hist,
        "sim_backend": result.sim_backend, "learner": result.learner_mode,
        "publications": result.publications, "publish_bytes": result.publish_bytes, "publish_s": result.publish_s,
        "state_bytes": state_nbytes(policy.state_dict()),
    }


def run_capped(trainer, max_s: float, until=None):
    """``ebrl.run(trainer)`` on a fresh uvloop, stopped cleanly (as by Ctrl-C) after ``max_s``
    seconds if it has not finished: the convergence suites' wall-time cap. ``until(row)``, if
    given, is asked about the newest history row every ``run.log_every_s`` and stops the run
    once it says yes."""
    import asyncio

    from ebrl.runtime.run import loop_factory

    async def capped():
        stop = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(max_s, stop.set)

        def progress(stats, learner) -> None:
            if learner.history and until(learner.history[-1]):
                stop.set()

        try:
            return await ebrl.run(trainer, stop=stop, progress=progress if until is not None else None)
        finally:
            timer.cancel()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(capped())


@functools.cache  # once per process: the import stays out of every measured run
def load_peer_module(stem: str):
    """A file of ``bench/peers/`` (not a package: loaded by path)."""
    path = PEERS_DIR / f"{stem}.py"
    spec = importlib.util.spec_from_file_location(f"ebrl_bench_peers_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickling looks a class's module up there
    spec.loader.exec_module(module)
    send_by_value(module)  # what it defines, to children that are not forked
    return module


def measure_peer(suite: Suite, env_fn, kind: str, steps: int, seed: int) -> dict:
    """``kind``: ``sync``/``async`` (gymnasium vector env, EBRL's policy and PPO) or ``cleanrl``
    (CleanRL's own networks and PPO loop, with the suite's PPO sizes: same training work)."""
    module = load_peer_module("cleanrl_ppo" if kind == "cleanrl" else "gym_vector")
    meter = CpuMeter()
    common = dict(num_envs=suite.num_envs, segment_len=suite.segment_len, total_env_steps=steps, seed=seed)
    if kind == "cleanrl":
        ppo = suite.algo_fn(seed).config
        out = module.run_cleanrl(
            env_fn, lr=ppo.lr, update_epochs=ppo.update_epochs, minibatch_size=ppo.minibatch_size,
            gamma=ppo.gamma, gae_lambda=ppo.gae_lambda, **common)
    else:
        probe = env_fn(0)
        policy = suite.policy_fn(probe.observation_space, probe.action_space, seed)
        probe.close()
        out = module.run_peer(kind, env_fn, policy, suite.algo_fn(seed), **common)
    return {"runner": out["peer"], "env_steps": out["env_steps"], "wall_s": out["wall_s"],
            "steps_per_s": out["steps_per_s"], "rollout_steps_per_s": out["rollout_steps_per_s"],
            "updates": out["updates"], "mean_return": out["mean_return"],
            "first_step_s": out["first_step_s"], "first_update_s": out["first_update_s"],
            "steady_steps_per_s": out["steady_steps_per_s"], **meter.read()}


REFERENCE = "gymnasium loop"  # the machine's reference runner (case MACHINE)


def measure_reference(seed: int = 0, steps: int = 16_000) -> dict:
    """The machine's own speed, with no EBRL in it: a gymnasium ``SyncVectorEnv`` of 8
    ``HalfCheetah-v5`` stepped with a small MLP's actions (one torch thread), the same work in
    every round. Its max/min over a suite's rounds is the machine's drift in those rounds."""
    import gymnasium as gym
    import torch

    torch.set_num_threads(1)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("HalfCheetah-v5") for _ in range(8)])
    net = torch.nn.Sequential(torch.nn.Linear(17, 64), torch.nn.Tanh(), torch.nn.Linear(64, 6))
    obs, _ = envs.reset(seed=seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps // 8):
            obs, *_ = envs.step(net(torch.as_tensor(obs, dtype=torch.float32)).numpy())
    wall = time.perf_counter() - t0
    envs.close()
    return {"runner": REFERENCE, "env_steps": steps // 8 * 8, "wall_s": wall, "steps_per_s": steps // 8 * 8 / wall}


def measure_case(suite: str, case: str, runner: str, steps: int, seed: int, quick: bool,
                 suites_dir: str | None = None) -> dict:
    """One run of ``bench/suites/SUITE.py``'s case: ``runner`` is a schedule (``async``...) or
    ``peer:KIND``. What a fresh process (:func:`ebrl.benchmark.fresh.call_fresh`) calls."""
    spec = load_suite(suite, suites_dir).SUITE.for_case(case).sized(quick)
    return measure_runner(spec, spec.cases[case], runner, steps, seed)


def measure_runner(suite: Suite, env_fn, runner: str, steps: int, seed: int) -> dict:
    """One run, in this process: ``runner`` is a schedule or ``peer:KIND``."""
    if runner.startswith("peer:"):
        return measure_peer(suite, env_fn, runner.partition(":")[2], steps, seed)
    return measure_schedule(suite, env_fn, runner, steps, seed)


def run_suite_rounds(suite: Suite, quick: bool, *, source: tuple[str, str | None] | None = None,
                     in_process: bool = False) -> dict:
    """Every round of ``suite``. ``source``: the suite's name and folder, so each run can load it
    again in a fresh process; without it (a suite made in code) or with ``in_process``, every
    run is in this process after an untimed warm-up run."""
    from ebrl.benchmark.fresh import call_fresh  # here: `python -m ebrl.benchmark.fresh` imports this package first

    whole = suite
    fresh = source is not None and not in_process
    rows, limits, sizes = [], {}, {}

    def measure(case: str, env_fn, runner: str, seed: int) -> dict:
        if fresh:
            return call_fresh("ebrl.benchmark.suite:measure_case",
                              dict(suite=source[0], suites_dir=source[1], case=case, runner=runner, steps=steps,
                                   seed=seed, quick=quick))
        return measure_runner(suite, env_fn, runner, steps, seed)

    for case, env_fn in whole.cases.items():
        suite = whole.for_case(case).sized(quick)
        steps = suite.quick_steps if quick else suite.steps
        sizes[case] = {"num_envs": suite.num_envs, "steps_per_run": steps}
        # in one process, an untimed warm-up: imports, lazy initialisation and first-call costs
        # would otherwise land on whichever runner goes first
        if not quick and not fresh:
            measure_schedule(suite, env_fn, suite.schedules[0], min(steps, 2 * suite.num_envs * suite.segment_len), 99)
        case_rows = []
        for r in range(suite.rounds):
            for runner in [*suite.schedules, *(f"peer:{kind}" for kind in suite.peers)]:
                case_rows.append({"case": case, "round": r, **measure(case, env_fn, runner, r)})
            if fresh and not quick:  # the machine's drift, in the same rounds
                done = sum(row.get("case") == MACHINE for row in rows)
                rows.append({"case": MACHINE, "round": done, **call_fresh("ebrl.benchmark.suite:measure_reference",
                                                                          {"seed": r})})
        if suite.limits:
            limit = physical_limit(suite, env_fn, quick)
            summary = summarize_rows(case_rows)[case]
            limit["efficiency"] = {name: figs["steps_per_s"]["median"] / limit["bottleneck_steps_per_s"]
                                   for name, figs in summary.items()}
            limits[case] = limit
        rows += case_rows
    ratios = suite_ratios(rows)
    steady = steadiness(rows)
    ratios.update(steady)
    return {"rows": rows, "summary": summarize_rows(rows), "ratios": ratios, "limits": limits,
            "targets": check_targets(ratios, suite.targets) + check_targets(
                {k: v for k, v in steady.items() if not k.startswith(f"{MACHINE}:")},
                {"async max/min over rounds": Target(STEADY_AT_MOST, lower_is_better=True)}),
            "meta": {"num_envs": suite.num_envs, "steps_per_run": steps, "rounds": suite.rounds,
                     **({"case_sizes": sizes} if whole.case_sizes else {}),
                     "segment_len": suite.segment_len, "description": suite.description,
                     "fresh_processes": fresh, "embedded": suite.embedded}}
