"""Stage: where one stage of the pipeline (the generator's policy calls, the learner's updates)
runs its calls, and what they cost. A call runs on the event loop's thread when it costs less
than a thread hop, else in the stage's own thread, the same one every time (CUDA streams and
torch's thread settings are per thread), so the loop serves simulation meanwhile; a platform
may run them elsewhere (:mod:`ebrl.runtime.platform`). A stage counts busy seconds, CPU seconds
of the thread that ran its calls (wall over CPU: how long a call waited for the GIL or a core),
calls, and the call in progress (:meth:`busy_until_now`: a profile window sees a 20 s update in
every window it spans).

    >>> import asyncio
    >>> from ebrl.runtime.stage import Stage
    >>> async def demo():
    ...     stage = Stage("doc")
    ...     try:
    ...         here = await stage.call(sum, [1, 2])
    ...         there = await stage.call(sum, [3, 4], thread=True)
    ...     finally:
    ...         stage.close()
    ...     return here, there, stage.calls
    >>> asyncio.run(demo())
    (3, 7, 2)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Stage:
    """Runs one stage's calls (see the module docstring)."""

    threads = True  # whether ``call(..., thread=True)`` runs the call in the stage's thread

    def __init__(self, name: str):
        self.name = name
        self.busy_s = 0.0  # in calls
        self.cpu_s = 0.0  # CPU time of the threads that made them
        self.calls = 0
        self.last_s = 0.0  # the latest call's seconds
        self.last_cpu_s = 0.0  # and its CPU seconds
        self._started: float | None = None  # loop time the call in progress started
        self._executor: ThreadPoolExecutor | None = None

    def now(self) -> float:
        """The clock the stage's costs are read on (seconds)."""
        return time.perf_counter()

    def busy_until_now(self, now: float) -> float:
        """``busy_s`` with the call in progress counted up to loop time ``now``."""
        return self.busy_s + (now - self._started if self._started is not None else 0.0)

    async def call(self, fn: Callable[..., T], *args: Any, thread: bool = False, size: int = 0) -> T:
        """``fn(*args)`` on the loop's thread, or in the stage's thread (``thread``), timed;
        ``size``: the call's rows or steps (what a platform charging declared costs reads)."""
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        t0 = time.perf_counter()
        try:
            if thread:
                result, cpu = await loop.run_in_executor(self._thread(), _timed, fn, args)
            else:
                result, cpu = _timed(fn, args)
            spent = time.perf_counter() - t0
        finally:
            self._started = None
        self.busy_s += spent
        self.cpu_s += cpu
        self.calls += 1
        self.last_s, self.last_cpu_s = spent, cpu
        return result

    async def aside(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the stage's thread, between its calls and not counted as one (a
        checkpoint, a collective's header)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread(), fn, *args)

    def start_thread(self) -> None:
        """Make the stage's thread now (the learner's, before anything forks); else the first
        threaded call makes it."""
        self._thread()

    def close(self, wait_s: float | None = None) -> list[threading.Thread]:
        """End the stage's thread: waiting for the call in flight (``wait_s`` at most, None for as
        long as it takes); the calls not started are cancelled. Returns the threads still running."""
        if self._executor is None:
            return []
        executor, self._executor = self._executor, None
        executor.shutdown(wait=wait_s is None, cancel_futures=True)
        threads = list(getattr(executor, "_threads", ()))  # the one thread it started, if it did
        for t in threads:
            t.join(wait_s or 0.0)
        return [t for t in threads if t.is_alive()]

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ebrl-{self.name}")
        return self._executor


def _timed(fn: Callable[..., T], args: tuple) -> tuple[T, float]:
    c0 = time.thread_time()  # the CPU time of the thread that runs the call
    result = fn(*args)
    return result, time.thread_time() - c0
