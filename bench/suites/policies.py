"""The embodied policies and GRPO learn: each trained as ``ebrl train`` trains it, to a score.

Every workload is exactly ``ebrl train --set env=... --set ...`` with the flags listed below
and every other setting at its default (the demo's 64 envs, PPO's minibatch 512, the run's
async schedule; ``algo.kind=grpo`` brings sync, reset groups of 4 and one episode per
segment), with a step budget and a wall-time cap:

- ``token``: ``TokenPolicy`` + PPO on ``FetchReachDense-v4``, to ``success_once >= 0.9``;
- ``flow``: ``FlowPolicy`` + PPO on ``FetchReachDense-v4`` in chunks of 4 actions
  (``env_kwargs.chunk=4``: a decision steps the arm 4 times), to ``success_once >= 0.9``;
- ``grpo``: the MLP + GRPO on sparse ``FetchReach-v4`` (reward -1 until the goal is reached), to
  ``success_at_end >= 0.8``.

The score is the mean over the last 100 episodes, read after every update. Each workload runs
once per seed, 3 seeds. The token and flow runs are capped at 300 s each (the GRPO run at
150 s), so the whole suite takes about 35 minutes; the target is whether a policy gets there,
and the time it took is reported. Reported per workload:
the best score reached, the score at the end, the env steps and seconds when the threshold was
first reached (or "not reached"). ``env_steps`` counts decisions, so a chunked run simulates 4
steps per counted step. The MLP with PPO, for comparison, reaches ``success_once >= 0.9`` on
``FetchReachDense-v4`` in about 12 s (``ebrl bench convergence``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ebrl.benchmark.figures import Target, check_targets, spread
from ebrl.benchmark.suite import run_capped
from ebrl.runs import build_spec, build_trainer

DESCRIPTION = "the token and flow policies (PPO) and GRPO to a FetchReach score, as `ebrl train` runs them"
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Workload:
    flags: tuple[str, ...]  # ebrl train --set flags
    score: str
    threshold: float
    steps: int  # env steps (decisions) per run
    max_s: float  # a run's wall-time cap
    quick_steps: int = 2_048


WORKLOADS = {
    "token": Workload(("env=robotics/FetchReachDense-v4", "policy.kind=token"), "success_once", 0.9,
                      steps=300_000, max_s=300),
    "flow": Workload(("env=robotics/FetchReachDense-v4", "policy.kind=flow", "env_kwargs.chunk=4"),
                     "success_once", 0.9, steps=300_000, max_s=300),
    "grpo": Workload(("env=robotics/FetchReach-v4", "algo.kind=grpo"), "success_at_end", 0.8,
                     steps=300_000, max_s=150),
}


def _run(w: Workload, seed: int, steps: int, quick: bool) -> tuple[list[dict], dict]:
    flags = [*w.flags, f"run.total_env_steps={steps}", f"run.seed={seed}", "run.log_every_s=3600.0"]
    if quick:
        flags.append("run.num_envs=8")
    trainer = build_trainer(build_spec(None, flags))
    result = run_capped(trainer, w.max_s)
    curve = [{"time": h["time"], "env_steps": h["env_steps"], "score": h.get(w.score)} for h in result.history]
    return curve, {"env_steps": result.env_steps, "wall_s": result.wall_s, "steps_per_s": result.env_steps_per_s,
                   "updates": result.updates, "num_envs": trainer.config.num_envs,
                   "schedule": result.schedule}


def _scores(curve: list[dict]) -> list[float]:
    return [r["score"] for r in curve if r["score"] is not None and not math.isnan(r["score"])]


def run(quick: bool) -> dict:
    seeds = SEEDS[:1] if quick else SEEDS
    rows = []
    for seed in seeds:
        for case, w in WORKLOADS.items():
            steps = w.quick_steps if quick else w.steps
            t0 = time.perf_counter()
            curve, out = _run(w, seed, steps, quick)
            hit = next((r for r in curve if r["score"] is not None and r["score"] >= w.threshold), None)
            scores = _scores(curve)
            rows.append({"case": case, "round": seed, "runner": case, "flags": list(w.flags), **out,
                         "score": w.score, "threshold": w.threshold, "budget_steps": steps, "cap_s": w.max_s,
                         "best_score": max(scores) if scores else math.nan,
                         "final_score": scores[-1] if scores else math.nan,
                         "time_to_threshold_s": None if hit is None else hit["time"],
                         "steps_to_threshold": None if hit is None else hit["env_steps"],
                         "elapsed_s": time.perf_counter() - t0, "curve": curve})
            print(f"  seed {seed} {case}: {out['env_steps']:,} steps in {out['wall_s']:.0f} s, best {w.score} "
                  f"{rows[-1]['best_score']:.3g}, final {rows[-1]['final_score']:.3g}, threshold "
                  f"{'at %.0f s' % hit['time'] if hit else 'not reached'}", flush=True)
    figures = {}
    for case, w in WORKLOADS.items():
        mine = [r for r in rows if r["case"] == case]
        figures[f"{case}: best {w.score}"] = spread(r["best_score"] for r in mine)
        figures[f"{case}: final {w.score}"] = spread(r["final_score"] for r in mine)
        figures[f"{case}: seconds to threshold"] = spread(r["time_to_threshold_s"] for r in mine
                                                          if r["time_to_threshold_s"] is not None)
        figures[f"{case}: steps to threshold"] = spread(r["steps_to_threshold"] for r in mine
                                                        if r["steps_to_threshold"] is not None)
    targets = check_targets({f"{case}: best {w.score}": figures[f"{case}: best {w.score}"]
                             for case, w in WORKLOADS.items()},
                            {f"{case}: best {w.score}": Target(w.threshold) for case, w in WORKLOADS.items()}, unit="")
    return {"rows": rows, "summary": {}, "ratios": {}, "figures": figures, "targets": targets,
            "meta": {"description": DESCRIPTION, "quick": quick, "seeds": list(seeds), "rounds": len(seeds),
                     "workloads": {n: {"flags": list(w.flags), "score": w.score, "threshold": w.threshold,
                                       "steps": w.steps, "max_s": w.max_s} for n, w in WORKLOADS.items()}}}
