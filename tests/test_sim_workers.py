"""The worker host on the block interface: steps travel through shared memory as env-id blocks,
replies stream (no env waits for the slowest of its message), failures are reported per env."""

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import signal
import time
import types

import gymnasium as gym
import numpy as np
import pytest

from ebrl.config import SimConfig
from ebrl.runtime.children import Child
from ebrl.runtime.errors import EnvStepError, PoolClosed
from ebrl.runtime.sim import SimPool, StepRows
from ebrl.runtime.sim import worker as sim_worker
from ebrl.runtime.sim import workers as sim_workers
from ebrl.runtime.sim.block import CPU, QUEUE, STEPS, WALL, Outbox
from ebrl.runtime.sim.stepping import reset_env, step_unit
from ebrl.testing import Latency, MockEnv


def ProcessSimPool(env_fn, num_envs, num_workers, start_method=None, reply_hold_s=0.002):  # noqa: N802
    """A pool whose envs all live on worker processes."""
    return SimPool(env_fn, num_envs, SimConfig(backend="process", num_workers=num_workers, start_method=start_method,
                                               reply_hold_s=reply_hold_s))


def step_env(env, action):
    """One step of an env outside any pool, as a worker steps it: a one-row Block."""
    rows = StepRows(1, env.observation_space, env.action_space)
    rows.set_actions(np.array([0]), np.asarray(action)[None])
    step_unit(env, rows, 0)
    return rows.block(np.array([0]))


class Collector:
    """Takes every block ``pool.recv()`` returns (until the pool closes), and can wait for ids."""

    def __init__(self, pool):
        self.blocks, self.waiters = [], []
        self.task = asyncio.get_running_loop().create_task(self.pump(pool))

    async def pump(self, pool):
        with contextlib.suppress(PoolClosed):
            while True:
                self.take(await pool.recv())

    def take(self, block):
        self.blocks.append(block)
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
    col = Collector(pool)
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
                np.testing.assert_array_equal(block.obs[r], want.obs[0])
                assert block.reward[r] == pytest.approx(want.reward[0])
                assert block.truncated[r] == want.truncated[0] == ((t + 1) % 3 == 0)
                assert not block.terminated[r] and block.finite[r] and block.success[r] == -1
                if want.truncated[0]:
                    truncations += 1
                    np.testing.assert_array_equal(block.final_obs[r], want.final_obs[0])
                    assert not np.array_equal(block.final_obs[r], block.obs[r])
                else:
                    assert r not in block.final_obs
        assert truncations == 8  # steps 3 and 6 of every env
    finally:
        pool.close()


async def test_a_slow_env_does_not_hold_back_its_worker_mates(monkeypatch, no_leaks):
    lat = lambda i: Latency.constant(0.2 if i == 0 else 0.001)  # noqa: E731
    pool = ProcessSimPool(lambda i: MockEnv(latency=lat(i)), num_envs=4, num_workers=1)
    delivered = []  # (ids, whether env 0's step was still out) as each block reached the outbox
    put = Outbox.put

    def put_recording(box, block):
        delivered.append((block.ids.tolist(), bool(pool.remote._busy[0])))
        put(box, block)

    monkeypatch.setattr(Outbox, "put", put_recording)
    col = await started(pool)
    try:
        ids, actions = np.arange(4), np.zeros((4, 4), np.float32)
        pool.submit(ids, actions)  # warm-up: the worker learns env 0 is slow
        await col.wait(ids)
        start = len(delivered)
        pool.submit(ids, actions)  # one message: env 0 first in it
        blocks = await col.wait(ids)
        rows = by_id(blocks)
        slow = blocks.index(rows[0][0])
        for i in (1, 2, 3):
            assert blocks.index(rows[i][0]) < slow, f"env {i} waited for env 0"
        assert list(blocks[slow].ids) == [0]
        # the fast envs reached the caller while env 0's step was still out (its reply not yet read),
        # whatever the load: an order, not a time
        fast = [out for ids_, out in delivered[start:] if 0 not in ids_]
        assert sorted(i for ids_, _ in delivered[start:] if 0 not in ids_ for i in ids_) == [1, 2, 3]
        assert fast and all(fast), delivered[start:]
    finally:
        pool.close()


