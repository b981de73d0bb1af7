"""Finds and loads the benchmark suites in the repository's ``bench/suites/``.

A suite is one small file defining either ``SUITE = ebrl.benchmark.Suite(...)`` (the usual
case: schedules, peers and the physical limit, measured by :mod:`ebrl.benchmark.suite`) or
``DESCRIPTION`` and ``run(quick: bool) -> dict`` with ``rows`` (one dict per measurement, with
``case``, ``round`` and ``runner``) and optionally ``ratios`` and ``targets`` (built with
:mod:`ebrl.benchmark.figures`) and ``meta``; a ``run`` that also takes ``out_dir`` gets the
output folder (for figures it draws). :mod:`ebrl.benchmark.bench` runs one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from ebrl.benchmark.report import REPO
from ebrl.config import ConfigError, did_you_mean
from ebrl.runtime.children import send_by_value

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
