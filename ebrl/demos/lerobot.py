"""Demonstrations in the LeRobot dataset format, written and read from a local directory.

The format robot-learning tools read today (LeRobot's ``LeRobotDataset``): frames in parquet
files, cameras as MP4 videos (or images inside the parquet, or PNG files next to it), and
``meta/info.json`` naming every feature with its dtype and shape. EBRL writes codebase version
``v3.0`` (many episodes per file; ``meta/episodes/`` says where each one starts) and reads
``v3.0`` and ``v2.x`` (one parquet and one video per episode). The files are written and read
here with pyarrow and imageio (the ``lerobot`` package pins ``torch<2.11``); what EBRL writes
opens in LeRobot's own ``LeRobotDataset`` (checked with ``lerobot-dataset`` 0.4.4 in
``tests/test_lerobot_interop.py``): each frame's ``task`` is its episode's instruction,
cameras decode, and ``meta/stats.json`` holds the statistics LeRobot computes.

Features EBRL writes, per frame: ``observation.<entry>`` for each vector entry of the env's
observation (``observation.state`` for a plain Box; nested dicts join their keys with dots),
``observation.images.<entry>`` for each camera (video), ``action``, ``next.reward``,
``next.done``, ``next.success`` (the step's ``is_success``/``success``), and LeRobot's own
``timestamp``, ``frame_index``, ``episode_index``, ``index`` and ``task_index`` (the episode's
instruction, in ``meta/tasks.parquet``: LeRobot's layout, the task string as the table's pandas
index beside a ``task_index`` column).

Statistics (``meta/stats.json``, and each episode's under ``stats/`` in ``meta/episodes/``) are
LeRobot's: per feature ``min``, ``max``, ``mean``, ``std``, ``count`` and the quantiles ``q01``,
``q10``, ``q50``, ``q90``, ``q99`` (from a 5000-bin histogram), per episode and then aggregated
over episodes weighted by their counts (quantiles too); a vector's over its last axis, a
camera's per channel in ``[0, 1]`` with shape ``[C, 1, 1]`` over a sample of each episode's
frames (LeRobot's: all of an episode under 100 frames; sides of 300 pixels or more strided to
about 150). One difference: LeRobot 0.4.4 squares the ``uint8`` pixels without widening them,
so its camera ``std`` comes out near 0; EBRL writes the true one.

    >>> import tempfile, numpy as np
    >>> from ebrl.demos.lerobot import LeRobotWriter, read_lerobot
    >>> with tempfile.TemporaryDirectory() as d:
    ...     w = LeRobotWriter(d, fps=10, features={"observation.state": ((3,), "float32"), "action": ((2,), "float32")})
    ...     for t in range(4):
    ...         w.add_frame({"observation.state": np.full(3, t, np.float32), "action": np.zeros(2, np.float32),
    ...                      "next.reward": 1.0, "next.done": t == 3, "next.success": t == 3}, task="reach the red cube")
    ...     w.end_episode()
    ...     root = w.close()
    ...     demos = read_lerobot(root)
    >>> demos.num_episodes, len(demos), demos.tasks, demos.frames["observation.state"][:, 0].tolist()
    (1, 4, ['reach the red cube'], [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-000/file-000.parquet"
# what LeRobot adds to every frame; the rest are the dataset's own features
INDEX_FEATURES = {"timestamp": ((1,), "float32"), "frame_index": ((1,), "int64"), "episode_index": ((1,), "int64"),
                  "index": ((1,), "int64"), "task_index": ((1,), "int64")}
STEP_FEATURES = {"next.reward": ((1,), "float32"), "next.done": ((1,), "bool"), "next.success": ((1,), "bool")}


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("LeRobot datasets need pyarrow: pip install 'ebrl[demos]'") from None
    return pa, pq


@dataclass
class Demos:
    """A dataset in memory: every frame's features as arrays ``[N, *shape]`` (images ``uint8
    [N, H, W, C]``), episodes as ``[start, end)`` frame ranges in order, and the tasks."""

    frames: dict[str, np.ndarray]
    episodes: list[tuple[int, int]]
    tasks: list[str]
    fps: float
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.frames["action"]) if "action" in self.frames else 0

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def image_keys(self) -> list[str]:
        return [k for k, f in self.info.get("features", {}).items() if f.get("dtype") in ("video", "image")]

    def episode_of(self) -> np.ndarray:
        """Each frame's position in :attr:`episodes` (``[N]``)."""
        out = np.empty(len(self), np.int64)
        for i, (lo, hi) in enumerate(self.episodes):
            out[lo:hi] = i
        return out

    def select(self, episodes: list[int]) -> Demos:
        """The dataset of these episodes (positions in :attr:`episodes`), frames re-indexed."""
        rows = np.concatenate([np.arange(*self.episodes[i]) for i in episodes]) if episodes else np.zeros(0, np.int64)
        spans, at = [], 0
        for i in episodes:
            n = self.episodes[i][1] - self.episodes[i][0]
            spans.append((at, at + n))
            at += n
        return Demos({k: v[rows] for k, v in self.frames.items()}, spans, self.tasks, self.fps, self.info)