class FakeClock:
    """``time`` for :mod:`ebrl.runtime.sim.worker`: wall and CPU seconds move only when a
    :class:`ClockedEnv` steps, by its declared cost."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def perf_counter(self):
        return self.wall

    def process_time(self):
        return self.cpu


class ClockedEnv(gym.Env):
    """Each step advances ``clock`` by ``wall_s`` (of which ``cpu_s`` on the CPU): a step of known cost."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, clock, wall_s, cpu_s=0.0):
        self.clock, self.wall_s, self.cpu_s = clock, wall_s, cpu_s

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.clock.wall += self.wall_s
        self.clock.cpu += self.cpu_s
        return np.zeros(1, np.float32), 0.0, False, False, {}


class InlineWorker:
    """A worker's stepping loop (:func:`~ebrl.runtime.sim.worker._step_message`) in this process, on
    a fake clock: its replies and costs are exact, whatever the machine's load."""

    def __init__(self, monkeypatch, costs, hold_s):
        """``costs``: per env, ``(wall_s, cpu_s)`` a step."""
        self.clock, self.hold_s = FakeClock(), hold_s
        monkeypatch.setattr(sim_worker, "time", self.clock)
        self.envs = {i: ClockedEnv(self.clock, w, c) for i, (w, c) in enumerate(costs)}
        self.rows = StepRows(len(costs), ClockedEnv.observation_space, ClockedEnv.action_space)
        self.ewma = [None] * len(costs)
        self.sent = []
        self.conn = types.SimpleNamespace(send_bytes=self.sent.append)

    def message(self, ids):
        """Step one message of ``ids``: the ids of each reply, in the order sent."""
        self.sent.clear()
        sim_worker._step_message(self.conn, self.envs, self.rows, self.ewma, list(ids), self.hold_s)
        assert all(raw[:1] == sim_worker.STEP for raw in self.sent)
        return [np.frombuffer(raw[1:], np.int32).tolist() for raw in self.sent]


def test_cheap_envs_come_back_in_one_reply_per_message(monkeypatch):
    worker = InlineWorker(monkeypatch, [(0.001, 0.0)] * 4, hold_s=0.05)  # 1 ms envs under a 50 ms hold
    for _ in range(5):
        assert worker.message(range(4)) == [[0, 1, 2, 3]]


