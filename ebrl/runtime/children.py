"""Child processes started fork-safely, and the parent's one handle on each (:class:`Child`): the
AUTO probe, the sim workers and the learner process.

Forking copies the parent's memory but only the forking thread. A graphics or GPU driver keeps
state and threads of its own (Mesa's EGL and its llvmpipe rendering threads under MuJoCo and
robosuite, SAPIEN's Vulkan, CUDA): in a child forked after it was loaded, building a renderer
waits on a futex that no thread of the child will ever release. So children are forked only
while the parent is clean, and otherwise come from a fork server: a fresh interpreter with
ebrl's child code and torch imported, which forks each child from its own clean state.

- ``sim.start_method=None`` (the default), on Linux: ``fork`` while :func:`fork_hazard` finds no
  graphics or GPU driver mapped in this process (fast: a child in milliseconds, which the
  start-up targets need), else ``forkserver`` (the first child of a run waits ~1-4 s for the
  server; later ones take milliseconds). Elsewhere: ``spawn``.
- ``fork``, ``forkserver``, ``spawn``: as set (a warning names the hazard if ``fork`` is set
  while one is present).

A child that does not come from a fork gets its arguments pickled: functions, lambdas and
classes defined in a script are sent by value (:func:`portable`, through cloudpickle), so the
child need not import the user's ``__main__`` module again, and does not (:func:`start`): a
script's top-level code runs once, in the script's own process.

The helper processes multiprocessing starts on demand, the fork server and the resource tracker
(which unlinks shared memory left by a crashed process), are stopped when the last
:func:`helpers_scope` that saw them start ends. ``run()`` holds one, and so does every owner of
children (the probe, the sim workers, the learner process) for its own life, so that no process
outlives ``run()``, nor a pool or probe built outside it.

A :class:`Child` is started by this rule, holds a :func:`helpers_scope` for its life, and is
the one place where a child's life is handled: frames on its pipe (multiprocessing's framing),
read on the event loop with ``add_reader`` or from a thread; requests with a deadline on the
running loop's clock (``asyncio.timeout``), the child killed past it; its death told with its
exit code or signal; kill and reap. The probe and the learner process ask pickled requests that
:func:`serve` answers in the child; the sim workers keep binary frames of their own for the
step's hot path, on the same pipe, life cycle and reader.

    >>> ctx, why = child_context("spawn")
    >>> ctx.get_start_method(), why
    ('spawn', 'sim.start_method')
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from multiprocessing import forkserver, resource_tracker, util
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any

from ebrl.runtime.threads import ignore_stop_signals, in_thread, leave
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.children")

# shared objects whose presence means a driver (and perhaps its threads) is set up in this process
DRIVER_LIBRARIES = ("libEGL", "libGLX", "libGL.so", "libOSMesa", "libgallium", "libvulkan", "libcuda.so",
                    "libnvidia-glcore", "libnvidia-eglcore")
# what the fork server imports once, so that its children start in milliseconds
PRELOAD = ["ebrl.runtime.probe", "ebrl.runtime.sim.worker", "ebrl.runtime.learner_process"]

_scopes = 0  # helpers_scope()s open now
_scopes_lock = threading.Lock()
_running_before: tuple[bool, bool] = (True, True)  # fork server, resource tracker: running when the first opened
STOP_WAIT_S = 5.0  # for a helper to exit once told; then it is killed


def fork_hazard() -> str | None:
    """The first graphics or GPU driver library mapped in this process (why a fork could hang a
    child that builds a simulator), or None. Read from ``/proc/self/maps``: a library stays
    mapped once loaded, so a process that rendered once stays unsafe to fork."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1]
                if any(lib in path for lib in DRIVER_LIBRARIES):
                    return path.strip().rsplit("/", 1)[-1]
    except OSError:  # no /proc (macOS): fork is not chosen there anyway
        return None
    return None


def child_context(start_method: str | None) -> tuple[BaseContext, str]:
    """The multiprocessing context for a child, and why it was chosen (see the module docstring)."""
    if start_method is not None:
        if start_method == "fork" and (hazard := fork_hazard()) is not None:
            log.warning("fork_with_driver_loaded", library=hazard,
                        hint="sim.start_method='fork' was set; a child that renders may hang. Leave it unset "
                             "to use a fork server in this case")
        return mp.get_context(start_method), "sim.start_method"
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn"), "not Linux"
    hazard = fork_hazard()
    if hazard is None:
        return mp.get_context("fork"), "clean parent"
    return fork_server(), f"{hazard} is loaded in this process"


