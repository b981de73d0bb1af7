"""Blocking work kept off the caller's event loop, in a private thread that never outlives the call.

``run()`` shares the caller's loop, so anything that blocks for milliseconds (building envs,
forking processes, joining them, a probe) runs here instead: a one-thread executor made for
the call and joined before it returns, also when the awaiting task is cancelled (the work is
bounded, and no thread may outlive ``run()``).

    >>> import asyncio, threading
    >>> asyncio.run(in_thread(lambda: threading.current_thread().name, name="ebrl-doc"))
    'ebrl-doc_0'
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any, name: str = "ebrl-offloop") -> T:
    """``fn(*args)`` in a private thread; see the module docstring."""
    executor = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    finally:
        executor.shutdown(wait=True)


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
    """In a child process (sim worker, learner, probe): Ctrl-C and SIGTERM are the parent's to
    act on. A terminal's Ctrl-C, or a scheduler's SIGTERM (Slurm, Kubernetes, ``timeout``),
    reaches the whole process group; the parent stops the run cleanly and ends its children.

    The child also exits within a second of its parent's death (a SIGKILL, an OOM kill): its
    pipe alone would not tell it, since forked siblings hold copies of the parent's ends."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # the parent's pid as recorded before the fork: a parent killed before this line runs has
    # already handed us to init (getppid() would then name init and we would wait for ever)
    known = multiprocessing.parent_process()
    exit_with_parent(known.pid if known is not None and known.pid is not None else os.getppid())


def exit_with_parent(parent: int) -> None:
    """Exit (``os._exit(1)``) within about half a second once process ``parent`` is no longer
    this one's parent: it died, and no one will read our results or stop us. A daemon thread
    watches; a data-parallel rank watches its launcher this way."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="ebrl-parent-watch", daemon=True).start()
