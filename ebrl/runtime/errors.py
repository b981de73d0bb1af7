"""The runtime's exceptions, and one error out of ``run()``: a TaskGroup's failures become the first of them.

A TaskGroup raises a :class:`BaseExceptionGroup` of every task's failure (and nests them, a
TaskGroup inside a task of another). ``run()`` raises one exception instead: the first failure
that is not a cancellation (``KeyboardInterrupt`` and ``SystemExit`` before any other), with
each *distinct* other failure added to it as a note (:meth:`BaseException.add_note`). Copies of
it (the same object, or the same type and message raised by several tasks) are left out.

    >>> group = ExceptionGroup("tasks", [ValueError("a"), ExceptionGroup("inner", [OSError("b"), ValueError("a")])])
    >>> err = first_error(group)
    >>> type(err).__name__, str(err), err.__notes__
    ('ValueError', 'a', ['also failed meanwhile: OSError: b'])
"""

from __future__ import annotations

import asyncio
import traceback
from typing import NoReturn

NOTE = "also failed meanwhile: "


def fault_reason(detail: str) -> str:
    """The drop reason of a step error's detail: ``env_error`` unless a pool said otherwise."""
    return getattr(detail, "reason", "env_error")


class Fault(str):
    """A step error's detail (the ``str`` a :class:`Block` carries) that says why the step was
    lost when the env itself did not raise: ``reason`` is the drop reason the driver counts."""

    reason = "env_error"


class WorkerDied(Fault):
    reason = "worker_died"  # the env's worker process ended (a signal, OOM, or killed for a hung mate)


class TimedOut(Fault):
    reason = "timeout"  # the step ran past faults.step_timeout_s and was abandoned


class NonFiniteReset(Fault):
    reason = "nonfinite"  # a reset observation with NaN/inf (faults.nonfinite='drop'): rebuilt like a failure


class PoolClosed(RuntimeError):
    """``await pool.recv()`` on a closed sim pool with no block left."""


class EnvStepError(RuntimeError):
    """An env raised inside ``step``, ``reset`` or its constructor."""

    def __init__(self, env_id: int, op: str, detail: str):
        super().__init__(f"env {env_id} failed in {op}: {detail}")
        self.env_id, self.op, self.detail = env_id, op, detail

    @property
    def reason(self) -> str:
        return fault_reason(self.detail)


class TooManyEnvFailures(RuntimeError):
    """More env failures within the window than ``faults.max_env_failures`` allows.

    ``failures`` lists the ones charged, oldest first, as ``(env, reason)`` (``env_error``,
    ``timeout`` or ``nonfinite``): a worker-mate lost with a hung or dead worker is not one."""

    def __init__(self, message: str, failures: list[tuple[int, str]] | None = None):
        super().__init__(message)
        self.failures = list(failures or [])


class NonFiniteError(RuntimeError):
    """An env produced NaN or inf in an observation or reward."""


class LearnerError(RuntimeError):
    """``algo.update`` raised in the learner process."""


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc`` (nested groups flattened, in order); ``[exc]`` if it is none."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The one exception to raise for ``group`` (see the module docstring). A group holding only
    cancellations gives its first."""
    every = leaves(group)
    errors = [e for e in every if not isinstance(e, asyncio.CancelledError)]
    if not errors:
        return every[0]
    errors.sort(key=lambda e: isinstance(e, Exception))  # stable: KeyboardInterrupt, SystemExit first
    first = errors[0]
    seen = {(type(first), str(first))}
    for e in errors[1:]:
        key = (type(e), str(e))
        if key in seen:
            continue  # the same failure (or the same object), raised again by another task
        seen.add(key)
        note = NOTE + "".join(traceback.format_exception_only(type(e), e)).strip()
        if note not in getattr(first, "__notes__", ()):
            first.add_note(note)
    return first


def raise_first(group: BaseExceptionGroup) -> NoReturn:
    """Raise :func:`first_error` of ``group``, from an ``except`` of it: the error keeps its own
    cause and context (the group it came in is not shown as the error it arose in)."""
    error = first_error(group)
    context = error.__context__
    try:
        raise error
    finally:
        error.__context__ = context  # raising it here made the group its context
