"""Scale-out on one machine: one rank against two data-parallel ranks, each rank pinned to a
core of its own, with the same per-rank config.

Each run is ``ebrl train --nproc N --pin-ranks --set env=robotics/FetchReachDense-v4`` with
every other setting at ``ebrl train``'s default (64 envs per rank, async, PPO) and the same
env steps per rank, so two ranks simulate twice the steps on twice the cores. The runners
alternate within each of 3 rounds (seed = round). Reported: the job's env steps per second
(every rank's steps over the run's wall time, from the runtime's start on each rank; the
process and launcher startup, about 3 s, is reported beside it), the ratio of two ranks to one within a round
(target >= 1.8x), the seconds and env steps until rank 0's recent episodes reach
``success_once >= 0.9`` (the ranks share their weights), and the final score. The machine has
two cores, so two ranks use all of it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ebrl.benchmark.figures import Target, check_targets, round_ratios, spread

DESCRIPTION = "1 rank vs 2 data-parallel ranks, each pinned to one core, same per-rank config: steps/s and time to a score"
SEEDS = (0, 1, 2)
RUNNERS = {"1 rank": 1, "2 ranks": 2}
ENV, SCORE, THRESHOLD = "robotics/FetchReachDense-v4", "success_once", 0.9
STEPS_PER_RANK, QUICK_STEPS_PER_RANK = 40_000, 1_024
TARGET = 1.8


def _run(nproc: int, seed: int, steps_per_rank: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ebrl-scaling-") as tmp:
        cmd = [sys.executable, "-m", "ebrl", "train", "--nproc", str(nproc), "--pin-ranks", "--quiet",
               "--log-dir", tmp, "--set", f"env={ENV}", "--set", f"run.total_env_steps={nproc * steps_per_rank}",
               "--set", f"run.seed={seed}", "--set", "run.checkpoint_every_s=1e9"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        elapsed = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
        result = json.loads((Path(tmp) / "result.json").read_text())
        history = [json.loads(line) for line in (Path(tmp) / "history.jsonl").read_text().splitlines() if line]
    curve = [{"time": h["time"], "env_steps": h.get("job_env_steps", h["env_steps"]), "score": h.get(SCORE)}
             for h in history]
    hit = next((c for c in curve if c["score"] is not None and c["score"] >= THRESHOLD), None)
    scores = [c["score"] for c in curve if c["score"] is not None and not math.isnan(c["score"])]
    return {"env_steps": result["env_steps"], "wall_s": result["wall_s"], "steps_per_s": result["env_steps_per_s"],
            "world_size": result["world_size"], "updates": result["updates"], "elapsed_s": elapsed,
            "steps_per_s_with_launch": result["env_steps"] / elapsed,  # counting process and torchrun startup
            "rank_env_steps": [r["env_steps"] for r in result["ranks"]] or [result["env_steps"]],
            "weights_agree": len(set(result["rank_weight_hashes"])) <= 1,
            "time_to_threshold_s": None if hit is None else hit["time"],
            "steps_to_threshold": None if hit is None else hit["env_steps"],
            "final_score": scores[-1] if scores else math.nan, "score": SCORE, "threshold": THRESHOLD, "curve": curve}


def run(quick: bool) -> dict:
    seeds, per_rank = (SEEDS[:1], QUICK_STEPS_PER_RANK) if quick else (SEEDS, STEPS_PER_RANK)
    rows = []
    for seed in seeds:
        for runner, nproc in RUNNERS.items():
            out = _run(nproc, seed, per_rank)
            rows.append({"case": "fetchreach", "round": seed, "runner": runner, **out})
            print(f"  seed {seed} {runner}: {out['env_steps']:,} steps in {out['wall_s']:.0f} s "
                  f"({out['steps_per_s']:,.0f}/s), {SCORE} {out['final_score']:.3g}, threshold "
                  f"{'at %.0f s' % out['time_to_threshold_s'] if out['time_to_threshold_s'] else 'not reached'}",
                  flush=True)
    ratios = {"fetchreach: 2 ranks/1 rank env steps/s": round_ratios(rows, "fetchreach", "2 ranks", ["1 rank"])}
    figures = {}
    for runner in RUNNERS:
        mine = [r for r in rows if r["runner"] == runner]
        figures[f"fetchreach: {runner} env steps/s"] = spread(r["steps_per_s"] for r in mine)
        figures[f"fetchreach: {runner} final {SCORE}"] = spread(r["final_score"] for r in mine)
        figures[f"fetchreach: {runner} seconds to threshold"] = spread(
            r["time_to_threshold_s"] for r in mine if r["time_to_threshold_s"] is not None)
        figures[f"fetchreach: {runner} steps to threshold"] = spread(
            r["steps_to_threshold"] for r in mine if r["steps_to_threshold"] is not None)
    per_round = []
    for seed in seeds:
        by = {r["runner"]: r for r in rows if r["round"] == seed}
        if by["1 rank"]["time_to_threshold_s"] and by["2 ranks"]["time_to_threshold_s"]:
            per_round.append(by["1 rank"]["time_to_threshold_s"] / by["2 ranks"]["time_to_threshold_s"])
    ratios["fetchreach: 2 ranks/1 rank time to threshold (sooner)"] = spread(per_round)
    targets = check_targets(ratios, {"fetchreach: 2 ranks/1 rank env steps/s": Target(TARGET)})
    return {"rows": rows, "summary": {}, "ratios": {k: v for k, v in ratios.items() if v["n"]}, "figures": figures,
            "targets": targets,
            "meta": {"description": DESCRIPTION, "quick": quick, "seeds": list(seeds), "rounds": len(seeds),
                     "env": ENV, "steps_per_rank": per_rank, "score": SCORE, "threshold": THRESHOLD}}
