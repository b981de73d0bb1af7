"""The one handle on a child process (:class:`Child`), for the AUTO probe, the sim workers and the
learner process, and the rule that starts each fork-safely (:func:`child_context`).

A fork copies only the forking thread, and a graphics or GPU driver keeps threads of its own
(Mesa's llvmpipe under MuJoCo, SAPIEN's Vulkan, CUDA): a child forked after one was loaded may
wait for ever on a lock that no thread of it holds. So with ``sim.start_method=None``, on Linux,
children are forked while :func:`fork_hazard` finds no driver loaded (milliseconds, which the
start-up targets need), else they come from a fork server (a fresh interpreter with ebrl's child
code imported; the first child waits ~1-4 s); elsewhere they are spawned. A child that is not
forked gets what it runs by value (:func:`portable`) and does not run the user's ``__main__``
again (:func:`start`). The fork server (and the resource tracker) end with the last
:func:`~ebrl.runtime.threads.helpers_scope` that saw them start; every :class:`Child` holds one.

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
import time
import traceback
from collections import deque
from importlib.machinery import ModuleSpec
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any

from ebrl.runtime.threads import helpers_scope, ignore_stop_signals, in_thread, leave
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.children")

# shared objects whose presence means a driver (and perhaps its threads) is set up in this process
DRIVER_LIBRARIES = ("libEGL", "libGLX", "libGL.so", "libOSMesa", "libgallium", "libvulkan", "libcuda.so",
                    "libnvidia-glcore", "libnvidia-eglcore")
# what the fork server imports once, so that its children start in milliseconds
PRELOAD = ["ebrl.runtime.probe", "ebrl.runtime.sim.worker", "ebrl.runtime.learner_process"]


def fork_hazard() -> str | None:
    """The first graphics or GPU driver library mapped in this process, or None. A library stays
    mapped once loaded (``/proc/self/maps``): a process that rendered once stays unsafe to fork."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.rsplit(" ", 1)[-1].strip() for line in maps]
    except OSError:  # no /proc (macOS): fork is not chosen there anyway
        return None
    return next((path.rsplit("/", 1)[-1] for path in paths if any(lib in path for lib in DRIVER_LIBRARIES)), None)


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
    """The ``forkserver`` context, its server (started by the first child) preloading ebrl's child code."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(proc: BaseProcess, ctx: BaseContext) -> None:
    """``proc.start()`` (``proc`` made by ``ctx``), never running a script's top-level code again in
    a child that is not forked: multiprocessing skips importing a main module named ``*.__main__``,
    so the main module is given such a name for the time of the start."""
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
    """Have what ``module`` defines travel to children by value: a module loaded from a file by path
    (``ebrl train --import x.py``, a benchmark suite) cannot be imported by its name in a child."""
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


# a child's first frame, and the parent's request to end, beside what else its pipe carries
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
    """A child process (or a thread standing in for one: no pid, never killed but left) and the
    parent's end of its pipe: frames (:meth:`frames`, :meth:`watch`), requests that :func:`serve`
    answers (:meth:`ask` on the loop, :meth:`ask_blocking` from a thread), and its end.

        >>> class Twice:
        ...     def twice(self, x):
        ...         return 2 * x
        >>> child = Child.start("ebrl-doc-child", serve, Twice(), ctx=child_context(None)[0])
        >>> child.ask_blocking("twice", 21, timeout_s=60.0)
        42
        >>> child.reap(5.0)
    """

    def __init__(self, name: str, process, conn, helpers: contextlib.ExitStack | None = None,
                 start_timeout_s: float | None = None):
        self.name, self.process, self.conn = name, process, conn
        self.start_timeout_s = start_timeout_s  # for its READY, before the first request
        self.heard = False  # it has sent something (its READY first): it started
        self.killed = False  # by this process (a deadline, a hung call): its death is on the way
        self.started_at = time.perf_counter()
        self._inbox: list[bytes] = []  # the reads holding the start of a frame not yet whole
        self._inbox_bytes = 0  # their length
        self._frame_bytes = 0  # that frame's, header included (0: its header not yet whole)
        self._replies: deque[bytes] = deque()  # whole frames read, not yet taken by ask
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the pipe
        self._helpers = helpers or contextlib.ExitStack()  # closed when it is reaped

    @classmethod
    def start(cls, name: str, target, *args, ctx: BaseContext, start_timeout_s: float | None = None) -> Child:
        """``target(conn, *args)`` in a child process of ``ctx`` (:func:`child_context`) that exits with
        its parent (:func:`ignore_stop_signals`). Blocking: a fork copies this process's page tables."""
        with contextlib.ExitStack() as undo:  # what a start that fails leaves behind
            undo.enter_context(helpers_scope())  # a fork server it needs ends with it
            parent, child = ctx.Pipe(duplex=True)
            undo.callback(parent.close)
            with child:  # the child's end is the child's alone
                proc = ctx.Process(target=_child_main, name=name, daemon=True,
                                   args=(child, target, *(portable(a, ctx) for a in args)))
                start(proc, ctx)
            return cls(name, proc, parent, undo.pop_all(), start_timeout_s)

    @classmethod
    async def start_off_loop(cls, name: str, target, *args, ctx: BaseContext,
                             start_timeout_s: float | None = None) -> Child:
        """:meth:`start` in a thread, off the loop; a caller cancelled meanwhile leaves no child."""
        started: list[Child] = []

        def begin() -> Child:
            started.append(cls.start(name, target, *args, ctx=ctx, start_timeout_s=start_timeout_s))
            return started[0]

        try:
            return await in_thread(begin, name=f"{name}-start")
        except BaseException:
            for child in started:
                child.reap()
            raise

    @property
    def pid(self) -> int | None:
        return getattr(self.process, "pid", None)

    def send_bytes(self, raw: bytes) -> None:
        self.conn.send_bytes(raw)

    def frames(self) -> list[bytes] | None:
        """Every whole frame the pipe holds now, in one read (``recv_bytes`` costs two reads and a
        BytesIO a frame); None if it closed: the child died. The framing is multiprocessing's (a
        4-byte big-endian signed length, -1 for an 8-byte one); a frame not yet whole waits."""
        try:
            data = os.read(self.conn.fileno(), READ_BYTES)
        except OSError:
            data = b""
        if not data:
            return None
        self.heard = True
        if self._inbox:  # joined once the frame is whole: joining every read would copy a large one quadratically
            self._inbox.append(data)
            self._inbox_bytes += len(data)
            if self._inbox_bytes < self._frame_bytes:
                return []
            data, self._inbox, self._inbox_bytes = b"".join(self._inbox), [], 0
        frames = []
        start, end = 0, len(data)
        self._frame_bytes = 0
        while end - start >= 4:
            n, head = int.from_bytes(data[start:start + 4], "big", signed=True), 4
            if n == -1:  # over 2 GiB
                if end - start < 12:
                    break
                n, head = int.from_bytes(data[start + 4:start + 12], "big"), 12
            if end - start < head + n:
                self._frame_bytes = head + n
                break
            frames.append(data[start + head:start + head + n])
            start += head + n
        if start < end:
            self._inbox, self._inbox_bytes = [data[start:]], end - start
        return frames

    def watch(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        """``callback(*args)`` on ``loop`` whenever the pipe is readable."""
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

    async def ask(self, op: str, *args, timeout_s: float | None = None) -> Any:
        """``handler.op(*args)`` in the child (:func:`serve`) under ``timeout_s``, once it is serving
        (under ``start_timeout_s``), on the running loop's clock: past either the child is killed
        and ``TimeoutError`` raised (``heard`` tells which). Else :class:`ChildFailed` or :class:`ChildDied`."""
        await self._until(lambda: self.heard, self.start_timeout_s)
        self._send(op, args)
        await self._until(lambda: self._replies, timeout_s)
        return self._reply(op)

    def ask_blocking(self, op: str, *args, timeout_s: float | None = None) -> Any:
        """:meth:`ask`, from a thread that waits in the pipe (without the GIL)."""
        self._until_blocking(lambda: self.heard, self.start_timeout_s)
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
        """SIGKILL it; a thread is left to return by itself, never waited for."""
        if self.pid is not None:
            self.process.kill()
        elif not self.killed and self.process.is_alive():
            leave(self.process)
        self.killed = True

    def exit_reason(self) -> str:
        """How it ended (its pipe closed): ``"exit code N"`` or ``"killed by SIGNAL"``."""
        if self.pid is None:
            return "the thread returned"
        self.process.join(REAP_S)
        code = self.process.exitcode
        return f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"

    def quit(self) -> None:
        """Ask it to end, after what it was sent."""
        with contextlib.suppress(OSError):
            self.conn.send_bytes(QUIT)

    def reap(self, wait_s: float = 0.0) -> None:
        """:meth:`quit`, ``wait_s`` for it to exit, then kill it; joined, its pipe and scope closed."""
        Child.reap_all([self], wait_s)

    @staticmethod
    def reap_all(children: list[Child], wait_s: float) -> None:
        """:meth:`reap` for each of ``children``, ``wait_s`` in all (one hung in a call never reads QUIT)."""
        for child in children:
            child.unwatch()
            child.quit()
        deadline = time.monotonic() + wait_s
        for child in children:
            child.process.join(0.0 if child.killed else max(0.0, deadline - time.monotonic()))
            if child.process.is_alive():
                child.kill()
                if child.pid is not None:  # a thread is left
                    child.process.join()
            child.conn.close()
            child._helpers.close()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _child_main(conn, target, *args) -> None:
    ignore_stop_signals()  # the parent decides when we stop
    target(conn, *args)


def serve(conn, handler) -> None:
    """A child's side of :meth:`Child.ask`: READY, then ``handler.op(*args)`` (or what it raised) for
    each request until QUIT or the parent's end closes; then ``handler.close()``, where it has one."""
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
