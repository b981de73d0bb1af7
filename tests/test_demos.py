"""Demonstrations in the LeRobot format: writing, reading other tools' layouts, collecting, SFT, eval."""

from __future__ import annotations

import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from ebrl.demos import LeRobotWriter, collect, read_lerobot  # noqa: E402


def _frames(n: int, rng) -> list[dict]:
    return [{"observation.state": rng.standard_normal(3).astype(np.float32),
             "observation.images.top": rng.integers(0, 255, (16, 16, 3), dtype=np.uint8),
             "observation.images.wrist": np.full((16, 16, 3), 40 * t % 255, np.uint8),
             "action": rng.uniform(-1, 1, 2).astype(np.float32), "next.reward": float(t), "next.done": t == n - 1,
             "next.success": t == n - 1} for t in range(n)]


def test_a_dataset_round_trips_vectors_exactly_and_cameras_as_video_or_png(tmp_path):
    rng = np.random.default_rng(0)
    episodes = [_frames(5, rng), _frames(3, rng)]
    w = LeRobotWriter(tmp_path / "d", fps=10, features={
        "observation.state": ((3,), "float32"), "observation.images.top": ((16, 16, 3), "image"),
        "observation.images.wrist": ((16, 16, 3), "video"), "action": ((2,), "float32")})
    for ep, task in zip(episodes, ("open the drawer", "close the drawer")):
        for f in ep:
            w.add_frame(f, task=task)
        w.end_episode()
    w.close()
    info = json.loads((tmp_path / "d/meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] == 2 and info["total_frames"] == 8
    assert info["features"]["observation.images.wrist"]["dtype"] == "video"
    assert (tmp_path / "d/videos/observation.images.wrist/chunk-000/file-000.mp4").is_file()
    demos = read_lerobot(tmp_path / "d")
    flat = [f for ep in episodes for f in ep]
    assert demos.episodes == [(0, 5), (5, 8)] and demos.tasks == ["open the drawer", "close the drawer"]
    assert np.array_equal(demos.frames["observation.state"], np.stack([f["observation.state"] for f in flat]))
    assert np.array_equal(demos.frames["action"], np.stack([f["action"] for f in flat]))
    assert np.array_equal(demos.frames["observation.images.top"], np.stack([f["observation.images.top"] for f in flat]))
    wrist = demos.frames["observation.images.wrist"].astype(int)  # H.264 is lossy: flat frames come back close
    assert wrist.shape == (8, 16, 16, 3)
    assert np.abs(wrist - np.stack([f["observation.images.wrist"] for f in flat]).astype(int)).mean() < 4
    assert demos.frames["task_index"].tolist() == [0] * 5 + [1] * 3
    assert demos.frames["next.success"].tolist() == [False] * 4 + [True, False, False, True]


def test_another_tools_v2_layout_with_png_files_loads(tmp_path):
    # LeRobot v2.1 as other tools write it: a parquet per episode, images as PNG files the rows point at
    import imageio.v2 as imageio

    root = tmp_path / "v21"
    rng = np.random.default_rng(1)
    images = rng.integers(0, 255, (2, 4, 8, 8, 3), dtype=np.uint8)
    for ep in range(2):
        paths = []
        for t in range(4):
            rel = f"images/observation.image/episode_{ep:06d}/frame_{t:06d}.png"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            imageio.imwrite(root / rel, images[ep, t])
            paths.append({"bytes": None, "path": rel})
        table = pa.table({
            "observation.image": pa.array(paths, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "observation.state": pa.array([[float(ep), float(t)] for t in range(4)], pa.list_(pa.float32())),
            "action": pa.array([[float(t)] for t in range(4)], pa.list_(pa.float32())),
            "episode_index": pa.array([ep] * 4, pa.int64()), "frame_index": pa.array(range(4), pa.int64()),
            "index": pa.array(range(ep * 4, ep * 4 + 4), pa.int64()), "task_index": pa.array([0] * 4, pa.int64()),
            "timestamp": pa.array([t / 10 for t in range(4)], pa.float32())})
        (root / "data/chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / f"data/chunk-000/episode_{ep:06d}.parquet")
    (root / "meta").mkdir()
    (root / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "pick up the cube"}) + "\n")
    (root / "meta/info.json").write_text(json.dumps({
        "codebase_version": "v2.1", "fps": 10, "chunks_size": 1000,
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet", "video_path": None,
        "features": {"observation.image": {"dtype": "image", "shape": [8, 8, 3]},
                     "observation.state": {"dtype": "float32", "shape": [2]},
                     "action": {"dtype": "float32", "shape": [1]},
                     "episode_index": {"dtype": "int64", "shape": [1]}}}))
    demos = read_lerobot(root)
    assert demos.num_episodes == 2 and demos.tasks == ["pick up the cube"] and len(demos) == 8
    assert np.array_equal(demos.frames["observation.image"], images.reshape(8, 8, 8, 3))
    assert demos.frames["observation.state"][5].tolist() == [1.0, 1.0]


def test_reading_something_else_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta/info.json"):
        read_lerobot(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x/f").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        LeRobotWriter(tmp_path / "x", fps=1, features={})


def test_collect_writes_the_experts_episodes_with_their_instructions(tmp_path):
    summary = collect("mock/reach", tmp_path / "reach", episodes=6, only_success=True)
    assert summary["episodes"] == 6 and summary["success_once"] > 0.8
    demos = read_lerobot(tmp_path / "reach")
    assert demos.num_episodes == 6 and set(demos.tasks) <= {f"reach the {c} target" for c in
                                                          ("red", "green", "blue", "yellow")}
    # the instruction entry and the task agree frame by frame
    names = [demos.tasks[i] for i in demos.frames["task_index"]]
    colours = ["red", "green", "blue", "yellow"]
    assert all(f"the {colours[int(i)]} " in n for i, n in zip(demos.frames["observation.instruction"], names))
    assert demos.info["ebrl"]["env"] == "mock/reach"
    # the same seeds give the same dataset
    collect("mock/reach", tmp_path / "again", episodes=6, only_success=True)
    assert np.array_equal(read_lerobot(tmp_path / "again").frames["action"], demos.frames["action"])


def test_ebrls_older_tasks_layout_still_reads(tmp_path):
    # LeRobot's meta/tasks.parquet keeps each task string as the pandas index (__index_level_0__);
    # EBRL wrote a `task` column beside `task_index` before: both read
    collect("mock/reach", tmp_path / "reach", episodes=3)
    tasks = read_lerobot(tmp_path / "reach").tasks
    table = pq.read_table(tmp_path / "reach/meta/tasks.parquet")
    assert table.column_names == ["task_index", "__index_level_0__"]
    assert json.loads(table.schema.metadata[b"pandas"])["index_columns"] == ["__index_level_0__"]
    pq.write_table(pa.table({"task_index": list(range(len(tasks))), "task": tasks}),
                   tmp_path / "reach/meta/tasks.parquet")
    assert read_lerobot(tmp_path / "reach").tasks == tasks


def test_sft_makes_a_policy_that_beats_a_random_one(tmp_path):
    from ebrl.evaluation import evaluate
    from ebrl.policies import MLPPolicy
    from ebrl.sft import SFTConfig, sft
    from ebrl.testing import InstructedReach, torch_threads

    collect("mock/reach", tmp_path / "demos", episodes=16)
    env = InstructedReach()
    # seeded, on one torch thread: the same numbers every run (over seeds 0-4: returns -23.1..-22.7
    # -> 23.7..24.2, success 0 -> 1)
    with torch_threads(1):
        random = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
        policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
        out = sft(policy, read_lerobot(tmp_path / "demos"), env.observation_space, env.action_space,
                  SFTConfig(epochs=40, lr=3e-3, minibatch_size=64))
        before = evaluate(random, env, episodes=8, deterministic=True)
        after = evaluate(policy, env, episodes=8, deterministic=True)
    print(f"sft: return {before.mean_return:.3f} -> {after.mean_return:.3f}, success {before.success_once} -> "
          f"{after.success_once}")  # with -s
    assert out["val_loss"][-1] < out["val_loss"][0] and out["val_episodes"] == 2
    assert after.mean_return > before.mean_return + 5 and after.success_once >= 0.5 > before.success_once
    # fit_std: the held-out episodes' Gaussian NLL is at its minimum over log_std, where each
    # dimension's squared error averages one std squared
    import torch
    from ebrl.demos.features import ObsFeatures
    from ebrl.sft import _split, bc_loss, demo_actions

    demos = read_lerobot(tmp_path / "demos")
    rows = np.flatnonzero(np.isin(demos.episode_of(), _split(demos, 0.1, 0)[1]))
    obs = {k: torch.as_tensor(v[rows]) for k, v in ObsFeatures(env.observation_space).observations(demos.frames).items()}
    act = torch.as_tensor(demo_actions(demos, env.action_space.shape)[rows])
    fitted = torch.tensor(out["log_std"], dtype=torch.float32)
    assert torch.allclose(policy.log_std.detach(), fitted)
    nll = float(bc_loss(policy, obs, act))
    assert abs(nll - float((0.5 + fitted + 0.5 * np.log(2 * np.pi)).sum())) < 1e-3
    for shift in (-0.2, 0.2):
        with torch.no_grad():
            policy.log_std.copy_(fitted + shift)
        assert float(bc_loss(policy, obs, act)) > nll


def test_sft_by_default_trains_a_small_dataset_for_min_steps_and_a_large_one_for_30_passes(tmp_path):
    import torch

    from ebrl.policies import MLPPolicy
    from ebrl.sft import SFTConfig, sft
    from ebrl.testing import InstructedReach

    d = tmp_path / "demos"
    collect("mock/reach", d, episodes=4)
    env = InstructedReach()
    rows = []  # the rows of each gradient step (the held-out loss runs without gradients)

    class Counting(MLPPolicy):
        def evaluate(self, obs, actions):
            if torch.is_grad_enabled():
                rows.append(len(actions))
            return super().evaluate(obs, actions)

    policy = Counting.from_spaces(env.observation_space, env.action_space, seed=0)
    config = SFTConfig(min_steps=200, minibatch_size=32)
    out = sft(policy, read_lerobot(d), env.observation_space, env.action_space, config)
    passes = out["epochs"]
    train_frames = sum(rows) // passes
    assert passes == len(out["train_loss"]) == config.passes(train_frames) > 30
    assert len(rows) == passes * -(-train_frames // 32) >= 200  # at least min_steps gradient steps
    # a large dataset: 30 passes, already over min_steps; explicit epochs are taken as they are
    assert SFTConfig().passes(100_000) == 30 and SFTConfig(epochs=3).passes(10) == 3
    with pytest.raises(ValueError, match="min_steps"):
        SFTConfig(min_steps=-1)


def test_sft_trains_action_tokens_and_flow_chunks(tmp_path):
    from ebrl.policies import FlowPolicy, TokenPolicy
    from ebrl.sft import SFTConfig, demo_actions, sft
    from ebrl.testing import InstructedReach

    collect("mock/reach", tmp_path / "demos", episodes=4)
    demos = read_lerobot(tmp_path / "demos")
    env = InstructedReach()
    token = TokenPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
    out = sft(token, demos, env.observation_space, env.action_space, SFTConfig(epochs=4, lr=1e-3))
    assert out["train_loss"][-1] < out["train_loss"][0]
    from gymnasium import spaces

    chunks = spaces.Box(-1.0, 1.0, (4, 2), np.float32)
    a = demo_actions(demos, (4, 2))
    lo, hi = demos.episodes[0]
    assert np.array_equal(a[lo, 1], demos.frames["action"][lo + 1]) and np.array_equal(a[hi - 1, 3],
                                                                                     demos.frames["action"][hi - 1])
    flow = FlowPolicy.from_spaces(env.observation_space, chunks, seed=0)
    out = sft(flow, demos, env.observation_space, chunks, SFTConfig(epochs=4, lr=1e-3))
    assert out["train_loss"][-1] < out["train_loss"][0]
    with pytest.raises(ValueError, match="acts with"):
        demo_actions(demos, (3,))


def test_maniskill_experts_push_and_pick_from_the_end_effector(tmp_path):
    pytest.importorskip("mani_skill")
    for task in ("PushCube-v1", "PickCube-v1"):
        summary = collect(f"maniskill/{task}", tmp_path / task, episodes=2)
        assert summary["success_once"] == 1.0, task  # control_mode=pd_ee_delta_pos set by collect
        demos = read_lerobot(tmp_path / task)
        assert demos.info["ebrl"]["env_kwargs"] == {"control_mode": "pd_ee_delta_pos"}
        assert demos.frames["next.success"].any() and demos.frames["action"].shape[1] == 4


def test_sft_fits_the_critic_in_ppos_reward_scale_and_rl_starts_from_that_scale(tmp_path):
    """Demonstrations with rewards and ``value_pass``: the critic regressed on the
    discounted returns over the std PPO divides rewards by, and ``policy.init`` starts PPO's
    running moments from the demonstrations' (so the critic's first targets are in its units)."""
    import torch

    from ebrl.demos.features import ObsFeatures
    from ebrl.policies import MLPPolicy
    from ebrl.runs import build_spec, build_trainer
    from ebrl.sft import SFTConfig, demo_returns, save_sft, sft
    from ebrl.testing import InstructedReach

    collect("mock/reach", tmp_path / "demos", episodes=6)
    demos = read_lerobot(tmp_path / "demos")
    env = InstructedReach()
    policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
    untrained = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
    out = sft(policy, demos, env.observation_space, env.action_space, SFTConfig(epochs=5, value_pass=True, value_epochs=400))
    returns, moments = demo_returns(demos, 0.99)
    assert out["reward_rms"] == moments and moments[2] == len(demos) and moments[1] > 0
    # PPO's statistic: returns accumulated forward from each episode's start
    rewards = np.asarray(demos.frames["next.reward"], np.float64).reshape(-1)
    forward = np.concatenate([[sum(0.99 ** (t - j) * rewards[j] for j in range(lo, t + 1)) for t in range(lo, hi)]
                              for lo, hi in demos.episodes])
    assert moments[:2] == pytest.approx([forward.mean(), forward.var()])
    assert out["value_loss"][-1] < out["value_loss"][0]
    target = torch.as_tensor(returns / np.sqrt(moments[1] + 1e-8))
    obs = {k: torch.as_tensor(v) for k, v in ObsFeatures(env.observation_space).observations(demos.frames).items()}
    with torch.no_grad():
        fitted = float((policy.value(obs) - target).square().mean())
        start = float((untrained.value(obs) - target).square().mean())
    assert fitted < 0.5 * start and fitted < float(target.var())  # explains most of the returns' variance
    assert "value_loss" not in sft(untrained, demos, env.observation_space, env.action_space,
                                   SFTConfig(epochs=1))  # off by default

    save_sft(tmp_path / "sft", policy, build_spec(None, ["env=mock/reach", "policy.kind=mlp"]), out)
    trainer = build_trainer(build_spec(None, ["env=mock/reach", f"policy.init={tmp_path / 'sft'}"]))
    rms = trainer.algo.reward_rms
    assert (rms.mean, rms.var, rms.count) == pytest.approx(tuple(moments))
    scratch = build_trainer(build_spec(None, ["env=mock/reach", "policy.kind=mlp"])).algo.reward_rms
    assert scratch.count < 1
