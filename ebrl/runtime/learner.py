"""Learner: takes segments from the RolloutQueue, runs ``algo.update`` off the event loop,
publishes the new weights to the Generator.

The update runs in the learner's own thread (torch releases the GIL inside its kernels),
so rollout continues while it trains. Weights are published as a snapshot taken in that
thread right after the update, so the generator never sees a half-written tensor.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ebrl.runtime.generation import Generator
from ebrl.runtime.rollout import RolloutQueue, Segment, collate
from ebrl.runtime.stats import RunStats
from ebrl.runtime.virtual_time import is_virtual


def snapshot(state: dict) -> dict:
    """A detached copy of a state dict (tensors cloned, other values as they are)."""
    return {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in state.items()}


class Learner:
    def __init__(self, policy, algo, rollout: RolloutQueue, generator: Generator, stats: RunStats,
                 *, pause_generation: bool):
        self.policy = policy
        self.algo = algo
        self.rollout = rollout
        self.generator = generator
        self.stats = stats
        self.pause_generation = pause_generation  # lag 0 and lockstep schedules: no overlap
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self.busy_s = 0.0
        self.untrained_in_hand = 0  # taken for an update that has not finished
        self.stopping = False  # a stop was requested: finish the update in flight, take no more
        self._executor: ThreadPoolExecutor | None = None
        self._virtual_cost = getattr(algo, "virtual_cost", None)

    async def run(self) -> None:
        try:
            while not self.stopping:
                await self.rollout.wait_due()
                if self.stopping:
                    return
                if self.pause_generation:
                    # the running batch finishes first, so its actions are in flight (and awaited) before the cut
                    await self.generator.pause()
                segments = await self.rollout.take(self.version)
                if segments is None:
                    return
                await self.train(segments)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None

    async def train(self, segments: list[Segment]) -> None:
        loop = asyncio.get_running_loop()
        n = sum(s.n for s in segments)
        self.untrained_in_hand = n
        t0 = time.perf_counter()
        if is_virtual(loop):
            metrics, state, lags = self._update(segments)
            if self._virtual_cost is not None:
                await asyncio.sleep(float(self._virtual_cost(n)))
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ebrl-learner")
            metrics, state, lags = await loop.run_in_executor(self._executor, self._update, segments)
        self.busy_s += time.perf_counter() - t0
        self.version += 1
        self.generator.publish(state, self.version)
        if self.pause_generation:
            self.generator.resume()
        self.untrained_in_hand = 0
        st = self.stats
        st.trained += n
        st.updates += 1
        values, counts = np.unique(lags, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            st.lag[v] += c
        st.last_metrics = metrics
        self.history.append({"update": self.version, "env_steps": st.simulated, "trained": st.trained,
                             "time": loop.time(), "mean_return": st.mean_return, **metrics})

    def _update(self, segments: list[Segment]):
        batch = collate(segments, self.version)
        lags = batch.lags.numpy()
        metrics = self.algo.update(self.policy, batch) or {}
        return {k: float(v) for k, v in metrics.items()}, snapshot(self.policy.state_dict()), lags
