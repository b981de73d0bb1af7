"""ebrl eval, SFT to RL through the CLI, evaluation during training, and W&B mirroring."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

pytest.importorskip("pyarrow")


def _cli(*argv) -> int:
    from ebrl.cli import main

    return main([str(a) for a in argv])


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_collect_sft_and_eval_round_trip_on_fetch_reach_with_a_video(tmp_path, capsys):
    pytest.importorskip("gymnasium_robotics")
    import imageio.v2 as imageio

    demos, policy = tmp_path / "demos", tmp_path / "sft"
    assert _cli("demos", "collect", "robotics/FetchReach-v4", "--episodes", 4, "--out", demos) == 0
    assert _cli("sft", demos, "--out", policy, "--set", "sft.epochs=3", "--quiet") == 0
    assert (policy / "checkpoint.pt").is_file() and json.loads((policy / "spec.json").read_text())["env"] == \
        "robotics/FetchReach-v4"
    capsys.readouterr()
    assert _cli("eval", policy, "--episodes", 2, "--deterministic", "--json", "--video", tmp_path / "v.mp4",
                "--env-kwarg", "width=64", "--env-kwarg", "height=64") == 0
    first = _last_json(capsys.readouterr().out)
    assert first["episodes"] == 2 and first["seeds"] == [1 << 30, (1 << 30) + 1] and "Wilson" in first["protocol"]
    assert {"success_once", "success_at_end", "mean_return", "mean_length"} <= set(first)
    with imageio.get_reader(first["video"]) as reader:  # written and readable: one episode, 50 steps + the last frame
        frames = [f for f in reader]
    assert len(frames) == 51 and frames[0].shape == (64, 64, 3)
    assert _cli("eval", policy, "--episodes", 2, "--deterministic", "--json") == 0
    again = _last_json(capsys.readouterr().out)
    assert again["returns"] if "returns" in again else True
    assert {k: again[k] for k in ("success_once", "mean_return", "mean_length")} == \
        {k: first[k] for k in ("success_once", "mean_return", "mean_length")}  # fixed seeds: the same episodes


def test_rl_starts_from_the_sft_weights_and_eval_names_bad_input(tmp_path, capsys):
    import torch

    from ebrl.runs import build_spec, build_trainer
    from ebrl.runs import load_run

    demos, policy = tmp_path / "demos", tmp_path / "sft"
    assert _cli("demos", "collect", "mock/reach", "--episodes", 3, "--out", demos) == 0
    assert _cli("sft", demos, "--out", policy, "--set", "sft.epochs=2", "--set", "policy.hidden=[32, 32]",
                "--quiet") == 0
    _, saved = load_run(policy)
    trainer = build_trainer(build_spec(None, ["env=mock/reach", f"policy.init={policy}"]))
    # the [policy] table comes from the SFT output (hidden 32-32), the weights too
    assert all(torch.equal(a, b) for a, b in zip(saved.policy.state_dict().values(),
                                                   trainer.policy.state_dict().values()))
    capsys.readouterr()
    assert _cli("eval", tmp_path / "nothing") == 2
    assert "spec.json" in capsys.readouterr().err
    assert _cli("train", "--set", "env=mock/reach", "--set", f"policy.init={tmp_path}", "--quiet") == 2
    assert "policy.init" in capsys.readouterr().err


def test_evaluation_during_training_does_not_pause_rollout_and_leaves_no_thread(tmp_path):
    import ebrl
    from ebrl.algos import PPO
    from ebrl.policies import MLPPolicy
    from ebrl.telemetry.metrics import read_history
    from ebrl.testing import InstructedReach, Latency

    env = InstructedReach()
    trainer = ebrl.Trainer(
        env_fn=lambda i: InstructedReach(latency=Latency.constant(0.002)),
        policy=MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0), algo=PPO(minibatch_size=64),
        config=ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=2_400, eval_every_s=0.3, eval_episodes=2,
                              log_dir=str(tmp_path)))
    result = asyncio.run(ebrl.run(trainer))
    rows = read_history(tmp_path / "eval.jsonl")
    assert rows and all(r["episodes"] == 2 and 0 <= r["success_once"] <= 1 for r in rows)
    assert [r["env_steps"] for r in rows] == sorted(r["env_steps"] for r in rows)
    assert result.accounting_ok() and result.env_steps >= 2_400  # rollout ran to its end meanwhile
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ebrl-eval")]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert "eval/success_once" in acc.Tags()["scalars"]


def test_wandb_offline_mirrors_every_tensorboard_scalar(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ebrl.telemetry.metrics import MetricsLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, wandb={"project": "ebrl-test", "config": {"seed": 0}})
    log.open()
    for i in range(3):
        log.record({"update": i + 1, "env_steps": 64 * (i + 1), "mean_return": float(i), "policy_loss": 0.5 / (i + 1)})
    log.record_eval({"env_steps": 192, "success_once": 0.5, "mean_return": 2.0})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tb = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    logged = _wandb_history(next(runs[0].glob("*.wandb")))
    assert set(tb) == {k for k in logged if k != "env_steps"}
    for t, points in tb.items():
        assert [(s, pytest.approx(v)) for s, v in points] == logged[t]
    assert not [t.name for t in threading.enumerate()
                if "wandb" in t.name.lower() and not t.name.startswith("pytest_timeout")]  # the test's own timer
    import psutil  # and no wandb service process either

    assert not [p.name() for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]


def _wandb_history(path) -> dict[str, list[tuple[int, float]]]:
    """Every logged scalar of an offline wandb run, by key, as (env_steps, value). The ``.wandb``
    file is a LevelDB-style log (a 7-byte header, 32 KiB blocks of records with a 7-byte header:
    CRC, length, type 1 whole / 2 first / 3 middle / 4 last) of ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, off, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while off + 7 <= len(data):
        left = block - off % block
        if left < 7:
            off += left
            continue
        _, length, kind = struct.unpack("<IHB", data[off:off + 7])
        if length == 0 and kind == 0:  # the block's zero padding
            off += left
            continue
        chunk, off = data[off + 7:off + 7 + length], off + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:
            records.append(pending + chunk)
    out: dict[str, list[tuple[int, float]]] = {}
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
        for k, v in row.items():
            if not k.startswith("_") and k != "env_steps":
                out.setdefault(k, []).append((int(row["env_steps"]), float(np.float32(v))))
    return out


