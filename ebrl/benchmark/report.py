"""How a benchmark report reads: the console table, the paste-able markdown, the stamp.

Every figure is the median over rounds with its min-max; every target says met or missed,
and the last line counts them (``targets met: K of N``). The stamp names the machine and the
software that produced the numbers, so a results file can be judged on its own.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent.parent
VERSIONED = ("torch", "numpy", "gymnasium", "mujoco", "ebrl")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_stamp() -> dict:
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "machine": platform.platform(),
            "python": platform.python_version(), "versions": versions, "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def fmt_num(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def fmt_spread(s: dict | None, unit: str = "", pct: bool = False) -> str:
    """``median (min-max)``; one value alone when there was one round."""
    if not s or not s.get("n"):
        return "n/a"
    f = (lambda v: f"{v:.0%}") if pct else fmt_num
    text = f(s["median"]) if s["n"] == 1 else f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"
    return text + unit


def fmt_ratio(s: dict) -> str:
    if not s or not s.get("n"):
        return "n/a"
    return f"{s['median']:.2f}x" + ("" if s["n"] == 1 else f" ({s['min']:.2f}-{s['max']:.2f})")


def fmt_target_value(t: dict) -> str:
    """A target's measured figure: a ratio (``1.42x (1.3-1.5)``) or a value with its unit."""
    if t.get("note"):
        return t["note"]
    return fmt_ratio(t) if t["unit"] == "x" else fmt_spread(t, t["unit"])


def summary_lines(report: dict) -> list[tuple]:
    """(case, runner, steps/s, µs/step, main-process CPU µs/step, CPU, return) per runner, every
    figure as a spread."""
    out = []
    for case, runners in report.get("summary", {}).items():
        for runner, figs in runners.items():
            out.append((case, runner, fmt_spread(figs.get("steps_per_s")), fmt_spread(figs.get("us_per_step")),
                        fmt_spread(figs.get("cpu_us_per_step")), fmt_spread(figs.get("cpu_util"), pct=True),
                        fmt_spread(figs.get("mean_return"))))
    return out


def summary_columns(report: dict) -> tuple[list[int], list[tuple]]:
    """:func:`summary_lines` and the indices of the columns that hold a figure in some line."""
    lines = summary_lines(report)
    width = len(lines[0]) if lines else 0
    return [i for i in range(width) if i < 2 or any(line[i] != "n/a" for line in lines)], lines


def targets_line(report: dict) -> str:
    targets = report.get("targets", [])
    return f"targets met: {sum(t['met'] for t in targets)} of {len(targets)}"


def print_report(name: str, report: dict, json_path: Path) -> None:
    console = Console(width=None if Console().is_terminal else 160)
    meta = report["meta"]
    table = Table(title=f"ebrl bench {name}" + (" (quick)" if meta.get("quick") else "")
                  + f": median (min-max) over {meta.get('rounds', 1)} round(s)")
    headers = ("case", "runner", "env steps/s", "µs/step", "main CPU µs/step", "CPU", "mean return")
    keep, lines = summary_columns(report)
    for i in keep:
        table.add_column(headers[i], justify="left" if i < 2 else "right")
    for line in lines:
        table.add_row(*(line[i] for i in keep))
    console.print(table)
    for k, v in report.get("ratios", {}).items():
        console.print(f"{k}: [bold]{fmt_ratio(v)}[/bold]")
    for case, limit in report.get("limits", {}).items():
        caps = ", ".join(f"{k} {v:,.0f}" for k, v in limit["capacity_steps_per_s"].items())
        eff = limit.get("efficiency", {}).get("ebrl-async")
        console.print(f"{case}: stage capacity alone (env steps/s): {caps}; bottleneck {limit['bottleneck']}"
                      + (f"; async efficiency {eff:.0%}" if eff is not None else ""))
    for note in report.get("notes", []):
        console.print(note)
    for t in report.get("targets", []):
        mark = "[green]met[/green]" if t["met"] else "[red]missed[/red]"
        console.print(f"target {t['figure']} {t['target']}: {fmt_target_value(t)} -> {mark}")
    console.print(f"raw numbers: {json_path}")
    console.print(targets_line(report))


def results_markdown(name: str, report: dict) -> str:
    """A paste-able summary: medians with min-max per runner and case, ratios, targets, efficiency."""
    meta = report["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
    lines = [f"### `{meta['command']}`", "", f"{meta.get('description', '')}", "",
             f"{meta['date']}; {meta['cpus']} CPUs ({meta.get('cpu_model', '?')}); {versions}; "
             f"commit {meta.get('commit', '?')}; median (min-max) over {meta.get('rounds', 1)} round(s).", ""]
    keep, rows = summary_columns(report)
    if rows:
        headers = ("case", "runner", "env steps/s (end to end)", "µs/step", "main-process CPU µs/step", "CPU util",
                   "mean return")
        lines += ["| " + " | ".join(headers[i] for i in keep) + " |",
                  "|" + "|".join("---" if i < 2 else "---:" for i in keep) + "|"]
        lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    lines += [""] + [f"- {k}: **{fmt_ratio(v)}**" for k, v in report.get("ratios", {}).items()]
    for case, limit in report.get("limits", {}).items():
        caps = ", ".join(f"{k} {v:,.0f}" for k, v in limit["capacity_steps_per_s"].items())
        effs = ", ".join(f"{k} {v:.0%}" for k, v in limit.get("efficiency", {}).items())
        lines.append(f"- {case}: stage capacities alone (env steps/s): {caps}; bottleneck **{limit['bottleneck']}**; "
                     f"shared-CPU bound {limit['shared_cpu_bound_steps_per_s']:,.0f}; efficiency: {effs}")
    lines += [f"- {note}" for note in report.get("notes", [])]
    targets = report.get("targets", [])
    if targets:
        lines += ["", "| target | wanted | measured | |", "|---|---|---:|---|"]
        for t in targets:
            lines.append(f"| {t['figure']} | {t['target']} | {fmt_target_value(t)} | {'met' if t['met'] else '**missed**'} |")
        lines += ["", f"**{targets_line(report)}**"]
    return "\n".join(lines) + "\n"
