"""Reset groups and episode segments (what GRPO needs from the runtime): envs of a group start
each episode from one seed on every sim backend, and with segment_cut="episode" each segment is
one episode from its reset, keyed by that seed in Batch.group."""

import numpy as np
import pytest

import ebrl
from ebrl.config import ConfigError
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual


class Drifting(MockEnv):
    """Env ``i`` draws ``i`` extra numbers from its RNG each step: group-mates' RNG streams part
    after their first episode, so only seeded resets give them equal starts."""

    def __init__(self, i):
        super().__init__(dim=3, episode_len=6, latency=Latency.uniform(0.0, 0.0005))
        self.i = i

    def step(self, action):
        self._rng.random(self.i)
        return super().step(action)


@pytest.mark.parametrize("backend", ["inline", "thread", "process"])
def test_groups_share_every_reset_and_segments_are_episodes(backend):
    algo = NoopAlgo()
    cfg = ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=1600, reset_group=4, segment_cut="episode",
                         sim={"backend": backend, "num_threads": 2, "num_workers": 2})
    # episodes of 6 steps: a segment of 16 holds one episode and stops at its end
    res = ebrl.run_sync(ebrl.Trainer(Drifting, MockPolicy(act_dim=3), algo, cfg))
    assert res.accounting_ok()
    firsts: dict[int, list[np.ndarray]] = {}
    for b in algo.batches:
        lengths = b.mask.sum(1).numpy()
        done = (b.terminated | b.truncated).numpy()
        ends, inner_ends = done[np.arange(len(lengths)), lengths - 1], done & (np.arange(done.shape[1]) < lengths[:, None] - 1)
        groups, first_obs = b.group.numpy(), b.obs[:, 0].numpy()
        assert not inner_ends.any()  # no episode end inside a segment: each one ends at its last step
        started = groups >= 0  # a batch may hold only rows cut for lag on a busy machine: counted over all, below
        for g, o, e, n in zip(groups[started], first_obs[started], ends[started], lengths[started]):
            assert n <= 6 and (e or n < 6)  # a whole episode, or the part before a cut for lag
            firsts.setdefault(int(g), []).append(o)
    assert firsts  # segments that start at a reset
    shared = [obs for obs in firsts.values() if len(obs) > 1]
    assert len(shared) >= 10  # episodes after the first: the seeds written for the autoresets
    for obs in shared:  # one seed, one start: MockEnv's first target is drawn from the reset's seed
        assert all(np.array_equal(obs[0], o) for o in obs[1:])


class EndsEarly(MockEnv):
    """Env ``i``'s ``k``-th episode terminates after ``3 + (i + 3k) % 9`` steps, before its time
    limit of 20: group-mates' episodes end at different steps (as when a task succeeds)."""

    def __init__(self, i):
        super().__init__(dim=3, episode_len=20)
        self.i, self.k, self.t = i, 0, 0

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        self.t += 1
        if self.t == 3 + (self.i + 3 * self.k) % 9:
            terminated = True
        if terminated or truncated:
            self.k, self.t = self.k + 1, 0
        return obs, reward, terminated, truncated, info


@pytest.mark.parametrize("schedule", ["sync", "pipelined"])
def test_lockstep_episode_segments_wait_for_every_env_instead_of_cutting(schedule):
    """Under a lockstep schedule an env whose episode ended first waits outside the barrier and
    the rest of its group steps on: every batch holds each env's whole episode from its reset
    (it was: the first episode end parked the whole group, the update cut every other segment,
    and GRPO used none of them)."""
    algo = NoopAlgo()
    num_envs = 8
    cfg = ebrl.RunConfig(num_envs=num_envs, segment_len=20, total_env_steps=2000, reset_group=4,
                         segment_cut="episode", schedule=schedule, num_groups=2, sim={"backend": "inline"})
    res = run_virtual(ebrl.Trainer(EndsEarly, MockPolicy(act_dim=3), algo, cfg))
    assert res.accounting_ok()
    full = algo.batches[:-1]  # the last one holds what the budget's end left
    assert len(full) >= 10
    for b in full:
        lengths = b.mask.sum(1).numpy()
        ends = (b.terminated | b.truncated).numpy()[np.arange(len(lengths)), lengths - 1]
        assert len(lengths) == num_envs and ends.all() and (b.group.numpy() >= 0).all(), lengths
        assert len(set(lengths.tolist())) > 1  # the episodes' lengths differ within a batch


def test_without_reset_groups_segments_cut_by_length_have_no_group():
    algo = NoopAlgo()
    cfg = ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=128, sim={"backend": "inline"})
    ebrl.run_sync(ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=6), MockPolicy(act_dim=3), algo, cfg))
    assert algo.batches and all(b.group is None for b in algo.batches)


def test_reset_group_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="reset_group"):
        ebrl.RunConfig(num_envs=6, reset_group=4)
    with pytest.raises(ConfigError, match="reset_group"):
        ebrl.RunConfig(num_envs=8, reset_group=4, sim={"vector_size": 2})
    with pytest.raises(ConfigError, match="segment_cut"):
        ebrl.RunConfig(segment_cut="episodes")
