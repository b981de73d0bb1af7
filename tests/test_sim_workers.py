"""ProcessSimPool on the block interface: steps travel through shared memory as env-id blocks,
replies stream (no env waits for the slowest of its message), failures are reported per env."""

import asyncio
import multiprocessing
import os
import pickle
import signal
import time

import gymnasium as gym
import numpy as np
import pytest

from ebrl.runtime import sim_workers
from ebrl.runtime.sim_types import EnvStepError, reset_env, step_env
from ebrl.runtime.sim_workers import ProcessSimPool
from ebrl.testing import Latency, MockEnv


class Collector:
    """An ``on_block`` that records every block and when it arrived, and can wait for ids."""

    def __init__(self):
        self.blocks, self.times, self.waiters = [], [], []

    def __call__(self, block):
        self.blocks.append(block)
        self.times.append(time.perf_counter())
        for w in self.waiters:
            w()

    async def wait(self, ids, timeout=5.0):
        """The blocks (from now on) that return ``ids``, once all of them are back."""
        start, want = len(self.blocks), set(int(i) for i in ids)
        done = asyncio.get_running_loop().create_future()

        def check():
            got = {int(i) for b in self.blocks[start:] for i in b.ids} | {
                i for b in self.blocks[start:] for i, _ in b.errors}
            if want <= got and not done.done():
                done.set_result(None)

        self.waiters.append(check)
        try:
            await asyncio.wait_for(done, timeout)
        finally:
            self.waiters.remove(check)
        return self.blocks[start:]


async def started(pool):
    col = Collector()
    pool.on_block = col
    await pool.start()
    return col


def by_id(blocks):
    """env id -> (block, row) over some blocks."""
    return {int(i): (b, r) for b in blocks for r, i in enumerate(b.ids)}


async def test_steps_match_an_in_process_copy_of_each_env(no_leaks):
    make = lambda i: MockEnv(dim=3, episode_len=3)  # noqa: E731
    pool = ProcessSimPool(make, num_envs=4, num_workers=2)
    col = await started(pool)
    try:
        assert pool.size == 2 and pool.observation_space == make(0).observation_space
        refs = [make(i) for i in range(4)]
        for i in range(4):
            obs, _ = await pool.reset(i, seed=i)
            np.testing.assert_array_equal(obs, reset_env(refs[i], seed=i)[0])
        rng = np.random.default_rng(0)
        ids = np.arange(4)
        truncations = 0
        for t in range(7):
            actions = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
            pool.submit(ids, actions)
            rows = by_id(await col.wait(ids))
            assert sorted(rows) == [0, 1, 2, 3]
            for i in range(4):
                block, r = rows[i]
                want = step_env(refs[i], actions[i])
                np.testing.assert_array_equal(block.obs[r], want.obs)
                assert block.reward[r] == pytest.approx(want.reward)
                assert block.truncated[r] == want.truncated == ((t + 1) % 3 == 0)
                assert not block.terminated[r] and block.finite[r] and block.success[r] == -1
                if want.truncated:
                    truncations += 1
                    np.testing.assert_array_equal(block.final_obs[r], want.final_obs)
                    assert not np.array_equal(block.final_obs[r], block.obs[r])
                else:
                    assert r not in block.final_obs
        assert truncations == 8  # steps 3 and 6 of every env
    finally:
        pool.close()


async def test_a_slow_env_does_not_hold_back_its_worker_mates(no_leaks):
    lat = lambda i: Latency.constant(0.2 if i == 0 else 0.001)  # noqa: E731
    pool = ProcessSimPool(lambda i: MockEnv(latency=lat(i)), num_envs=4, num_workers=1)
    col = await started(pool)
    try:
        ids, actions = np.arange(4), np.zeros((4, 4), np.float32)
        pool.submit(ids, actions)  # warm-up: the worker learns env 0 is slow
        await col.wait(ids)
        t0 = time.perf_counter()
        pool.submit(ids, actions)  # one message: env 0 first in it
        blocks = await col.wait(ids)
        start = len(col.blocks) - len(blocks)
        rows = by_id(blocks)
        slow = blocks.index(rows[0][0])
        for i in (1, 2, 3):
            assert blocks.index(rows[i][0]) < slow, f"env {i} waited for env 0"
            assert col.times[start + blocks.index(rows[i][0])] - t0 < 0.1
        assert list(blocks[slow].ids) == [0]
    finally:
        pool.close()


