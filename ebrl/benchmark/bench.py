"""``ebrl bench SUITE``: runs one suite of ``bench/suites/``, prints medians with min-max and
the targets met, and writes ``OUT/<suite>.json`` (every raw round, the summary, the stamp) and
``OUT/<suite>-results.md`` (a table to paste)."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

from ebrl.benchmark.figures import summarize_rows
from ebrl.benchmark.loader import load_suite
from ebrl.benchmark.report import machine_stamp, print_report, results_markdown
from ebrl.benchmark.suite import measure_schedule, run_suite_rounds
from ebrl.telemetry.timeline import Timeline


def run_suite(name: str, *, quick: bool = False, out_dir: Path = Path("bench_out"),
              suites_dir: str | Path | None = None, trace: bool = False, in_process: bool = False) -> dict:
    """``in_process``: every measured run in this process (profiling), not each in a fresh one."""
    suite = load_suite(name, suites_dir)
    t0 = time.perf_counter()
    if hasattr(suite, "SUITE") and not hasattr(suite, "run"):  # a suite with a run() adds to its SUITE's rounds
        folder = None if suites_dir is None else str(suites_dir)
        report = run_suite_rounds(suite.SUITE, quick, source=(name, folder), in_process=in_process)
    else:  # custom suites: the output folder for figures, and the in-process flag, where they take them
        out_dir.mkdir(parents=True, exist_ok=True)
        takes = inspect.signature(suite.run).parameters
        extra = {"out_dir": out_dir} if "out_dir" in takes else {}
        if "in_process" in takes:
            extra["in_process"] = in_process
        report = suite.run(quick=quick, **extra)
    if "summary" not in report:  # custom suites may summarise their own fields
        report["summary"] = summarize_rows(report["rows"])
    report.setdefault("ratios", {})
    report.setdefault("targets", [])
    description = suite.SUITE.description if hasattr(suite, "SUITE") else getattr(suite, "DESCRIPTION", "")
    report["meta"] = {"description": description, **report.get("meta", {}), "suite": name, "quick": quick,
                      "duration_s": time.perf_counter() - t0, **machine_stamp(),
                      "command": f"ebrl bench {name}" + (" --quick" if quick else "")
                      + (" --in-process" if in_process else "")}
    report["targets_met"] = sum(t["met"] for t in report["targets"])
    out_dir.mkdir(parents=True, exist_ok=True)
    if trace and hasattr(suite, "SUITE"):
        report["traces"] = write_traces(suite.SUITE, name, out_dir, quick)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=float))
    (out_dir / f"{name}-results.md").write_text(results_markdown(name, report))
    print_report(name, report, path)
    return report


def write_traces(suite, name: str, out_dir: Path, quick: bool) -> dict[str, str]:
    """One short traced run per schedule of the first case: Chrome trace JSON and a Gantt PNG."""
    case, env_fn = next(iter(suite.cases.items()))
    suite = suite.for_case(case).sized(quick)
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
