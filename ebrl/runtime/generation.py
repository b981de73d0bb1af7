"""Generator: the inference server that turns many ``act()`` requests into few policy calls.

A batch runs as soon as one of three things holds:

1. ``batch_target`` requests are waiting;
2. every live env is waiting (nobody else can arrive, so waiting longer only idles);
3. the oldest request has waited as long as one batch takes (a running average), and
   never longer than ``max_wait_s``: waiting longer than a batch costs would delay the
   waiting envs more than a second, smaller batch would.

One batch runs at a time, off the event loop in a worker thread once batches cost more
than a thread hop (``Offload.AUTO``), so simulation results keep flowing while the policy
runs. New weights are swapped in between batches, never during one, and every action is
tagged with the version of the weights that produced it.

    >>> import asyncio, numpy as np
    >>> from ebrl.runtime.generation import Generator
    >>> from ebrl.testing import MockPolicy
    >>> async def demo():
    ...     gen = Generator(MockPolicy(act_dim=2), batch_target=4, max_wait_s=0.01, live=4)
    ...     server = asyncio.create_task(gen.serve())
    ...     replies = await asyncio.gather(*(gen.act(i, np.zeros(3, np.float32)) for i in range(4)))
    ...     server.cancel()
    ...     return [version for _, _, version in replies], dict(gen.batch_sizes)
    >>> asyncio.run(demo())
    ([0, 0, 0, 0], {4: 1})
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ebrl.config import Offload
from ebrl.policies.base import ActResult
from ebrl.runtime.virtual_time import is_virtual
from ebrl.spaces import stack

if TYPE_CHECKING:
    from ebrl.runtime.profiler import Timeline

# What act() returns: the batch's result, this request's row in it, and the policy version.
ActReply = tuple[ActResult, int, int]


class Generator:
    """Dynamic batching in front of ``policy.act``."""

    def __init__(self, policy, *, batch_target: int, max_wait_s: float, live: int,
                 offload: Offload = Offload.AUTO, inline_below_s: float = 200e-6,
                 on_action: Callable[[int, int], None] | None = None, timeline: Timeline | None = None):
        self.policy = policy
        self.batch_target = batch_target
        self.max_wait_s = max_wait_s
        self.offload = offload
        self.inline_below_s = inline_below_s
        self.version = 0
        self.live = live  # envs that may still send a request
        self.batch_sizes: Counter = Counter()
        self.max_request_wait_s = 0.0
        self.busy_s = 0.0  # time spent in policy calls
        self._on_action = on_action
        self._timeline = timeline  # records lane "generator", "batch" (arg: batch size) per policy call
        # requests: (env id, obs, future, time) or, from a vector env, (env ids, obs list, future, time)
        self._pending: list[tuple[Any, Any, asyncio.Future, float]] = []
        self._pending_rows = 0
        self._wake = asyncio.Event()
        self._paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._idle = asyncio.Event()  # no batch is running
        self._idle.set()
        self._new_weights: tuple[dict, int] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._cost_ewma: float | None = None  # seconds per inline policy call (AUTO offload)
        self.batch_s_ewma = 0.0  # seconds per batch, how ever it ran: the adaptive wait
        self._virtual_cost = getattr(policy, "virtual_cost", None)

    # ---------------------------------------------------------------- requests

    async def act(self, env_id: int, obs: Any) -> ActReply:
        """Wait for an action for ``obs``; returns ``(result, row, version)``."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((env_id, obs, fut, asyncio.get_running_loop().time()))
        self._pending_rows += 1
        if len(self._pending) == 1 or self._due():
            self._wake.set()
        return await fut

    async def act_many(self, env_ids: list[int], obs: list[Any]) -> list[ActReply]:
        """One request for several envs (a vector env's); they land in the same batch."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((env_ids, obs, fut, asyncio.get_running_loop().time()))
        self._pending_rows += len(env_ids)
        if len(self._pending) == 1 or self._due():
            self._wake.set()
        return await fut

    def set_live(self, delta: int) -> None:
        """An env stopped (-1) or resumed (+1) sending requests: the 'everyone waits' rule changes."""
        self.live += delta
        if self._pending and self._due():
            self._wake.set()

    def _due(self) -> bool:
        return self._pending_rows >= min(self.batch_target, max(self.live, 1))

    # ---------------------------------------------------------------- weights and pausing

    def publish(self, state: dict, version: int) -> None:
        """New weights; they take effect at the next batch."""
        self._new_weights = (state, version)

    async def pause(self) -> None:
        """Stop forming batches (after the running one finishes); used while an update must not overlap generation."""
        self._paused = True
        self._unpaused.clear()
        await self._idle.wait()

    def resume(self) -> None:
        self._paused = False
        self._unpaused.set()

    # ---------------------------------------------------------------- the server

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        virtual = is_virtual(loop)
        try:
            while True:
                while not self._pending:
                    self._wake.clear()
                    await self._wake.wait()
                deadline = self._pending[0][3] + min(self.max_wait_s, self.batch_s_ewma)
                while not self._due():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    self._wake.clear()
                    try:
                        async with asyncio.timeout(remaining):
                            await self._wake.wait()
                    except TimeoutError:
                        break
                if self._paused:
                    await self._unpaused.wait()
                await self._run_batch(loop, virtual)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None
            for _, _, fut, _ in self._pending:
                fut.cancel()

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, virtual: bool) -> None:
        batch, self._pending = self._pending, []
        rows, self._pending_rows = self._pending_rows, 0
        if self._new_weights is not None:
            state, self.version = self._new_weights
            self._new_weights = None
            self.policy.load_state_dict(state)
        now = loop.time()
        self.max_request_wait_s = max(self.max_request_wait_s, now - batch[0][3])
        if rows == len(batch):
            obs = stack([item[1] for item in batch])
            env_ids = [item[0] for item in batch]
        else:  # some requests carry several envs
            obs = stack([o for item in batch for o in (item[1] if isinstance(item[0], list) else (item[1],))])
            env_ids = [i for item in batch for i in (item[0] if isinstance(item[0], list) else (item[0],))]
        if self._on_action is not None:
            # the version is fixed now: mark the actions in flight before the policy runs, so a
            # learner cut taken meanwhile waits for them instead of missing them
            for env_id in env_ids:
                self._on_action(env_id, self.version)
        self._idle.clear()
        try:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            if virtual or not self._use_thread():
                result = self.policy.act(obs)
                spent = time.perf_counter() - t0
                if not virtual:
                    # CPU time, not wall: waiting for the GIL or a core under load is no reason to offload
                    cpu = time.thread_time() - cpu0
                    self._cost_ewma = cpu if self._cost_ewma is None else 0.9 * self._cost_ewma + 0.1 * cpu
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="ebrl-generator")
                result = await loop.run_in_executor(self._executor, self.policy.act, obs)
                spent = time.perf_counter() - t0
            if virtual and self._virtual_cost is not None:
                spent = float(self._virtual_cost(rows))
                await asyncio.sleep(spent)
            self.busy_s += spent
            self.batch_s_ewma = 0.8 * self.batch_s_ewma + 0.2 * spent
        except BaseException as exc:
            for _, _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(exc) if isinstance(exc, Exception) else fut.cancel()
            raise
        finally:
            self._idle.set()
        if self._timeline is not None:
            self._timeline.record("generator", "batch", now, loop.time(), rows)
        self.batch_sizes[rows] += 1
        version = self.version
        row = 0
        for ids, _, fut, _ in batch:
            n = len(ids) if isinstance(ids, list) else 0
            if not fut.done():
                fut.set_result([(result, r, version) for r in range(row, row + n)] if n else (result, row, version))
            row += n or 1

    def _use_thread(self) -> bool:
        if self.offload is Offload.THREAD:
            return True
        if self.offload is Offload.INLINE:
            return False
        # AUTO: inline until batches are measured to cost more than a thread hop; then threads for good
        if self._cost_ewma is not None and self._cost_ewma > self.inline_below_s:
            self.offload = Offload.THREAD
            return True
        return False
