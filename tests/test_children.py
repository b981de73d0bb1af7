"""The child-process helper (:class:`~ebrl.runtime.children.Child`) on real children: a request
past its deadline (on the loop's clock) kills the child, a child that dies mid-request is named
with its exit code or signal, reaping leaves no child. And nothing that starts children outlives
its owner: the fork server and the resource tracker that a run, a pool, a probe or a learner
process started are stopped when it ends, in a fresh interpreter where nothing else holds them
(this session's own scope would, see conftest.py)."""

import asyncio
import itertools
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ebrl.runtime.children import Child, ChildDied, ChildFailed, serve
from ebrl.virtual_time import VirtualTimeLoop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork servers and /proc")

# each owner in turn, on the fork server; after each: are the helpers running, and which
# processes are left below this one
SCRIPT = textwrap.dedent("""\
    import asyncio, json, os, sys
    from pathlib import Path

    import torch

    import ebrl
    from ebrl.config import FaultConfig, SimConfig
    from ebrl.runtime import threads
    from ebrl.runtime.learner_process import LearnerProcess
    from ebrl.runtime.probe import EnvProbe
    from ebrl.runtime.sim import SimPool
    from ebrl.testing import MockEnv, MockPolicy, NoopAlgo

    def left():
        kids = []
        for tasks in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
            kids += [int(k) for k in tasks.read_text().split()]
        live = [k for k in kids if Path(f"/proc/{k}/stat").exists()
                and Path(f"/proc/{k}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"]
        return {"helpers": threads._helpers_running(), "children": live, "server_seen": seen[-1]}

    seen = [False]
    real = threads._helpers_running
    def spy():  # whether the fork server ran at some point of the owner's life
        running = real()
        seen[-1] = seen[-1] or running[0]
        return running

    env_fn = lambda i: MockEnv(dim=2, episode_len=5)
    sim = SimConfig(backend="process", num_workers=1, start_method="forkserver")

    async def pool():
        p = SimPool(env_fn, 2, sim)
        await p.start()
        await p.reset(0, seed=0)
        spy()
        p.close()

    async def probe():
        async with EnvProbe(env_fn, SimConfig(backend="auto", start_method="forkserver"), FaultConfig()) as p:
            await p.facts()
            spy()

    def learner():
        policy = torch.nn.Linear(2, 2)
        remote = LearnerProcess(policy, NoopAlgo(), torch_threads=1, start_method="forkserver", start_timeout_s=60)
        remote.algo_state()  # started and answering
        spy()
        remote.close(policy, NoopAlgo())

    def run():
        trainer = ebrl.Trainer(env_fn=env_fn, policy=MockPolicy(act_dim=2), algo=NoopAlgo(),
                               config=ebrl.RunConfig(num_envs=2, segment_len=4, total_env_steps=16,
                                                     sim={"backend": "process", "num_workers": 1,
                                                          "start_method": "forkserver"}))
        ebrl.run_sync(trainer)
        seen[-1] = True  # run() stops its helpers before it returns: checked below by their absence

    out = {}
    for name, owner in [("pool", pool), ("probe", probe), ("learner", learner), ("run", run)]:
        seen.append(False)
        result = owner()
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        out[name] = left()
    print("RESULT", json.dumps(out))
""")


@pytest.fixture(scope="module")
def after_each_owner():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.mark.parametrize("owner", ["pool", "probe", "learner", "run"])
def test_an_owner_of_children_stops_the_helpers_it_started(after_each_owner, owner):
    state = after_each_owner[owner]
    if owner != "run":
        assert state["server_seen"], "the owner never used a fork server: the test proves nothing"
    assert state["helpers"] == [False, False], "fork server, resource tracker still running"
    assert state["children"] == []


