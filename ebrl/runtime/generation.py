"""Generator: the inference server that turns many action requests into few policy calls.

A request is a block of envs (the envs whose steps just finished, or a vector env's rows), with
their observations as one array tree, and a callback that receives the actions (no future or
task per request). A batch runs when ``batch_target`` rows wait, when every live env waits, or
when the oldest request has waited its fill wait (:meth:`Generator.fill_wait`; docs/batching.md
says why each). One batch runs at a time, on the event loop or in the generator's
:class:`~ebrl.runtime.stage.Stage` thread (``offload``; under ``Offload.AUTO`` the controller
picks from the first measured call). New weights are swapped in between batches, never during
one, and every action is tagged with the version of the weights that produced it.

    >>> import asyncio, numpy as np
    >>> from ebrl.runtime.generation import Generator
    >>> from ebrl.testing import MockPolicy
    >>> async def demo():
    ...     gen = Generator(MockPolicy(act_dim=2), batch_target=4, max_wait_s=0.01, live=4)
    ...     server = asyncio.create_task(gen.serve())
    ...     got = []
    ...     done = asyncio.Event()
    ...     for ids in ([0, 1], [2, 3]):   # two blocks of two envs: one batch of 4
    ...         gen.request(np.array(ids), np.zeros((2, 3), np.float32),
    ...                     lambda ids, res, lo, hi, version: got.append((ids.tolist(), lo, hi, version)) or done.set())
    ...     await done.wait()
    ...     server.cancel()
    ...     return got, dict(gen.batch_sizes)
    >>> asyncio.run(demo())
    ([([0, 1], 0, 2, 0), ([2, 3], 2, 4, 0)], {4: 1})
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ebrl.config import Offload
from ebrl.policies.base import ActResult, load_published
from ebrl.runtime.stage import Stage
from ebrl.runtime.state import RunState
from ebrl.spaces import concat

if TYPE_CHECKING:
    from ebrl.runtime.resources.gpu import GpuStreams
    from ebrl.telemetry.timeline import Timeline

FILL_WAIT_MAX_S = 0.05  # a batch filling to its target never waits longer (an env may be resetting)


class BatchCosts:
    """Seconds per policy call against the rows in the batch: a running mean per batch size,
    and the line ``fixed + per_row * rows`` through them. A VLA's call is mostly ``fixed`` (a
    batch of 16 costs little more than a batch of 1); a small MLP's is close to free either way.

        >>> costs = BatchCosts()
        >>> for rows, s in [(1, 0.041), (2, 0.042), (4, 0.044), (8, 0.048)]:
        ...     costs.add(rows, s)
        >>> [round(x * 1e3, 2) for x in costs.fit()]   # ms: fixed, per row
        [40.0, 1.0]
    """

    def __init__(self) -> None:
        self.mean_s: dict[int, float] = {}
        self.calls: Counter = Counter()

    def add(self, rows: int, seconds: float) -> None:
        n = self.calls[rows] = self.calls[rows] + 1
        # the mean of the first calls, then a running mean: the policy's cost drifts (threads, caches)
        self.mean_s[rows] = seconds if n == 1 else self.mean_s[rows] + (seconds - self.mean_s[rows]) / min(n, 20)

    def fit(self) -> tuple[float, float] | None:
        """``(fixed_s, per_row_s)`` by least squares weighted by calls, both at least 0; None
        until two batch sizes, the larger at least twice the smaller, have been measured."""
        if len(self.mean_s) < 2 or max(self.mean_s) < 2 * min(self.mean_s):
            return None
        rows = np.array(list(self.mean_s), float)
        secs = np.array([self.mean_s[r] for r in self.mean_s])
        w = np.array([self.calls[r] for r in self.mean_s], float)
        xm, ym = np.average(rows, weights=w), np.average(secs, weights=w)
        per_row = max(0.0, float(np.sum(w * (rows - xm) * (secs - ym)) / np.sum(w * (rows - xm) ** 2)))
        fixed = max(0.0, float(ym - per_row * xm))
        return fixed, per_row

    def to_dict(self) -> dict[str, Any]:
        fit = self.fit()
        return {"mean_us": {r: round(self.mean_s[r] * 1e6, 1) for r in sorted(self.mean_s)},
                "calls": dict(sorted(self.calls.items())),
                "fixed_us": None if fit is None else round(fit[0] * 1e6, 1),
                "per_row_us": None if fit is None else round(fit[1] * 1e6, 2)}


# A request's callback: (env ids, the batch's result, first row, end row, policy version).
OnActions = Callable[[np.ndarray, ActResult, int, int, int], None]


class Generator:
    """Dynamic batching in front of ``policy.act``."""

    def __init__(self, policy, *, batch_target: int, max_wait_s: float, live: int = 0,
                 state: RunState | None = None, offload: Offload = Offload.AUTO,
                 on_batch: Callable[[np.ndarray, int], None] | None = None, timeline: Timeline | None = None,
                 streams: GpuStreams | None = None, stage: Stage | None = None):
        self.policy = policy
        self.streams = streams  # GPU: policy calls go to the generation stream (resources.gpu)
        self.batch_target = batch_target
        self.max_wait_s = max_wait_s
        self.offload = offload
        self.version = 0
        # where the count of live envs comes from (without a run's: ``live`` envs, all of them live)
        self._state = state if state is not None else RunState(budget=0, active=live)
        self._state.watch(self.poke)  # fewer live envs: the ones waiting may now be everyone
        self.batch_sizes: Counter = Counter()
        self.costs = BatchCosts()  # seconds per call against batch size: the controller's batch target
        self.max_request_wait_s = 0.0
        self.request_wait_s = 0.0  # summed over rows: how long each waited for its batch to start
        self.capped_batches = 0  # batches started because the wait reached max_wait_s (not full, not all waiting)
        # where its calls run (the platform's: ebrl.runtime.platform) and what they cost (busy and
        # CPU seconds: wall over CPU says how long calls wait for the GIL)
        self.stage = stage or Stage("generator")
        self._on_batch = on_batch  # (env ids, version) as a batch forms: the rollout marks them in flight
        self._timeline = timeline  # records lane "generator", "batch" (arg: batch size) per policy call
        self._pending: list[tuple[np.ndarray, Any, OnActions, float]] = []  # (ids, obs rows, callback, time)
        self._pending_rows = 0
        self._wake = asyncio.Event()
        self.paused_s = 0.0  # loop time spent paused (lockstep schedules: while the learner trains)
        self._paused_at: float | None = None  # loop time the pause in progress began; None: not paused
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._idle = asyncio.Event()  # no batch is running
        self._idle.set()
        self._new_weights: tuple[dict, int] | None = None
        self.load_weights_s = 0.0  # loading published weights into the acting copy
        self._warmed = False  # AUTO: the first call ran (in the thread)
        # AUTO: the CPU seconds of the first measured inline call, once it ran; the controller's
        # start rule resolves AUTO from it (rules_start.offload_start)
        self.first_inline_cpu_s: float | None = None
        self.measured = asyncio.Event()
        self.batch_s_ewma = 0.0  # seconds per batch, how ever it ran: the adaptive wait
        self.rows_per_s = 0.0  # requested rows per second, a running average: how fast a batch fills
        self._last_start = None  # loop time the last batch started

    @property
    def busy_s(self) -> float:
        return self.stage.busy_s

    def counters(self, now: float) -> dict[str, float]:
        """Its counters as they stand at loop time ``now`` (running totals: a profile window is
        the difference of two snapshots)."""
        sizes = self.batch_sizes
        return {"gen_batches": sum(sizes.values()), "gen_rows": sum(k * v for k, v in sizes.items()),
                "gen_busy": self.busy_s, "gen_cpu": self.stage.cpu_s, "gen_wait": self.request_wait_s,
                "gen_capped": self.capped_batches, "gen_paused": self.paused_until_now(now)}

    def actuators(self) -> dict[str, Callable[[Any], None]]:
        """Knob -> setter, for the controller's decisions; each takes effect at the next batch."""
        def batch_target(rows: int) -> None:
            self.batch_target = int(rows)
            self.poke()  # rows waiting now may already make a batch

        return {"max_wait_s": lambda s: setattr(self, "max_wait_s", float(s)), "batch_target": batch_target,
                "offload": lambda mode: setattr(self, "offload", Offload(mode))}

    @property
    def live(self) -> int:
        """Envs that may still send a request."""
        return self._state.live

    # ---------------------------------------------------------------- requests

    def request(self, ids: np.ndarray, obs: Any, on_actions: OnActions) -> None:
        """Ask for actions for envs ``ids`` (observation rows ``obs``, a tree ``[B, ...]``); the
        batch that serves them calls ``on_actions(ids, result, lo, hi, version)``: rows
        ``lo:hi`` of ``result`` are theirs. They all land in the same batch."""
        self._pending.append((ids, obs, on_actions, asyncio.get_running_loop().time()))
        self._pending_rows += len(ids)
        if len(self._pending) == 1 or self._due():
            self._wake.set()

    def poke(self) -> None:
        """The count of live envs changed (:meth:`RunState.watch`): 'everyone waits' may now hold."""
        if self._pending and self._due():
            self._wake.set()

    def _due(self) -> bool:
        return self._pending_rows >= min(self.batch_target, max(self.live, 1))

    # ---------------------------------------------------------------- weights and pausing

    def publish(self, state: dict, version: int, event: Any = None) -> None:
        """New weights; they take effect at the next batch. ``event``: the CUDA event recorded
        on the training stream after the weights were copied, waited for on the generation stream."""
        self._new_weights = (state, version, event)

    async def pause(self) -> None:
        """Stop forming batches (after the running one finishes); used while an update must not overlap generation."""
        if self._paused_at is None:
            self._paused_at = asyncio.get_running_loop().time()
        self._unpaused.clear()
        await self._idle.wait()

    def resume(self) -> None:
        if self._paused_at is not None:
            self.paused_s += asyncio.get_running_loop().time() - self._paused_at
        self._paused_at = None
        self._unpaused.set()

    def paused_until_now(self, now: float) -> float:
        """``paused_s`` with a pause in progress counted up to loop time ``now``."""
        return self.paused_s + (now - self._paused_at if self._paused_at is not None else 0.0)

    # ---------------------------------------------------------------- the server

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while not self._pending:
                    self._wake.clear()
                    await self._wake.wait()
                wait, capped = self.fill_wait()
                deadline = self._pending[0][3] + wait
                while not self._due():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        self.capped_batches += capped
                        break
                    self._wake.clear()
                    try:
                        async with asyncio.timeout(remaining):
                            await self._wake.wait()
                    except TimeoutError:
                        self.capped_batches += capped
                        break
                await self._unpaused.wait()  # returns at once unless paused
                await self._run_batch(loop)
        finally:
            self.stage.close()
            self._pending.clear()

    def fill_wait(self) -> tuple[float, bool]:
        """How long the oldest request may wait for its batch to fill, and whether ``max_wait_s``
        (not the batch's duration or fill time) sets it."""
        if self.batch_target < self.live:  # fill to the target
            fill = self.batch_target / self.rows_per_s if self.rows_per_s > 0 else 0.0
            return min(FILL_WAIT_MAX_S, max(self.max_wait_s, fill)), fill <= self.max_wait_s
        return min(self.max_wait_s, self.batch_s_ewma), self.max_wait_s <= self.batch_s_ewma

    async def _run_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        rows, self._pending_rows = self._pending_rows, 0
        start = loop.time()
        if self._last_start is not None and start > self._last_start:
            rate = rows / (start - self._last_start)  # the rows that arrived since the last batch started
            self.rows_per_s = rate if self.rows_per_s == 0 else 0.9 * self.rows_per_s + 0.1 * rate
        self._last_start = start
        if self._new_weights is not None:
            state, self.version, event = self._new_weights
            self._new_weights = None
            t0 = self.stage.now()
            if self.streams is not None:
                self.streams.wait_published(event)
                with self.streams.generation():
                    load_published(self.policy, state)
            else:
                load_published(self.policy, state)
            self.load_weights_s += self.stage.now() - t0
        now = loop.time()
        self.max_request_wait_s = max(self.max_request_wait_s, now - batch[0][3])
        if len(batch) == 1:
            env_ids, obs = batch[0][0], batch[0][1]
        else:
            env_ids = np.concatenate([item[0] for item in batch])
            obs = concat([item[1] for item in batch])
        if self._on_batch is not None:
            # the version is fixed now: mark the actions in flight before the policy runs, so a
            # learner cut taken meanwhile waits for them instead of missing them
            self._on_batch(env_ids, self.version)
        self._idle.clear()
        try:
            act = self.policy.act if self.streams is None else self._act_on_stream
            threaded = self.stage.threads and self._use_thread()
            result = await self.stage.call(act, obs, thread=threaded, size=rows)
            spent = self.stage.last_s
            if self.first_inline_cpu_s is None and self.stage.threads and not threaded:
                # CPU time, not wall: waiting for the GIL or a core under load is no reason to offload
                self.first_inline_cpu_s = self.stage.last_cpu_s
                self.measured.set()
            if self.batch_sizes:  # the first call pays the policy's lazy set-up: not its cost
                self.costs.add(rows, spent)
            self.batch_s_ewma = 0.8 * self.batch_s_ewma + 0.2 * spent
        finally:
            self._idle.set()
        if self._timeline is not None:
            self._timeline.record("generator", "batch", now, loop.time(), rows)
        self.batch_sizes[rows] += 1
        version, lo = self.version, 0
        waited = 0.0
        for ids, _, on_actions, t_req in batch:
            hi = lo + len(ids)
            waited += (now - t_req) * (hi - lo)
            on_actions(ids, result, lo, hi, version)
            lo = hi
        self.request_wait_s += waited

    @property
    def offload_mode(self) -> Offload:
        """Where the next batch runs: ``INLINE`` or ``THREAD`` (``AUTO`` resolved as it stands)."""
        if self.offload is Offload.AUTO:
            return Offload.THREAD if not self._warmed else Offload.INLINE
        return self.offload

    def _act_on_stream(self, obs: Any) -> ActResult:
        with self.streams.generation():  # the stream is per thread: entered where the call runs
            return self.policy.act(obs)

    def _use_thread(self) -> bool:
        # AUTO until the controller resolves it: the first call pays the policy's lazy set-up
        # (tens of ms for a torch policy), off the loop and not measured; the next runs inline
        mode, self._warmed = self.offload_mode, True
        return mode is Offload.THREAD
