"""Figures from benchmark rounds: median with min-max, per-round ratios, targets met or missed.

A benchmark runs each runner once per round, alternating runners within a round, so machine
drift lands on all of them alike. A ratio is taken *within* each round (async of round r over
sync of round r) and then summarised, so its spread shows how far the rounds disagree.

    >>> rows = [{"case": "c", "round": r, "runner": n, "steps_per_s": v}
    ...         for r, (a, s) in enumerate([(300, 100), (330, 110), (280, 100)])
    ...         for n, v in (("ebrl-async", a), ("ebrl-sync", s))]
    >>> spread([3.0, 1.0, 2.0])["median"]
    2.0
    >>> ratio = round_ratios(rows, "c", "ebrl-async", ["ebrl-sync"])
    >>> ratio["median"], ratio["min"], ratio["max"]
    (3.0, 2.8, 3.0)
    >>> [t["met"] for t in check_targets({"c: async/sync": ratio}, {"async/sync": 2.0})]
    [True]
    >>> Target(6.0, lower_is_better=True).describe(" µs")
    '<= 6 µs'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """What a figure should reach: its median ``>= bound`` (``<=`` when ``lower_is_better``)."""

    bound: float
    lower_is_better: bool = False

    def met(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value <= self.bound if self.lower_is_better else value >= self.bound

    def describe(self, unit: str = "x") -> str:
        return f"{'<=' if self.lower_is_better else '>='} {self.bound:g}{unit}"


def as_target(value: float | Target) -> Target:
    return value if isinstance(value, Target) else Target(float(value))


def spread(values: Iterable[float]) -> dict:
    """Median, min, max and every value (finite ones; NaN where there are none)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0, "values": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def summarize_rows(rows: list[dict], fields: tuple[str, ...] = ("steps_per_s", "rollout_steps_per_s", "cpu_util",
                                                                 "us_per_step", "mean_return", "first_step_s",
                                                                 "first_update_s", "steady_steps_per_s", "reset_s")) -> dict:
    """``{case: {runner: {field: spread}}}`` over the rounds, for the fields the rows have."""
    out: dict[str, dict[str, dict]] = {}
    for row in rows:
        out.setdefault(str(row.get("case", "")), {}).setdefault(row["runner"], {})
    for case, runners in out.items():
        for runner, figures in runners.items():
            mine = [r for r in rows if str(r.get("case", "")) == case and r["runner"] == runner]
            for f in fields:
                if any(isinstance(r.get(f), (int, float)) and not isinstance(r.get(f), bool) for r in mine):
                    figures[f] = spread(r.get(f, math.nan) for r in mine)
    return out


def round_ratios(rows: list[dict], case: str, numerator: str, denominators: list[str],
                 field: str = "steps_per_s") -> dict:
    """``numerator / max(denominators)`` within each round of ``case``, then its spread."""
    per_round: dict[int, dict[str, float]] = {}
    for r in rows:
        if str(r.get("case", "")) == case:
            per_round.setdefault(r.get("round", 0), {})[r["runner"]] = r[field]
    values = []
    for by_runner in per_round.values():
        dens = [by_runner[d] for d in denominators if d in by_runner]
        if numerator in by_runner and dens and max(dens) > 0:
            values.append(by_runner[numerator] / max(dens))
    return spread(values)


MACHINE = "machine"  # the case of the reference rows: a fixed loop without EBRL, once a round
STEADY_AT_MOST = 1.15  # a runner's max/min over rounds: the target of every "max/min over rounds" figure


def steadiness(rows: list[dict], runners: tuple[str, ...] = ("ebrl-async",)) -> dict[str, dict]:
    """Per case, each of ``runners``' fastest round over its slowest (``"<case>: <runner> max/min
    over rounds"``), and the machine's own (the reference rows' case :data:`MACHINE`): a runner
    no steadier than the machine was moved by the machine, not by its own decisions.

        >>> rows = [{"case": "c", "round": r, "runner": "ebrl-async", "steps_per_s": v}
        ...         for r, v in enumerate([300.0, 330.0, 280.0])]
        >>> round(steadiness(rows)["c: async max/min over rounds"]["median"], 3)
        1.179
    """
    out = {}
    for case in dict.fromkeys(str(r.get("case", "")) for r in rows):
        for runner in (runners if case != MACHINE else tuple(dict.fromkeys(
                r["runner"] for r in rows if r.get("case") == MACHINE))):
            xs = [r["steps_per_s"] for r in rows if str(r.get("case", "")) == case and r["runner"] == runner
                  and math.isfinite(r.get("steps_per_s", math.nan)) and r["steps_per_s"] > 0]
            if len(xs) >= 2:
                out[f"{case}: {runner.removeprefix('ebrl-')} max/min over rounds"] = spread([max(xs) / min(xs)])
    return out


def suite_ratios(rows: list[dict], reference: str = "ebrl-async") -> dict[str, dict]:
    """Per case: the reference runner over every other runner, over the best other schedule
    and over the best peer (the fastest other EBRL schedule, and non-EBRL runner, of the same round)."""
    ratios = {}
    for case in dict.fromkeys(str(r.get("case", "")) for r in rows):
        runners = list(dict.fromkeys(r["runner"] for r in rows if str(r.get("case", "")) == case))
        if reference not in runners or case == MACHINE:
            continue
        for other in runners:
            if other != reference:
                ratios[f"{case}: async/{other.removeprefix('ebrl-')}"] = round_ratios(rows, case, reference, [other])
        schedules = [n for n in runners if n.startswith("ebrl-") and n != reference]
        if schedules:  # the defaults against whichever other schedule was fastest that round
            ratios[f"{case}: async/best schedule"] = round_ratios(rows, case, reference, schedules)
        peers = [n for n in runners if not n.startswith("ebrl-")]
        if peers:
            ratios[f"{case}: async/best peer"] = round_ratios(rows, case, reference, peers)
    return ratios


def check_targets(figures: dict[str, dict], targets: dict[str, float | Target], unit: str = "x") -> list[dict]:
    """One row per (figure, target). A target named ``"async/sync"`` applies to every
    ``"<case>: async/sync"`` figure; a full figure name applies to that figure alone."""
    out = []
    for name, raw in targets.items():
        target = as_target(raw)
        matches = [f for f in figures if f == name or f.endswith(f": {name}")]
        if not matches:  # a target with no figure is missed, and says so
            out.append({"figure": name, "target": target.describe(unit), "median": math.nan, "min": math.nan,
                        "max": math.nan, "n": 0, "unit": unit, "met": False, "note": "not measured"})
        for f in matches:
            s = figures[f]
            out.append({"figure": f, "target": target.describe(unit), "median": s["median"], "min": s["min"],
                        "max": s["max"], "n": s["n"], "unit": unit, "met": target.met(s["median"])})
    return out