def test_envs_finished_within_the_hold_time_share_a_reply(monkeypatch):
    # 2 ms envs under a 5 ms hold: a reply goes once its oldest env finished over 5 ms ago (rule (b))
    worker = InlineWorker(monkeypatch, [(0.002, 0.0)] * 8, hold_s=0.005)
    for _ in range(2):  # unmeasured, then measured (none is slow enough for rule (a))
        assert worker.message(range(8)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_known_slow_env_is_stepped_last_after_a_reply_of_its_mates(monkeypatch):
    worker = InlineWorker(monkeypatch, [(0.2, 0.0)] + [(0.001, 0.0)] * 3, hold_s=0.005)
    assert worker.message(range(4)) == [[0, 1, 2, 3]]  # unmeasured: in the message's order
    assert worker.message(range(4)) == [[1, 2, 3], [0]]  # rule (a): the finished mates go before env 0 steps


def test_a_workers_step_costs_are_its_wall_cpu_and_queue_seconds(monkeypatch):
    # env 0 sleeps 10 ms, env 1 computes its 20 ms, env 2 computes 4 of its 30 ms; one message of
    # all three (stepped cheapest first), three times: each waits for those stepped before it in
    # its message, never for itself
    worker = InlineWorker(monkeypatch, [(0.01, 0.0), (0.02, 0.02), (0.03, 0.004)], hold_s=0.002)
    for _ in range(3):
        worker.message(range(3))
    cost = worker.rows.cost
    np.testing.assert_array_equal(cost[:, STEPS], [3, 3, 3])
    np.testing.assert_allclose(cost[:, WALL], [0.03, 0.06, 0.09])
    np.testing.assert_allclose(cost[:, CPU], [0.0, 0.06, 0.012], atol=1e-12)
    np.testing.assert_allclose(cost[:, QUEUE], [0.0, 0.03, 0.09], atol=1e-12)


async def test_finished_envs_are_not_held_longer_than_the_hold_time(no_leaks):
    # 2 ms envs under a 5 ms hold: none is slow enough for rule (a), yet a message of 8 of
    # them (16 ms) must not come back as a single reply (rule (b)). A step sleeps at least its
    # 2 ms on any load, so the fourth env always ends over 5 ms after the first; how many replies
    # there are beyond that depends on the load (exactly two on an exact clock: the test above)
    pool = ProcessSimPool(lambda i: MockEnv(latency=Latency.constant(0.002)), num_envs=8, num_workers=1,
                          reply_hold_s=0.005)
    col = await started(pool)
    try:
        ids = np.arange(8)
        pool.submit(ids, np.zeros((8, 4), np.float32))
        await col.wait(ids)
        pool.submit(ids, np.zeros((8, 4), np.float32))
        blocks = await col.wait(ids)
        assert len(blocks) > 1
        assert sorted(i for b in blocks for i in b.ids) == list(range(8))
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
        assert len(pool.remote._blocks) == 2 * 2 + 2 + 5  # obs and final_obs per key, act per key, reward, flags, cost, started, reset_seed
        for i in range(4):
            await pool.reset(i)
        calls = []
        counting = type("P", (), {
            "dumps": staticmethod(lambda *a, **k: calls.append("dumps") or pickle.dumps(*a, **k)),
            "loads": staticmethod(lambda *a, **k: calls.append("loads") or pickle.loads(*a, **k))})
        for module in (sim_workers, sim_worker):  # the host's pickles and its worker links'
            monkeypatch.setattr(module, "pickle", counting)
        sizes = []
        for w in pool.remote._workers:  # messages sent
            def sent(msg, fn=w.child.send_bytes):
                sizes.append(len(msg))
                return fn(msg)
            w.child.send_bytes = sent
        read = Child.frames  # replies received, as read off the pipe and framed

        def replied(link):
            got = read(link)
            sizes.extend(len(raw) for raw in got or ())
            return got
        monkeypatch.setattr(Child, "frames", replied)
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
    with pytest.raises(EnvStepError, match="env 3 failed in env_fn: in worker 1: RuntimeError: no simulator here"):
        await pool.start()
    assert multiprocessing.active_children() == []


class TupleEnv(MockEnv):
    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))


async def test_an_unsupported_space_raises_type_error_and_leaves_no_process():
    pool = ProcessSimPool(lambda i: TupleEnv(), num_envs=2, num_workers=2)
    with pytest.raises(TypeError, match="Tuple spaces cannot be stored in rows"):
        await pool.start()
    assert multiprocessing.active_children() == [] and pool.remote._blocks == []


async def test_a_dead_worker_fails_its_envs_is_respawned_and_its_envs_come_back_when_rebuilt():
    from ebrl.runtime.errors import fault_reason

    pool = ProcessSimPool(lambda i: MockEnv(latency=Latency.constant(1.0 if i == 0 else 0.0)), num_envs=4,
                          num_workers=2)
    col = await started(pool)
    try:
        await pool.reset(2)
        pool.submit(np.array([0]), np.zeros((1, 4), np.float32))  # env 0 steps for 1 s; env 2 is idle
        await wait_for(lambda: pool.remote.rows.started[0] > 0)  # env 0 is inside its step
        dead = pool.remote._workers[0].child.pid
        os.kill(dead, signal.SIGKILL)
        blocks = await col.wait([0])
        errors = [e for b in blocks for e in b.errors]
        assert errors == [(0, "worker 0 died (killed by SIGKILL) and was respawned")]
        assert fault_reason(errors[0][1]) == "worker_died"
        assert pool.respawns == 1 and pool.remote._workers[0].child.pid != dead
        # env 2 was idle on it: its next step fails the same way, at once, until it is rebuilt
        pool.submit(np.array([1, 2]), np.zeros((2, 4), np.float32))
        blocks = await col.wait([1, 2])
        assert [i for b in blocks for i in b.ids] == [1]
        assert [fault_reason(e[1]) for b in blocks for e in b.errors] == ["worker_died"]
        await pool.rebuild(2)  # built anew in the respawned worker
        await pool.reset(2)
        pool.submit(np.array([2]), np.zeros((1, 4), np.float32))
        blocks = await col.wait([2])
        assert [i for b in blocks for i in b.ids] == [2] and not any(b.errors for b in blocks)
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
    names = [b.name for b in pool.remote._blocks]
    assert len(names) == 8  # obs, final_obs, act, reward, flags, cost, started, reset_seed
    pool.close()
    pool.close()
    assert multiprocessing.active_children() == []
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(np.arange(1), np.zeros((1, 4), np.float32))


