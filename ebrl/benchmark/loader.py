"""Finds and runs the benchmark suites in the repository's ``bench/suites/``.

A suite is one small file defining either ``SUITE = ebrl.benchmark.Suite(...)`` (the usual
case: schedules, peers and the physical limit, measured by :mod:`ebrl.benchmark.suite`) or
``DESCRIPTION`` and ``run(quick: bool) -> dict`` with ``rows`` (one dict per measurement, with
``case``, ``round`` and ``runner``) and optionally ``ratios`` and ``targets`` (built with
:mod:`ebrl.benchmark.figures`) and ``meta``; a ``run`` that also takes ``out_dir`` gets the
output folder (for figures it draws). The runner prints medians with min-max and the
targets met, and writes ``OUT/<suite>.json`` (every raw round, the summary, the stamp) and
``OUT/<suite>-results.md`` (a table to paste).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import ModuleType

from ebrl.benchmark.figures import summarize_rows
from ebrl.benchmark.report import REPO, machine_stamp, print_report, results_markdown
from ebrl.config import ConfigError
from ebrl.runtime.children import send_by_value
from ebrl.envs import did_you_mean

REPO_BENCH = REPO / "bench" / "suites"


def _dir(suites_dir: str | Path | None) -> Path:
    path = Path(suites_dir) if suites_dir else REPO_BENCH
    if not path.is_dir():
        raise FileNotFoundError(f"no benchmark suites at {path}: run from a clone of the repository "
                                f"or pass --suites-dir")
    return path


def load_suite(name: str, suites_dir: str | Path | None = None) -> ModuleType:
    import importlib.util

    path = _dir(suites_dir) / f"{name.replace('-', '_')}.py"
    if not path.is_file():
        known = list_suites(suites_dir)
        raise ConfigError("suite", name, f"unknown benchmark suite{did_you_mean(name, known)} (known: "
                          f"{', '.join(known)})")
    spec = importlib.util.spec_from_file_location(f"ebrl_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look a class's module up there
    spec.loader.exec_module(module)
    send_by_value(module)  # its env_fns, to children that are not forked
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
              suites_dir: str | Path | None = None, trace: bool = False, in_process: bool = False) -> dict:
    """``in_process``: every measured run in this process (profiling), not each in a fresh one."""
    suite = load_suite(name, suites_dir)
    t0 = time.perf_counter()
    if hasattr(suite, "SUITE") and not hasattr(suite, "run"):  # a suite with a run() adds to its SUITE's rounds
        from ebrl.benchmark.suite import run_suite_rounds

        folder = None if suites_dir is None else str(suites_dir)
        report = run_suite_rounds(suite.SUITE, quick, source=(name, folder), in_process=in_process)
    else:  # custom suites: the output folder for figures, and the in-process flag, where they take them
        import inspect

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
    from ebrl.benchmark.suite import measure_schedule
    from ebrl.runtime.profiler import Timeline

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