# ---------------------------------------------------------------------------------------- writing

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's: stats keys q01, q10, q50, q90, q99
QUANTILE_BINS = 5000


class LeRobotWriter:
    """Episodes frame by frame into a ``v3.0`` dataset at ``root`` (created; must be empty).

    ``features``: name -> ``(shape, dtype)`` for the dataset's own entries; ``dtype`` ``"video"``
    for cameras (``uint8 [H, W, 3]`` frames, one MP4 per camera, every episode in it one after
    another), ``"image"`` to keep PNGs inside the parquet instead. ``next.reward``,
    ``next.done`` and ``next.success`` are always there. :meth:`close` writes the files.
    """

    def __init__(self, root: str | Path, *, fps: float, features: dict[str, tuple[tuple[int, ...], str]],
                 robot_type: str | None = None, extra: dict[str, Any] | None = None):
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(f"{self.root} is not empty: a dataset is written into a new directory")
        for name, (shape, dtype) in features.items():
            if dtype in ("video", "image") and (len(shape) != 3 or shape[-1] not in (1, 3)):
                raise ValueError(f"feature {name!r}: a camera is uint8 [H, W, 3] (or [H, W, 1]), not {tuple(shape)}")
        # LeRobot writes an int; a whole rate stays one so its readers see the same
        self.fps = int(fps) if float(fps).is_integer() else float(fps)
        self.features = {**{k: (tuple(s), d) for k, (s, d) in features.items()}, **STEP_FEATURES}
        self.robot_type = robot_type
        self.extra = extra or {}  # written under info.json's "ebrl" key (e.g. the env it came from)
        self.tasks: dict[str, int] = {}
        self._columns: dict[str, list] = {k: [] for k in self.features}
        self._index: dict[str, list] = {k: [] for k in INDEX_FEATURES}
        self._episodes: list[dict[str, Any]] = []
        self._stats: list[dict[str, dict[str, np.ndarray]]] = []  # each episode's
        self._frames_in_episode = 0
        self._episode_tasks: list[str] = []
        self._videos = {k: None for k, (_, d) in self.features.items() if d == "video"}
        # this episode's frames of each camera, [C, H, W] as LeRobot's statistics read them
        self._camera_frames: dict[str, list[np.ndarray]] = {
            k: [] for k, (_, d) in self.features.items() if d in ("video", "image")}

    @property
    def frames(self) -> int:
        return len(self._index["index"])

    def add_frame(self, values: dict[str, Any], *, task: str = "") -> None:
        """One frame: a value for every feature (``next.*`` default to 0/False)."""
        missing = [k for k in self.features if k not in values and k not in STEP_FEATURES]
        if missing:
            raise KeyError(f"frame without {missing}; features: {list(self.features)}")
        task_index = self.tasks.setdefault(task, len(self.tasks))
        if task not in self._episode_tasks:
            self._episode_tasks.append(task)
        t = self._frames_in_episode
        for k, (shape, dtype) in self.features.items():
            v = values.get(k, 0)
            if dtype in ("video", "image"):
                img = np.asarray(v, np.uint8)
                if dtype == "video":
                    self._video(k, shape).append_data(_hwc3(img))
                else:
                    self._columns[k].append({"bytes": _png(img), "path": None})
                self._camera_frames[k].append(_stats_view(img))
            else:
                self._columns[k].append(np.asarray(v, dtype).reshape(shape))
        for k, v in (("timestamp", t / self.fps), ("frame_index", t), ("episode_index", len(self._episodes)),
                     ("index", self.frames), ("task_index", task_index)):
            self._index[k].append(v)
        self._frames_in_episode += 1

    def end_episode(self) -> None:
        n = self._frames_in_episode
        if n == 0:
            raise ValueError("end_episode() with no frames since the last one")
        start = self.frames - n
        video_start = start / self.fps
        ep = {"episode_index": len(self._episodes), "tasks": list(self._episode_tasks), "length": n,
              "data/chunk_index": 0, "data/file_index": 0, "dataset_from_index": start, "dataset_to_index": start + n}
        for k in self._videos:
            ep.update({f"videos/{k}/chunk_index": 0, f"videos/{k}/file_index": 0,
                       f"videos/{k}/from_timestamp": video_start, f"videos/{k}/to_timestamp": video_start + n / self.fps})
        stats = self._episode_stats(start, n)
        for k, feature in stats.items():
            ep.update({f"stats/{k}/{name}": value.tolist() for name, value in feature.items()})
        ep.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        self._episodes.append(ep)
        self._stats.append(stats)
        self._frames_in_episode, self._episode_tasks = 0, []

    def close(self) -> Path:
        """Write the parquet files and metadata; returns the root."""
        pa, pq = _pa()
        if self._frames_in_episode:
            self.end_episode()
        for writer in self._videos.values():
            if writer is not None:
                writer.close()
        data = self.root / DATA_PATH.format(chunk_index=0, file_index=0)
        data.parent.mkdir(parents=True, exist_ok=True)
        columns = {}
        for k, (shape, dtype) in self.features.items():
            if dtype == "video":
                continue
            if dtype == "image":
                columns[k] = pa.array(self._columns[k], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
            else:
                columns[k] = _arrow_column(pa, np.asarray(self._columns[k], dtype).reshape(self.frames, *shape), shape)
        for k, (_, dtype) in INDEX_FEATURES.items():
            columns[k] = pa.array(np.asarray(self._index[k], dtype))
        pq.write_table(pa.table(columns), data)
        episodes = self.root / EPISODES_PATH
        episodes.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episodes), episodes)
        _write_tasks(pa, pq, [t for t, _ in sorted(self.tasks.items(), key=lambda kv: kv[1])],
                     self.root / "meta" / "tasks.parquet")
        stats = {k: {name: v.tolist() for name, v in feature.items()} for k, feature in _aggregate_stats(self._stats).items()}
        (self.root / "meta" / "stats.json").write_text(json.dumps(stats, indent=2))
        (self.root / "meta" / "info.json").write_text(json.dumps(self._info(), indent=2))
        return self.root

    # ---- helpers

    def _video(self, key: str, shape: tuple[int, ...]):
        if self._videos[key] is None:
            import imageio.v2 as imageio

            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            # macro_block_size 1: frames keep their size (yuv420p needs even sides: checked by ffmpeg);
            # a key frame every 2 frames, as LeRobot encodes, so that reading one frame decodes at most two
            self._videos[key] = imageio.get_writer(path, fps=self.fps, codec="libx264", quality=9,
                                                   pixelformat="yuv420p", macro_block_size=1,
                                                   ffmpeg_params=["-g", "2"])
        return self._videos[key]

    def _episode_stats(self, start: int, n: int) -> dict[str, dict[str, np.ndarray]]:
        """LeRobot's statistics of the episode's frames ``[start, start + n)`` (``compute_episode_stats``)."""
        out = {}
        for k, (shape, dtype) in self.features.items():
            if dtype in ("video", "image"):
                frames = self._camera_frames[k]
                picked = np.stack([frames[i] for i in _sample_indices(len(frames))])
                c = picked.shape[1]
                stats = _feature_stats(picked.transpose(0, 2, 3, 1).reshape(-1, c), len(picked))
                out[k] = {name: v if name == "count" else v.reshape(c, 1, 1) / 255.0 for name, v in stats.items()}
                frames.clear()
            elif dtype != "string":
                x = np.asarray(self._columns[k][start:start + n], dtype)
                out[k] = _feature_stats(x.reshape(-1, shape[-1] if shape else 1), n)
        for k, (_, dtype) in INDEX_FEATURES.items():  # LeRobot's timestamps are float64 until the parquet
            values = np.asarray(self._index[k][start:start + n], np.float64 if k == "timestamp" else dtype)
            out[k] = _feature_stats(values.reshape(-1, 1), n)
        return out

    def _features_info(self) -> dict[str, Any]:
        out = {}
        for k, (shape, dtype) in {**self.features, **INDEX_FEATURES}.items():
            entry: dict[str, Any] = {"dtype": dtype, "shape": list(shape), "names": None}
            if dtype in ("video", "image"):
                entry["names"] = ["height", "width", "channels"]
            if dtype == "video":
                entry["info"] = {"video.height": shape[0], "video.width": shape[1], "video.codec": "h264",
                                 "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": self.fps,
                                 "video.channels": 3, "has_audio": False}
            out[k] = entry
        return out

    def _info(self) -> dict[str, Any]:
        return {"codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
                "total_episodes": len(self._episodes), "total_frames": self.frames, "total_tasks": len(self.tasks),
                "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 200, "fps": self.fps,
                "splits": {"train": f"0:{len(self._episodes)}"}, "data_path": DATA_PATH,
                "video_path": VIDEO_PATH if self._videos else None, "features": self._features_info(),
                "ebrl": self.extra}


