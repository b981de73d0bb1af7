"""Convergence in wall-clock time: how soon each runner's policy reaches a score, and the score
it ends with, on the same envs, policy, algorithm and step budget.

Runners: EBRL's ``async`` and ``sync`` schedules (same MLP policy, same PPO, every other knob at
its default) and the CleanRL-style PPO loop of ``bench/peers/cleanrl_ppo.py`` (its own networks,
a gymnasium ``SyncVectorEnv``). Each runs the workload's env-step budget (or until its wall-time
cap), once per seed, runners alternating within a seed, each run in a fresh Python process (as a
user's script; ``--in-process`` runs them all in the bench's own). The score is the mean over the last 100
episodes (return, or ``success_once`` for Fetch), read after every update.

- *time to threshold*: seconds from the start until the score first reaches the workload's
  threshold; a runner that never does is reported as not reached, and a ratio against it is a
  lower bound (its whole run) and says so;
- *steps to threshold*: env steps at that moment (sample efficiency: policy lag costs here);
- *final score*: the score at the end of the budget.

Workloads (each sized to fit 15 minutes on 2 cores with 3 seeds):

- ``longtail``: MockEnv (dim 8, 16-step episodes) with lognormal step latency (median 2 ms,
  sigma 1), the longtail suite's env and sizes; threshold mean return 10 of a possible 16
  (random actions earn about 2.4);
- ``halfcheetah``: ``HalfCheetah-v5`` to a mean return of 1,000;
- ``fetchreach``: ``FetchReachDense-v4`` (flattened observations) to ``success_once >= 0.9``;
- ``pushcube`` (not in the default set: ``ebrl bench embodied-learning`` runs it): ManiSkill3
  ``PushCube-v1`` from state on SAPIEN's CPU backend (ManiSkill's dense reward, 50-step
  episodes), 16 envs, to ``success_once >= 0.8``, capped at 30 minutes a run; async and sync
  only. PPO's discount is ManiSkill's own PPO baseline's, ``gamma=0.8`` (its 50-step tasks); with
  EBRL's default 0.99 an exploratory 30-minute run reached success 0.03. A run stops when it
  reaches the threshold: the time to it is the measure, and its final score is the one there.

Learning curves against wall time are drawn to ``convergence-<workload>.png`` next to the JSON.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import gymnasium as gym

import ebrl
from ebrl.algos import PPO
from ebrl.benchmark.figures import Target, check_targets, spread
from ebrl.benchmark.suite import run_capped
from ebrl.policies import MLPPolicy
from ebrl.runtime.sim.stepping import single_spaces
from ebrl.testing import Latency, MockEnv

DESCRIPTION = "wall-clock time and env steps to a score: async vs sync vs CleanRL-style PPO, 3 seeds"
SEEDS = (0, 1, 2)
RUNNERS = ("ebrl-async", "ebrl-sync", "cleanrl")
PEERS = Path(__file__).resolve().parent.parent / "peers"


def longtail_env(i: int) -> MockEnv:
    return MockEnv(dim=8, latency=Latency.lognormal(0.002, 1.0))


def halfcheetah_env(i: int) -> gym.Env:
    return gym.make("HalfCheetah-v5")


def pushcube_env(i: int) -> gym.Env:
    from ebrl.envs import make

    return make("maniskill/PushCube-v1")


def fetchreach_env(i: int) -> gym.Env:
    from ebrl.envs.robotics import make_robotics

    return make_robotics("FetchReachDense-v4")


@dataclass(frozen=True)
class Workload:
    env_fn: object
    score: str  # "mean_return" or "success_once"
    threshold: float
    num_envs: int
    steps: int  # env steps per run (every runner the same)
    max_s: float  # a run's wall-time cap
    quick_steps: int
    minibatch_size: int = 512
    segment_len: int = 32
    runners: tuple[str, ...] = RUNNERS
    ppo: tuple[tuple[str, object], ...] = ()  # the task's own PPO settings (its simulator's baseline), else defaults
    stop_at_threshold: bool = False  # end a run when it first reaches the threshold


WORKLOADS = {
    "longtail": Workload(longtail_env, "mean_return", 10.0, num_envs=32, steps=200_000, max_s=150, quick_steps=2_048),
    "halfcheetah": Workload(halfcheetah_env, "mean_return", 1000.0, num_envs=16, steps=1_000_000, max_s=150,
                            quick_steps=2_048, segment_len=64),
    "fetchreach": Workload(fetchreach_env, "success_once", 0.9, num_envs=16, steps=150_000, max_s=150,
                           quick_steps=2_048, segment_len=50),
    "pushcube": Workload(pushcube_env, "success_once", 0.8, num_envs=16, steps=5_000_000, max_s=1_800,
                         quick_steps=256, segment_len=50, runners=("ebrl-async", "ebrl-sync"),
                         ppo=(("gamma", 0.8),), stop_at_threshold=True),
}
DEFAULT_WORKLOADS = ("longtail", "halfcheetah", "fetchreach")
QUICK_ENVS = 4  # --quick is a smoke test: a real simulator's 16 builds per run cost more than its steps
TARGETS = {"longtail: async/sync": 2.5, "halfcheetah: async/sync": 1.5, "halfcheetah: async/cleanrl": 1.3,
           "pushcube: async/sync": 1.0}  # time to the threshold: async learns at least as fast per second


def _cleanrl():
    spec = importlib.util.spec_from_file_location("ebrl_bench_cleanrl_ppo", PEERS / "cleanrl_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_cleanrl


def _run_ebrl(w: Workload, schedule: str, seed: int, steps: int, max_s: float) -> tuple[list[dict], dict]:
    probe = w.env_fn(0)
    obs_space, act_space = single_spaces(probe)
    probe.close()
    policy = MLPPolicy.from_spaces(obs_space, act_space, seed=seed)
    until = None
    if w.stop_at_threshold:  # looked at every second (the progress callback's period), on the loop
        def until(row: dict) -> bool:
            return row.get(w.score) is not None and row[w.score] >= w.threshold
    cfg = ebrl.RunConfig(num_envs=w.num_envs, segment_len=w.segment_len, total_env_steps=steps,
                         schedule=schedule, seed=seed, log_every_s=1.0 if until else 3600.0)
    trainer = ebrl.Trainer(w.env_fn, policy, PPO(minibatch_size=w.minibatch_size, seed=seed, **dict(w.ppo)), cfg)
    result = run_capped(trainer, max_s, until=until)
    curve = [{"time": h["time"], "env_steps": h["env_steps"], "score": h.get(w.score)} for h in result.history]
    # what lag does to the updates (means over the run's updates): the lag trained at, the KL from the
    # behaviour policy to the weights at the update's start (PPO's lag_correction reports it), the share
    # of samples clipped and approx_kl (against those weights when corrected), and the adaptive lr
    lag = {k: _mean_of(result.history, k) for k in ("lag_mean", "lag_kl", "clipfrac", "approx_kl", "lr")}
    return curve, {"env_steps": result.env_steps, "wall_s": result.wall_s, "steps_per_s": result.env_steps_per_s,
                   **lag}


def _mean_of(history: list[dict], key: str) -> float | None:
    xs = [h[key] for h in history if isinstance(h.get(key), float) and math.isfinite(h[key])]
    return sum(xs) / len(xs) if xs else None


def _run_cleanrl(w: Workload, seed: int, steps: int, max_s: float) -> tuple[list[dict], dict]:
    curve: list[dict] = []

    def on_update(row: dict) -> bool:
        curve.append({"time": row["time"], "env_steps": row["env_steps"], "score": row.get(w.score)})
        return row["time"] >= max_s

    out = _cleanrl()(w.env_fn, num_envs=w.num_envs, segment_len=w.segment_len, total_env_steps=steps, seed=seed,
                     minibatch_size=w.minibatch_size, on_update=on_update)
    return curve, {"env_steps": out["env_steps"], "wall_s": out["wall_s"], "steps_per_s": out["steps_per_s"]}


def _reached(curve: list[dict], threshold: float) -> dict | None:
    for row in curve:
        s = row["score"]
        if s is not None and not math.isnan(s) and s >= threshold:
            return row
    return None


def _final(curve: list[dict]) -> float:
    scores = [r["score"] for r in curve if r["score"] is not None and not math.isnan(r["score"])]
    return scores[-1] if scores else math.nan


def _ratio(rows: list[dict], case: str, other: str) -> dict:
    """``other``'s time to threshold over async's, per seed; a runner that never reached it
    contributes its whole run (a lower bound, counted in ``lower_bounds``)."""
    values, bounds = [], 0
    for seed in {r["round"] for r in rows if r["case"] == case}:
        by = {r["runner"]: r for r in rows if r["case"] == case and r["round"] == seed}
        a, o = by.get("ebrl-async"), by.get(other)
        if a is None or o is None or a["time_to_threshold_s"] is None:
            continue
        t_other = o["time_to_threshold_s"]
        if t_other is None:
            t_other, bounds = o["wall_s"], bounds + 1
        values.append(t_other / a["time_to_threshold_s"])
    return {**spread(values), "lower_bounds": bounds}


def _plot(case: str, rows: list[dict], w: Workload, out_dir: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"ebrl-async": "tab:blue", "ebrl-sync": "tab:orange", "cleanrl": "tab:green"}
    for r in rows:
        pts = [(p["time"], p["score"]) for p in r["curve"] if p["score"] is not None and not math.isnan(p["score"])]
        if pts:
            ax.plot(*zip(*pts), color=colors.get(r["runner"], "gray"), alpha=0.8,
                    label=r["runner"] if r["round"] == min(SEEDS) else None)
    ax.axhline(w.threshold, color="black", linestyle="--", linewidth=0.8, label=f"threshold {w.threshold:g}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(w.score)
    ax.set_title(f"{case}: learning curves, {len(SEEDS)} seeds")
    ax.legend()
    path = out_dir / f"convergence-{case}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path.name


def measure_run(workload: str, runner: str, seed: int, steps: int, num_envs: int | None = None) -> dict:
    """One run, ``{"curve": [...], "out": {...}}``: what a fresh process
    (``call_fresh("suite:convergence:measure_run", ...)``) computes; ``num_envs``: the workload's
    own unless given."""
    w = WORKLOADS[workload]
    if num_envs is not None:
        w = replace(w, num_envs=num_envs)
    if runner == "cleanrl":
        curve, out = _run_cleanrl(w, seed, steps, w.max_s)
    else:
        curve, out = _run_ebrl(w, runner.removeprefix("ebrl-"), seed, steps, w.max_s)
    return {"curve": curve, "out": out}


def run(quick: bool, workloads: tuple[str, ...] | None = None, out_dir: Path | None = None,
        in_process: bool = False) -> dict:
    """Every run in a fresh process (as a user's script), unless ``in_process``."""
    from ebrl.benchmark.fresh import call_fresh

    names = workloads or tuple(os.environ.get("EBRL_CONVERGENCE", ",".join(DEFAULT_WORKLOADS)).split(","))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown convergence workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    seeds = SEEDS[:1] if quick else SEEDS
    rows = []
    for case in names:
        w = WORKLOADS[case]
        steps = w.quick_steps if quick else w.steps
        for seed in seeds:
            for runner in w.runners:
                t0 = time.perf_counter()
                args = {"workload": case, "runner": runner, "seed": seed, "steps": steps,
                        "num_envs": min(w.num_envs, QUICK_ENVS) if quick else w.num_envs}
                one = measure_run(**args) if in_process else call_fresh("suite:convergence:measure_run", args)
                curve, out = one["curve"], one["out"]
                hit = _reached(curve, w.threshold)
                rows.append({"case": case, "round": seed, "runner": runner, **out,
                             "time_to_threshold_s": None if hit is None else hit["time"],
                             "steps_to_threshold": None if hit is None else hit["env_steps"],
                             "final_score": _final(curve), "score": w.score, "threshold": w.threshold,
                             "budget_steps": steps, "cap_s": w.max_s, "elapsed_s": time.perf_counter() - t0,
                             "curve": curve})
                print(f"  {case} seed {seed} {runner}: {out['env_steps']:,} steps in {out['wall_s']:.0f} s, "
                      f"final {w.score} {rows[-1]['final_score']:.3g}, threshold "
                      f"{'at %.0f s' % hit['time'] if hit else 'not reached'}", flush=True)
    ratios, figures = {}, {}
    for case in names:
        for other in WORKLOADS[case].runners[1:]:
            ratios[f"{case}: async/{other.removeprefix('ebrl-')}"] = _ratio(rows, case, other)
        for runner in WORKLOADS[case].runners:
            mine = [r for r in rows if r["case"] == case and r["runner"] == runner]
            figures[f"{case}: {runner} final {WORKLOADS[case].score}"] = spread(r["final_score"] for r in mine)
            figures[f"{case}: {runner} seconds to threshold"] = spread(
                r["time_to_threshold_s"] for r in mine if r["time_to_threshold_s"] is not None)
            figures[f"{case}: {runner} steps to threshold"] = spread(
                r["steps_to_threshold"] for r in mine if r["steps_to_threshold"] is not None)
            for key in ("lag_mean", "lag_kl", "clipfrac", "approx_kl", "lr"):
                if any(r.get(key) is not None for r in mine):
                    figures[f"{case}: {runner} {key} (mean over updates)"] = spread(
                        r[key] for r in mine if r.get(key) is not None)
    targets = check_targets(ratios, {k: Target(v) for k, v in TARGETS.items() if k.split(":")[0] in names})
    ratios = {k: v for k, v in ratios.items() if v["n"]}  # a ratio needs async to reach the threshold
    plots = {}
    if out_dir is not None and not quick:
        for case in names:
            plots[case] = _plot(case, [r for r in rows if r["case"] == case], WORKLOADS[case], out_dir)
    return {"rows": rows, "summary": {}, "ratios": ratios, "figures": figures, "targets": targets,
            "meta": {"description": DESCRIPTION, "quick": quick, "seeds": list(seeds), "rounds": len(seeds), "plots": plots,
                     "fresh_processes": not in_process,
                     "workloads": {n: {"score": WORKLOADS[n].score, "threshold": WORKLOADS[n].threshold,
                                       "num_envs": WORKLOADS[n].num_envs, "steps": WORKLOADS[n].steps,
                                       "max_s": WORKLOADS[n].max_s, "ppo": dict(WORKLOADS[n].ppo),
                                       "stop_at_threshold": WORKLOADS[n].stop_at_threshold} for n in names}}}
