"""Demonstrations in the LeRobot dataset format, written and read from a local directory.

The format robot-learning tools read today (LeRobot's ``LeRobotDataset``): frames in parquet
files, cameras as MP4 videos (or images inside the parquet, or PNG files next to it), and
``meta/info.json`` naming every feature with its dtype and shape. EBRL writes codebase version
``v3.0`` (many episodes per file; ``meta/episodes/`` says where each one starts) and reads
``v3.0`` and ``v2.x`` (one parquet and one video per episode). The ``lerobot`` package itself
pins ``torch<2.11``, so the files are written and read here with pyarrow and imageio.

Features EBRL writes, per frame: ``observation.<entry>`` for each vector entry of the env's
observation (``observation.state`` for a plain Box; nested dicts join their keys with dots),
``observation.images.<entry>`` for each camera (video), ``action``, ``next.reward``,
``next.done``, ``next.success`` (the step's ``is_success``/``success``), and LeRobot's own
``timestamp``, ``frame_index``, ``episode_index``, ``index`` and ``task_index`` (the episode's
instruction, in ``meta/tasks.parquet``).

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
        self.fps = float(fps)
        self.features = {**{k: (tuple(s), d) for k, (s, d) in features.items()}, **STEP_FEATURES}
        self.robot_type = robot_type
        self.extra = extra or {}  # written under info.json's "ebrl" key (e.g. the env it came from)
        self.tasks: dict[str, int] = {}
        self._columns: dict[str, list] = {k: [] for k in self.features}
        self._index: dict[str, list] = {k: [] for k in INDEX_FEATURES}
        self._episodes: list[dict[str, Any]] = []
        self._frames_in_episode = 0
        self._task: int | None = None
        self._videos = {k: None for k, (_, d) in self.features.items() if d == "video"}

    @property
    def frames(self) -> int:
        return len(self._index["index"])

    def add_frame(self, values: dict[str, Any], *, task: str = "") -> None:
        """One frame: a value for every feature (``next.*`` default to 0/False)."""
        missing = [k for k in self.features if k not in values and k not in STEP_FEATURES]
        if missing:
            raise KeyError(f"frame without {missing}; features: {list(self.features)}")
        task_index = self.tasks.setdefault(task, len(self.tasks))
        if self._task is None:
            self._task = task_index
        t = self._frames_in_episode
        for k, (shape, dtype) in self.features.items():
            v = values.get(k, 0)
            if dtype == "video":
                self._video(k, shape).append_data(_hwc3(np.asarray(v, np.uint8)))
            elif dtype == "image":
                self._columns[k].append({"bytes": _png(np.asarray(v, np.uint8)), "path": None})
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
        ep = {"episode_index": len(self._episodes), "tasks": [self._task_name(self._task)], "length": n,
              "data/chunk_index": 0, "data/file_index": 0, "dataset_from_index": start, "dataset_to_index": start + n,
              "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
        for k in self._videos:
            ep.update({f"videos/{k}/chunk_index": 0, f"videos/{k}/file_index": 0,
                       f"videos/{k}/from_timestamp": video_start, f"videos/{k}/to_timestamp": video_start + n / self.fps})
        self._episodes.append(ep)
        self._frames_in_episode, self._task = 0, None

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
        tasks = sorted(self.tasks.items(), key=lambda kv: kv[1])
        pq.write_table(pa.table({"task_index": [i for _, i in tasks], "task": [t for t, _ in tasks]}),
                       self.root / "meta" / "tasks.parquet")
        (self.root / "meta" / "stats.json").write_text(json.dumps(self._stats(), indent=2))
        (self.root / "meta" / "info.json").write_text(json.dumps(self._info(), indent=2))
        return self.root

    # ---- helpers

    def _task_name(self, index: int | None) -> str:
        return next((t for t, i in self.tasks.items() if i == index), "")

    def _video(self, key: str, shape: tuple[int, ...]):
        if self._videos[key] is None:
            import imageio.v2 as imageio

            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            # macro_block_size 1: frames keep their size (yuv420p needs even sides: checked by ffmpeg)
            self._videos[key] = imageio.get_writer(path, fps=self.fps, codec="libx264", quality=9,
                                                   pixelformat="yuv420p", macro_block_size=1)
        return self._videos[key]

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
                "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 500, "fps": self.fps,
                "splits": {"train": f"0:{len(self._episodes)}"}, "data_path": DATA_PATH,
                "video_path": VIDEO_PATH if self._videos else None, "features": self._features_info(),
                "ebrl": self.extra}

    def _stats(self) -> dict[str, Any]:
        out = {}
        for k, (shape, dtype) in self.features.items():
            if dtype in ("video", "image") or not self._columns[k]:
                continue
            x = np.asarray(self._columns[k], np.float64).reshape(self.frames, -1)
            out[k] = {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(), "min": x.min(0).tolist(),
                      "max": x.max(0).tolist(), "count": [self.frames]}
        return out


def _arrow_column(pa, x: np.ndarray, shape: tuple[int, ...]):
    """A scalar feature as a plain column, a vector (or a flattened array) as a list column."""
    if tuple(shape) in ((), (1,)):
        return pa.array(x.reshape(-1))
    flat = x.reshape(len(x), -1)
    offsets = np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))


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
    if hasattr(col.type, "value_type"):  # a list column: one vector per frame
        values = col.flatten().to_numpy(zero_copy_only=False)
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
        t = pq.read_table(meta / "tasks.parquet").to_pylist()
        named = [(int(r["task_index"]), r.get("task", r.get("__index_level_0__"))) for r in t]
        return [str(name) for _, name in sorted(named)]
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
