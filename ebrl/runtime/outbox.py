"""The :class:`Outbox` between a sim pool and the driver's loop (``await pool.recv()``).

    >>> import asyncio
    >>> async def demo():
    ...     box = Outbox()
    ...     box.put("block 1")            # a pool puts blocks (Block objects) as steps finish ...
    ...     first = await box.get()       # ... the driver takes them in order, waiting when none is back
    ...     box.close()
    ...     try:
    ...         await box.get()
    ...     except PoolClosed as exc:
    ...         return first, str(exc)
    >>> asyncio.run(demo())
    ('block 1', 'the sim pool was closed')
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from ebrl.runtime.errors import PoolClosed

if TYPE_CHECKING:
    from ebrl.runtime.sim_types import Block


class Outbox:
    """Finished blocks on their way to :meth:`SimPool.recv`: a pool puts them (on the event loop
    thread), the driver's loop takes them in order. A waiting reader costs one future a wake-up,
    not one an env step."""

    __slots__ = ("blocks", "waiter", "closed")

    def __init__(self):
        self.blocks: deque[Block] = deque()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def put(self, block: Block) -> None:
        self.blocks.append(block)
        self._wake()

    async def get(self) -> Block:
        while not self.blocks:
            if self.closed:
                raise PoolClosed("the sim pool was closed")
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.blocks.popleft()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