def _write_tasks(pa, pq, tasks: list[str], path: Path) -> None:
    """``meta/tasks.parquet`` as LeRobot writes it (``pandas.DataFrame({"task_index": ...},
    index=tasks).to_parquet``): the task string is the pandas index, so LeRobot's
    ``tasks.iloc[task_index].name`` is the instruction. Written without pandas."""
    pandas_meta = {"index_columns": ["__index_level_0__"],
                   "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                                       "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                                "numpy_type": "int64", "metadata": None},
                               {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": None}],
                   "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__},
                   "pandas_version": "2.2.0"}
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      "__index_level_0__": pa.array(tasks, pa.string())})
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def _sample_indices(n: int) -> list[int]:
    """The frames of an ``n``-frame episode LeRobot's image statistics read (``sample_indices``)."""
    samples = max(min(n, 100), min(int(n ** 0.75), 10_000))
    return np.round(np.linspace(0, n - 1, samples)).astype(int).tolist()


def _stats_view(img: np.ndarray) -> np.ndarray:
    """A camera frame as LeRobot's statistics see it: RGB, ``[C, H, W]``, sides of 300 pixels or
    more strided to about 150 (``auto_downsample_height_width``)."""
    chw = np.moveaxis(_hwc3(img), -1, 0)
    h, w = chw.shape[1:]
    if max(h, w) >= 300:
        step = int(w / 150) if w > h else int(h / 150)
        chw = chw[:, ::step, ::step]
    return np.ascontiguousarray(chw)


