"""Finds and runs the benchmark suites in the repository's ``bench/suites/``.

A suite is one small file defining either ``SUITE = ebrl.benchmark.Suite(...)`` (the usual
case: schedules, peers and the physical limit, measured by :mod:`ebrl.benchmark`) or
``DESCRIPTION`` and ``run(quick: bool) -> dict`` with ``rows`` (one dict per measurement)
and optionally ``ratios`` and ``meta``. The runner prints the rows as a table and writes
``OUT/<suite>.json`` (every raw number) and ``OUT/<suite>-results.md`` (a table to paste).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.table import Table

CONSOLE_COLUMNS = ("case", "round", "runner", "env", "observation", "schedule", "num_envs", "vector_size", "env_steps", "wall_s", "steps_per_s",
                   "rollout_steps_per_s", "us_per_step", "cpu_util", "gen_batch_mean", "lag_mean", "mean_return")
REPO_BENCH = Path(__file__).resolve().parent.parent / "bench" / "suites"


def _dir(suites_dir: str | Path | None) -> Path:
    path = Path(suites_dir) if suites_dir else REPO_BENCH
    if not path.is_dir():
        raise FileNotFoundError(f"no benchmark suites at {path}: run from a clone of the repository "
                                f"or pass --suites-dir")
    return path


def load_suite(name: str, suites_dir: str | Path | None = None) -> ModuleType:
    path = _dir(suites_dir) / f"{name.replace('-', '_')}.py"
    if not path.is_file():
        known = ", ".join(list_suites(suites_dir))
        raise ValueError(f"unknown benchmark suite {name!r}; known: {known}")
    spec = importlib.util.spec_from_file_location(f"ebrl_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def list_suites(suites_dir: str | Path | None = None) -> dict[str, str]:
    out = {}
    for path in sorted(_dir(suites_dir).glob("*.py")):
        if path.stem.startswith("_"):
            continue
        text = path.read_text()
        first = next((ln for ln in text.splitlines() if ln.lstrip().startswith(("DESCRIPTION", "description="))), "")
        out[path.stem.replace("_", "-")] = first.partition("=")[2].strip().strip(",").strip("\"'")
    return out


def run_suite(name: str, *, quick: bool = False, out_dir: Path = Path("bench_out"),
              suites_dir: str | Path | None = None, trace: bool = False) -> dict:
    suite = load_suite(name, suites_dir)
    t0 = time.perf_counter()
    if hasattr(suite, "SUITE"):
        from ebrl.benchmark import run_suite_rounds

        report = run_suite_rounds(suite.SUITE, quick)
    else:
        report = suite.run(quick=quick)
    report.setdefault("ratios", {})
    report["meta"] = {**report.get("meta", {}), "suite": name, "quick": quick,
                      "duration_s": time.perf_counter() - t0, "cpus": os.cpu_count(),
                      "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "command": f"ebrl bench {name}" + (" --quick" if quick else "")}
    out_dir.mkdir(parents=True, exist_ok=True)
    if trace and hasattr(suite, "SUITE"):
        report["traces"] = write_traces(suite.SUITE, name, out_dir, quick)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=float))
    (out_dir / f"{name}-results.md").write_text(results_markdown(name, report))
    console = Console(width=None if Console().is_terminal else 160)
    table = Table(title=f"ebrl bench {name}" + (" (quick)" if quick else ""))
    rows = report["rows"]
    columns = [c for c in CONSOLE_COLUMNS if c in rows[0]] or [c for c, v in rows[0].items()
                                                                 if not isinstance(v, (dict, list))]
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    console.print(table)
    for k, v in report["ratios"].items():
        console.print(f"{k}: [bold]{v:.2f}x[/bold]")
    for case, limit in report.get("limits", {}).items():
        caps = ", ".join(f"{k} {v:,.0f}" for k, v in limit["capacity_steps_per_s"].items())
        eff = limit["efficiency"].get("ebrl-async")
        console.print(f"{case}: stage capacity alone (env steps/s): {caps}; bottleneck {limit['bottleneck']}; "
                      f"async efficiency {eff:.0%}" if eff is not None else "")
    console.print(f"raw numbers: {path}")
    return report


def _fmt(v) -> str:
    return f"{v:,.2f}" if isinstance(v, float) and abs(v) < 10 else (f"{v:,.0f}" if isinstance(v, float) else str(v))


def results_markdown(name: str, report: dict) -> str:
    """A paste-able summary: mean env steps/s per runner and case, ratios, efficiency."""
    meta = report["meta"]
    lines = [f"### `{meta['command']}`", "", f"{meta.get('description', '')}", "",
             f"{meta['date']}, {meta['cpus']} CPUs, {meta['machine']}", ""]
    rows = report["rows"]
    if rows and "runner" in rows[0]:
        lines += ["| case | runner | env steps/s (end to end) | rollout steps/s | CPU util | mean return |",
                  "|---|---|---:|---:|---:|---:|"]
        groups: dict[tuple, list] = {}
        for r in rows:
            groups.setdefault((r.get("case", ""), r["runner"]), []).append(r)
        for (case, runner), rs in groups.items():
            mean = lambda k: sum(x.get(k, float("nan")) for x in rs) / len(rs)  # noqa: E731
            lines.append(f"| {case} | {runner} | {mean('steps_per_s'):,.0f} | {mean('rollout_steps_per_s'):,.0f} "
                         f"| {mean('cpu_util'):.0%} | {mean('mean_return'):,.1f} |")
    lines += [""] + [f"- {k}: **{v:.2f}x**" for k, v in report["ratios"].items()]
    for case, limit in report.get("limits", {}).items():
        caps = ", ".join(f"{k} {v:,.0f}" for k, v in limit["capacity_steps_per_s"].items())
        effs = ", ".join(f"{k} {v:.0%}" for k, v in limit["efficiency"].items())
        lines.append(f"- {case}: stage capacities alone (env steps/s): {caps}; bottleneck **{limit['bottleneck']}**; "
                     f"efficiency: {effs}")
    return "\n".join(lines) + "\n"


def write_traces(suite, name: str, out_dir: Path, quick: bool) -> dict[str, str]:
    """One short traced run per schedule of the first case: Chrome trace JSON and a Gantt PNG."""
    from ebrl.benchmark import measure_schedule
    from ebrl.runtime.profiler import Timeline

    suite = suite.sized(quick)
    case, env_fn = next(iter(suite.cases.items()))
    steps = min(suite.quick_steps if quick else suite.steps, 4 * suite.num_envs * suite.segment_len)
    written = {}
    for schedule in suite.schedules:
        timeline = Timeline()
        measure_schedule(suite, env_fn, schedule, steps, seed=0, timeline=timeline)
        stem = out_dir / f"{name}-{schedule}"
        timeline.to_chrome_trace(f"{stem}.trace.json")
        timeline.plot_gantt(f"{stem}.png", title=f"{name} / {case}: {schedule}")
        written[schedule] = f"{stem}.png"
    return written