def test_nested_scopes_stop_the_helpers_with_the_last():
    script = textwrap.dedent("""\
        from ebrl.runtime import children, threads
        with children.helpers_scope():
            with children.helpers_scope():
                p = children.fork_server().Process(target=int)
                p.start(); p.join(30)
            inner = threads._helpers_running()[0]
        print(inner, threads._helpers_running()[0])
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["True", "False"]


FORK = multiprocessing.get_context("fork")  # the handler below travels with the fork
GATE = threading.Event()  # a thread child's hang returns when it is set


class Handler:
    def echo(self, x):
        return x

    def sleep(self, s):
        time.sleep(s)
        return s

    def hang(self):
        GATE.wait(60)

    def fail(self):
        raise ValueError("bad input")

    def exit(self, code):
        os._exit(code)

    def kill_self(self):
        os.kill(os.getpid(), signal.SIGKILL)


def handler_main(conn):
    serve(conn, Handler())


def start(name="ebrl-test-child", start_timeout_s=30):
    return Child.start(name, handler_main, ctx=FORK, start_timeout_s=start_timeout_s)


def gone(child) -> bool:
    return not child.process.is_alive() and child.process.exitcode is not None and child.conn.closed


@pytest.fixture(autouse=False)
def no_children():
    yield
    assert multiprocessing.active_children() == []


async def test_a_request_past_its_deadline_kills_the_child_and_raises(no_children):
    child = start()
    try:
        assert await child.ask("echo", {"a": 1}, timeout_s=30) == {"a": 1}
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await child.ask("sleep", 60, timeout_s=0.2)
        assert 0.2 <= time.monotonic() - t0 < 10
        assert child.killed and child.exit_reason() == "killed by SIGKILL"
    finally:
        child.reap()
    assert gone(child)


def test_a_deadline_is_read_from_the_running_loops_clock(no_children):
    """On a virtual-time loop, whose clock jumps to the next timer when nothing is ready, an hour's
    deadline passes at once in wall time: the deadline is the loop's, not the wall clock's."""
    async def ask():
        child = start(start_timeout_s=None)
        try:
            assert await child.ask("echo", 1) == 1  # no deadline: the loop waits on the pipe itself
            t0, v0 = time.monotonic(), asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await child.ask("sleep", 60, timeout_s=3600)
            return time.monotonic() - t0, asyncio.get_running_loop().time() - v0
        finally:
            child.reap()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        wall, virtual = runner.run(ask())
    assert wall < 10 and virtual >= 3600


@pytest.mark.parametrize("how, request_, reason", [("exit", ("exit", 3), "exit code 3"),
                                                   ("signal", ("kill_self",), "killed by SIGKILL")])
async def test_a_child_that_dies_mid_request_is_named_with_its_exit_reason(no_children, how, request_, reason):
    child = start()
    try:
        with pytest.raises(ChildDied, match=rf"ebrl-test-child died \({reason}\)") as err:
            await child.ask(*request_, timeout_s=30)
        assert err.value.how == reason and not child.killed
        with pytest.raises(ChildDied):  # asked again: its pipe is broken
            child.ask_blocking("echo", 1, timeout_s=30)
    finally:
        child.reap()
    assert gone(child)


def test_blocking_requests_have_the_same_deadline_failure_and_death(no_children):
    child = start()
    try:
        assert child.ask_blocking("echo", 5, timeout_s=30) == 5
        with pytest.raises(ChildFailed, match="ValueError: bad input") as err:
            child.ask_blocking("fail", timeout_s=30)
        assert "Traceback" in err.value.trace and err.value.summary == "ValueError: bad input"
        assert child.ask_blocking("echo", 6) == 6  # a failed request leaves it serving
        with pytest.raises(TimeoutError):
            child.ask_blocking("sleep", 60, timeout_s=0.2)
        assert child.exit_reason() == "killed by SIGKILL"
    finally:
        child.reap()
    assert gone(child)


def test_reaping_ends_idle_and_hung_children_alike_and_leaves_none(no_children):
    idle, hung = start("ebrl-test-idle"), start("ebrl-test-hung")
    assert idle.ask_blocking("echo", 0) == hung.ask_blocking("echo", 0) == 0  # both serving
    hung.send_bytes(__import__("pickle").dumps(("sleep", (60,))))  # in a call: it never reads QUIT
    t0 = time.monotonic()
    Child.reap_all([idle, hung], wait_s=0.5)
    assert time.monotonic() - t0 < 10
    assert idle.process.exitcode == 0 and not idle.killed  # it read QUIT and returned
    assert hung.process.exitcode == -signal.SIGKILL and hung.killed
    assert gone(idle) and gone(hung)


async def test_a_start_cancelled_off_the_loop_still_reaps_its_child(no_children):
    task = asyncio.ensure_future(Child.start_off_loop("ebrl-test-child", handler_main, ctx=FORK))
    await asyncio.sleep(0)  # the fork is under way in its thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_thread_child_answers_alike_and_is_left_when_it_hangs():
    GATE.clear()
    parent, conn = multiprocessing.Pipe()
    thread = threading.Thread(target=handler_main, args=(conn,), name="ebrl-test-thread", daemon=True)
    thread.start()
    child = Child("ebrl-test-thread", thread, parent, start_timeout_s=30)  # a thread standing in for a child
    try:
        assert await child.ask("echo", [1, 2], timeout_s=30) == [1, 2]
        with pytest.raises(ChildFailed, match="ValueError"):
            await child.ask("fail", timeout_s=30)
        with pytest.raises(TimeoutError):
            await child.ask("hang", timeout_s=0.1)
        assert thread.is_alive()  # never joined: a thread cannot be killed
        child.reap(0.0)
    finally:
        GATE.set()
    thread.join(30)  # its hang returned, its reply found the pipe closed
    assert not thread.is_alive()


def test_frames_are_whole_across_reads():
    """One read may hold two frames, or half of one: each whole frame is handed over once, in order."""
    mine, theirs = multiprocessing.Pipe()
    child = Child("ebrl-test-reader", None, mine)  # only the reader: no process
    theirs.send_bytes(b"S" + bytes(8))
    theirs.send_bytes(b"S" + bytes(4))
    assert child.frames() == [b"S" + bytes(8), b"S" + bytes(4)] and child.heard
    frame = struct.pack("!i", 9) + b"E" + bytes(8)
    os.write(theirs.fileno(), frame[:6])  # the header and a byte of the body
    assert child.frames() == []
    os.write(theirs.fileno(), frame[6:])
    assert child.frames() == [b"E" + bytes(8)]
    theirs.close()
    assert child.frames() is None  # its end closed: it died
    mine.close()


def test_a_frame_over_many_reads_comes_whole_once():
    """A frame larger than one read (a learner process's trained state) arrives over many reads,
    its header split among them too: it is handed over whole once its last byte is read, then
    the frame after it."""
    mine, theirs = multiprocessing.Pipe()
    child = Child("ebrl-test-reader", None, mine)
    body = bytes(range(256)) * 4096  # 1 MiB, in 17 reads of at most 64 KiB (each fits the socket's buffer)
    wire = struct.pack("!i", len(body)) + body + struct.pack("!i", 2) + b"OK"
    cuts = [0, 2, 5, *range(5 + 65_536, len(body), 65_536), len(wire) - 4, len(wire)]  # the last two split a header
    got = []
    for a, b in itertools.pairwise(cuts):
        os.write(theirs.fileno(), wire[a:b])
        got.append(child.frames())
    assert got[:-2] == [[]] * (len(got) - 2) and got[-2:] == [[body], [b"OK"]]
    theirs.close()
    mine.close()