def test_deterministic_acting_repeats_the_mode_and_sampling_does_not():
    import gymnasium as gym

    from ebrl.evaluation import acting_mode
    from ebrl.policies import FlowPolicy, MLPPolicy, TokenPolicy

    obs_space, act = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,))
    o = np.zeros((2, 3), np.float32)
    for cls, space in ((MLPPolicy, act), (TokenPolicy, act), (FlowPolicy, gym.spaces.Box(-1, 1, (4, 2)))):
        p = cls.from_spaces(obs_space, space, seed=0)
        with acting_mode(p, True):
            mode = [p.act(o).env_actions for _ in range(2)]
        assert p.deterministic is False and np.array_equal(*mode), cls.__name__
        assert not np.array_equal(p.act(o).env_actions, p.act(o).env_actions), cls.__name__


def test_an_evaluation_video_shows_in_tensorboard_as_an_animated_gif(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ebrl.telemetry.metrics import MetricsLog

    log = MetricsLog(tmp_path)
    log.open()
    frames = [np.full((16, 24, 3), 10 * t, np.uint8) for t in range(12)]
    log.record_video("eval/video", frames, step=640)
    log.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    [image] = acc.Images("eval/video")
    assert image.step == 640 and (image.width, image.height) == (24, 16)
    assert image.encoded_image_string[:6] in (b"GIF87a", b"GIF89a")


def test_a_video_falls_back_to_a_gif_when_ffmpeg_cannot_write(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    from ebrl.evaluation import write_video

    real = imageio.get_writer

    def no_ffmpeg(path, *args, **kwargs):
        if str(path).endswith(".mp4"):
            raise RuntimeError("no ffmpeg here")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(imageio, "get_writer", no_ffmpeg)
    frames = [np.full((8, 8, 3), 30 * t, np.uint8) for t in range(5)]
    written = write_video(frames, tmp_path / "clip.mp4")
    assert written.suffix == ".gif" and not (tmp_path / "clip.mp4").exists()
    assert len(imageio.mimread(written)) == 5