def fork_server() -> BaseContext:
    """The ``forkserver`` context, its server preloading ebrl's child code (started by the first
    child; the :func:`helpers_scope` open then stops it again)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _helpers_running() -> tuple[bool, bool]:
    return (forkserver._forkserver._forkserver_pid is not None,  # noqa: SLF001 (no public probe)
            resource_tracker._resource_tracker._pid is not None)  # noqa: SLF001


@contextlib.contextmanager
def helpers_scope() -> Iterator[None]:
    """Around a run, or the life of an owner of children: the fork server and the resource
    tracker, where they started inside, are stopped when the last open scope ends (every child
    reaped by then). Nested and concurrent scopes (a learner process starts in a thread) share them."""
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
                server_before, tracker_before = _running_before
                if not server_before:
                    _stop_forkserver()
                if not tracker_before:
                    _stop_resource_tracker()


def _stop_forkserver() -> None:
    """The stdlib's ``_stop``, with a deadline: close the server's alive pipe, wait, kill."""
    server = forkserver._forkserver  # noqa: SLF001
    with server._lock:  # noqa: SLF001
        if server._forkserver_pid is None:  # noqa: SLF001
            return
        os.close(server._forkserver_alive_fd)  # noqa: SLF001
        _reap(server._forkserver_pid, "fork server")  # noqa: SLF001
        address = server._forkserver_address  # noqa: SLF001
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None  # noqa: SLF001


def _stop_resource_tracker() -> None:
    """The resource tracker ends at end-of-file on its pipe, which every child forked meanwhile
    also holds: one still alive would keep it waiting, so it gets a deadline too."""
    tracker = resource_tracker._resource_tracker  # noqa: SLF001
    with tracker._lock:  # noqa: SLF001
        if tracker._pid is None:  # noqa: SLF001
            return
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


def start(proc: BaseProcess, ctx: BaseContext) -> None:
    """``proc.start()`` (``proc`` made by ``ctx``); a child that is not forked does not run the
    caller's ``__main__`` again. Multiprocessing would re-import it in the child (a script's
    top-level code, building envs or rendering, run once more in every worker); the child needs
    none of it, since :func:`portable` sends what it runs by value. Multiprocessing skips that
    import for a main module named ``*.__main__``, so the main module is given such a name for
    the time of the start."""
    main = sys.modules.get("__main__")
    if ctx.get_start_method() == "fork" or main is None:
        proc.start()
        return
    spec = getattr(main, "__spec__", None)
    main.__spec__ = ModuleSpec("ebrl.children.__main__", None)
    try:
        proc.start()
    finally:
        main.__spec__ = spec


def send_by_value(module: ModuleType) -> None:
    """Have what ``module`` defines travel to children by value: for a module loaded from a file
    by path (``ebrl train --import x.py``, a benchmark suite), which a child that is not forked
    could not import by its name."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def portable(obj: Any, ctx: BaseContext) -> Any:
    """``obj`` as it can travel to a child of ``ctx``: itself for a fork, else wrapped so that
    pickling sends lambdas, closures and a script's classes by value (cloudpickle)."""
    return obj if ctx.get_start_method() == "fork" else _ByValue(obj)


class _ByValue:
    """Pickles the object it holds with cloudpickle; unpickles to that object itself."""

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce__(self):
        import cloudpickle

        return cloudpickle.loads, (cloudpickle.dumps(self.obj),)


# the frames of a child's life, beside whatever else its pipe carries (pickled requests and
# replies, or a sim worker's step frames): READY is a child's first frame, QUIT asks it to end
READY, QUIT = b"R", b"Q"
READ_BYTES = 1 << 20  # the most one read of a child's pipe takes (more waits for the next)
REAP_S = 1.0  # how long a child whose pipe closed is given to exit, to learn its exit code


class ChildDied(RuntimeError):
    """A child's pipe closed: it exited or was killed. ``how``: ``"exit code 1"``, ``"killed by SIGKILL"``."""

    def __init__(self, name: str, how: str):
        super().__init__(f"{name} died ({how})")
        self.how = how


class ChildFailed(RuntimeError):
    """A request raised in the child: ``summary`` (``"TypeName: message"``) and its traceback."""

    def __init__(self, op: str, summary: str, trace: str):
        super().__init__(f"{op} failed in the child: {summary}")
        self.op, self.summary, self.trace = op, summary, trace


