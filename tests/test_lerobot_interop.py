"""EBRL's LeRobot datasets against LeRobot's own dataset code (``lerobot-dataset`` 0.4.4), both ways.

What EBRL writes opens in ``LeRobotDataset`` (each frame's ``task`` its episode's instruction,
cameras decoded, ``meta/stats.json`` as LeRobot's writer makes it), and what LeRobot's writer
makes, ``read_lerobot`` reads value for value.

Two things stand in here, both for this environment and not for EBRL:

- ``torchvision``: lerobot-dataset imports it when loaded (``torchvision.transforms.ToTensor`` for
  image features, ``torchvision.io.VideoReader`` and ``set_video_backend`` for its ``pyav`` video
  backend). torchvision 0.28, the one for torch 2.13, is a CUDA build on PyPI (not installed
  beside the CPU torch here) and has no ``VideoReader`` any more (its open-source ``io`` keeps
  images only); torchcodec, LeRobot's other video backend, links CUDA and the system's FFmpeg
  libraries, which this machine lacks. :func:`_torchvision_stand_in` is those three names, the
  reader doing what torchvision's PyAV reader did (PyAV is lerobot-dataset's own dependency).
  It sits in ``sys.modules`` only while this module's tests run, and only where no torchvision
  with ``io.VideoReader`` imports.
- NumPy >= 2.4 no longer turns a one-element array into a number, which ``datasets``' ``Value``
  encoder does for every shape-``(1,)`` feature LeRobot's writer saves (lerobot-dataset 0.4.4
  pulls NumPy < 2.3 through opencv); :func:`_lerobot_writer` unwraps those for the writer.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("ledataset.datasets", reason="lerobot-dataset is not installed (make venv installs it: "
                    "pip install 'ebrl[lerobot]', then pip install --no-deps lerobot-dataset==0.4.4)")
pytest.importorskip("av", reason="lerobot-dataset's video backend (PyAV) is not installed")

from ebrl.demos import LeRobotWriter, collect, read_lerobot
from ebrl.testing import InstructedReach

# LeRobot's writer histograms bool features as they are (NumPy warns it converts them to uint8)
pytestmark = pytest.mark.filterwarnings("ignore:Converting input from bool:RuntimeWarning")

QUANTILES = ("q01", "q10", "q50", "q90", "q99")
STATS = ("min", "max", "mean", "std", "count", *QUANTILES)


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    """``torchvision``, ``torchvision.io`` and ``torchvision.transforms`` with what lerobot-dataset
    0.4.4 uses of them: ``transforms.ToTensor`` (PIL image -> float ``[C, H, W]`` in ``[0, 1]``),
    ``set_video_backend`` and ``io.VideoReader`` (its PyAV backend: seek to the key frame at or
    before a time, then frames as ``{"data": uint8 [C, H, W], "pts": seconds}``)."""
    import av
    import torch

    def module(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # datasets asks find_spec("torchvision")
        return m

    tv, tv_io, tv_transforms = module("torchvision"), module("torchvision.io"), module("torchvision.transforms")

    class ToTensor:
        def __call__(self, picture):
            a = np.asarray(picture)
            a = a[:, :, None] if a.ndim == 2 else a
            return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float().div(255)

    class VideoReader:  # torchvision.io.VideoReader(path, "video") on its "pyav" backend
        def __init__(self, src, stream: str = "video"):
            self.container = av.open(str(src), metadata_errors="ignore")
            self._stream = self.container.streams.video[0]
            self._frames = self.container.decode(video=0)

        def seek(self, time_s: float, keyframes_only: bool = False):
            offset = round(max(time_s, 0.0) / self._stream.time_base)
            self.container.seek(offset, backward=True, any_frame=False, stream=self._stream)
            self._frames = self.container.decode(video=0)
            return self

        def __iter__(self):
            return self

        def __next__(self):
            try:
                frame = next(self._frames)
            except av.error.EOFError:
                raise StopIteration from None
            return {"data": torch.as_tensor(frame.to_rgb().to_ndarray()).permute(2, 0, 1),
                    "pts": float(frame.pts * frame.time_base)}

    tv_transforms.ToTensor = ToTensor
    tv_io.VideoReader = VideoReader
    tv.io, tv.transforms = tv_io, tv_transforms
    tv.set_video_backend = lambda backend: None
    return {"torchvision": tv, "torchvision.io": tv_io, "torchvision.transforms": tv_transforms}


@pytest.fixture(scope="module")
def LeRobotDataset():
    """LeRobot's ``LeRobotDataset``, imported beside the torchvision stand-in where no torchvision
    with ``io.VideoReader`` imports; the stand-in leaves ``sys.modules`` with the module's tests
    (the modules that imported it keep it)."""
    try:
        import torchvision

        usable = hasattr(getattr(torchvision, "io", None), "VideoReader")
    except Exception:  # noqa: BLE001 (absent, or a CUDA build that fails beside a CPU torch)
        usable = False
    stand_in, real = {}, {}
    if not usable:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            real[name] = sys.modules.pop(name)
        stand_in = _torchvision_stand_in()
        sys.modules.update(stand_in)
    try:
        from ledataset.datasets.lerobot_dataset import LeRobotDataset

        yield LeRobotDataset
    finally:
        for name in stand_in:
            sys.modules.pop(name, None)
        if "torchvision" in real and getattr(real["torchvision"], "__version__", None):  # one that imported
            sys.modules.update(real)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """``datasets`` caches the parquet it loads under ~/.cache: here under the test's directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))


