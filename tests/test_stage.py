"""Stage: where the generator's and the learner's calls run, and what they cost."""

import asyncio
import threading
import time

import pytest

from ebrl.runtime.stage import Stage
from ebrl.virtual_time import InlineStage, VirtualTimeLoop


def test_under_virtual_time_a_call_runs_inline_and_costs_what_it_declares():
    stage = InlineStage("gen", cost=lambda rows: 0.001 * rows)
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(stage.call(lambda: seen.append(threading.current_thread()) or 7, size=5,
                                              thread=True))  # thread is ignored: nothing runs in threads here
        await asyncio.sleep(0.002)
        during = stage.busy_until_now(loop.time())  # the call in progress, counted up to now
        return await task, during, loop.time()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, during, now = runner.run(main())
    assert result == 7 and seen == [threading.main_thread()]
    assert during == pytest.approx(0.002) and now == pytest.approx(0.005)
    assert stage.busy_s == pytest.approx(0.005) and stage.last_s == stage.busy_s and stage.cpu_s == 0.0
    assert stage.calls == 1


def test_threaded_calls_run_in_one_thread_of_their_own_and_count_its_cpu():
    stage = Stage("learner")

    def spin() -> str:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:
            pass
        return threading.current_thread().name

    async def main():
        names = [await stage.call(spin, thread=True) for _ in range(2)]
        inline = await stage.call(threading.current_thread)
        return names, inline

    try:
        names, inline = asyncio.run(main())
    finally:
        assert stage.close() == []
    assert names[0] == names[1] and names[0].startswith("ebrl-learner")
    assert inline is threading.main_thread()
    assert stage.calls == 3 and stage.cpu_s >= 0.04 and stage.busy_s >= stage.cpu_s * 0.9


def test_close_reports_a_call_that_outlives_its_wait():
    stage = Stage("stuck")
    release = threading.Event()

    async def main():
        task = asyncio.create_task(stage.call(release.wait, thread=True))
        await asyncio.sleep(0.05)
        return task

    with asyncio.Runner() as runner:
        task = runner.run(main())
        running = stage.close(wait_s=0.05)
        assert [t.name for t in running] and running[0].is_alive()
        release.set()
        running[0].join(1.0)
        assert runner.run(asyncio.wait_for(task, 1.0)) is True  # the call's own result still arrives
    assert not running[0].is_alive() and stage.calls == 1
