"""Regenerate the benchmark pages from the raw JSON: ``python -m ebrl.benchmark.docs``.

``make bench`` runs every suite into ``docs/benchmarks/`` and then this script, which rewrites
``docs/benchmarks/README.md`` (every suite's full results), each ``<suite>-results.md``, and
the tables between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` markers in the README,
docs/benchmarks.md and docs/simulators.md from that same JSON, so no figure on those pages can
drift from the raw numbers. Tables include:

- ``summary``: one row per suite case: medians (min-max) of EBRL async and sync, the best
  gymnasium peer, the CleanRL-style peer, the ratios, and the targets met;
- ``step-cost``: single-env steps/s of each simulator adapter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

from ebrl.benchmark.figures import MACHINE, spread
from ebrl.benchmark.report import fmt_ratio, fmt_spread, results_markdown

ORDER = ("overhead", "longtail", "longtail-user", "heterogeneous", "mujoco-state", "startup", "startup-mock",
         "mujoco-pixels", "vector-gpu", "embodied", "libero", "controller", "convergence", "embodied-learning", "vla", "sft-rl", "sample-efficiency", "lag", "policies",
         "scaling", "gpu-split", "soak", "step-cost")


def load_reports(bench_dir: Path) -> dict[str, dict]:
    reports = {}
    for path in sorted(bench_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "rows" in data and "meta" in data and "suite" in data["meta"]:
            reports[data["meta"]["suite"]] = data
    return dict(sorted(reports.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER)))


def _best_peer(runners: dict) -> tuple[str, dict] | None:
    peers = {n: f["steps_per_s"] for n, f in runners.items() if n.startswith("gym-")}
    if not peers:
        return None
    name = max(peers, key=lambda n: peers[n]["median"])
    return name, peers[name]


def summary_table(reports: dict[str, dict]) -> str:
    head = ("| suite (`ebrl bench SUITE`) | case | EBRL async | EBRL sync | best gymnasium peer | CleanRL peer "
            "| async/sync | async/best peer | targets met |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, rep in reports.items():
        if name in ("step-cost", "overhead", "startup-mock"):
            continue
        for case, runners in rep.get("summary", {}).items():
            if "ebrl-async" not in runners:
                continue
            peer = _best_peer(runners)
            ratios = rep.get("ratios", {})
            targets = [t for t in rep.get("targets", []) if t["figure"].startswith(f"{case}: ")]
            met = ", ".join(f"{t['figure'].split(': ', 1)[1]} {t['target']}: {'met' if t['met'] else '**missed**'}"
                            for t in targets) or "none set"
            cells = [f"`{name}`", case, fmt_spread(runners["ebrl-async"]["steps_per_s"]),
                     fmt_spread(runners.get("ebrl-sync", {}).get("steps_per_s")),
                     f"{fmt_spread(peer[1])} ({peer[0]})" if peer else "n/a",
                     fmt_spread(runners.get("cleanrl", {}).get("steps_per_s")),
                     fmt_ratio(ratios.get(f"{case}: async/sync")), fmt_ratio(ratios.get(f"{case}: async/best peer")),
                     met]
            lines.append("| " + " | ".join(cells) + " |")
    stamps = {f"{r['meta']['date'][:10]}, commit {r['meta'].get('commit', '?')}" for r in reports.values()}
    fresh = sorted(n for n, r in reports.items() if n not in ("step-cost", "overhead") and "summary" in r
                   and r["meta"].get("fresh_processes"))
    warm = sorted(n for n, r in reports.items() if n not in ("step-cost", "overhead") and "summary" in r
                  and "fresh_processes" in r["meta"] and not r["meta"]["fresh_processes"])
    how = (f" Each run of {', '.join(f'`{n}`' for n in fresh)} is a fresh Python process, imports outside the "
           "timer, as a user's script runs" if fresh else "")
    how += (f"; {', '.join(f'`{n}`' for n in warm)} ran every run in one process (`--in-process`)" if warm else "")
    lines += ["", "Env steps/s end to end (training included), median (min-max) over "
              f"{_rounds(reports)} alternating rounds; measured {'; '.join(sorted(stamps))}." + (how + "." if how else "")]
    startup = startup_table(reports)
    if startup:
        lines += ["", startup]
    if "startup-mock" in reports:
        lines += ["", startup_mock_table(reports["startup-mock"])]
    if "overhead" in reports:
        lines += ["", overhead_table(reports["overhead"])]
    total = sum(len(r.get("targets", [])) for r in reports.values())
    met = sum(sum(t["met"] for t in r.get("targets", [])) for r in reports.values())
    lines += ["", f"Targets met over all suites: **{met} of {total}** (each suite's list: "
              "[docs/benchmarks/](docs/benchmarks/README.md))."]
    return "\n".join(lines)


def startup_table(reports: dict[str, dict]) -> str:
    """Start-up and steady state of every runner that reports them: seconds from the ``run()``
    call (a peer: its loop's start) to the first env step and to the end of the first update,
    and env steps/s after that update."""
    lines = []
    for name, rep in reports.items():
        for case, runners in rep.get("summary", {}).items():
            for runner, figs in runners.items():
                if "first_step_s" not in figs:
                    continue
                lines.append(f"| `{name}` | {case} | {runner} | {fmt_spread(figs['first_step_s'])} "
                             f"| {fmt_spread(figs['first_update_s'])} | {fmt_spread(figs.get('steady_steps_per_s'))} "
                             f"| {fmt_spread(figs['steps_per_s'])} |")
    if not lines:
        return ""
    return "\n".join(["Start-up and steady state, same runs (seconds from the call; a peer from its loop's start):", "",
                      "| suite | case | runner | to first env step (s) | to first update (s) "
                      "| steady env steps/s (after the first update) | end to end |",
                      "|---|---|---|---:|---:|---:|---:|", *lines])


def startup_mock_table(rep: dict) -> str:
    """``ebrl bench startup-mock``: a 160-step run's ``run()`` after imports, and the imports."""
    lines = ["Start-up alone (`ebrl bench startup-mock`: 16 MockEnvs, 160 env steps, MLP + PPO, defaults, each run "
             "a fresh process; seconds):", "",
             "| runner | `import ebrl` (+ algos, testing) | `run()` after imports | to first env step "
             "| to first update |", "|---|---:|---:|---:|---:|"]
    for runner, figs in rep["summary"].get("mock-16x160", {}).items():
        lines.append(f"| {runner} | {fmt_spread(figs.get('import_s'))} | {fmt_spread(figs.get('wall_s'))} "
                     f"| {fmt_spread(figs.get('first_step_s'))} | {fmt_spread(figs.get('first_update_s'))} |")
    for t in rep.get("targets", []):
        lines.append(f"| target: {t['figure'].removeprefix('mock-16x160: ')} {t['target']} | | | | "
                     f"{'met' if t['met'] else '**missed**'} |")
    return "\n".join(lines)


def _rounds(reports: dict[str, dict]) -> str:
    rounds = sorted({r["meta"].get("rounds", 1) for r in reports.values()})
    return "/".join(str(x) for x in rounds)


def overhead_table(rep: dict) -> str:
    lines = ["Runtime overhead (`ebrl bench overhead`: no-op env and policy; inline rows on one core, thread and "
             "process rows on the whole machine):", "",
             "| configuration, sim backend | env steps/s | wall µs per env step | main-process CPU µs per env step |",
             "|---|---:|---:|---:|"]
    for runner, figs in rep["summary"].get("noop", {}).items():
        lines.append(f"| {runner} | {fmt_spread(figs['steps_per_s'])} | {fmt_spread(figs['us_per_step'])} "
                     f"| {fmt_spread(figs.get('cpu_us_per_step'))} |")
    for t in rep.get("targets", []):
        lines.append(f"| target: {t['figure'].removeprefix('noop: ')} {t['target']} | | | "
                     f"{'met' if t['met'] else '**missed**'} |")
    return "\n".join(lines)


def step_cost_table(rep: dict) -> str:
    lines = ["| env | observation | steps/s | µs/step | reset s |", "|---|---|---:|---:|---:|"]
    for env, runners in rep["summary"].items():
        for obs, figs in runners.items():
            if "steps_per_s" not in figs:  # not installed where the suite ran
                lines.append(f"| `{env}` | {obs} | skipped | | |")
                continue
            lines.append(f"| `{env}` | {obs} | {fmt_spread(figs['steps_per_s'])} | {fmt_spread(figs['us_per_step'])} "
                         f"| {fmt_spread(figs.get('reset_s'))} |")
    meta = rep["meta"]
    lines += ["", f"Median (min-max) over {meta.get('rounds', 1)} rounds; {meta['date'][:10]}, commit "
              f"{meta.get('commit', '?')}, mujoco {meta.get('versions', {}).get('mujoco')}."]
    return "\n".join(lines)


def controller_table(rep: dict) -> str:
    """``ebrl bench controller``: per workload, the best static configuration against the run
    a user gets (defaults, controller on), how long the controller took to settle and what it
    changed, and the suite's targets."""
    lines = ["| workload | best static configuration | its env steps/s | defaults (probe + controller) "
             "| controller/best static | settled after (epochs) | loop block (ms) | decisions (all rounds) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    ratios, figures = rep.get("ratios", {}), rep.get("figures", {})
    for workload, runners in rep["summary"].items():
        key = f"{workload}: controller/best static"
        best = ratios.get(key, {}).get("best_static")
        made: dict[str, int] = {}
        for row in rep["rows"]:
            if row["case"] == workload and row["runner"] == "defaults (controller)":
                for d in row["decisions"]:
                    name = d["knob"] + (" (reverted)" if d["reason"].startswith("reverted")
                                        else " (start)" if d["epoch"] < 0 else "")
                    made[name] = made.get(name, 0) + 1
        cells = [workload, best or "n/a", fmt_spread(runners.get(best, {}).get("steps_per_s")),
                 fmt_spread(runners.get("defaults (controller)", {}).get("steps_per_s")), fmt_ratio(ratios.get(key)),
                 fmt_spread(figures.get(f"{workload}: settled after (epochs)")),
                 fmt_spread(figures.get(f"{workload}: loop block (ms)")),
                 ", ".join(f"{k} x{v}" for k, v in made.items()) or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| figure | measured | target | |", "|---|---:|---|---|"]
    for t in rep.get("targets", []):
        value = fmt_ratio(t) if t["unit"] == "x" else fmt_spread(t, t["unit"])
        lines.append(f"| {t['figure']} | {value} | {t['target']} | {'met' if t['met'] else '**missed**'} |")
    meta = rep["meta"]
    lines += ["", f"Env steps/s of the whole `run()` (start-up, probe and training included), median (min-max) over "
              f"{meta.get('rounds', 1)} alternating rounds, {meta['num_envs']} envs; {meta['date'][:10]}, commit "
              f"{meta.get('commit', '?')}. Raw rounds, every decision with its reason: "
              "[docs/benchmarks/controller.json](docs/benchmarks/controller.json)."]
    return "\n".join(lines)


def ratio_rows(rep: dict) -> list[str]:
    """One table row per ratio of ``rep``: the measured spread (and how many of its values are
    lower bounds, where a runner never reached a threshold), its target and met or missed."""
    rows = []
    for name, ratio in rep.get("ratios", {}).items():
        target = next((t for t in rep.get("targets", []) if t["figure"] == name), None)
        bound = f" ({ratio['lower_bounds']} a lower bound: not reached by the other)" if ratio.get("lower_bounds") else ""
        rows.append(f"| {name} | {fmt_ratio(ratio)}{bound} | {target['target'] if target else 'none set'} | "
                    f"{('met' if target['met'] else '**missed**') if target else ''} |")
    return rows


def embodied_table(rep: dict) -> str:
    """``ebrl bench embodied`` (and ``libero``): per workload and schedule, end-to-end env steps/s
    (RLinf's metric: env steps over iteration time, rollout and training) and rollout env
    steps/s, then the ratios and the targets."""
    meta = rep["meta"]
    lines = ["| workload | envs | schedule | env steps/s (end to end) | rollout env steps/s | first env step (s) |",
             "|---|---:|---|---:|---:|---:|"]
    for case, runners in rep["summary"].items():
        envs = meta.get("case_sizes", {}).get(case, {}).get("num_envs", meta.get("num_envs"))
        for runner, figs in runners.items():
            lines.append(f"| {case} | {envs} | {runner.removeprefix('ebrl-')} | {fmt_spread(figs.get('steps_per_s'))} "
                         f"| {fmt_spread(figs.get('rollout_steps_per_s'))} | {fmt_spread(figs.get('first_step_s'))} |")
    lines += ["", "| ratio (end to end, within each round) | measured | target | |", "|---|---:|---|---|"]
    lines += ratio_rows(rep)
    lines += ["", f"Median (min-max) over {meta.get('rounds')} alternating rounds, every run a fresh process at the "
              f"defaults; {meta['date'][:10]}, commit {meta.get('commit', '?')}; raw rows in "
              f"[docs/benchmarks/{meta['suite']}.json](docs/benchmarks/{meta['suite']}.json)."]
    return "\n".join(lines)


def vla_table(rep: dict) -> str:
    """``ebrl bench vla``: per schedule, end-to-end env steps/s, the generation batches, and what
    each weight publication moved and took; then the ratios (schedules, and publication of the
    trainable tensors against the whole state) and the targets."""
    meta = rep["meta"]
    lines = ["| workload | schedule | env steps/s (end to end) | mean generation batch | generation batches (rows: count) "
             "| ms per policy call (fixed + a row) | MB per publication (whole state) | ms per publication |",
             "|---|---|---:|---:|---|---|---:|---:|"]
    for case, runners in rep["summary"].items():
        if case == MACHINE:  # the machine's reference loop: its drift is in the ratio rows
            continue
        for runner in runners:
            mine = [r for r in rep["rows"] if r["case"] == case and r["runner"] == runner]
            hist: dict[str, int] = {}
            for r in mine:
                for size, count in r.get("gen_batch_hist", {}).items():
                    hist[str(size)] = hist.get(str(size), 0) + int(count)
            sizes = ", ".join(f"{k}: {v:,}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
            mb = spread(r["publish_bytes"] / 1e6 for r in mine if r.get("publications"))
            whole = spread(r["state_bytes"] / 1e6 for r in mine if r.get("publications"))
            ms = spread(r["publish_s"] * 1e3 for r in mine if r.get("publications"))
            fits = [r["gen_costs"] for r in mine if (r.get("gen_costs") or {}).get("fixed_us") is not None]
            call = (f"{spread(f['fixed_us'] / 1e3 for f in fits)['median']:.1f} + "
                    f"{spread(f['per_row_us'] / 1e3 for f in fits)['median']:.2f}" if fits else "n/a")
            lines.append(f"| {case} | {runner.removeprefix('ebrl-')} | {fmt_spread(runners[runner].get('steps_per_s'))} "
                         f"| {fmt_spread(spread(r['gen_batch_mean'] for r in mine))} | {sizes} | {call} "
                         f"| {fmt_spread(mb)} ({whole['median']:.1f}) | {fmt_spread(ms)} |")
    lines += ["", "| ratio (within each round) | measured | target | |", "|---|---:|---|---|"]
    lines += ratio_rows(rep)
    seconds = rep.get("publication_seconds", {})
    if seconds:
        lines += ["", f"One publication snapshotted and loaded in one process: LoRA's trainable tensors "
                      f"{seconds['lora']['median'] * 1e3:.1f} ms, the whole state "
                      f"{seconds['full']['median'] * 1e3:.1f} ms (median of {seconds['lora']['n']} each)."]
    calls = rep.get("call_ms", {})
    if calls:
        batches = list(next(iter(calls.values())))
        lines += ["", "| ms per `act` call, batch size | " + " | ".join(batches) + " |",
                  "|---|" + "---:|" * len(batches)]
        lines += [f"| {case} | " + " | ".join(fmt_spread(by[b]) for b in batches) + " |" for case, by in calls.items()]
    lines += ["", f"Median (min-max) over {meta.get('rounds')} alternating rounds, every run a fresh process; "
              f"{meta.get('segment_len')}-step segments and PPO minibatches of 64 (an update sized for a 23M "
              f"backbone on this CPU), every other knob at its default; {meta['date'][:10]}, commit "
              f"{meta.get('commit', '?')}; raw rows in [docs/benchmarks/vla.json](docs/benchmarks/vla.json)."]
    return "\n".join(lines)


def sft_rl_table(rep: dict) -> str:
    """``ebrl bench sft-rl``: per seed and RL run, success after SFT and after RL (the mode; 95% Wilson
    interval), the gain, the same with sampled actions (as RL's rollouts act; ``—`` where a row
    predates it), the seconds to the first evaluation at SFT + 0.3; then the ratios and the target."""
    meta = rep["meta"]
    lines = ["| seed | RL run | success after SFT | success after RL (95% interval) | gain | sampled actions: "
             "SFT → RL | seconds to +0.3 | env steps/s |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rep["rows"]:
        ci = r.get("rl_success_ci") or [math.nan, math.nan]
        reached = r.get("time_to_gain_s")
        sampled = [r.get(k) for k in ("sft_sampled_success", "rl_sampled_success")]
        lines.append(f"| {r['round']} | {r['case']} | {r['sft_success']:.2f} | {r['rl_success']:.2f} "
                     f"({ci[0]:.2f}-{ci[1]:.2f}) | {r['gain']:+.2f} | "
                     f"{' → '.join('—' if x is None else f'{x:.2f}' for x in sampled)} | "
                     f"{'%.0f' % reached if reached is not None else 'not reached'} | {r['steps_per_s']:,.0f} |")
    lines += ["", "| figure | measured | target | |", "|---|---:|---|---|"]
    for name, s in rep.get("ratios", {}).items():
        lines.append(f"| {name} | {fmt_ratio(s)} | none set | |")
    for t in rep.get("targets", []):
        lines.append(f"| {t['figure']} | min {t['min']:+.2f}, median {t['median']:+.2f} | {t['target']} "
                     f"| {'met' if t['met'] else '**missed**'} |")
    seeds = meta.get("seeds", [])
    lines += ["", f"Seeds {', '.join(map(str, seeds))} ({len(seeds)} of the suite's 3), {meta.get('demos')} expert "
              f"demonstrations each on `{meta.get('env', '?')}`, success over {meta.get('eval_episodes')} evaluation "
              "episodes (the policy's mode), "
              f"RL {meta.get('max_s', 0) / 60:.0f} minutes a run in a fresh process, {meta.get('num_envs')} envs; "
              f"{meta['date'][:10]}, commit {meta.get('commit', '?')}; raw rows in "
              f"[docs/benchmarks/sft-rl.json](docs/benchmarks/sft-rl.json)."]
    return "\n".join(lines)


def convergence_table(rep: dict) -> str:
    """``ebrl bench convergence`` (and ``embodied-learning``): per workload and runner, the seconds
    and env steps to the threshold and the final score; then the time-to-threshold ratios and
    the targets."""
    lines = ["| workload (score >= threshold) | runner | seconds to threshold | env steps to threshold | reached "
             "| final score | env steps/s |", "|---|---|---:|---:|---:|---:|---:|"]
    figures, rows = rep.get("figures", {}), rep["rows"]
    for case, w in rep["meta"].get("workloads", {}).items():
        for runner in dict.fromkeys(r["runner"] for r in rows if r["case"] == case):
            mine = [r for r in rows if r["case"] == case and r["runner"] == runner]
            reached = sum(r["time_to_threshold_s"] is not None for r in mine)
            speed = {"n": len(mine), "median": sorted(r["steps_per_s"] for r in mine)[len(mine) // 2],
                     "min": min(r["steps_per_s"] for r in mine), "max": max(r["steps_per_s"] for r in mine)}
            score = w["score"]
            cells = [f"{case} ({score} >= {w['threshold']:g})", runner,
                     fmt_spread(figures.get(f"{case}: {runner} seconds to threshold")),
                     fmt_spread(figures.get(f"{case}: {runner} steps to threshold")), f"{reached} of {len(mine)}",
                     fmt_spread(figures.get(f"{case}: {runner} final {score}")), fmt_spread(speed)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| time to threshold | measured | target | |", "|---|---:|---|---|"]
    lines += ratio_rows(rep)
    for t in rep.get("targets", []):
        if t["figure"] not in rep.get("ratios", {}):
            lines.append(f"| {t['figure']} | not measured (async never reached the threshold) | {t['target']} "
                         "| **missed** |")
    meta = rep["meta"]
    own = "; ".join(f"{c}: PPO's {', '.join(f'{k}={v:g}' for k, v in w['ppo'].items())} (the task's own baseline)"
                    for c, w in meta.get("workloads", {}).items() if w.get("ppo"))
    stops = [c for c, w in meta.get("workloads", {}).items() if w.get("stop_at_threshold")]
    lines += ["", f"Each workload: {len(meta.get('seeds', []))} seeds, runners alternating per seed, every knob at "
              f"its default{' but ' + own if own else ''}"
              + (f"; {', '.join(stops)} runs stop at the threshold, so the final score is the one there" if stops
                 else "")
              + f"; {meta['date'][:10]}, commit {meta.get('commit', '?')}. Learning curves: "
              + ", ".join(f"[{c}](docs/benchmarks/{p})" for c, p in meta.get("plots", {}).items() if p)
              + f"; raw curves in [docs/benchmarks/{meta['suite']}.json](docs/benchmarks/{meta['suite']}.json)."]
    return "\n".join(lines)


def sample_efficiency_table(rep: dict) -> str:
    """``ebrl bench sample-efficiency``: per case and runner, env steps and seconds to success 0.8
    (over the runs that reached it), how many did, the final success; then PPO's steps over each
    off-policy runner's, the targets, SFT's starting point and the cost of a decision."""
    lines = ["| case | runner | env steps to 0.8 | seconds to 0.8 | reached | final success | budget (steps, s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    figures, rows, meta = rep.get("figures", {}), rep["rows"], rep["meta"]
    for case, c in meta.get("cases", {}).items():
        for runner, r in c["runners"].items():
            mine = [x for x in rows if x["case"] == case and x["runner"] == runner]
            reached = sum(x["steps_to_threshold"] is not None for x in mine)
            lines.append(f"| {case} | {runner} | {fmt_spread(figures.get(f'{case}: {runner} steps to threshold'))} "
                         f"| {fmt_spread(figures.get(f'{case}: {runner} seconds to threshold'))} "
                         f"| {reached} of {len(mine)} | {fmt_spread(figures.get(f'{case}: {runner} final success'))} "
                         f"| {r['steps']:,}, {r['max_s']:.0f} |")
    lines += ["", "| PPO's env steps to 0.8 over | measured | target | |", "|---|---:|---|---|"]
    for t in rep.get("targets", []):  # the note says where a ratio is short of seeds or a lower bound
        ratio = rep.get("ratios", {}).get(t["figure"])
        measured = t.get("note") or (fmt_ratio(ratio) if ratio else "not measured")
        if ratio and ratio.get("lower_bounds") and "lower bound" not in measured:
            measured += f"; {ratio['lower_bounds']} of {ratio['n']} a lower bound (PPO did not reach it)"
        lines.append(f"| {t['figure']} | {measured} | {t['target']} | {'met' if t['met'] else '**missed**'} |")
    sft = meta.get("sft", [])
    if sft:
        lines += ["", "flow-dsrl, the SFT policy before RL (success over 200 episodes): "
                  + "; ".join(f"seed {p['round']}: {p['sft_success_flow_noise']:.2f} as PPO's rollouts act "
                              f"(Flow-Noise), {p['sft_success_ode']:.2f} as DSRL's base (ODE)" for p in sft) + "."]
    for c in meta.get("cost", []):
        lines += ["", ("| flow-dsrl cost per decision (µs, one torch thread) | batch | DSRL act | PPO act "
                       "| PPO forward-backward x epochs | PPO total / DSRL |"), "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| flow {c['flow_params']:,} params, steering actor {c['steer_params']:,} | {x['batch']} "
                  f"| {x['dsrl_act_us']:.0f} | {x['ppo_act_us']:.0f} | {x['ppo_train_us']:.0f} "
                  f"({x['ppo_update_epochs']} epochs) | {x['ppo_over_dsrl']:.1f}x |" for x in c["cost"]]
    lines += ["", (f"{len(meta.get('seeds', []))} seeds, runners alternating per seed, each run in a fresh process "
                   f"stopped at success {meta.get('threshold', 0.8):g}, its step budget or its wall cap; "
                   f"{meta['date'][:10]}, commit {meta.get('commit', '?')}; raw curves in "
                   f"[docs/benchmarks/{meta['suite']}.json](docs/benchmarks/{meta['suite']}.json).")]
    return "\n".join(lines)


def lag_table(rep: dict) -> str:
    """``ebrl bench lag``: per algorithm, the final return at lag 0 and at max_policy_lag=4,
    the lag actually trained at, and the ratio; then the targets."""
    figures, ratios = rep.get("figures", {}), rep.get("ratios", {})
    lines = ["| algorithm | final return, lag 0 | final return, max_policy_lag=4 | mean lag trained at (max 4) "
             "| lag 4 / lag 0 |", "|---|---:|---:|---:|---:|"]
    for algo in dict.fromkeys(r["case"] for r in rep["rows"]):
        lines.append(f"| {algo} | {fmt_spread(figures.get(f'{algo}: lag 0 final return'))} "
                     f"| {fmt_spread(figures.get(f'{algo}: lag 4 final return'))} "
                     f"| {fmt_spread(figures.get(f'{algo}: lag 4 mean lag trained'))} "
                     f"| {fmt_ratio(ratios.get(f'{algo}: lag 4/lag 0 final return'))} |")
    lines += ["", "| figure | measured | target | |", "|---|---:|---|---|"]
    for t in rep.get("targets", []):
        lines.append(f"| {t['figure']} | {fmt_ratio(t)} | {t['target']} | {'met' if t['met'] else '**missed**'} |")
    meta = rep["meta"]
    lines += ["", f"{len(meta.get('seeds', []))} seeds, {meta.get('steps', 0):,} env steps per run, "
              f"{meta.get('num_envs')} envs, async, defaults; {meta['date'][:10]}, commit {meta.get('commit', '?')}; "
              "raw rows: [docs/benchmarks/lag.json](docs/benchmarks/lag.json)."]
    return "\n".join(lines)


def policies_table(rep: dict) -> str:
    """``ebrl bench policies``: per workload, its flags, the best and final score, when the
    threshold was reached; then the targets."""
    figures, meta = rep.get("figures", {}), rep["meta"]
    lines = ["| workload | `ebrl train --set` | best score | final score | env steps to threshold | seconds to "
             "threshold | reached | env steps/s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case, w in meta.get("workloads", {}).items():
        mine = [r for r in rep["rows"] if r["case"] == case]
        if not mine:
            continue
        reached = sum(r["time_to_threshold_s"] is not None for r in mine)
        speed = {"n": len(mine), "median": sorted(r["steps_per_s"] for r in mine)[len(mine) // 2],
                 "min": min(r["steps_per_s"] for r in mine), "max": max(r["steps_per_s"] for r in mine)}
        score = w["score"]
        lines.append(f"| {case} ({score} >= {w['threshold']:g}) | " + " ".join(f"`{f}`" for f in w["flags"])
                     + f" | {fmt_spread(figures.get(f'{case}: best {score}'))} "
                     f"| {fmt_spread(figures.get(f'{case}: final {score}'))} "
                     f"| {fmt_spread(figures.get(f'{case}: steps to threshold'))} "
                     f"| {fmt_spread(figures.get(f'{case}: seconds to threshold'))} | {reached} of {len(mine)} "
                     f"| {fmt_spread(speed)} |")
    lines += ["", "| figure | measured | target | |", "|---|---:|---|---|"]
    for t in rep.get("targets", []):
        lines.append(f"| {t['figure']} | {fmt_spread(t)} | {t['target']} | {'met' if t['met'] else '**missed**'} |")
    caps = sorted({f"{w['steps']:,} env steps or {w['max_s']:g} s" for w in meta.get("workloads", {}).values()})
    lines += ["", f"{len(meta.get('seeds', []))} seeds, each run capped at {' / '.join(caps)}, every other setting "
              f"at `ebrl train`'s default; {meta['date'][:10]}, commit {meta.get('commit', '?')}; raw rows and "
              "curves: [docs/benchmarks/policies.json](docs/benchmarks/policies.json)."]
    return "\n".join(lines)


def scaling_table(rep: dict) -> str:
    """``ebrl bench scaling``: per runner (1 rank, 2 ranks), env steps/s, time and steps to the
    threshold, final score; then the ratios and the target."""
    figures, meta = rep.get("figures", {}), rep["meta"]
    lines = ["| runner | env steps/s | env steps/s with launch | seconds to threshold | env steps to threshold "
             "| reached | final score | weights agree |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for runner in dict.fromkeys(r["runner"] for r in rep["rows"]):
        mine = [r for r in rep["rows"] if r["runner"] == runner]
        reached = sum(r["time_to_threshold_s"] is not None for r in mine)
        launch = {"n": len(mine), "median": sorted(r["steps_per_s_with_launch"] for r in mine)[len(mine) // 2],
                  "min": min(r["steps_per_s_with_launch"] for r in mine),
                  "max": max(r["steps_per_s_with_launch"] for r in mine)}
        lines.append(f"| {runner} | {fmt_spread(figures.get(f'fetchreach: {runner} env steps/s'))} "
                     f"| {fmt_spread(launch)} "
                     f"| {fmt_spread(figures.get(f'fetchreach: {runner} seconds to threshold'))} "
                     f"| {fmt_spread(figures.get(f'fetchreach: {runner} steps to threshold'))} "
                     f"| {reached} of {len(mine)} "
                     f"| {fmt_spread(figures.get(f'fetchreach: {runner} final ' + meta['score']))} "
                     f"| {'yes' if all(r['weights_agree'] for r in mine) else '**no**'} |")
    lines += ["", "| figure | measured | target | |", "|---|---:|---|---|"]
    lines += ratio_rows(rep)
    lines += ["", f"`{meta['env']}`, {meta['steps_per_rank']:,} env steps per rank, {meta['score']} >= "
              f"{meta['threshold']:g}; {len(meta.get('seeds', []))} rounds alternating; {meta['date'][:10]}, commit "
              f"{meta.get('commit', '?')}; raw rows: [docs/benchmarks/scaling.json](docs/benchmarks/scaling.json)."]
    return "\n".join(lines)


def bench_readme(reports: dict[str, dict]) -> str:
    parts = ["# Benchmark results", "",
             "Generated by `make bench` (`python -m ebrl.benchmark.docs`) from the JSON files in this folder, "
             "which hold every raw round. Every number is end-to-end env steps/s over wall time, training "
             "included, unless it says rollout; each figure is the median over alternating rounds with its "
             "min-max.", ""]
    for name, rep in reports.items():
        parts += [results_markdown(name, rep), ""]
    return "\n".join(parts)


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- bench:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /bench:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"README has no <!-- bench:{name} --> ... <!-- /bench:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text)


PAGES = ("README.md", "docs/benchmarks.md", "docs/simulators.md")  # the pages with tables, from the repository root
MARKER = re.compile(r"<!-- bench:([\w-]+) -->")


def tables(reports: dict[str, dict]) -> dict[str, str]:
    """Every table a page may hold, by its block name (a suite's only where its JSON is here)."""
    out = {"summary": summary_table(reports)}
    for name, make in (("step-cost", step_cost_table), ("controller", controller_table),
                       ("convergence", convergence_table), ("embodied", embodied_table), ("libero", embodied_table),
                       ("embodied-learning", convergence_table), ("vla", vla_table), ("sft-rl", sft_rl_table),
                       ("sample-efficiency", sample_efficiency_table),
                       ("lag", lag_table), ("policies", policies_table), ("scaling", scaling_table)):
        if name in reports:
            out[name] = make(reports[name])
    return out


def relink(body: str, page: Path, root: Path) -> str:
    """The tables link from the repository root (``docs/benchmarks/x.json``): from a page in
    ``docs/``, the same files are ``benchmarks/x.json``."""
    up = Path(os.path.relpath(root, page.resolve().parent))
    if up == Path("."):
        return body
    return re.sub(r"\]\((docs/[^)]*)\)", lambda m: "](" + os.path.relpath(root / m.group(1), page.resolve().parent) + ")",
                  body)


def render(bench_dir: Path, pages: list[Path], root: Path | None = None) -> list[str]:
    """Rewrite ``bench_dir``'s README and results pages, and every table block in ``pages``
    (links relative to ``root``, the repository: by default ``bench_dir``'s grandparent).
    A table that no page holds, or a block no table fills, is an error: nothing drops silently."""
    reports = load_reports(bench_dir)
    if not reports:
        raise FileNotFoundError(f"no benchmark JSON in {bench_dir}: run `make bench` (or `ebrl bench SUITE --out "
                                f"{bench_dir}`) first")
    root = (root or bench_dir.resolve().parent.parent).resolve()
    (bench_dir / "README.md").write_text(bench_readme(reports))
    for name, rep in reports.items():  # each suite's page too, so every rendering comes from this code
        (bench_dir / f"{name}-results.md").write_text(results_markdown(name, rep))
    bodies, placed = tables(reports), set()
    for page in map(Path, pages):
        text = page.read_text()
        for name in MARKER.findall(text):
            if name not in bodies:
                raise ValueError(f"{page} has a <!-- bench:{name} --> block, but no table of that name "
                                 f"(no {name}.json in {bench_dir}?)")
            text = replace_block(text, name, relink(bodies[name], page, root))
            placed.add(name)
        page.write_text(text)
    if set(bodies) - placed:
        raise ValueError(f"no page holds the tables {sorted(set(bodies) - placed)}: add their "
                         f"<!-- bench:NAME --> blocks to one of {[str(p) for p in pages]}")
    return list(reports)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ebrl.benchmark.docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_dir", nargs="?", default="docs/benchmarks", type=Path)
    parser.add_argument("pages", nargs="*", default=list(PAGES), type=Path, help=f"default: {' '.join(PAGES)}")
    args = parser.parse_args(argv)
    names = render(args.bench_dir, args.pages)
    print(f"rewrote {args.bench_dir / 'README.md'} and the tables of {', '.join(map(str, args.pages))} from: "
          f"{', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
