import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import uvloop

EXIT_GRACE_S = 5.0  # for a thread or child told to stop to finish exiting


def timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)


@pytest.fixture(autouse=True)
def _stacks_before_timeout(request):
    """Every thread's stack on stderr a second before pytest-timeout ends a hung test. Its own
    dump goes to the terminal, which an xdist worker does not show; faulthandler writes from C,
    so it fires while the main thread sits in uvloop's loop."""
    limit = timeout_of(request.node)
    if limit > 1:
        faulthandler.dump_traceback_later(limit - 1, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


# The slowest tests against their timeouts, at the end of every run: a test that uses much of its
# timeout on a quiet machine fails on a busy one. Each test's timeout travels in its reports'
# user_properties, which xdist's workers send to the process that prints the summary.
_spent: dict[str, list[float]] = {}  # nodeid -> [seconds in setup, call and teardown, timeout]


def pytest_runtest_setup(item):
    item.user_properties.append(("timeout_s", timeout_of(item)))


def pytest_runtest_logreport(report):
    limit = dict(report.user_properties).get("timeout_s")
    if limit:  # the timeout covers setup, call and teardown together
        spent = _spent.setdefault(report.nodeid, [0.0, limit])
        spent[0] += report.duration


def pytest_terminal_summary(terminalreporter):
    slowest = sorted(_spent.items(), key=lambda kv: kv[1][0] / kv[1][1], reverse=True)[:10]
    if slowest:
        terminalreporter.write_sep("=", "the 10 tests nearest their timeouts")
        for nodeid, (spent, limit) in slowest:
            terminalreporter.write_line(f"{spent:7.1f} s of {limit:5.0f} s ({spent / limit:4.0%})  {nodeid}")


def pytest_asyncio_loop_factories(config, item):
    """Async tests run on uvloop, as ebrl.run_sync does."""
    return {"uvloop": uvloop.new_event_loop}


def ebrl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ebrl-")]


def ebrl_children() -> list[str]:
    import multiprocessing

    return [p.name for p in multiprocessing.active_children() if p.name.startswith("ebrl-")]


def eventually_empty(what, grace_s: float = EXIT_GRACE_S) -> list:
    """``what()`` once it is empty, or as it stands after ``grace_s`` (a thread or child already
    told to stop may still be on its way out)."""
    deadline = time.monotonic() + grace_s
    while (left := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def no_leaks():
    """Fails a test that leaves an ebrl thread or a worker process behind."""
    yield
    assert eventually_empty(ebrl_threads) == []
    assert eventually_empty(ebrl_children) == []


def live_descendants(pid: int) -> dict[tuple[int, str], str]:
    """Every live process below ``pid``: (pid, start time) -> its command line. Read from
    /proc/PID/task/*/children, which lists a task's children (Linux; elsewhere: none found)."""
    found: dict[tuple[int, str], str] = {}
    todo = [pid]
    while todo:
        for tasks in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in tasks.read_text().split()]
            except OSError:
                continue
            for kid in kids:
                try:
                    stat = Path(f"/proc/{kid}/stat").read_text().rpartition(")")[2].split()
                    cmd = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if stat[0] not in ("Z", "X"):  # a zombie has died; its parent has not collected it yet
                    found[(kid, stat[19])] = cmd.strip()[:200]
                    todo.append(kid)
    return found


_started_by: dict[tuple[int, str], str] = {}  # a child process of this pytest process -> the test it appeared in


@pytest.fixture(autouse=True)
def _who_started_children(request):
    yield
    for proc in live_descendants(os.getpid()):
        _started_by.setdefault(proc, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _nothing_outlives_the_session():
    """Fails the session if a process this pytest process started is still alive at its end
    (after the session's helpers are stopped), naming it and the test it appeared in."""
    yield
    left = eventually_empty(lambda: live_descendants(os.getpid()))
    if left:
        pytest.fail("processes outlived the test session:\n" + "\n".join(
            f"  pid {pid}: {cmd} (started in {_started_by.get((pid, start), 'a session fixture')})"
            for (pid, start), cmd in left.items()), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _helpers_for_the_session(_nothing_outlives_the_session):
    """The session holds one :func:`~ebrl.runtime.children.helpers_scope`, as a run does: the
    fork server starts once for all the tests here and stops before the check above."""
    from ebrl.runtime.children import helpers_scope

    with helpers_scope():
        yield


@pytest.fixture
def hf_offline(monkeypatch):
    """No test may reach the network: connecting a socket raises, and the hub is told it is
    offline (the bring-your-own-VLA tests load every model from a local directory)."""
    import socket

    connect = socket.socket.connect

    def refuse(sock, *args, **kwargs):
        if sock.family == socket.AF_UNIX:  # this machine's own (a fork server's socket)
            return connect(sock, *args, **kwargs)
        raise OSError("network access attempted in an offline test")

    def refuse_connection(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse_connection)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama at save_random_hf_model's defaults (hidden 32, 2 layers, initializer
    range 0.02, as a fresh config gives), with the words "reach the target"."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from ebrl.testing import save_random_hf_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(path, kind="llama", sentences=("reach the target",))
    return path
