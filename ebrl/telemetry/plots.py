"""Learning curves of a run, also one still training: ``ebrl plot runs/X``.

Reads the run's rows from a run directory (its ``history.jsonl``, else its
``result.json``), a ``history.jsonl`` (a partial last line, the row being written, is
left out) or a ``result.json``. Draws the mean episode return (last 100 episodes) and,
when the env reports success, the success rate (succeeded at any step), against env
steps, with matplotlib's Agg backend.

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from ebrl.telemetry.plots import load_rows
    >>> tmp = tempfile.TemporaryDirectory()
    >>> d = Path(tmp.name)
    >>> _ = (d / "history.jsonl").write_text('{"env_steps": 64, "mean_return": 1.0}\\n{"env_st')
    >>> load_rows(d)[0]
    [{'env_steps': 64, 'mean_return': 1.0}]
    >>> tmp.cleanup()
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ebrl.telemetry.metrics import HISTORY, RESULT, read_history


def load_rows(path: str | Path) -> tuple[list[dict[str, Any]], str]:
    """The history rows of a run directory, ``history.jsonl`` or ``result.json``, and a title."""
    path = Path(path)
    if path.is_dir():
        for name in (HISTORY, RESULT):
            if (path / name).is_file():
                return load_rows(path / name)
        raise FileNotFoundError(f"{path}: no {HISTORY} or {RESULT} (is it a run directory?)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        rows = read_history(path)
        steps = rows[-1]["env_steps"] if rows else 0
        return rows, f"{path.parent.name}: {len(rows)} updates, {steps:,} env steps"
    result = json.loads(path.read_text(encoding="utf-8"))
    return result["history"], f"{result['schedule']} schedule, {result['env_steps']:,} env steps"


def default_png(path: str | Path) -> Path:
    """``DIR/curve.png`` for a run directory, else the file's name with ``.png``."""
    path = Path(path)
    return path / "curve.png" if path.is_dir() else path.with_suffix(".png")


def plot_history(path: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history, default_title = load_rows(path)
    rows = [h for h in history if not _nan(h.get("mean_return"))]
    if not rows:
        raise ValueError(f"{path}: no finished episodes to plot yet")
    steps = [h["env_steps"] for h in rows]
    success = [math.nan if h.get("success_once") is None else h["success_once"] for h in rows]
    has_success = any(not math.isnan(x) for x in success)
    fig = Figure(figsize=(9, 3.2 if not has_success else 5.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if has_success else 1, 1, sharex=True, squeeze=False)[:, 0]
    axes[0].plot(steps, [h["mean_return"] for h in rows], color="tab:blue")
    axes[0].set_ylabel("mean return (last 100)")
    if has_success:
        axes[1].plot(steps, success, color="tab:green")
        axes[1].set_ylabel("success once (last 100)")
        axes[1].set_ylim(-0.02, 1.02)
    axes[-1].set_xlabel("env steps")
    fig.suptitle(title or default_title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    return out_png


def _nan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))