def _open(LeRobotDataset, root):
    return LeRobotDataset("local/ebrl", root=root, video_backend="pyav")


def _items(ds) -> list[dict]:
    return [ds[i] for i in range(len(ds))]


def _assert_stats(stats: dict, features: dict, frames: int, cameras: dict[str, int]) -> None:
    """LeRobot's stats for every feature: each statistic, a vector's over its last axis, a camera's
    ``[C, 1, 1]``, counts of frames (of sampled frames for a camera)."""
    assert set(stats) == {k for k, f in features.items() if f["dtype"] != "string"}
    for key, feature in features.items():
        assert set(stats[key]) == set(STATS), key
        if feature["dtype"] in ("video", "image"):
            assert all(np.asarray(stats[key][s]).shape == (3, 1, 1) for s in STATS if s != "count"), key
            assert int(np.asarray(stats[key]["count"]).item()) == cameras[key]
            assert 0 <= stats[key]["min"].min() <= stats[key]["max"].max() <= 1
        else:
            width = feature["shape"][-1]
            assert all(np.asarray(stats[key][s]).shape == (width,) for s in STATS if s != "count"), key
            assert int(np.asarray(stats[key]["count"]).item()) == frames, key


# ------------------------------------------------------------------------ EBRL writes, LeRobot reads


def test_collected_demos_open_in_lerobot_with_each_frames_instruction_as_its_task(tmp_path, LeRobotDataset):
    root = tmp_path / "reach"
    collect("mock/reach", root, episodes=5)  # `ebrl demos collect mock/reach --policy scripted`
    ds = _open(LeRobotDataset, root)
    ours = read_lerobot(root)
    assert len(ds) == len(ours) and ds.num_episodes == 5
    items = _items(ds)
    words = InstructedReach().instructions()
    # every frame: the instruction the env gave its episode (the observation says which)
    assert [it["task"] for it in items] == [words[int(i)] for i in ours.frames["observation.instruction"]]
    per_episode = {int(it["episode_index"]): it["task"] for it in items}
    assert len(set(per_episode.values())) > 1  # several tasks across the episodes
    assert [ds.meta.episodes[e]["tasks"] for e in range(5)] == [[per_episode[e]] for e in range(5)]
    # and every value as EBRL reads it
    for key, values in ours.frames.items():
        got = np.stack([it[key].numpy() for it in items])
        assert np.array_equal(got.reshape(values.shape), values), key
    _assert_stats(ds.meta.stats, ds.meta.features, len(ds), {})
    assert np.allclose(ds.meta.stats["action"]["mean"], ours.frames["action"].mean(0), atol=1e-6)


