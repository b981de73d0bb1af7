"""Benchmarks: suites of runners measured in alternating rounds, reported as medians with
min-max, with targets met or missed (``ebrl bench SUITE``; ``make bench`` runs them all and
regenerates docs/benchmarks/ and the README's tables)."""

from ebrl.benchmark.figures import Target, check_targets, round_ratios, spread, summarize_rows
from ebrl.benchmark.spec import Suite
from ebrl.benchmark.suite import measure_peer, measure_schedule, run_suite_rounds

__all__ = ["Suite", "Target", "check_targets", "measure_peer", "measure_schedule", "round_ratios",
           "run_suite_rounds", "spread", "summarize_rows"]
