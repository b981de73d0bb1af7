"""Learning on a real manipulation task: PPO + MLP on ManiSkill3 ``PushCube-v1`` from state,
every knob at its default, on this machine's CPU (SAPIEN's CPU backend, 16 envs). Success
against wall time for the async and sync schedules, 3 seeds, each run capped at 30 minutes;
reported: the time to ``success_once >= 0.8``, or that it was not reached within the cap.

The workload is the convergence suite's ``pushcube`` (``bench/suites/convergence.py``), run by
that suite's code: same curves, same figures, its own JSON and plot. A full run takes up to
3 hours (2 schedules x 3 seeds x 30 minutes).
"""

from __future__ import annotations

from pathlib import Path

from ebrl.benchmark.loader import load_suite

DESCRIPTION = "PPO + MLP on real ManiSkill PushCube-v1 (CPU, 16 envs): time to success 0.8, async vs sync, 3 seeds"


def run(quick: bool, out_dir: Path | None = None) -> dict:
    return load_suite("convergence").run(quick, ("pushcube",), out_dir)
