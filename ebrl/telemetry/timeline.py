"""The stage timeline: every env step, generation batch and update as an interval on a lane.

``run(trainer, timeline=Timeline())`` records, in the event loop's clock (``loop.time()``;
virtual seconds under :func:`ebrl.testing.run_virtual`):

- lane ``"env i"``: ``"sim"`` from just before ``pool.step`` to its return; ``"act"`` while
  the env is ready for its next action and does not have it (inside ``generator.act``; under
  the lockstep schedules also the wait for the group's slowest env, the barrier);
  ``"blocked"`` while backpressure (a full rollout queue) holds it; ``"fail"`` for a step
  that raised. "sim" includes any wait for a free lane or worker of the sim pool (give the
  pool one lane per env to see pure step times);
- lane ``"generator"``: ``"batch"`` for each policy call, ``arg`` = batch size;
- lane ``"learner"``: ``"update"`` for each update, ``arg`` = steps trained.

Recording is one tuple appended to a bounded deque (a ring buffer: the oldest events go
first). :meth:`Timeline.to_chrome_trace` writes a Chrome trace that Perfetto
(https://ui.perfetto.dev) opens with one lane per env, one for the generator and one for
the learner; :meth:`Timeline.plot_gantt` draws a PNG Gantt chart where stalls show as
long "act" bars.

    >>> import ebrl
    >>> from ebrl.telemetry.timeline import Timeline
    >>> from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual
    >>> trainer = ebrl.Trainer(
    ...     env_fn=lambda i: MockEnv(latency=Latency.constant(0.010 if i == 0 else 0.001)),
    ...     policy=MockPolicy(act_dim=4, base_cost_s=0.0005),
    ...     algo=NoopAlgo(base_cost_s=0.002),
    ...     config=ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=400, schedule="sync",
    ...                           sim={"num_threads": 4}),
    ... )
    >>> timeline = Timeline()
    >>> result = run_virtual(trainer, timeline=timeline)
    >>> sum(1 for lane, name, *_ in timeline.events if name == "sim") == result.env_steps
    True
    >>> f"{timeline.busy_fraction('env 0', name='sim'):.2f} {timeline.busy_fraction('env 1', name='sim'):.2f}"
    '0.93 0.09'
    >>> sorted(result.busy)   # generator, learner and mean per-env sim busy fractions
    ['generator', 'learner', 'sim']
    >>> import tempfile
    >>> from pathlib import Path
    >>> out = tempfile.TemporaryDirectory()   # or any directory of yours
    >>> timeline.to_chrome_trace(Path(out.name) / "trace.json")   # open in https://ui.perfetto.dev
    >>> timeline.plot_gantt(Path(out.name) / "gantt.png", title="sync, env 0 10x slower")
    >>> sorted(p.name for p in Path(out.name).iterdir())
    ['gantt.png', 'trace.json']
    >>> out.cleanup()
"""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path
from typing import Any

# One event: (lane, name, t0, t1, arg); times in seconds of the event loop's clock.
Event = tuple[str, str, float, float, "int | float | None"]

# Colours of the stage names; other names take the tab10 colours in order of appearance.
COLOURS = {
    "sim": "#1f77b4",  # blue: simulating
    "act": "#fdbf6f",  # pale orange: ready, waiting for an action (a stall when long)
    "blocked": "#d9d9d9",  # grey: held by backpressure
    "fail": "#000000",
    "batch": "#2ca02c",  # green: a policy call
    "update": "#d62728",  # red: a training update
}
LABELS = {"act": "act (waiting for an action)", "blocked": "blocked (queue full)", "batch": "batch (policy call)",
          "update": "update (training)", "fail": "fail (step raised)"}
_ARG_NAMES = {"batch": "batch_size", "update": "steps"}
_ENV = re.compile(r"^env (\d+)$")


def lane_order(lane: str) -> tuple:
    """Generator first, then the learner, then envs by number, then anything else by name."""
    if lane == "generator":
        return (0, 0, "")
    if lane == "learner":
        return (1, 0, "")
    m = _ENV.match(lane)
    if m:
        return (2, int(m.group(1)), "")
    return (3, 0, lane)