def _feature_stats(x: np.ndarray, count: int) -> dict[str, np.ndarray]:
    """LeRobot's ``get_feature_stats`` of ``x [rows, d]`` (``count`` frames), over the rows:
    min and max in ``x``'s dtype, the rest float64; quantiles from a histogram of
    ``QUANTILE_BINS`` bins from min to max, interpolated inside a bin."""
    keys = [f"q{int(q * 100):02d}" for q in QUANTILES]
    rows = len(x)
    if x.dtype == np.uint8 and rows >= 2:  # pixels: everything from each channel's 256 value counts (faster)
        counts = np.stack([np.bincount(x[:, j], minlength=256) for j in range(x.shape[1])]).astype(np.float64)
        values = np.arange(256.0)
        lo = np.array([np.flatnonzero(c)[0] for c in counts], np.uint8)
        hi = np.array([np.flatnonzero(c)[-1] for c in counts], np.uint8)
        mean, squares = counts @ values / rows, counts @ values ** 2 / rows

        def histogram(j: int, edges: np.ndarray) -> np.ndarray:
            return np.histogram(values, bins=edges, weights=counts[j])[0]
    else:
        f = x.astype(np.float64)
        lo, hi, mean = x.min(0), x.max(0), f.mean(0)
        if rows < 2:
            return {"min": lo, "max": hi, "mean": mean, "std": f.std(0), "count": np.array([count]),
                    **{k: mean.copy() for k in keys}}
        squares = (f ** 2).mean(0)

        def histogram(j: int, edges: np.ndarray) -> np.ndarray:
            return np.histogram(f[:, j], bins=edges)[0]
    stats = {"min": lo, "max": hi, "mean": mean, "std": np.sqrt(np.maximum(0.0, squares - mean ** 2)),
             "count": np.array([count])}
    quantiles = np.empty((len(QUANTILES), len(mean)))
    for j in range(len(mean)):
        edges = np.linspace(float(lo[j]) - 1e-10, float(hi[j]) + 1e-10, QUANTILE_BINS + 1)
        cum = np.cumsum(histogram(j, edges))
        for i, q in enumerate(QUANTILES):
            target = q * rows
            b = int(np.searchsorted(cum, target))
            if b == 0 or b >= len(cum):
                quantiles[i, j] = edges[0] if b == 0 else edges[-1]
                continue
            inside = cum[b] - cum[b - 1]
            frac = (target - cum[b - 1]) / inside if inside else 0.0
            quantiles[i, j] = edges[b] + frac * (edges[b + 1] - edges[b])
    stats.update(zip(keys, quantiles))
    return stats


