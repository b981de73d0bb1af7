"""A live progress bar (tqdm) and an end-of-run summary table (rich)."""

from __future__ import annotations

import math
import time

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from ebrl.runtime.stats import RunResult, RunStats


class ProgressBar:
    """``run(trainer, progress=ProgressBar(total))``: env steps, steps/s, return and policy lag."""

    def __init__(self, total: int, desc: str = "train"):
        self.bar = tqdm(total=total, desc=desc, unit="step", unit_scale=True, dynamic_ncols=True, smoothing=0.1)
        self._last_steps, self._last_t = 0, time.perf_counter()

    def __call__(self, stats: RunStats, learner) -> None:
        now = time.perf_counter()
        rate = (stats.simulated - self._last_steps) / max(now - self._last_t, 1e-9)
        self._last_steps, self._last_t = stats.simulated, now
        lag_n = sum(stats.lag.values())
        lag = sum(k * v for k, v in stats.lag.items()) / lag_n if lag_n else 0.0
        self.bar.set_postfix_str(f"{rate:,.0f} steps/s | return {_fmt(stats.mean_return)} | "
                                 f"updates {stats.updates} | lag {lag:.2f}", refresh=False)
        self.bar.update(stats.simulated - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.1f}"


def _batches(result: RunResult) -> str:
    """The batch-size histogram, mean first, and the measured cost curve where there is one."""
    hist = result.gen_batch_hist
    shown = dict(sorted(hist.items(), key=lambda kv: -kv[1])[:6])  # the commonest sizes
    text = f"mean {result.gen_batch_mean:.1f}; " + ", ".join(f"{k}: {v:,}" for k, v in sorted(shown.items()))
    if len(hist) > len(shown):
        text += f", {len(hist) - len(shown)} more sizes"
    costs = result.gen_costs or {}
    if costs.get("fixed_us") is not None:
        text += f"\na call: {costs['fixed_us'] / 1e3:.2f} ms + {costs['per_row_us'] / 1e3:.3f} ms a row"
    return text


def summary_table(result: RunResult, title: str = "EBRL run") -> Table:
    first = next((h["mean_return"] for h in result.history if not math.isnan(h["mean_return"])), math.nan)
    rows = [
        ("schedule", result.schedule),
        ("sim backend / learner", f"{result.sim_backend} / {result.learner_mode}"),
        ("env steps", f"{result.env_steps:,}"),
        ("wall time", f"{result.wall_s:,.1f} s"),
        ("env steps/s (end to end)", f"{result.env_steps_per_s:,.0f}"),
        ("updates", f"{result.updates}"),
        ("mean return: first updates -> end", f"{_fmt(first)} -> {_fmt(result.mean_return)}"),
        ("episodes", f"{result.episodes:,}"),
        ("policy lag (mean / max)", f"{result.lag_mean:.2f} / {result.lag_max}"),
        ("generation batches (rows: calls)", _batches(result)),
        ("busy: generator / learner", f"{result.generator_busy_s:,.1f} s / {result.learner_busy_s:,.1f} s"),
        ("trained / dropped / in flight", f"{result.trained:,} / {sum(result.dropped.values()):,} / "
                                          f"{result.in_flight_at_stop:,}"),
        ("env failures", f"{result.env_failures}"),
    ]
    if not math.isnan(result.success_once):
        rows.append(("success once / at end (last 100 episodes)",
                     f"{result.success_once:.2f} / {result.success_at_end:.2f}"))
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in rows:
        table.add_row(k, v)
    return table


def print_summary(result: RunResult, title: str = "EBRL run") -> None:
    Console().print(summary_table(result, title))
