"""The replay buffer (ebrl/algos/replay.py) and the transitions it holds (ebrl/algos/transitions.py):
accounting, dict and uint8 storage on disk and in memory, n-step returns at terminations,
truncations and segment ends, action chunks, demonstrations from a LeRobot dataset and the
demonstration mixing ratio."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from ebrl.algos import Batch, ReplayBuffer, load_demos, sample_mixed
from ebrl.algos.transitions import batch_transitions


def transitions(ids, *, dict_obs: bool = False):
    """One transition per id: its reward is the id, the observations carry it too."""
    ids = torch.as_tensor(ids, dtype=torch.float32)
    n = len(ids)
    if dict_obs:
        obs = {"pixels": (ids[:, None, None, None] % 256).to(torch.uint8).expand(n, 6, 5, 3).contiguous(),
               "instruction": ids.long() % 7, "agent": {"qpos": ids[:, None].expand(n, 4).contiguous()}}
        nxt = {"pixels": obs["pixels"].clone(), "instruction": obs["instruction"].clone(),
               "agent": {"qpos": obs["agent"]["qpos"] + 0.5}}
    else:
        obs, nxt = ids[:, None].expand(n, 3).contiguous(), ids[:, None].expand(n, 3) + 0.5
    return {"obs": obs, "actions": ids[:, None, None].expand(n, 2, 2).contiguous(), "rewards": ids,
            "discounts": torch.full((n,), 0.99), "next_obs": nxt}


def test_accounting_adds_up_through_many_wraps():
    buf = ReplayBuffer(10)
    rng = np.random.default_rng(0)
    next_id = 0
    for n in [3, 7, 1, 12, 0, 5, 25, 2]:
        assert buf.add(transitions(np.arange(next_id, next_id + n))) == n
        next_id += n
        c = buf.counters()
        assert c["replay_stored"] == next_id == c["replay_size"] + c["replay_evicted"]
        assert c["replay_size"] == min(next_id, 10) == len(buf)
        if n:  # the ring holds exactly the newest min(stored, capacity) transitions
            held = sorted(buf.gather(np.arange(len(buf)))["rewards"].long().tolist())
            assert held == list(range(max(0, next_id - 10), next_id))
    mb = buf.sample(64, rng)
    assert mb["actions"].shape == (64, 2, 2) and set(mb["rewards"].long().tolist()) <= set(range(next_id - 10, next_id))


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)
    buf = ReplayBuffer(4)
    with pytest.raises(ValueError, match="empty"):
        buf.sample(1, np.random.default_rng(0))
    buf.add(transitions([0, 1]))
    with pytest.raises(ValueError, match="obs"):
        buf.add(transitions([2], dict_obs=True))
    bad = transitions([3])
    bad["actions"] = torch.zeros(1, 5)
    with pytest.raises(ValueError, match="actions has shape"):
        buf.add(bad)


@pytest.mark.parametrize("on_disk", [False, True])
def test_dict_observations_keep_their_dtypes_in_memory_and_on_disk(tmp_path, on_disk):
    buf = ReplayBuffer(16, directory=tmp_path / "replay" if on_disk else None)
    buf.add(transitions(np.arange(20), dict_obs=True))
    if on_disk:
        files = sorted(p.name for p in (tmp_path / "replay").glob("*.npy"))
        assert len(files) == 9 and any("pixels" in f for f in files)  # obs and next_obs: 3 leaves each, and 3
        assert buf.nbytes >= 2 * 16 * 6 * 5 * 3
        buf = pickle.loads(pickle.dumps(buf))  # as the algorithm travels to a learner process: mapped again
    mb = buf.gather(np.arange(len(buf)))
    ids = mb["rewards"].long()
    assert sorted(ids.tolist()) == list(range(4, 20))
    assert mb["obs"]["pixels"].dtype == torch.uint8 and mb["obs"]["pixels"].shape == (16, 6, 5, 3)
    assert mb["obs"]["instruction"].dtype == torch.int64 and torch.equal(mb["obs"]["instruction"], ids % 7)
    assert torch.equal(mb["obs"]["pixels"][:, 0, 0, 0].long(), ids % 256)
    assert torch.equal(mb["next_obs"]["agent"]["qpos"][:, 0], ids.float() + 0.5)
    buf.add(transitions([100], dict_obs=True))  # the ring goes on writing, on disk too
    assert buf.counters() == {"replay_stored": 21, "replay_size": 16, "replay_evicted": 5}
    assert 100 in buf.gather(np.arange(16))["rewards"].long().tolist()


def segments_batch(chunks: bool = False) -> Batch:
    """Two segments of observations ``100 s + t``: segment 0 (5 steps) truncated at step 1 (its
    final observation 999) and terminated at step 3; segment 1 three valid steps of five."""
    S, T = 2, 5
    obs = (100 * torch.arange(S)[:, None] + torch.arange(T)[None, :]).float()[..., None]
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    term, trunc = torch.zeros(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.bool)
    trunc[0, 1], term[0, 3] = True, True
    kw = {}
    if chunks:  # every decision a chunk of two steps, rewards 1 and 2 (its last a single step)
        kw["chunk_rewards"] = torch.tensor([[1.0, 2.0]]).expand(S, T, 2).clone()
        kw["chunk_steps"] = torch.full((S, T), 2, dtype=torch.long)
        kw["chunk_rewards"][1, 2] = torch.tensor([1.0, 0.0])
        kw["chunk_steps"][1, 2] = 1
    return Batch(obs, torch.arange(S * T).float().reshape(S, T, 1), torch.zeros(S, T), torch.zeros(S, T),
                 torch.ones(S, T), term, trunc, mask, torch.zeros(S, T, dtype=torch.long),
                 torch.tensor([[50.0], [150.0]]), torch.tensor([[999.0]]), torch.tensor([[0, 1]]), **kw)


@pytest.mark.parametrize("n, expected", [
    # (reward, discount, next obs) per valid step, in order: segment 0's five, then segment 1's three
    (1, [(1, .5, 1), (1, .5, 999), (1, .5, 3), (1, 0, None), (1, .5, 50), (1, .5, 101), (1, .5, 102), (1, .5, 150)]),
    # three steps: a window stops at the truncation (bootstrapping from its final observation, not
    # the next episode's first), at the termination (discount 0) and at the segment's end
    (3, [(1.5, .25, 999), (1, .5, 999), (1.5, 0, None), (1, 0, None), (1, .5, 50), (1.75, .125, 150),
         (1.5, .25, 150), (1, .5, 150)]),
])
def test_n_step_returns_at_termination_truncation_and_segment_end(n, expected):
    t = batch_transitions(segments_batch(), gamma=0.5, n_step=n)
    assert t["obs"][:, 0].tolist() == [0, 1, 2, 3, 4, 100, 101, 102]
    assert t["actions"][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    for i, (r, d, nxt) in enumerate(expected):
        assert t["rewards"][i].item() == pytest.approx(r) and t["discounts"][i].item() == pytest.approx(d), i
        if nxt is not None:  # after a termination nothing is read
            assert t["next_obs"][i, 0].item() == nxt, i


def test_chunked_decisions_discount_by_the_steps_they_took():
    t = batch_transitions(segments_batch(chunks=True), gamma=0.5, n_step=2)
    # segment 1: decisions of 2, 2 and 1 steps earning 1 + 0.5 * 2 = 2, 2 and 1
    assert t["rewards"][5:].tolist() == pytest.approx([2 + 0.25 * 2, 2 + 0.25 * 1, 1.0])
    assert t["discounts"][5:].tolist() == pytest.approx([0.25 * 0.25, 0.25 * 0.5, 0.5])
    assert t["next_obs"][5:, 0].tolist() == [102, 150, 150]


def test_demo_mixing_ratio_is_exact():
    online, demos = ReplayBuffer(100), ReplayBuffer(100)
    online.add(transitions(np.zeros(50)))
    demos.add(transitions(np.ones(30)))
    rng = np.random.default_rng(0)
    for ratio, want in ((0.5, 128), (0.25, 64), (0.0, 0)):
        mb, k = sample_mixed(online, demos, 256, ratio, rng)
        assert k == want and int(mb["rewards"].sum()) == want and mb["obs"].shape == (256, 3)
    mb, k = sample_mixed(online, None, 256, 0.5, rng)
    assert k == 0 and int(mb["rewards"].sum()) == 0


def test_demonstrations_load_from_a_lerobot_dataset(tmp_path):
    """Episode ends: a terminal last frame (ended before the time limit) is kept with discount 0;
    an episode that ran into the time limit has no observation after its last frame, which is
    left out (the frame before bootstraps from its observation)."""
    import gymnasium as gym

    from ebrl.demos.lerobot import LeRobotWriter

    w = LeRobotWriter(tmp_path / "d", fps=10, features={"observation.state": ((3,), "float32"),
                                                        "action": ((2,), "float32")})
    for length in (3, 5):
        for t in range(length):
            w.add_frame({"observation.state": np.full(3, 10 * length + t, np.float32),
                         "action": np.full(2, t, np.float32), "next.reward": float(t), "next.done": t == length - 1,
                         "next.success": False}, task="reach")
        w.end_episode()
    root = w.close()
    space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    buf = load_demos(root, space, (2,), gamma=0.5, n_step=1, time_limit=5)
    mb = buf.gather(np.arange(len(buf)))
    assert len(buf) == 3 + 4
    assert mb["obs"][:, 0].tolist() == [30, 31, 32, 50, 51, 52, 53]
    assert mb["rewards"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert mb["discounts"].tolist() == [0.5, 0.5, 0.0, 0.5, 0.5, 0.5, 0.5]
    assert mb["next_obs"][[0, 1, 3, 6], 0].tolist() == [31, 32, 51, 54]
    # without a time limit every next.done is a termination (LeRobot's reading); n-step windows
    both = load_demos(root, space, (2,), gamma=0.5, n_step=2)
    mb = both.gather(np.arange(len(both)))
    assert len(both) == 8 and mb["discounts"].tolist() == [0.25, 0, 0, 0.25, 0.25, 0.25, 0, 0]
    assert mb["rewards"].tolist() == [0.5, 2, 2, 0.5, 2, 3.5, 5, 4]
    chunked = load_demos(root, space, (2, 2), gamma=0.5, n_step=1, time_limit=5)  # a chunk of 2: 2-step windows
    assert chunked.gather(np.arange(1))["actions"].shape == (1, 2, 2) and len(chunked) == 7


def test_demonstrations_keep_the_instruction_index(tmp_path):
    from ebrl.demos import collect
    from ebrl.testing import InstructedReach

    collect("mock/reach", tmp_path / "reach", episodes=2)
    env = InstructedReach()
    buf = load_demos(tmp_path / "reach", env.observation_space, env.action_space.shape, gamma=0.99, n_step=3,
                     time_limit=env.episode_len)
    mb = buf.sample(32, np.random.default_rng(0))
    assert mb["obs"]["instruction"].dtype == torch.int64 and mb["obs"]["state"].shape == (32, 4)
    assert len(buf) == 2 * (env.episode_len - 1)  # both ran into the time limit: their last frames left out
