"""The start-up probe in each of its placements: a child process (the hang matrix in
test_hangs.py covers its deadlines), a thread of this process, and inline on the caller's thread,
where a virtual-time loop allows neither a thread nor a child."""

import asyncio
import multiprocessing
import threading
import time
from typing import ClassVar

import pytest
from conftest import ebrl_threads

from ebrl.config import FaultConfig, SimConfig
from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.probe import EnvProbe
from ebrl.virtual_time import VirtualTimeLoop
from ebrl.testing import MockEnv

GATE = threading.Event()  # a hung build in the probe's thread returns when it is set


class Recorded(MockEnv):
    """Says which thread built it and how many steps it took."""

    threads: ClassVar[list[str]] = []
    steps = 0

    def __init__(self, i: int = 0):
        Recorded.threads.append(threading.current_thread().name)
        super().__init__(dim=3)

    def step(self, action):
        Recorded.steps += 1
        return super().step(action)


def test_inline_runs_every_request_on_the_callers_thread_under_virtual_time():
    Recorded.threads, Recorded.steps = [], 0

    async def probe():
        async with EnvProbe(Recorded, SimConfig(backend="auto"), FaultConfig(), where="inline") as p:
            return await p.facts(), await p.step_profile()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        facts, step = runner.run(probe())
    assert facts.action_space.shape == (3,) and step.wall_s > 0 and step.cpu_s >= 0
    assert Recorded.threads == [threading.current_thread().name] and Recorded.steps >= 10  # built and stepped here
    assert multiprocessing.active_children() == [] and ebrl_threads() == []


def test_inline_names_env_0_and_the_phase_of_a_failure():
    def broken(i):
        raise ValueError("no such env")

    async def probe():
        async with EnvProbe(broken, SimConfig(backend="auto"), FaultConfig(), where="inline") as p:
            await p.facts()

    with pytest.raises(EnvStepError, match=r"env 0 failed in env_fn: ValueError: no such env"):
        asyncio.run(probe())


def hangs(i):
    GATE.wait(60)
    return MockEnv(dim=3)


def test_a_build_hung_in_the_probes_thread_is_left_at_its_deadline_with_one_error():
    GATE.clear()

    async def probe():
        async with EnvProbe(hangs, SimConfig(backend="thread"), FaultConfig(build_timeout_s=0.2)) as p:
            await p.facts()

    t0 = time.monotonic()
    try:
        with pytest.raises(EnvStepError) as err:
            asyncio.run(probe())
        assert time.monotonic() - t0 >= 0.2
        assert err.value.op == "env_fn" and err.value.reason == "timeout"
        assert "its build in the sim probe ran past faults.build_timeout_s=0.2 s; its thread was left" in str(err.value)
        assert ebrl_threads() == ["ebrl-sim-probe"]  # still in env_fn: never joined
    finally:
        GATE.set()
    deadline = time.monotonic() + 30
    while ebrl_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ebrl_threads() == []  # its build returned; its reply found the pipe closed, and it ended