async def test_cheap_envs_come_back_in_one_reply_per_message(no_leaks):
    pool = ProcessSimPool(lambda i: MockEnv(latency=Latency.constant(0.001)), num_envs=4, num_workers=1,
                          reply_hold_s=0.05)
    col = await started(pool)
    try:
        ids = np.arange(4)
        for _ in range(5):
            pool.submit(ids, np.zeros((4, 4), np.float32))
            blocks = await col.wait(ids)
            assert len(blocks) == 1 and sorted(blocks[0].ids) == [0, 1, 2, 3]
        assert len(col.blocks) == 5
    finally:
        pool.close()


async def test_finished_envs_are_not_held_longer_than_the_hold_time(no_leaks):
    # 2 ms envs under a 5 ms hold: none is slow enough for rule (a), yet a message of 8 of
    # them (16 ms) must not come back as a single reply (rule (b))
    pool = ProcessSimPool(lambda i: MockEnv(latency=Latency.constant(0.002)), num_envs=8, num_workers=1,
                          reply_hold_s=0.005)
    col = await started(pool)
    try:
        ids = np.arange(8)
        pool.submit(ids, np.zeros((8, 4), np.float32))
        await col.wait(ids)
        pool.submit(ids, np.zeros((8, 4), np.float32))
        blocks = await col.wait(ids)
        assert 1 < len(blocks) < 8
    finally:
        pool.close()


class DictEnv(gym.Env):
    """Dict observations and actions whose values say which env, step and action made them."""

    observation_space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8),
                                         "state": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)})
    action_space = gym.spaces.Dict({"move": gym.spaces.Box(-1, 1, (2,), np.float32),
                                    "grip": gym.spaces.Discrete(2)})

    def __init__(self, env_id):
        self.env_id, self.t = env_id, 0

    def _obs(self, move=(0.0, 0.0), grip=0):
        pixels = np.full((8, 8, 3), (10 * self.env_id + self.t) % 256, np.uint8)
        return {"pixels": pixels, "state": np.array([self.t, move[0] + move[1], grip], np.float32)}

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(action["move"], int(action["grip"])), 1.0, False, self.t >= 4, {}


async def test_dict_observations_travel_through_shared_memory_unpickled(monkeypatch, no_leaks):
    pool = ProcessSimPool(DictEnv, num_envs=4, num_workers=2)
    col = await started(pool)
    try:
        assert len(pool._blocks) == 2 * 2 + 2 + 2  # obs and final_obs per key, act per key, reward, flags
        for i in range(4):
            await pool.reset(i)
        calls = []
        monkeypatch.setattr(sim_workers, "pickle", type("P", (), {
            "dumps": staticmethod(lambda *a, **k: calls.append("dumps") or pickle.dumps(*a, **k)),
            "loads": staticmethod(lambda *a, **k: calls.append("loads") or pickle.loads(*a, **k))}))
        sizes = []
        for w in pool._workers:
            for name in ("send_bytes", "recv_bytes"):
                def wrap(fn=getattr(w.conn, name)):
                    def inner(*a):
                        out = fn(*a)
                        sizes.append(len(a[0]) if a else len(out))
                        return out
                    return inner
                setattr(w.conn, name, wrap())
        ids = np.arange(4)
        for t in range(1, 7):
            move = np.stack([np.full(2, 0.1 * i + 0.01 * t, np.float32) for i in range(4)])
            grip = np.array([t % 2] * 4)
            pool.submit(ids, {"move": move, "grip": grip})
            rows = by_id(await col.wait(ids))
            for i in range(4):
                block, r = rows[i]
                assert block.obs["pixels"].dtype == np.uint8 and block.obs["pixels"].shape[1:] == (8, 8, 3)
                step = t % 4  # episodes of 4 steps, reset in the same step
                assert (block.obs["pixels"][r] == 10 * i + step).all()
                if step:
                    np.testing.assert_allclose(block.obs["state"][r], [step, move[i].sum(), t % 2], rtol=1e-6)
                else:
                    assert block.truncated[r]
                    assert (block.final_obs[r]["pixels"] == 10 * i + 4).all()
                    np.testing.assert_allclose(block.final_obs[r]["state"], [4, move[i].sum(), t % 2], rtol=1e-6)
        assert calls == []
        # every step message and reply is a tag and int32 ids: 2 envs a worker, one message each way
        assert set(sizes) <= {1 + 4 * k for k in (1, 2)} and len(sizes) >= 6 * 2 * 2
    finally:
        pool.close()


