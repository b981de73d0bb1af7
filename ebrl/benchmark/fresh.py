"""One measurement in a fresh Python process, as a user's script runs.

A process that has already run EBRL once has paid torch's lazy imports, warmed its allocator
and forks its workers from a warm image, so a second run in it is faster than any user's
first. The suites therefore run every measured run (each EBRL schedule and each peer) through
:func:`call_fresh`: a new interpreter imports the measuring function's module (outside any
timer), calls it with JSON arguments, and prints its dict as JSON on the last line of stdout.
``ebrl bench SUITE --in-process`` runs every run in the bench's own process instead, for
profiling.

    >>> call_fresh("ebrl.benchmark.fresh:echo", {"x": 2})
    {'x': 2, 'fresh': True}
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

from ebrl.benchmark.loader import load_suite

FRESH_ENV = "EBRL_BENCH_FRESH"  # set in the child: a measuring function can tell where it runs


def call_fresh(target: str, kwargs: dict, *, timeout_s: float | None = None) -> dict:
    """``target(**kwargs)`` in a new interpreter; ``target`` is ``"module:function"`` or
    ``"suite:NAME:function"`` (a function of ``bench/suites/NAME.py``; ``kwargs`` may hold
    ``suites_dir``). Raises ``RuntimeError`` with the child's stderr tail if it fails."""
    proc = subprocess.run([sys.executable, "-m", "ebrl.benchmark.fresh"], input=json.dumps([target, kwargs]),
                          capture_output=True, text=True, timeout=timeout_s, check=False, env={**os.environ, FRESH_ENV: "1"})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"{target} failed in its own process (exit code {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    if proc.stderr.strip():  # warnings, and the child's own log lines: kept visible
        sys.stderr.write(proc.stderr)
    return json.loads(lines[-1])


def echo(**kwargs) -> dict:
    return {**kwargs, "fresh": os.environ.get(FRESH_ENV) == "1"}


def main() -> None:
    target, kwargs = json.loads(sys.stdin.read())
    head, _, name = target.rpartition(":")
    if head.startswith("suite:"):  # a suite file (not a package): loaded by path
        module = load_suite(head.partition(":")[2], kwargs.pop("suites_dir", None))
    else:
        module = importlib.import_module(head)
    out = getattr(module, name)(**kwargs)
    sys.stdout.flush()
    print("\n" + json.dumps(out, default=float))


if __name__ == "__main__":
    main()