def _matches(lane: str, prefix: str) -> bool:
    # "env" matches "env 3"; "env 1" matches "env 1" only, not "env 10"
    if lane == prefix:
        return True
    return lane.startswith(prefix) and (prefix.endswith(" ") or lane[len(prefix)] == " ")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Timeline:
    """A ring buffer of stage events; see the module docstring."""

    def __init__(self, capacity: int = 1_000_000):
        self.events: deque[Event] = deque(maxlen=capacity)
        self._append = self.events.append

    def record(self, lane: str, name: str, t0: float, t1: float, arg: int | float | None = None) -> None:
        """Append one event (cheap: called per env step; pass precomputed lane strings)."""
        self._append((lane, name, t0, t1, arg))

    def __len__(self) -> int:
        return len(self.events)

    @property
    def capacity(self) -> int:
        return self.events.maxlen

    @property
    def full(self) -> bool:
        """True once the buffer holds ``capacity`` events: older ones may have been dropped."""
        return len(self.events) == self.events.maxlen

    def clear(self) -> None:
        self.events.clear()

    def lanes(self) -> list[str]:
        """The lanes that have events, in display order."""
        return sorted({e[0] for e in self.events}, key=lane_order)

    def span(self) -> tuple[float, float]:
        """``(first t0, last t1)`` over all events; ``(0.0, 0.0)`` when empty."""
        if not self.events:
            return 0.0, 0.0
        return min(e[2] for e in self.events), max(e[3] for e in self.events)

    # ---------------------------------------------------------------- busy time

    def busy(self, lane_prefix: str, start: float | None = None, end: float | None = None,
             name: str | None = None) -> float:
        """Seconds covered by events on the lanes matching ``lane_prefix``, averaged over those lanes.

        A lane matches when it equals the prefix or continues it after a space ("env" matches
        every env lane, "env 1" only env 1). Overlapping events on one lane count once;
        events are clipped to ``[start, end]``; ``name`` keeps only events of that name.
        A matching lane with no event of that name counts as 0. Hence ``busy("env",
        name="sim")`` is the mean per-env simulation time.
        """
        lo = float("-inf") if start is None else start
        hi = float("inf") if end is None else end
        per_lane: dict[str, list[tuple[float, float]]] = {}
        for lane, ev_name, t0, t1, _ in self.events:
            if not _matches(lane, lane_prefix):
                continue
            intervals = per_lane.setdefault(lane, [])
            if name is not None and ev_name != name:
                continue
            a, b = max(t0, lo), min(t1, hi)
            if b > a:
                intervals.append((a, b))
        if not per_lane:
            return 0.0
        return sum(_union(iv) for iv in per_lane.values()) / len(per_lane)

    def busy_fraction(self, lane_prefix: str, start: float | None = None, end: float | None = None,
                      name: str | None = None) -> float:
        """:meth:`busy` over the window's length; the window defaults to the timeline's span."""
        first, last = self.span()
        start = first if start is None else start
        end = last if end is None else end
        if end <= start:
            return 0.0
        return self.busy(lane_prefix, start, end, name) / (end - start)

    # ---------------------------------------------------------------- export

    def to_chrome_trace(self, path: str | Path) -> None:
        """Write Chrome trace event JSON (complete "X" events, µs): opens in Perfetto or chrome://tracing."""
        origin, _ = self.span()
        tids = {lane: k + 1 for k, lane in enumerate(self.lanes())}
        out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                                      "args": {"name": "ebrl"}}]
        for lane, tid in tids.items():
            out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        for lane, name, t0, t1, arg in self.events:
            ev = {"name": name, "cat": lane.split(" ", 1)[0], "ph": "X", "pid": 1, "tid": tids[lane],
                  "ts": round((t0 - origin) * 1e6, 3), "dur": round(max(t1 - t0, 0.0) * 1e6, 3)}
            if arg is not None:
                ev["args"] = {_ARG_NAMES.get(name, "arg"): arg}
            out.append(ev)
        text = json.dumps({"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"origin_s": origin}},
                          separators=(",", ":"))  # dumps, not dump: the C encoder, 4x faster on 1M events
        with open(path, "w") as f:
            f.write(text)

    def plot_gantt(self, path: str | Path, title: str = "", start: float | None = None,
                   end: float | None = None, max_envs: int = 32) -> None:
        """Draw a PNG Gantt chart: one row per lane, one colour per event name.

        ``start``/``end`` select a window (loop-clock seconds); the x axis shows seconds from
        the timeline's first event. At most ``max_envs`` env lanes are drawn (the first by
        number). Each lane is drawn at the chart's resolution, one column per pixel: a column
        takes the colour of the event name that covers most of it, shaded by how much of it
        events cover (a solid bar: busy all along; a pale one: short events now and then;
        blank: nothing). A long run draws as fast as a short one.
        """
        import numpy as np
        from matplotlib.backends.backend_agg import (
            FigureCanvasAgg,  # no pyplot: leaves the global backend alone
        )
        from matplotlib.colors import to_rgba
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        origin, last = self.span()
        lo = origin if start is None else start
        hi = last if end is None else end
        lanes = self.lanes()
        env_lanes = [lane for lane in lanes if _ENV.match(lane)]
        shown_envs = set(env_lanes[:max_envs])
        lanes = [lane for lane in lanes if not _ENV.match(lane) or lane in shown_envs]
        row = {lane: k for k, lane in enumerate(lanes)}

        x0, x1 = lo - origin, max(hi - origin, lo - origin + 1e-9)
        per_lane: dict[str, dict[str, list[tuple[float, float]]]] = {}
        names: list[str] = []
        for lane, name, t0, t1, _ in self.events:
            if lane not in row or min(t1, hi) <= max(t0, lo):
                continue
            if name not in names:
                names.append(name)
            per_lane.setdefault(lane, {}).setdefault(name, []).append((t0 - origin, t1 - origin))
        ordered = [n for n in COLOURS if n in names] + [n for n in names if n not in COLOURS]
        spare = iter(["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#ff7f0e"] * 10)
        colour = {n: COLOURS.get(n) or next(spare) for n in ordered}

        fig = Figure(figsize=(14.0, 1.6 + 0.28 * max(len(lanes), 1)), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)  # generator on top
        ax.set_xlim(x0, x1)
        ax.set_xlabel("seconds from the first event")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        hidden = len(env_lanes) - len(shown_envs)
        full_title = title + (f"  ({hidden} more env lanes not shown)" if hidden else "")
        if full_title:
            ax.set_title(full_title)
        handles = [Patch(facecolor=colour[n], label=LABELS.get(n, n)) for n in ordered]
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        fig.tight_layout()

        bins = max(int(ax.get_window_extent().width), 50)  # one column per pixel of the plot area
        edges = np.linspace(x0, x1, bins + 1)
        for lane, by_name in per_lane.items():
            lane_names = list(by_name)
            cover = np.zeros((len(lane_names), bins))
            for k, name in enumerate(lane_names):
                iv = np.asarray(by_name[name], float)
                a, b = np.clip(iv[:, 0], x0, x1), np.clip(iv[:, 1], x0, x1)
                cover[k] = np.diff(_covered_up_to(edges, a, np.maximum(a, b)))
            cover /= edges[1] - edges[0]
            total = cover.sum(0)
            # shade in tenths, at least 0.4 so a lone short event still shows
            shade = np.where(total > 1e-3, np.round(np.clip(total, 0.4, 1.0) * 10), 0).astype(int)
            key = np.where(shade > 0, cover.argmax(0) * 16 + shade, -1)
            change = np.flatnonzero(np.diff(key)) + 1
            run_starts = np.concatenate(([0], change)).tolist()
            run_ends = np.concatenate((change, [bins])).tolist()
            xr, colours = [], []
            for s, e in zip(run_starts, run_ends):
                if key[s] >= 0:
                    xr.append((edges[s], edges[e] - edges[s]))
                    colours.append(to_rgba(colour[lane_names[key[s] // 16]], shade[s] / 10))
            if xr:
                ax.broken_barh(xr, (row[lane] - 0.4, 0.8), facecolors=colours, edgecolor="none", antialiased=False)
        fig.savefig(path, format="png")


def _covered_up_to(x, a, b):
    """For each x: the total length of the intervals ``[a_i, b_i]`` that lies below x."""
    import numpy as np

    def below(points):
        p = np.sort(points)
        prefix = np.concatenate(([0.0], np.cumsum(p)))
        k = np.searchsorted(p, x, "left")
        return k * x - prefix[k]

    return below(a) - below(b)