def _aggregate_stats(episodes: list[dict[str, dict[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """LeRobot's ``aggregate_stats``: means, variances and quantiles weighted by each episode's count."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in dict.fromkeys(k for ep in episodes for k in ep):
        parts = [ep[key] for ep in episodes if key in ep]
        counts = np.stack([p["count"] for p in parts]).astype(np.float64)
        total = counts.sum(0)
        means = np.stack([p["mean"] for p in parts])
        w = counts.reshape(-1, *[1] * (means.ndim - 1))
        mean = (means * w).sum(0) / total
        var = ((np.stack([p["std"] for p in parts]) ** 2 + (means - mean) ** 2) * w).sum(0) / total
        agg = {"min": np.min(np.stack([p["min"] for p in parts]), 0), "max": np.max(np.stack([p["max"] for p in parts]), 0),
               "mean": mean, "std": np.sqrt(var), "count": total.astype(np.int64)}
        for q in (k for k in parts[0] if k[0] == "q" and k[1:].isdigit()):
            agg[q] = (np.stack([p[q] for p in parts]) * w).sum(0) / total
        out[key] = agg
    return out


def _arrow_column(pa, x: np.ndarray, shape: tuple[int, ...]):
    """A scalar feature as a plain column, a vector as a list column, an array of more axes as
    nested lists (how LeRobot stores one: the storage of ``datasets``' ``Array2D`` and up)."""
    if tuple(shape) in ((), (1,)):
        return pa.array(x.reshape(-1))
    column = pa.array(x.reshape(-1))
    for size in reversed((len(x), *shape)[1:]):
        rows = len(column) // size
        column = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * size + 1, size, dtype=np.int32)), column)
    return column


def _hwc3(img: np.ndarray) -> np.ndarray:
    return np.repeat(img, 3, axis=-1) if img.shape[-1] == 1 else img


def _png(img: np.ndarray) -> bytes:
    import imageio.v2 as imageio

    buf = io.BytesIO()
    imageio.imwrite(buf, img[..., 0] if img.shape[-1] == 1 else img, format="png")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------- reading


def read_lerobot(root: str | Path) -> Demos:
    """Load a LeRobot dataset (codebase ``v2.x`` or ``v3.0``) from the local directory ``root``.

    Cameras come back as ``uint8 [N, H, W, C]`` whether stored as video, as PNG bytes in the
    parquet, or as image files the parquet points at (relative to ``root``).
    """
    pa, pq = _pa()
    root = Path(root)
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{root} is not a LeRobot dataset: no meta/info.json")
    info = json.loads(info_path.read_text())
    version = str(info.get("codebase_version", "v2.1"))
    features = info.get("features", {})
    files = sorted((root / "data").glob("*/*.parquet"))
    if not files:
        raise FileNotFoundError(f"{root}/data holds no parquet files")
    table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    if "index" in table.column_names:
        table = table.sort_by("index")
    elif "episode_index" in table.column_names:
        table = table.sort_by([("episode_index", "ascending"), ("frame_index", "ascending")])
    frames: dict[str, np.ndarray] = {}
    for name, feat in features.items():
        dtype, shape = feat.get("dtype"), tuple(feat.get("shape", ()))
        if dtype == "video" or name not in table.column_names:
            continue
        col = table.column(name).combine_chunks()
        if dtype == "image":
            frames[name] = np.stack([_decode_image(v, root) for v in col.to_pylist()]) if len(col) else np.zeros(0)
        elif dtype == "string":
            frames[name] = np.asarray(col.to_pylist(), object)
        else:
            frames[name] = _numpy_column(col, dtype, shape)
    episode = frames.get("episode_index", np.zeros(len(table), np.int64)).reshape(-1)
    bounds = np.flatnonzero(np.diff(episode)) + 1
    starts = np.concatenate([[0], bounds]).astype(int) if len(episode) else np.zeros(0, int)
    ends = np.concatenate([bounds, [len(episode)]]).astype(int) if len(episode) else np.zeros(0, int)
    spans = list(zip(starts.tolist(), ends.tolist()))
    ids = [int(episode[s]) for s in starts]
    tasks = _read_tasks(root, pq)
    videos = [k for k, f in features.items() if f.get("dtype") == "video"]
    if videos:
        meta = _episode_meta(root, version, pq)
        for key in videos:
            frames[key] = _read_videos(root, info, version, key, ids, spans, meta)
    return Demos(frames, spans, tasks, float(info.get("fps", 1.0)), info)


def _numpy_column(col, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    np_dtype = {"bool": np.bool_}.get(dtype, dtype)
    if hasattr(col.type, "storage_type"):  # an extension type (datasets' Array2D... as LeRobot writes them)
        col = col.storage
    if hasattr(col.type, "value_type"):  # a list column: one vector (or nested lists: one array) per frame
        values = col
        while hasattr(values.type, "value_type"):
            values = values.flatten()
        values = values.to_numpy(zero_copy_only=False)
        return values.astype(np_dtype).reshape(len(col), *[s for s in shape if s is not None])
    x = col.to_numpy(zero_copy_only=False).astype(np_dtype)
    return x if tuple(shape) in ((), (1,)) else x.reshape(len(col), *shape)


def _decode_image(value: Any, root: Path) -> np.ndarray:
    import imageio.v2 as imageio

    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    else:
        data, path = (value, None) if isinstance(value, bytes) else (None, value)
    if data is not None:
        img = imageio.imread(io.BytesIO(data))
    elif path:
        img = imageio.imread(root / path if not Path(path).is_absolute() else path)
    else:
        raise ValueError("an image entry with neither bytes nor a path")
    img = np.asarray(img, np.uint8)
    return img[..., None] if img.ndim == 2 else img[..., :3]


def _read_tasks(root: Path, pq) -> list[str]:
    meta = root / "meta"
    if (meta / "tasks.parquet").is_file():
        # LeRobot's layout keeps the task string as the pandas index (``__index_level_0__``, or
        # the index's name) beside ``task_index``; a ``task`` column beside it reads too
        table = pq.read_table(meta / "tasks.parquet")
        pandas_meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
        names = [c for c in pandas_meta.get("index_columns", []) if isinstance(c, str)] + ["task"]
        name = next((c for c in names if c in table.column_names),
                    next((c for c in table.column_names if c != "task_index"), None))
        if name is None:
            raise ValueError(f"{meta / 'tasks.parquet'} holds no task strings (columns {table.column_names})")
        named = zip(table.column("task_index").to_pylist(), table.column(name).to_pylist())
        return [str(task) for _, task in sorted(named)]
    if (meta / "tasks.jsonl").is_file():
        rows = [json.loads(line) for line in (meta / "tasks.jsonl").read_text().splitlines() if line.strip()]
        return [str(r["task"]) for r in sorted(rows, key=lambda r: r["task_index"])]
    return []


def _episode_meta(root: Path, version: str, pq) -> dict[int, dict[str, Any]]:
    """v3.0: each episode's row of ``meta/episodes/`` (where its frames sit in each video)."""
    if not version.startswith("v3"):
        return {}
    rows = []
    for f in sorted((root / "meta" / "episodes").glob("*/*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return {int(r["episode_index"]): r for r in rows}


def _read_videos(root: Path, info: dict, version: str, key: str, ids: list[int], spans, meta) -> np.ndarray:
    import imageio.v2 as imageio

    template = info.get("video_path") or ""
    chunk_size = int(info.get("chunks_size", 1000))
    fps = float(info.get("fps", 1.0))
    out: list[np.ndarray] = []
    decoded: dict[Path, list[np.ndarray]] = {}
    for ep, (lo, hi) in zip(ids, spans):
        if version.startswith("v3"):
            m = meta[ep]
            path = root / template.format(video_key=key, chunk_index=int(m[f"videos/{key}/chunk_index"]),
                                          file_index=int(m[f"videos/{key}/file_index"]))
            first = int(round(float(m[f"videos/{key}/from_timestamp"]) * fps))
        else:
            path = root / template.format(video_key=key, episode_chunk=ep // chunk_size, episode_index=ep)
            first = 0
        if path not in decoded:
            with imageio.get_reader(path) as reader:
                decoded[path] = [np.asarray(f, np.uint8) for f in reader]
        got = decoded[path][first:first + (hi - lo)]
        if len(got) != hi - lo:
            raise ValueError(f"{path}: episode {ep} needs {hi - lo} frames from frame {first}, the video has "
                             f"{len(decoded[path])}")
        out.extend(got)
    return np.stack(out) if out else np.zeros((0,), np.uint8)
