"""Learning curves from a run's ``result.json``: ``ebrl plot runs/X/result.json``.

Draws the mean episode return (last 100 episodes) and, when the env reports success, the
success rate (succeeded at any step), against env steps, with matplotlib's Agg backend.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def plot_history(result_json: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    result = json.loads(Path(result_json).read_text())
    rows = [h for h in result["history"] if not math.isnan(h.get("mean_return", math.nan))]
    if not rows:
        raise ValueError(f"{result_json}: no finished episodes to plot")
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
    fig.suptitle(title or f"{result['schedule']} schedule, {result['env_steps']:,} env steps")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    return out_png
