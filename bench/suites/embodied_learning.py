"""Learning on a real manipulation task: PPO + MLP on ManiSkill3 ``PushCube-v1`` from state,
on this machine's CPU (SAPIEN's CPU backend, 16 envs), every knob at its default but PPO's
discount, ``gamma=0.8`` from ManiSkill's own PPO baseline for its 50-step tasks (with EBRL's
default 0.99 a 30-minute exploratory run reached success 0.03). Success against wall time for
the async and sync schedules, 3 seeds, each run capped at 30 minutes and stopped when it first
reaches ``success_once >= 0.8``; reported: the time to it, or that it was not reached.

The workload is the convergence suite's ``pushcube`` (``bench/suites/convergence.py``), run by
that suite's code: same curves, same figures, its own JSON and plot. A full run takes up to
3 hours (2 schedules x 3 seeds x 30 minutes) if no run reaches the threshold; about half an hour
when they do in the few minutes seen so far.
"""

from __future__ import annotations

from pathlib import Path

from ebrl.benchmark.loader import load_suite

DESCRIPTION = "PPO + MLP on real ManiSkill PushCube-v1 (CPU, 16 envs): time to success 0.8, async vs sync, 3 seeds"


def run(quick: bool, out_dir: Path | None = None, in_process: bool = False) -> dict:
    return load_suite("convergence").run(quick, ("pushcube",), out_dir, in_process=in_process)
