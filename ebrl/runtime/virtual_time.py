"""An event loop whose clock jumps to the next timer whenever nothing is ready.

Scheduler tests run on it to be exact and fast: a MockEnv step of 10 ms "takes" 10 ms of
loop time and no wall time. Nothing may run in threads on it (their real duration would
be invisible), so the runtime runs every stage inline there and charges each stage's
declared cost with ``asyncio.sleep``.

    >>> import asyncio
    >>> from ebrl.runtime.virtual_time import VirtualTimeLoop
    >>> async def nap():
    ...     t0 = asyncio.get_running_loop().time()
    ...     await asyncio.sleep(3600)
    ...     return asyncio.get_running_loop().time() - t0
    >>> with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
    ...     runner.run(nap())
    3600.0
"""

from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector:
    """Wraps the loop's selector: polls real I/O, and where the loop would sleep, advances the clock."""

    def __init__(self, inner: selectors.BaseSelector, loop: "VirtualTimeLoop"):
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None):
        events = self._inner.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer pending: only real I/O (a thread calling back) can wake us
            return self._inner.select(None)
        self._loop._now += timeout
        return []

    def __getattr__(self, name):
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop with a virtual clock starting at 0."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._selector = _JumpingSelector(self._selector, self)

    def time(self) -> float:
        return self._now


def is_virtual(loop: asyncio.AbstractEventLoop | None = None) -> bool:
    loop = loop or asyncio.get_running_loop()
    return isinstance(loop, VirtualTimeLoop)
