"""Finds and runs the benchmark suites in the repository's ``bench/suites/``.

A suite is one small file defining ``DESCRIPTION`` and ``run(quick: bool) -> dict`` with
``rows`` (one dict per measurement) and optionally ``ratios`` and ``meta``. The runner
prints the rows as a table and writes everything to ``OUT/<suite>.json``.
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
        first = next((ln for ln in path.read_text().splitlines() if ln.startswith("DESCRIPTION")), "")
        out[path.stem.replace("_", "-")] = first.partition("=")[2].strip().strip("\"'")
    return out


def run_suite(name: str, *, quick: bool = False, out_dir: Path = Path("bench_out"),
              suites_dir: str | Path | None = None) -> dict:
    suite = load_suite(name, suites_dir)
    t0 = time.perf_counter()
    report = suite.run(quick=quick)
    report.setdefault("ratios", {})
    report["meta"] = {**report.get("meta", {}), "suite": name, "quick": quick,
                      "duration_s": time.perf_counter() - t0, "cpus": os.cpu_count(),
                      "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=float))
    console = Console(width=None if Console().is_terminal else 160)
    table = Table(title=f"ebrl bench {name}" + (" (quick)" if quick else ""))
    rows = report["rows"]
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,.1f}" if isinstance(v, float) else str(v) for v in row.values()))
    console.print(table)
    for k, v in report["ratios"].items():
        console.print(f"{k}: [bold]{v:.2f}x[/bold]")
    console.print(f"raw numbers: {path}")
    return report
