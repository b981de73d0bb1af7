"""Blocking work kept off the caller's event loop (:func:`in_thread`: ``run()`` shares the
caller's loop), and the thread and process plumbing the runtime shares: usable cores, a child's
stop signals, and the life of the helper processes multiprocessing starts on demand
(:func:`helpers_scope`). A thread inside a call that hangs (an env constructor hung in C code)
cannot be stopped: it is never joined on the loop, and logged; work that may hang for good
belongs in a child process, which can be killed (:mod:`ebrl.runtime.children`).

    >>> import asyncio, threading
    >>> asyncio.run(in_thread(lambda: threading.current_thread().name, name="ebrl-doc"))
    'ebrl-doc'
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, resource_tracker, util
from typing import Any, TypeVar

from ebrl.telemetry.logging import get_logger

T = TypeVar("T")
# how long a closing piece waits for work in flight (a lane's step, a worker, the update, an
# evaluation) before it leaves or kills it: with every piece closed in turn, a stop ends within 5 s
CLOSE_WAIT_S = 1.0
log = get_logger("ebrl.threads")
_scopes = 0  # helpers_scope()s open now
_scopes_lock = threading.Lock()
_running_before: tuple[bool, bool] = (True, True)  # fork server, resource tracker: running when the first opened
STOP_WAIT_S = 5.0  # for a helper to exit once told; then it is killed


async def in_thread(fn: Callable[..., T], *args: Any, name: str = "ebrl-offloop", may_hang: bool = False,
                    timeout_s: float | None = None) -> T:
    """``fn(*args)`` in a private daemon thread, joined once it returns. Bounded work (a fork, a
    join) is awaited to its end however often the caller is cancelled, so what it started is
    there to close; work that ``may_hang`` (a user's env constructor) is given up on at once when
    the caller is cancelled, or with ``TimeoutError`` past ``timeout_s``, and its thread left."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, done, result, exc)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        async with asyncio.timeout(timeout_s if may_hang else None):
            return await asyncio.shield(done)
    except asyncio.CancelledError:
        while not may_hang and not done.done():  # milliseconds more: then the caller's cleanup sees it all
            with contextlib.suppress(BaseException):
                await asyncio.shield(done)
        raise
    finally:
        if done.done():
            thread.join()  # it has handed its result over: it is returning
        else:
            done.add_done_callback(forget)  # the work failed after it was given up on
            leave(thread, timeout_s)


def leave(thread: threading.Thread, timeout_s: float | None = None) -> None:
    """Give up on ``thread``, in a call that may never return: it is never joined, and logged."""
    log.warning("thread_left_running", thread=thread.name, timeout_s=timeout_s,
                hint="a call that never returned (an env constructor hung in C code?); the thread is a daemon")


def settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """Give ``fut`` its result or exception, unless it is done (called on the loop, from a thread)."""
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)


def forget(fut: asyncio.Future) -> None:
    """A done callback for a future whose outcome no longer matters: asyncio logs no exception of it."""
    if not fut.cancelled():
        fut.exception()


def usable_cpus() -> int:
    """Cores this process may use: its CPU affinity (a pinned rank has one), not the machine's;
    shared with the other ranks of a data-parallel job on this machine (torchrun's
    ``LOCAL_WORLD_SIZE``), or as many as a launcher gave it (``EBRL_CPUS``, Ray's bundles)."""
    if os.environ.get("EBRL_CPUS", "").isdigit() and int(os.environ["EBRL_CPUS"]) > 0:
        return int(os.environ["EBRL_CPUS"])
    try:
        n = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        n = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, n // int(local)) if local.isdigit() and int(local) > 1 else n


def ignore_stop_signals() -> None:
    """In a child process: Ctrl-C and SIGTERM, which a terminal or a scheduler (Slurm, Kubernetes,
    ``timeout``) sends the whole process group, are the parent's to act on (it ends its children
    cleanly); and the child exits within a second of its parent's death (a SIGKILL, an OOM kill),
    which its pipe alone would not tell it, since forked siblings hold copies of the parent's ends."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # read once: read again after the parent died, it would name init, whose death we would wait for
    known, parent = multiprocessing.parent_process(), os.getppid()
    if known is not None and known.pid is not None and known.pid != parent:
        # started by a fork server (our OS parent is the server), or forked from a parent that is
        # already dead: the pipe multiprocessing keeps to the parent closes when it dies
        _exit_after(known.join)
    else:
        exit_with_parent(parent)


def exit_with_parent(parent: int) -> None:
    """Exit within about half a second once process ``parent`` is no longer this one's parent: it
    died, and no one will read our results or stop us (a data-parallel rank watches its launcher)."""

    def gone() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)

    _exit_after(gone)


def _exit_after(wait: Callable[[], Any]) -> None:
    """``os._exit(1)`` once ``wait()`` returns, in a daemon thread."""

    def watch() -> None:
        wait()
        os._exit(1)

    threading.Thread(target=watch, name="ebrl-parent-watch", daemon=True).start()


def _helpers_running() -> tuple[bool, bool]:
    return (forkserver._forkserver._forkserver_pid is not None,  # noqa: SLF001 (no public probe)
            resource_tracker._resource_tracker._pid is not None)  # noqa: SLF001


@contextlib.contextmanager
def helpers_scope() -> Iterator[None]:
    """Around a run, the sim workers' shared memory, or a :class:`~ebrl.runtime.children.Child`'s
    life: the fork server and the resource tracker (which unlinks shared memory a crashed process
    left), where they started inside, are stopped when the last open scope ends, so that no process
    outlives ``run()``, nor a pool or probe built outside it. Nested and concurrent scopes (a
    learner process starts in a thread) share them."""
    global _scopes, _running_before
    with _scopes_lock:
        if not _scopes:
            _running_before = _helpers_running()
        _scopes += 1
    try:
        yield
    finally:
        with _scopes_lock:
            _scopes -= 1
            if not _scopes:
                _stop_helpers(*_running_before)


def _stop_helpers(server_before: bool, tracker_before: bool) -> None:
    """The stdlib's ``_stop`` of the fork server and the resource tracker that were not running
    before, with a deadline: close the helper's alive pipe, wait, kill. Every child forked
    meanwhile also holds that pipe: one still alive would keep the helper waiting."""
    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker  # noqa: SLF001
    with server._lock:  # noqa: SLF001
        if not server_before and server._forkserver_pid is not None:  # noqa: SLF001
            os.close(server._forkserver_alive_fd)  # noqa: SLF001
            _reap(server._forkserver_pid, "fork server")  # noqa: SLF001
            address = server._forkserver_address  # noqa: SLF001
            if address and not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None  # noqa: SLF001
    with tracker._lock:  # noqa: SLF001
        if not tracker_before and tracker._pid is not None:  # noqa: SLF001
            os.close(tracker._fd)  # noqa: SLF001
            _reap(tracker._pid, "resource tracker")  # noqa: SLF001
            tracker._fd = tracker._pid = None  # noqa: SLF001


def _reap(pid: int, what: str) -> None:
    deadline = time.monotonic() + STOP_WAIT_S
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                log.warning("helper_process_killed", what=what, pid=pid, wait_s=STOP_WAIT_S)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # killed: it is gone at once
                return
            time.sleep(0.01)