# --- per-env costs, placement, migration, resize -------------------------------------------


class PidEnv(gym.Env):
    """Observations ``[pid of the hosting process, env id, steps since reset]``; reset's info
    has the pid too. ``close`` leaves a file ``closed-{id}-{pid}`` in ``flags``; seed 13 fails."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, env_id, flags, sleep_s=0.0):
        self.env_id, self.flags, self.sleep_s, self.t = env_id, flags, sleep_s, 0

    def _obs(self):
        return np.array([os.getpid(), self.env_id, self.t], np.float64)

    def reset(self, *, seed=None, options=None):
        if seed == 13:
            raise ValueError("unlucky seed")
        self.t = 0
        return self._obs(), {"pid": os.getpid()}

    def step(self, action):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self.t += 1
        return self._obs(), 0.0, False, False, {}

    def close(self):
        (self.flags / f"closed-{self.env_id}-{os.getpid()}").touch()


class PidEnvs:
    """``env_fn`` for PidEnv; raises once a file ``fail`` exists in ``flags`` (in any process)."""

    def __init__(self, flags, sleep=None):
        self.flags, self.sleep = flags, sleep or {}

    def __call__(self, i):
        if (self.flags / "fail").exists():
            raise RuntimeError("no simulator here")
        return PidEnv(i, self.flags, self.sleep.get(i, 0.0))


def pids(pool):
    return [w.child.pid for w in pool.remote._workers]


async def step_all(pool, col, ids):
    """Step ``ids`` once; env id -> the pid its step ran in."""
    ids = np.asarray(ids)
    pool.submit(ids, np.zeros((len(ids), 1), np.float32))
    blocks = await col.wait(ids)
    assert not any(b.errors for b in blocks)
    return {i: int(b.obs[r][0]) for i, (b, r) in by_id(blocks).items()}


async def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class CpuBoundEnv(MockEnv):
    """A MockEnv whose step computes: it spins until its thread has used ``cpu_s`` of CPU time
    (however much wall time that takes on a busy machine)."""

    def __init__(self, cpu_s, **kwargs):
        super().__init__(**kwargs)
        self.cpu_s = cpu_s

    def step(self, action):
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return super().step(action)


async def test_workers_count_each_envs_steps_wall_and_cpu_time(no_leaks):
    # env 0 sleeps 10 ms in step (CPU idle), env 1 computes 10 ms of CPU (busy); each on its own worker.
    # Only bounds that hold on any load: a sleep lasts at least its time, CPU time spun is spun, and
    # a step's wall time holds its CPU time; the exact sums are test_a_workers_step_costs_... above
    def make(i):
        return CpuBoundEnv(0.01) if i == 1 else MockEnv(latency=Latency.constant(0.01 if i == 0 else 0.0))

    pool = ProcessSimPool(make, num_envs=4, num_workers=2)
    assert pool.costs() is None
    col = await started(pool)
    try:
        assert pool.costs().shape[0] == 4 and not pool.costs().any()
        for _ in range(5):
            ids = np.arange(4)
            pool.submit(ids, np.zeros((4, 4), np.float32))
            await col.wait(ids)
        pool.submit(np.array([0]), np.zeros((1, 4), np.float32))  # env 0 once more
        await col.wait([0])
        costs = pool.costs()
        np.testing.assert_array_equal(costs[:, STEPS], [6, 5, 5, 5])
        assert (costs[:, WALL] > 0).all() and (costs[:, CPU] >= 0).all()
        assert costs[0, WALL] >= 6 * 0.01 and costs[1, WALL] >= 5 * 0.01
        assert costs[1, CPU] >= 5 * 0.01  # the computing env's CPU time is counted
        assert costs[0, CPU] < costs[0, WALL]  # the sleeping env's sleep is not
        assert costs[0, CPU] < costs[1, CPU]
        costs[:] = -1  # a copy
        assert (pool.costs() >= 0).all()
    finally:
        pool.close()
    assert pool.costs() is None


async def test_a_step_waiting_behind_its_worker_mates_counts_queue_time(no_leaks):
    pool = ProcessSimPool(lambda i: MockEnv(latency=Latency.constant(0.01)), num_envs=3, num_workers=1)
    col = await started(pool)
    try:
        for _ in range(3):
            pool.submit(np.arange(3), np.zeros((3, 4), np.float32))  # one message: 0, 10 and 20 ms of waiting
            await col.wait(range(3))
        costs = pool.costs()
        assert (costs[:, QUEUE] >= 0).all()
        # each message's second env waits at least one 10 ms sleep, its third two, on any load;
        # that nobody waits for its own step is exact on a fake clock (test_a_workers_step_costs_...)
        assert costs[:, QUEUE].sum() >= 3 * 0.03 - 1e-9
    finally:
        pool.close()


async def test_migrate_moves_an_env_to_another_worker(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path), num_envs=4, num_workers=2)
    col = await started(pool)
    try:
        pid = pids(pool)
        np.testing.assert_array_equal(pool.placement, [0, 1, 0, 1])
        assert pool.migrations == 0
        ran = await step_all(pool, col, range(4))
        assert ran == {0: pid[0], 1: pid[1], 2: pid[0], 3: pid[1]}
        obs, info = await pool.migrate(0, 1, seed=3)
        assert info["pid"] == pid[1] and obs.tolist() == [pid[1], 0, 0]
        np.testing.assert_array_equal(pool.placement, [1, 1, 0, 1])
        assert pool.migrations == 1
        pool.placement[0] = 0  # a copy
        assert pool.placement[0] == 1
        assert await step_all(pool, col, [0]) == {0: pid[1]}  # right after the migration
        await wait_for(lambda: (tmp_path / f"closed-0-{pid[0]}").exists())  # the old copy is closed
        ran = await step_all(pool, col, range(4))  # one block for all, across both workers
        assert ran == {0: pid[1], 1: pid[1], 2: pid[0], 3: pid[1]}
        np.testing.assert_array_equal(pool.costs()[:, STEPS], [3, 2, 2, 2])  # one row, wherever it ran
        obs, _ = await pool.reset(0)
        assert obs.tolist() == [pid[1], 0, 0]  # requests follow the placement
        await pool.rebuild(0)
        assert (tmp_path / f"closed-0-{pid[1]}").exists()  # rebuilt where it lives now
        with pytest.raises(ValueError, match="already on worker 1"):
            await pool.migrate(0, 1, seed=None)
        obs, info = await pool.migrate(0, 0, seed=None)  # and back
        assert info["pid"] == pid[0]
        assert await step_all(pool, col, range(4)) == {0: pid[0], 1: pid[1], 2: pid[0], 3: pid[1]}
        assert pool.migrations == 2
        with pytest.raises(ValueError, match="no worker 2"):
            await pool.migrate(0, 2, seed=None)
    finally:
        pool.close()


async def test_a_stepping_or_migrating_env_cannot_migrate_or_step(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path, sleep={0: 0.2}), num_envs=2, num_workers=2)
    col = await started(pool)
    try:
        pool.submit(np.array([0]), np.zeros((1, 1), np.float32))
        with pytest.raises(ValueError, match="env 0 is stepping"):
            await pool.migrate(0, 1, seed=None)
        await col.wait([0])
        moving = asyncio.ensure_future(pool.migrate(0, 1, seed=None))
        await asyncio.sleep(0)  # it has asked worker 1 to build env 0
        with pytest.raises(ValueError, match=r"envs \[0\] are migrating"):
            pool.submit(np.array([0, 1]), np.zeros((2, 1), np.float32))
        with pytest.raises(ValueError, match="env 0 is migrating"):
            await pool.reset(0)
        with pytest.raises(ValueError, match="env 0 is stepping or migrating"):
            await pool.migrate(0, 0, seed=None)
        await moving
        assert pool.placement.tolist() == [1, 1]
        pool.submit(np.array([0, 1]), np.zeros((2, 1), np.float32))
        await col.wait([0, 1])
    finally:
        pool.close()


async def test_a_cancelled_migration_leaves_the_env_where_it_was(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path), num_envs=2, num_workers=2)
    col = await started(pool)
    try:
        pid = pids(pool)
        moving = asyncio.ensure_future(pool.migrate(0, 1, seed=None))
        await asyncio.sleep(0)  # the adopt request is queued for worker 1
        moving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await moving
        assert pool.placement.tolist() == [0, 1] and pool.migrations == 0
        await wait_for(lambda: (tmp_path / f"closed-0-{pid[1]}").exists())  # worker 1 built it, then dropped it
        assert await step_all(pool, col, [0, 1]) == {0: pid[0], 1: pid[1]}
        _, info = await pool.migrate(0, 1, seed=None)
        assert info["pid"] == pid[1]
    finally:
        pool.close()


async def test_a_failed_migration_leaves_the_env_where_it_was(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path), num_envs=2, num_workers=2)
    col = await started(pool)
    try:
        pid = pids(pool)
        await step_all(pool, col, [0, 1])
        with pytest.raises(EnvStepError, match="env 1 failed in reset: in worker 0: ValueError: unlucky seed") as err:
            await pool.migrate(1, 0, seed=13)
        assert err.value.env_id == 1 and err.value.op == "reset"
        (tmp_path / "fail").touch()  # env_fn raises from now on, in every process
        with pytest.raises(EnvStepError, match="env 1 failed in env_fn: in worker 0: RuntimeError: no simulator"):
            await pool.migrate(1, 0, seed=0)
        assert pool.placement.tolist() == [0, 1] and pool.migrations == 0
        assert await step_all(pool, col, [0, 1]) == {0: pid[0], 1: pid[1]}
        assert (await step_all(pool, col, [1])) == {1: pid[1]}
        np.testing.assert_array_equal(pool.costs()[:, STEPS], [2, 3])
        (tmp_path / "fail").unlink()
        _, info = await pool.migrate(1, 0, seed=0)  # nothing left behind in worker 0 by the failures
        assert info["pid"] == pid[0]
        assert await step_all(pool, col, [0, 1]) == {0: pid[0], 1: pid[0]}
    finally:
        pool.close()


async def test_a_dead_worker_fails_the_envs_placed_on_it(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path, sleep={2: 1.0}), num_envs=4, num_workers=2)
    col = await started(pool)
    try:
        pid = pids(pool)
        await pool.migrate(0, 1, seed=None)  # worker 0 keeps env 2 only
        pool.submit(np.arange(4), np.zeros((4, 1), np.float32))
        blocks = await col.wait([0, 1, 3])
        assert sorted(i for b in blocks for i in b.ids) == [0, 1, 3]
        await wait_for(lambda: pool.remote.rows.started[2] > 0)  # env 2 is inside its step
        os.kill(pid[0], signal.SIGKILL)
        blocks = await col.wait([2])
        assert [e for b in blocks for e in b.errors] == [(2, "worker 0 died (killed by SIGKILL) and was respawned")]
        new = pids(pool)[0]
        assert new != pid[0] and pool.respawns == 1
        with pytest.raises(EnvStepError, match="env 2 failed in reset: .*not built in this worker"):
            await pool.reset(2)  # the respawned worker hosts nothing until the env is rebuilt or moved
        assert await step_all(pool, col, [0, 1, 3]) == {0: pid[1], 1: pid[1], 3: pid[1]}
        _, info = await pool.migrate(2, 1, seed=None)  # an env can be moved off its respawned worker
        assert info["pid"] == pid[1] and pool.placement.tolist() == [1, 1, 1, 1]
        assert await step_all(pool, col, range(4)) == dict.fromkeys(range(4), pid[1])
        _, info = await pool.migrate(1, 0, seed=None)  # and onto it
        assert info["pid"] == new
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
async def test_grow_adds_empty_workers_and_resize_retires_only_empty_ones(tmp_path, start_method, no_leaks):
    # one worker grown to two: a spawned worker imports ebrl (torch) afresh, seconds of CPU each
    pool = ProcessSimPool(PidEnvs(tmp_path), num_envs=2, num_workers=1, start_method=start_method)
    col = await started(pool)
    try:
        with pytest.raises(ValueError, match=">= 1"):
            pool.resize_workers(0)
        await pool.grow(2)
        assert pool.size == 2
        pid = pids(pool)
        assert pool.placement.tolist() == [0, 0]  # the new worker starts empty
        _, info = await pool.migrate(1, 1, seed=None)
        assert info["pid"] == pid[1] != pid[0]
        assert await step_all(pool, col, range(2)) == {0: pid[0], 1: pid[1]}
        np.testing.assert_array_equal(pool.costs()[:, STEPS], [1, 1])  # the new worker shares the rows
        with pytest.raises(ValueError, match=r"workers 1..1 still host envs \[1\]"):
            pool.resize_workers(1)
        await pool.migrate(1, 0, seed=None)
        pool.resize_workers(1)
        assert pool.size == 1 and pids(pool) == pid[:1]
        retired = pool.remote._retired[0].child.process
        await wait_for(lambda: not retired.is_alive())
        assert (tmp_path / f"closed-1-{pid[1]}").exists()  # the drop ran before it quit
        assert await step_all(pool, col, range(2)) == {0: pid[0], 1: pid[0]}
        with pytest.raises(ValueError, match="no worker 1"):
            await pool.migrate(1, 1, seed=None)
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


async def test_grow_forks_workers_off_the_loop_that_envs_can_move_to(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path), num_envs=3, num_workers=1)
    col = await started(pool)
    try:
        ticks = 0

        async def tick():  # the loop keeps running while the workers fork
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await pool.grow(3)
        ticker.cancel()
        assert pool.size == 3 and len(pids(pool)) == 3 and ticks > 1
        pid = pids(pool)
        await pool.migrate(1, 1, seed=None)
        await pool.migrate(2, 2, seed=None)
        assert await step_all(pool, col, range(3)) == {0: pid[0], 1: pid[1], 2: pid[2]}
        await pool.grow(2)  # no fewer: nothing to do
        assert pool.size == 3
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


async def test_a_grow_cancelled_mid_fork_leaves_no_process(tmp_path, no_leaks):
    pool = ProcessSimPool(PidEnvs(tmp_path), num_envs=2, num_workers=1)
    await started(pool)
    try:
        task = asyncio.ensure_future(pool.grow(4))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


class GatedEnv(MockEnv):
    """A MockEnv whose every step waits until the file ``gate`` exists: a step that runs until
    the test lets it end (or for ever, until its worker is killed)."""

    def __init__(self, gate, **kwargs):
        super().__init__(**kwargs)
        self.gate = str(gate)

    def step(self, action):
        while not os.path.exists(self.gate):
            time.sleep(0.001)
        return super().step(action)


async def test_a_stale_step_start_never_times_a_step_out(tmp_path, no_leaks):
    """A step cannot start before its message was sent: an older StepRows.started (left by
    anything) is ignored, so only a step that really ran past the limit kills its worker."""
    pool = ProcessSimPool(lambda i: GatedEnv(tmp_path / f"go-{i}", dim=2), num_envs=2, num_workers=1)
    col = await started(pool)
    try:
        for i in range(2):
            await pool.reset(i)
        started_at = pool.remote.rows.started
        pool.submit(np.array([0]), np.zeros((1, 2), np.float32))
        await wait_for(lambda: started_at[0] > 0)  # env 0 is in its step, which ends when we open its gate
        started_at[0] = time.perf_counter() - 100.0  # stale: before the step was sent
        assert pool.abandon_late(1.0) == [] and pool.remote._stale_starts == 1
        assert pool.respawns == 0
        (tmp_path / "go-0").touch()
        await col.wait([0])
        pool.submit(np.array([1]), np.zeros((1, 2), np.float32))
        await wait_for(lambda: started_at[1] > 0 and time.perf_counter() - started_at[1] > 0.05)
        assert pool.abandon_late(0.05) == [1]  # a real one: started after its send, running past 50 ms
    finally:
        pool.close()

