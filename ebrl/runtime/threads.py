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
import signal
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


def ignore_stop_signals() -> None:
    """In a child process (sim worker, learner, probe): Ctrl-C and SIGTERM are the parent's to
    act on. A terminal's Ctrl-C, or a scheduler's SIGTERM (Slurm, Kubernetes, ``timeout``),
    reaches the whole process group; the parent stops the run cleanly and ends its children."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
