"""Child processes started fork-safely: the AUTO probe, the sim workers and the learner process.

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

    >>> ctx, why = child_context("spawn")
    >>> ctx.get_start_method(), why
    ('spawn', 'sim.start_method')
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import forkserver, resource_tracker, util
from importlib.machinery import ModuleSpec
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any

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