class Child:
    """A child (a process, or a thread standing in for one: :meth:`thread`) and the parent's end
    of its pipe. Frames: :meth:`send_bytes`, :meth:`frames` (the loop's reader, :meth:`watch`);
    requests: :meth:`ask` on the loop, :meth:`ask_blocking` from a thread, answered by
    :func:`serve`; its end: :meth:`kill`, :meth:`exit_reason`, :meth:`reap`.

        >>> class Twice:
        ...     def twice(self, x):
        ...         return 2 * x
        >>> child = Child.thread("ebrl-doc-child", serve, Twice())  # Child.start(..., ctx=...): a process
        >>> child.ask_blocking("twice", 21, timeout_s=5.0)
        42
        >>> child.reap(1.0)
    """

    def __init__(self, name: str, process, conn, helpers: contextlib.ExitStack | None = None):
        self.name, self.process, self.conn = name, process, conn
        self.heard = False  # it has sent something (its READY first): it started
        self.killed = False  # by this process (a deadline, a hung call): its death is on the way
        self.started_at = time.perf_counter()
        self._inbox = b""  # the start of a frame not yet whole
        self._replies: deque[bytes] = deque()  # whole frames read, not yet taken by ask
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the pipe
        self._helpers = helpers or contextlib.ExitStack()

    @classmethod
    def start(cls, name: str, target, *args, ctx: BaseContext) -> Child:
        """Start ``target(conn, *args)`` in a child process of ``ctx`` (:func:`child_context`),
        ignoring stop signals and exiting with its parent (:func:`ignore_stop_signals`). Blocking:
        a fork copies this process's page tables (milliseconds with torch loaded)."""
        helpers = contextlib.ExitStack()
        helpers.enter_context(helpers_scope())  # a fork server it needs ends with it
        try:
            parent, child = ctx.Pipe(duplex=True)
            try:
                proc = ctx.Process(target=_child_main, name=name, daemon=True,
                                   args=(child, target, *(portable(a, ctx) for a in args)))
                start(proc, ctx)
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()
        except BaseException:
            helpers.close()
            raise
        return cls(name, proc, parent, helpers)

    @classmethod
    async def start_off_loop(cls, name: str, target, *args, ctx: BaseContext) -> Child:
        """:meth:`start` in a thread, off the loop. A caller cancelled meanwhile leaves no child:
        the one started is reaped (by the thread, where it ends after the caller gave up)."""
        lock, started, gave_up = threading.Lock(), [], threading.Event()

        def begin() -> Child:
            child = cls.start(name, target, *args, ctx=ctx)
            with lock:
                if not gave_up.is_set():
                    started.append(child)
                    return child
            child.reap()
            return child

        try:
            return await in_thread(begin, name=f"{name}-start")
        except BaseException:
            with lock:
                gave_up.set()
            for child in started:
                child.reap()
            raise

    @classmethod
    def thread(cls, name: str, target, *args) -> Child:
        """``target(conn, *args)`` in a daemon thread of this process, on a pipe like a child's."""
        parent, child = mp.Pipe(duplex=True)
        thread = _Thread(name, target, child, args)
        thread.start()
        return cls(name, thread, parent)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send_bytes(self, raw: bytes) -> None:
        self.conn.send_bytes(raw)

    def frames(self) -> list[bytes] | None:
        """Every whole frame the pipe holds now, in one read; None if it closed (the child died).
        The framing is multiprocessing's (a 4-byte big-endian signed length, -1 for an 8-byte
        one), as the child's ``send_bytes`` writes it; ``Connection.recv_bytes`` costs two reads
        and a BytesIO a frame. A frame not yet whole waits for the next read."""
        try:
            data = os.read(self.conn.fileno(), READ_BYTES)
        except OSError:
            data = b""
        if not data:
            return None
        self.heard = True
        if self._inbox:
            data, self._inbox = self._inbox + data, b""
        frames = []
        start, end = 0, len(data)
        while end - start >= 4:
            n, head = int.from_bytes(data[start:start + 4], "big", signed=True), 4
            if n == -1:  # over 2 GiB
                if end - start < 12:
                    break
                n, head = int.from_bytes(data[start + 4:start + 12], "big"), 12
            if end - start < head + n:
                break
            frames.append(data[start + head:start + head + n])
            start += head + n
        self._inbox = data[start:]
        return frames

    def watch(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        """Call ``callback(*args)`` on ``loop`` whenever the pipe is readable."""
        fd = self.conn.fileno()
        loop.add_reader(fd, callback, *args)
        self._loop = loop
        # add_reader makes the socket non-blocking (uvloop); a frame larger than the socket
        # buffer then arrives in pieces, and a read would fail half-way. Readable means a frame
        # has started, and the child writes the rest at once: a blocking read is safe.
        os.set_blocking(fd, True)

    def unwatch(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            with contextlib.suppress(Exception):  # a closed pipe or loop: nothing is watched
                loop.remove_reader(self.conn.fileno())

    async def ready(self, timeout_s: float | None) -> None:
        """Wait for its READY (on the loop; killed past ``timeout_s``: ``TimeoutError``)."""
        await self._until(lambda: self.heard, timeout_s)

    def ready_blocking(self, timeout_s: float | None) -> None:
        """:meth:`ready`, from a thread that waits in the pipe."""
        self._until_blocking(lambda: self.heard, timeout_s)

    async def ask(self, op: str, *args, timeout_s: float | None = None) -> Any:
        """``handler.op(*args)`` in the child (:func:`serve`), awaited on the running loop under
        ``timeout_s`` of its clock; past it, the child is killed and ``TimeoutError`` raised.
        Raises :class:`ChildFailed` (the call raised there) or :class:`ChildDied`."""
        self._send(op, args)
        await self._until(lambda: self._replies, timeout_s)
        return self._reply(op)

    def ask_blocking(self, op: str, *args, timeout_s: float | None = None) -> Any:
        """:meth:`ask`, from a thread that waits in the pipe (without the GIL)."""
        self._send(op, args)
        self._until_blocking(lambda: self._replies, timeout_s)
        return self._reply(op)

    def _send(self, op: str, args: tuple) -> None:
        # plain pickle copies tensors by value; Connection.send would route them through torch's
        # shared-memory handles, which need the sender alive to be opened
        try:
            self.conn.send_bytes(pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # a broken pipe: it died
            raise ChildDied(self.name, self.exit_reason()) from None

    def _reply(self, op: str) -> Any:
        ok, value = pickle.loads(self._replies.popleft())
        if not ok:
            raise ChildFailed(op, *value)
        return value

    async def _until(self, done, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                while not done():
                    readable = loop.create_future()
                    self.watch(loop, _wake, readable)
                    try:
                        await readable
                    finally:
                        self.unwatch()
                    self._take()
        except TimeoutError:
            self.kill()
            raise

    def _until_blocking(self, done, timeout_s: float | None) -> None:
        while not done():
            if not self.conn.poll(timeout_s):
                self.kill()
                raise TimeoutError(f"{self.name} did not answer in {timeout_s:g} s")
            self._take()

    def _take(self) -> None:
        frames = self.frames()
        if frames is None:
            raise ChildDied(self.name, self.exit_reason())
        self._replies.extend(f for f in frames if f != READY)

    def kill(self) -> None:
        """SIGKILL it (a thread cannot be killed: it is left to return by itself)."""
        self.killed = True
        self.process.kill()

    def exit_reason(self) -> str:
        """How it ended (its pipe closed): ``"exit code N"`` or ``"killed by SIGNAL"``."""
        if isinstance(self.process, _Thread):
            return "the thread returned"
        self.process.join(REAP_S)
        code = self.process.exitcode
        return f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"

    def quit(self) -> None:
        """Ask it to end, after what it was sent."""
        with contextlib.suppress(OSError):
            self.conn.send_bytes(QUIT)

    def reap(self, wait_s: float = 0.0) -> None:
        """:meth:`quit`, ``wait_s`` for it to exit, then kill it; joined, its pipe closed."""
        Child.reap_all([self], wait_s)

    @staticmethod
    def reap_all(children: list[Child], wait_s: float) -> None:
        """:meth:`reap` for each of ``children``, ``wait_s`` in all (one hung in a call never
        reads QUIT). Blocking: milliseconds for children that exit or are killed."""
        for child in children:
            child.unwatch()
            child.quit()
        deadline = time.monotonic() + wait_s
        for child in children:
            child.process.join(max(0.0, deadline - time.monotonic()))
            if child.process.is_alive():
                child.kill()
                child.process.join()
            child.conn.close()
            child._helpers.close()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _child_main(conn, target, *args) -> None:
    ignore_stop_signals()  # the parent decides when we stop
    target(conn, *args)


class _Thread:
    """A thread standing in for a child process (what :class:`Child` uses of one). It cannot be
    killed: killed, it is left to return by itself and never waited for."""

    pid = exitcode = None

    def __init__(self, name: str, target, conn, args: tuple):
        self.thread = threading.Thread(target=self._main, args=(target, conn, args), name=name, daemon=True)
        self.left = False

    @staticmethod
    def _main(target, conn, args: tuple) -> None:
        try:
            target(conn, *args)
        finally:
            conn.close()  # the parent sees it end

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(0.0 if self.left else timeout)

    def kill(self) -> None:
        if not self.left and self.thread.is_alive():
            self.left = True
            leave(self.thread)


def serve(conn, handler) -> None:
    """A child's side of :meth:`Child.ask`: READY, then each request ``(op, args)`` answered with
    ``handler.op(*args)``, or what it raised, until QUIT or the parent's end closes; then
    ``handler.close()``, where it has one."""
    try:
        conn.send_bytes(READY)
        while (raw := conn.recv_bytes()) != QUIT:
            op, args = pickle.loads(raw)
            try:
                reply = pickle.dumps((True, getattr(handler, op)(*args)), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # the parent's to report  # noqa: BLE001
                summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                reply = pickle.dumps((False, (summary, "".join(traceback.format_exception(exc)))))
            conn.send_bytes(reply)
    except (EOFError, OSError):
        pass  # the parent has gone or given up
    finally:
        close = getattr(handler, "close", None)
        if callable(close):
            close()
