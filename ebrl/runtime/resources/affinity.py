"""CPU affinity: the event loop, the learner process and the sim workers on separate cores.

On Linux each thread carries its own CPU mask (threads started later inherit their creator's),
so :func:`pin` sets every thread of a process. With too few cores for each part to have its own,
:func:`split_plan` is None: sharing every core is then the better default.

    >>> split_plan(8, 2)
    {'loop': [0], 'learner': [1], 'workers': [2, 3, 4, 5, 6, 7]}
    >>> split_plan(2, 2) is None
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable


def split_plan(cpus: Iterable[int] | int, workers: int) -> dict[str, list[int]] | None:
    """Core sets for ``loop``, ``learner`` and ``workers``; None with fewer than ``workers + 2`` cores."""
    cores = sorted(range(cpus) if isinstance(cpus, int) else cpus)
    if workers < 1 or len(cores) < workers + 2:
        return None
    return {"loop": cores[:1], "learner": cores[1:2], "workers": cores[2:]}


def threads_of(pid: int) -> list[int]:
    """Thread ids of process ``pid`` (just ``pid`` where ``/proc`` is not there)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def pin(pid: int, cores: Iterable[int], setaffinity: Callable[[int, set[int]], None] | None = None) -> int:
    """Pin every thread of ``pid`` to ``cores``; returns how many threads were set (a thread that
    ended meanwhile is skipped). ``setaffinity`` defaults to ``os.sched_setaffinity`` (tests pass a fake)."""
    setaffinity = setaffinity or os.sched_setaffinity
    done = 0
    for tid in threads_of(pid):
        try:
            setaffinity(tid, set(cores))
            done += 1
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return done


def available() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")