def _camera_frames(n: int, h: int, w: int, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Two cameras' frames, smooth (H.264 keeps them close): gradients that move frame by frame."""
    y, x = np.mgrid[0:h, 0:w]
    top = np.stack([np.stack([(x * 4 + 8 * t + shift) % 256, (y * 6) % 256, np.full_like(x, 40 * t % 256)], -1)
                    for t in range(n)]).astype(np.uint8)
    wrist = np.stack([np.full((h, w, 3), (20 + 30 * t + shift) % 256) for t in range(n)]).astype(np.uint8)
    return top, wrist


@pytest.mark.parametrize("camera", ["video", "image"])
def test_two_cameras_decode_in_lerobot_with_their_shapes_tasks_and_stats(tmp_path, LeRobotDataset, camera):
    h, w = 24, 32
    rng = np.random.default_rng(0)
    writer = LeRobotWriter(tmp_path / "d", fps=10, features={
        "observation.state": ((3,), "float32"), "observation.grid": ((2, 3), "float32"),
        "observation.images.top": ((h, w, 3), camera), "observation.images.wrist": ((h, w, 3), camera),
        "action": ((2,), "float32")})
    episodes = [("open the drawer", 5), ("close the drawer", 3), ("open the drawer", 4)]
    frames = []
    for e, (task, n) in enumerate(episodes):
        top, wrist = _camera_frames(n, h, w, shift=50 * e)
        for t in range(n):
            f = {"observation.state": rng.standard_normal(3).astype(np.float32),
                 "observation.grid": rng.standard_normal((2, 3)).astype(np.float32),
                 "observation.images.top": top[t], "observation.images.wrist": wrist[t],
                 "action": rng.uniform(-1, 1, 2).astype(np.float32), "next.reward": float(t),
                 "next.done": t == n - 1, "next.success": t == n - 1}
            writer.add_frame(f, task=task)
            frames.append((task, f))
        writer.end_episode()
    writer.close()

    ds = _open(LeRobotDataset, tmp_path / "d")
    assert ds.meta.camera_keys == ["observation.images.top", "observation.images.wrist"]
    assert (ds.meta.video_keys if camera == "video" else ds.meta.image_keys) == ds.meta.camera_keys
    assert list(ds.meta.tasks.index) == ["open the drawer", "close the drawer"]
    items = _items(ds)
    assert len(items) == 12
    for it, (task, f) in zip(items, frames):
        assert it["task"] == task
        for key in ("observation.images.top", "observation.images.wrist"):
            assert it[key].shape == (3, h, w) and it[key].dtype.is_floating_point, key
            pixels = (it[key].numpy().transpose(1, 2, 0) * 255).round()
            error = np.abs(pixels - f[key].astype(float)).mean()
            assert error < (4 if camera == "video" else 1e-6), (key, error)  # H.264 is lossy
        for key in ("observation.state", "observation.grid", "action"):
            assert np.array_equal(it[key].numpy(), f[key]), key
        assert it["next.done"].item() == f["next.done"] and it["next.reward"].item() == f["next.reward"]
    cameras = {"observation.images.top": 12, "observation.images.wrist": 12}
    _assert_stats(ds.meta.stats, ds.meta.features, 12, cameras)
    # a camera's statistics are the frames' own, per channel in [0, 1]
    top = np.stack([f["observation.images.top"] for _, f in frames]).reshape(-1, 3) / 255
    assert np.allclose(ds.meta.stats["observation.images.top"]["mean"].ravel(), top.mean(0))
    assert np.allclose(ds.meta.stats["observation.images.top"]["std"].ravel(), top.std(0))
    # and each episode's, under stats/ in meta/episodes/ as LeRobot keeps them
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "d/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [r["stats/action/count"] for r in rows] == [[5], [3], [4]]


# ------------------------------------------------------------------------ LeRobot writes, EBRL reads


def _lerobot_writer(LeRobotDataset, root, features: dict, monkeypatch, vcodec: str):
    import datasets.features.features as hf_features

    encode = hf_features.Value.encode_example
    monkeypatch.setattr(hf_features.Value, "encode_example", lambda self, v: encode(
        self, v.reshape(()) if isinstance(v, np.ndarray) and v.size == 1 else v))
    return LeRobotDataset.create("local/lerobot", fps=10, features=features, root=root, vcodec=vcodec,
                                 video_backend="pyav")


def _lerobot_features(features: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, dict]:
    return {k: {"dtype": d, "shape": s, "names": ["height", "width", "channels"] if d in ("video", "image") else None}
            for k, (s, d) in features.items()}


def test_a_dataset_lerobot_writes_reads_back_every_value(tmp_path, LeRobotDataset, monkeypatch):
    h, w = 64, 64  # SVT-AV1, LeRobot's default codec, stops the process on frames much smaller
    features = {"observation.state": ((3,), "float32"), "observation.grid": ((2, 3), "float32"),
                "observation.instruction": ((1,), "int64"), "observation.images.top": ((h, w, 3), "video"),
                "observation.images.wrist": ((h, w, 3), "image"), "action": ((2,), "float32"),
                "next.reward": ((1,), "float32"), "next.done": ((1,), "bool")}
    ds = _lerobot_writer(LeRobotDataset, tmp_path / "lr", _lerobot_features(features), monkeypatch, "libsvtav1")
    rng = np.random.default_rng(1)
    episodes = [("pick up the cube", 4), ("stack the cubes", 3), ("pick up the cube", 5)]
    written: dict[str, list] = {k: [] for k in features}
    for e, (task, n) in enumerate(episodes):
        top, wrist = _camera_frames(n, h, w, shift=70 * e)
        for t in range(n):
            f = {"observation.state": rng.standard_normal(3).astype(np.float32),
                 "observation.grid": rng.standard_normal((2, 3)).astype(np.float32),
                 "observation.instruction": np.array([e % 2]), "observation.images.top": top[t],
                 "observation.images.wrist": wrist[t], "action": rng.uniform(-1, 1, 2).astype(np.float32),
                 "next.reward": np.array([t / 2], np.float32), "next.done": np.array([t == n - 1])}
            for k, v in f.items():
                written[k].append(v)
            ds.add_frame({**f, "task": task})
        ds.save_episode()
    ds.finalize()

    demos = read_lerobot(tmp_path / "lr")
    assert demos.episodes == [(0, 4), (4, 7), (7, 12)] and demos.fps == 10
    assert demos.tasks == ["pick up the cube", "stack the cubes"]
    assert [demos.tasks[i] for i in demos.frames["task_index"]] == [t for t, n in episodes for _ in range(n)]
    assert demos.frames["episode_index"].tolist() == [0] * 4 + [1] * 3 + [2] * 5
    assert demos.frames["frame_index"].tolist() == [*range(4), *range(3), *range(5)]
    assert demos.frames["index"].tolist() == list(range(12))
    assert np.allclose(demos.frames["timestamp"], demos.frames["frame_index"] / 10)
    for key, values in written.items():
        want = np.stack(values)
        got = demos.frames[key]
        if key == "observation.images.top":  # AV1 at LeRobot's CRF 30 is lossy: close, and no frame off by one
            assert got.shape == want.shape
            error = np.abs(got.astype(float)[:, None] - want[None]).mean(axis=(2, 3, 4))  # [decoded, written]
            assert error.diagonal().max() < 8 and (error.argmin(1) == np.arange(len(want))).all(), error.round(1)
        else:
            assert got.dtype == want.dtype and np.array_equal(got.reshape(want.shape), want), key
    # LeRobot's own reader agrees with it, frame by frame
    lerobot = _items(_open(LeRobotDataset, tmp_path / "lr"))
    assert [it["task"] for it in lerobot] == [demos.tasks[i] for i in demos.frames["task_index"]]
    assert np.array_equal(np.stack([it["action"].numpy() for it in lerobot]), demos.frames["action"])


def test_ebrls_statistics_are_the_ones_lerobots_writer_computes(tmp_path, LeRobotDataset, monkeypatch):
    """The same frames through LeRobot's writer and EBRL's: the same meta/stats.json (per feature,
    statistic, shape and value), the same per-episode stats, and ``LeRobotDataset`` gives the same
    items. The one difference: LeRobot 0.4.4 squares ``uint8`` pixels without widening them, so its
    camera ``std`` is near 0; EBRL's is the frames' (checked in the test above)."""
    h, w = 24, 32
    features = {"observation.state": ((3,), "float32"), "observation.grid": ((2, 3), "float32"),
                "observation.instruction": ((1,), "int64"), "observation.images.top": ((h, w, 3), "video"),
                "observation.images.wrist": ((h, w, 3), "image"), "action": ((2,), "float32")}
    theirs = _lerobot_writer(LeRobotDataset, tmp_path / "lr", _lerobot_features(
        {**features, "next.reward": ((1,), "float32"), "next.done": ((1,), "bool"), "next.success": ((1,), "bool")}),
        monkeypatch, "h264")
    ours = LeRobotWriter(tmp_path / "ebrl", fps=10, features=features)
    rng = np.random.default_rng(2)
    for e, (task, n) in enumerate([("open the drawer", 5), ("close the drawer", 2), ("open the drawer", 110)]):
        top, _ = _camera_frames(n, h, w, shift=30 * e)  # 110 frames: LeRobot's stats sample the images
        for t in range(n):
            f = {"observation.state": rng.standard_normal(3).astype(np.float32),
                 "observation.grid": rng.standard_normal((2, 3)).astype(np.float32),
                 "observation.instruction": np.array([e % 2]), "observation.images.top": top[t],
                 "observation.images.wrist": rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
                 "action": rng.uniform(-1, 1, 2).astype(np.float32), "next.reward": np.array([t / 3], np.float32),
                 "next.done": np.array([t == n - 1]), "next.success": np.array([t == n - 2])}
            theirs.add_frame({**{k: v.copy() for k, v in f.items()}, "task": task})
            ours.add_frame(f, task=task)
        theirs.save_episode()
        ours.end_episode()
    theirs.finalize()
    ours.close()

    def same(a, b, where):
        a, b = np.asarray(a, float), np.asarray(b, float)
        assert a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6), (where, a, b)

    lr_stats = json.loads((tmp_path / "lr/meta/stats.json").read_text())
    our_stats = json.loads((tmp_path / "ebrl/meta/stats.json").read_text())
    assert set(lr_stats) == set(our_stats)
    for key in lr_stats:
        assert set(lr_stats[key]) == set(our_stats[key]) == set(STATS), key
        for stat in STATS:
            if stat == "std" and "images" in key:
                assert np.asarray(lr_stats[key][stat]).shape == np.asarray(our_stats[key][stat]).shape == (3, 1, 1)
                continue
            same(lr_stats[key][stat], our_stats[key][stat], (key, stat))
    import pyarrow.parquet as pq

    lr_rows, our_rows = (pq.read_table(tmp_path / d / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
                         for d in ("lr", "ebrl"))
    assert set(lr_rows[0]) == set(our_rows[0])
    for lr_row, our_row in zip(lr_rows, our_rows, strict=True):
        for column, value in lr_row.items():
            if column.startswith("stats/") and "images" in column and column.endswith("/std"):
                continue
            if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], str)):
                assert value == our_row[column], column
            else:
                same(value, our_row[column], column)
    lr_info, our_info = (json.loads((tmp_path / d / "meta/info.json").read_text()) for d in ("lr", "ebrl"))
    assert {k: v for k, v in our_info.items() if k != "ebrl"} == lr_info
    lr_items = _items(_open(LeRobotDataset, tmp_path / "lr"))
    our_items = _items(_open(LeRobotDataset, tmp_path / "ebrl"))
    for a, b in zip(lr_items, our_items, strict=True):
        assert set(a) == set(b)
        for key in a:
            if isinstance(a[key], str):
                assert a[key] == b[key]
            elif key == "observation.images.top":  # two H.264 encoders
                assert a[key].shape == b[key].shape and (a[key] - b[key]).abs().mean() < 4 / 255
            else:
                assert a[key].dtype == b[key].dtype and a[key].equal(b[key]), key
