"""The step-timeout watchdog reads StepRows.started while the workers write it: a step that ends
while the worker host's abandon_late reads must not look late. Read twice, its start passed the
"> 0" test and the 0 its worker wrote then gave ``now - 0`` (the host's uptime) as its age: the
false timeout that once killed a healthy worker at the end of a convergence run."""

import asyncio
import contextlib
import time
import types

import numpy as np

from test_sim_workers import GatedEnv, ProcessSimPool, wait_for

from ebrl.runtime.errors import PoolClosed, fault_reason
from ebrl.runtime.sim import workers as sim_workers


PUMPS: set[asyncio.Task] = set()


def collect(pool) -> list:
    """The blocks ``pool.recv()`` returns, taken by a task that ends when the pool closes."""
    blocks = []

    async def pump():
        with contextlib.suppress(PoolClosed):
            while True:
                blocks.append(await pool.recv())

    task = asyncio.get_running_loop().create_task(pump())
    PUMPS.add(task)  # a task is only weakly held by the loop
    task.add_done_callback(PUMPS.discard)
    return blocks


def ends_on_clock_read(pool, env_id):
    """the worker host's ``time``, whose perf_counter first ends env ``env_id``'s running step (its
    worker writes 0, as at a step's end): the watchdog reads the clock between its reads of the row."""

    def perf_counter():
        pool.remote.rows.started[env_id] = 0.0
        return time.perf_counter()

    return types.SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic)


async def a_step_ending_mid_read(monkeypatch, pool, gate, guard: bool):
    blocks = collect(pool)
    await pool.start()
    try:
        await pool.reset(0)
        pool.submit(np.array([0]), np.zeros((1, 2), np.float32))
        await wait_for(lambda: pool.remote.rows.started[0] > 0)  # env 0 is in its step (until the gate opens)
        if not guard:
            pool.remote._sent_at[:] = 0.0  # as before the send-time guard (0051b83): nothing to compare with
        with monkeypatch.context() as m:
            m.setattr(sim_workers, "time", ends_on_clock_read(pool, 0))
            late = pool.abandon_late(60.0)
        assert late == [] and pool.respawns == 0
        assert pool.remote._stale_starts == 0  # a step that ended is not a stale start either
        gate.touch()
        await wait_for(lambda: blocks)
        assert [b.ids.tolist() for b in blocks] == [[0]] and not blocks[0].errors  # the step came back whole
    finally:
        pool.close()


async def test_a_step_ending_while_the_watchdog_reads_is_not_late(monkeypatch, tmp_path, no_leaks):
    pool = ProcessSimPool(lambda i: GatedEnv(tmp_path / "go", dim=2), num_envs=1, num_workers=1)
    await a_step_ending_mid_read(monkeypatch, pool, tmp_path / "go", guard=True)


async def test_without_the_send_time_guard_too(monkeypatch, tmp_path, no_leaks):
    """The incident's code had no send-time guard: the second read alone then killed the worker."""
    pool = ProcessSimPool(lambda i: GatedEnv(tmp_path / "go", dim=2), num_envs=1, num_workers=1)
    await a_step_ending_mid_read(monkeypatch, pool, tmp_path / "go", guard=False)


async def hang_and_kill(pool: ProcessSimPool) -> list:
    """Start ``pool``, step env 0 (which hangs) until the watchdog kills its worker for it; the
    blocks that came back (env 0's failure)."""
    blocks = collect(pool)
    await pool.start()
    await pool.reset(0)
    started = pool.remote.rows.started
    pool.submit(np.array([0]), np.zeros((1, 2), np.float32))
    # in its step, and for longer than the limit: it hangs, so no load can end it first
    await wait_for(lambda: started[0] > 0 and time.perf_counter() - started[0] > 0.1)
    assert pool.abandon_late(0.1) == [0]
    await wait_for(lambda: blocks)
    return blocks


def hanging(tmp_path):
    """``env_fn``: envs whose steps never end (their gate never opens)."""
    return lambda i: GatedEnv(tmp_path / "never", dim=2)


async def test_a_step_really_past_the_limit_still_times_out(tmp_path, no_leaks):
    pool = ProcessSimPool(hanging(tmp_path), num_envs=1, num_workers=1)
    try:
        blocks = await hang_and_kill(pool)
        assert [i for b in blocks for i, _ in b.errors] == [0] and pool.respawns == 1
    finally:
        pool.close()


async def test_a_killed_workers_step_start_does_not_time_out_the_envs_rebuild_in_the_new_worker(tmp_path, no_leaks):
    """Killed in a step, a worker leaves that step's start in the shared row. The env's rebuild,
    queued in the new worker, must not look late by it: that killed the new worker (and the
    env's worker-mates again) and charged the env a second timeout."""
    pool = ProcessSimPool(hanging(tmp_path), num_envs=2, num_workers=1)
    try:
        blocks = await hang_and_kill(pool)
        assert [(i, fault_reason(e)) for b in blocks for i, e in b.errors] == [(0, "timeout")] and pool.respawns == 1
        # the new worker has started (so its start-up time is not on trial: only the row is)
        await wait_for(lambda: pool.remote._workers[0].child.heard, timeout=30.0)
        rebuild = asyncio.ensure_future(pool.rebuild(0))
        assert not pool.abandon(0, 0.1)  # not started in the new worker: not late
        await rebuild
        assert pool.respawns == 1
    finally:
        pool.close()
