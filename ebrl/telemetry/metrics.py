"""The per-update metrics sink: one row per update, kept in memory and, with a log directory,
appended to ``history.jsonl`` and written as TensorBoard scalars while the run goes.

The learner hands every row to one :class:`MetricsLog`. Under ``RunConfig.log_dir`` it
writes, per update, one JSON line (flushed at once, so ``tail -f`` works) and one
``add_scalar`` per number, with env steps as TensorBoard's ``global_step``; at the end
``result.json``. Without a log directory it writes nothing and creates no SummaryWriter.
Evaluations during training (:meth:`MetricsLog.record_eval`) go to ``eval.jsonl`` and
``eval/*``. With ``wandb`` (``run.wandb=true``) every scalar is mirrored to a Weights & Biases
run in ``log_dir/wandb/`` under the same tag, against ``env_steps``.

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from ebrl.telemetry.metrics import MetricsLog, read_history, tag
    >>> tmp = tempfile.TemporaryDirectory()
    >>> d = Path(tmp.name)
    >>> log = MetricsLog(d)
    >>> log.open()
    >>> log.record({"update": 1, "env_steps": 64, "mean_return": 2.5, "policy_loss": 0.1})
    >>> log.close()
    >>> read_history(d / "history.jsonl")
    [{'update': 1, 'env_steps': 64, 'mean_return': 2.5, 'policy_loss': 0.1}]
    >>> tag("policy_loss"), tag("mean_return"), tag("cpu_util_mean", system=True)
    ('losses/policy_loss', 'charts/mean_return', 'system/cpu_util_mean')
    >>> tmp.cleanup()
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ebrl.telemetry.system import SystemSampler

HISTORY = "history.jsonl"
EVAL = "eval.jsonl"
RESULT = "result.json"

# TensorBoard tags of the runtime's own row keys, grouped as CleanRL does; whatever else the
# algorithm returns goes under "losses/", the system sampler's keys under "system/".
TAGS = {
    "mean_return": "charts/mean_return",
    "episode_length": "charts/episode_length",
    "success_once": "charts/success_rate",
    "success_at_end": "charts/success_at_end",
    "episodes": "charts/episodes",
    "env_steps_per_s": "perf/env_steps_per_s",
    "env_steps_per_s_overall": "perf/env_steps_per_s_overall",
    "update_s": "perf/update_s",
    "gen_batch_mean": "perf/gen_batch_mean",
    "publish_bytes": "perf/publish_bytes",
    "publish_s": "perf/publish_s",
    "lag_mean": "lag/mean",
    "lag_max": "lag/max",
    "trained": "counters/trained",
    "dropped": "counters/dropped",
    "env_failures": "counters/env_failures",
}
AXES = ("update", "env_steps", "time")  # the row's coordinates, not plotted as scalars


def tag(key: str, system: bool = False) -> str:
    """The TensorBoard tag of a row key."""
    if system:
        return f"system/{key}"
    return TAGS.get(key) or f"losses/{key}"


class MetricsLog:
    """Receives one row (a flat dict of numbers) per update; see the module docstring.

    ``system``, a :class:`~ebrl.telemetry.system.SystemSampler`, adds CPU/GPU utilisation
    to each row. :meth:`open` before the first row, :meth:`close` always (it joins the
    SummaryWriter's thread); both are idempotent.
    """

    def __init__(self, log_dir: str | Path | None = None, system: "SystemSampler | None" = None,
                 *, flush_secs: float = 5.0, wandb: dict[str, Any] | None = None):
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.system = system
        self.rows: list[dict[str, Any]] = []
        self.eval_rows: list[dict[str, Any]] = []
        self.flush_secs = flush_secs  # how stale TensorBoard may be; the JSON lines are never stale
        self._jsonl: IO[str] | None = None
        self._tb = None  # torch.utils.tensorboard.SummaryWriter
        self.wandb_options = wandb  # {"project": ..., "config": ...}: mirror to W&B; None: don't
        self._wandb = None  # the wandb run

    def open(self) -> None:
        if self.log_dir is None or self._jsonl is not None:
            return
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when writing

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.log_dir / HISTORY, "w", encoding="utf-8")
        try:
            # a deep queue: add_scalar must not block the event loop while the writer thread catches up
            self._tb = SummaryWriter(str(self.log_dir), max_queue=1000, flush_secs=self.flush_secs)
        except BaseException:
            self._jsonl.close()
            self._jsonl = None
            raise
        if self.wandb_options is not None:
            try:
                self._wandb = start_wandb(self.log_dir, **self.wandb_options)
            except BaseException:
                self.close()
                raise

    def record(self, row: dict[str, Any]) -> None:
        """Keep ``row`` (with the system sample added) and write it out when a log directory is open."""
        system = self.system.sample() if self.system is not None else {}
        row.update(system)
        self.rows.append(row)
        if self._jsonl is not None:
            # strict JSON for other tools: NaN and inf (no episode finished yet, ...) become null
            self._jsonl.write(json.dumps(_strict(row), allow_nan=False) + "\n")
            self._jsonl.flush()  # one line, whole, per update: readers never wait for the run's end
        step = int(row.get("env_steps", len(self.rows)))
        self.record_scalars({tag(key, system=key in system): float(value) for key, value in row.items()
                             if key not in AXES and _is_number(value)}, step)

    def record_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Scalars by their full tag (``sft/train_loss``), at ``step``: TensorBoard, and W&B when mirrored."""
        if self._tb is not None:
            for key, value in scalars.items():
                if _is_number(value):
                    self._tb.add_scalar(key, float(value), global_step=step)
        if self._wandb is not None:
            self._wandb.log({**{k: float(v) for k, v in scalars.items() if _is_number(v)}, "env_steps": step})

    def record_video(self, tag_name: str, frames: list, step: int, fps: float = 20.0) -> None:
        """A short animated GIF in TensorBoard's images (what ``add_video`` makes, without moviepy)."""
        if self._tb is None or not frames:
            return
        import io

        import imageio.v2 as imageio
        from tensorboard.compat.proto.summary_pb2 import Summary

        keep = frames[:: max(1, len(frames) // 100)]  # at most ~100 frames: a short clip
        buf = io.BytesIO()
        imageio.mimsave(buf, keep, format="gif", duration=1000.0 / fps * (len(frames) / len(keep)), loop=0)
        h, w = keep[0].shape[:2]
        image = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=buf.getvalue())
        self._tb._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag_name, image=image)]), step)

    def record_eval(self, row: dict[str, Any], video: str | None = None) -> None:
        """One evaluation during training (``row["env_steps"]``: where the weights were): a line of
        ``eval.jsonl`` and ``eval/<key>`` scalars."""
        self.eval_rows.append({**row, "video": video})
        if self.log_dir is not None and self._jsonl is not None:
            with open(self.log_dir / EVAL, "a", encoding="utf-8") as f:
                f.write(json.dumps(_strict({**row, "video": video}), allow_nan=False) + "\n")
        self.record_scalars({f"eval/{k}": v for k, v in row.items() if k not in AXES}, int(row["env_steps"]))

    def write_result(self, result: Any) -> None:
        """``result.json``: the finished run's :class:`~ebrl.runtime.stats.RunResult`."""
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(result), indent=2, default=str)
        (self.log_dir / RESULT).write_text(text, encoding="utf-8")

    def close(self) -> None:
        """Flush and close the files; the SummaryWriter's thread is joined before this returns."""
        tb, self._tb = self._tb, None
        jsonl, self._jsonl = self._jsonl, None
        run, self._wandb = self._wandb, None
        try:
            if tb is not None:
                tb.close()  # flushes, stops and joins its writer thread
            if run is not None:
                import wandb

                run.finish()
                wandb.teardown()  # its service process and threads: nothing outlives run()
        finally:
            if jsonl is not None:
                jsonl.close()
            if self.system is not None:
                self.system.close()


def start_wandb(log_dir: Path, *, project: str, config: dict[str, Any] | None = None):
    """A wandb run writing under ``log_dir/wandb``: online where wandb has credentials, else offline."""
    import os

    try:
        import wandb
    except ImportError:
        raise ImportError("run.wandb=true needs wandb: pip install 'ebrl[wandb]'") from None
    mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_credentials() else "offline")
    run = wandb.init(project=project, dir=str(log_dir), name=log_dir.name, mode=mode,
                     config=json.loads(json.dumps(config or {}, default=str)),
                     settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
    run.define_metric("env_steps")
    run.define_metric("*", step_metric="env_steps")
    return run


def _wandb_credentials() -> bool:
    import os

    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def _strict(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``history.jsonl``, also while a run is still appending to it: a last line
    without its newline is a row being written, and is left out."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    lines.pop()  # what follows the last newline: "" when the file is whole, else a partial row
    return list(_parse(path, lines))


def _parse(path: Path, lines: Iterable[str]):
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not a JSON row ({exc.msg})") from None