class BadReset(MockEnv):
    def reset(self, *, seed=None, options=None):
        if seed == 13:
            raise ValueError("unlucky seed")
        return super().reset(seed=seed, options=options)


async def test_a_failing_env_is_reported_in_its_block_and_can_be_rebuilt(no_leaks):
    pool = ProcessSimPool(lambda i: BadReset(fail_at_step=2 if i == 1 else None), num_envs=3, num_workers=2)
    col = await started(pool)
    try:
        ids, actions = np.arange(3), np.zeros((3, 4), np.float32)
        pool.submit(ids, actions)
        await col.wait(ids)
        pool.submit(ids, actions)
        blocks = await col.wait(ids)
        errors = [e for b in blocks for e in b.errors]
        assert errors == [(1, "RuntimeError: MockEnv: injected fault at step 2")]
        assert sorted(i for b in blocks for i in b.ids) == [0, 2]
        await pool.rebuild(1)
        obs, _ = await pool.reset(1, seed=0)
        np.testing.assert_array_equal(obs, MockEnv().reset(seed=0)[0])
        pool.submit(ids, actions)
        blocks = await col.wait(ids)
        assert sorted(i for b in blocks for i in b.ids) == [0, 1, 2] and not any(b.errors for b in blocks)
        with pytest.raises(EnvStepError, match="env 2 failed in reset: ValueError: unlucky seed") as err:
            await pool.reset(2, seed=13)
        assert err.value.env_id == 2 and err.value.op == "reset"
    finally:
        pool.close()


def _fail_on_3(i):
    if i == 3:
        raise RuntimeError("no simulator here")
    return MockEnv()


async def test_a_start_failure_names_the_worker_and_leaves_no_process():
    pool = ProcessSimPool(_fail_on_3, num_envs=4, num_workers=2)
    pool.on_block = lambda b: None
    with pytest.raises(EnvStepError, match="env 3 failed in env_fn: in worker 1: RuntimeError: no simulator here"):
        await pool.start()
    assert multiprocessing.active_children() == []


class TupleEnv(MockEnv):
    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))


async def test_an_unsupported_space_raises_type_error_and_leaves_no_process():
    pool = ProcessSimPool(lambda i: TupleEnv(), num_envs=2, num_workers=2)
    pool.on_block = lambda b: None
    with pytest.raises(TypeError, match="Tuple spaces cannot be stored in rows"):
        await pool.start()
    assert multiprocessing.active_children() == [] and pool._blocks == []


async def test_a_dead_worker_fails_its_envs_in_a_block_and_its_requests():
    pool = ProcessSimPool(lambda i: MockEnv(latency=Latency.constant(1.0 if i == 0 else 0.0)), num_envs=4,
                          num_workers=2)
    col = await started(pool)
    try:
        pool.submit(np.array([0, 2]), np.zeros((2, 4), np.float32))
        await asyncio.sleep(0.1)
        os.kill(pool._workers[0].process.pid, signal.SIGKILL)
        blocks = await col.wait([0, 2])
        assert sorted(e for b in blocks for e in b.errors) == [(0, "worker 0 died (exit code -9)"),
                                                               (2, "worker 0 died (exit code -9)")]
        with pytest.raises(RuntimeError, match="env 2: worker 0 died"):
            await pool.reset(2)
        pool.submit(np.array([1, 2]), np.zeros((2, 4), np.float32))  # worker 1 still steps
        blocks = await col.wait([1, 2])
        assert [i for b in blocks for i in b.ids] == [1] and [e for b in blocks for e in b.errors] == [
            (2, "worker 0 died (exit code -9)")]
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


async def test_close_leaves_no_process_and_unlinks_shared_memory():
    from multiprocessing import shared_memory

    pool = ProcessSimPool(lambda i: MockEnv(), num_envs=3, num_workers=3)
    col = await started(pool)
    await pool.reset(0)
    pool.submit(np.arange(3), np.zeros((3, 4), np.float32))
    await col.wait(range(3))
    names = [b.name for b in pool._blocks]
    assert len(names) == 5
    pool.close()
    pool.close()
    assert multiprocessing.active_children() == []
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(np.arange(1), np.zeros((1, 4), np.float32))
