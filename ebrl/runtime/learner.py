"""Learner: takes segments from the RolloutQueue, runs ``algo.update`` off the event loop,
publishes the new weights to the Generator.

The update runs in the learner's :class:`~ebrl.runtime.stage.Stage` thread, so rollout
continues while it trains, in one of two places (:class:`~ebrl.config.LearnerMode`):

- that thread itself: right for a GPU, where torch ops are asynchronous launches;
- a child process (:class:`~ebrl.runtime.learner_process.LearnerProcess`) the thread waits
  on: right on a CPU host, where a learner thread and the event loop convoy on the GIL.

Weights are published as a snapshot taken right after the update, so the generator never
sees a half-written tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
# torch.optim imports torch._dynamo (about 1.2 s on the reference machine) the first time an
# optimiser is built or stepped. Imported here, with the runtime, it is paid before run() and
# before any fork: the learner process and the sim workers inherit it, and no run's first
# update waits for it (a 160-step run took 1.35 s with it inside run(), 0.15 s without).
import torch._dynamo  # noqa: F401

from ebrl.algos.batch import Batch
from ebrl.checkpoint import algo_state, write_checkpoint
from ebrl.config import NonFinite
from ebrl.policies.base import published_state
from ebrl.runtime.errors import LearnerError, NonFiniteError
from ebrl.runtime.generation import Generator
from ebrl.runtime.learner_process import LearnerProcess, nonfinite_weights, restore, snapshot, update_once
from ebrl.runtime.collate import collate
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.stage import Stage
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats
from ebrl.runtime.threads import CLOSE_WAIT_S, in_thread
from ebrl.runtime.virtual_time import is_virtual
from ebrl.telemetry.logging import get_logger
from ebrl.telemetry.metrics import MetricsLog

if TYPE_CHECKING:
    from ebrl.distributed import DataParallel
    from ebrl.telemetry.timeline import Timeline
    from ebrl.runtime.resources.gpu import GpuStreams

log = get_logger("ebrl.learner")
JOINT_POLL_S = 0.005  # how often a rank waiting for its queue looks for another rank's request


@dataclass
class Checkpointing:
    """Periodic checkpoints (``RunConfig.checkpoint_every_s``): where, how often, and the env
    steps of earlier runs this one continues."""

    path: Path
    every_s: float
    policy_class: str
    base_env_steps: int = 0
    last: float = -math.inf

    def due(self, now: float) -> bool:
        return math.isfinite(self.every_s) and now - self.last >= self.every_s


class Learner:
    def __init__(self, policy, algo, rollout: RolloutQueue, generator: Generator, stats: RunStats,
                 state: RunState, *, pause_generation: bool, remote: LearnerProcess | None = None,
                 timeline: Timeline | None = None, checkpoint: Checkpointing | None = None,
                 metrics: MetricsLog | None = None, streams: GpuStreams | None = None,
                 nonfinite: NonFinite = NonFinite.RAISE, dp: DataParallel | None = None,
                 update_timeout_s: float | None = None):
        self.policy = policy
        # faults.update_timeout_s: an update in the learner's thread past it ends the run (the
        # learner process applies its own, killing the process)
        self.update_timeout_s = update_timeout_s
        self.algo = algo
        self.nonfinite = nonfinite  # faults.nonfinite: a NaN/inf loss or weights raise, or skip the update
        self._published = snapshot(published_state(policy))  # what an update that went NaN is undone to
        self.streams = streams  # GPU: updates go to the training stream (resources.gpu)
        self.threads: int | None = None  # torch threads for the learner process (the controller's), None: as started
        self._event = None  # the CUDA event recorded after the latest update's weight snapshot
        self.rollout = rollout
        self.generator = generator
        self.stats = stats
        self.pause_generation = pause_generation  # lag 0 and lockstep schedules: no overlap
        self.version = 0
        self.metrics = metrics if metrics is not None else MetricsLog()  # receives one row per update
        # where updates run and what they cost: busy seconds (virtual ones under virtual time)
        self.stage = Stage("learner", getattr(algo, "virtual_cost", None))
        self.untrained_in_hand = 0  # taken for an update that has not finished
        self.state = state  # state.stopping: finish the update in flight, take no more
        self.t0 = 0.0  # loop time at the run's start; history times are relative to it
        self.remote = remote
        self._timeline = timeline  # records lane "learner", "update" (arg: steps trained) per update
        self.checkpoint = checkpoint
        self.dp = dp  # one rank of a data-parallel job (ebrl.distributed), or None
        self._rounds, self._said_done = 0, False  # a data-parallel rank: updates joined, done announced
        self.job: dict[str, Any] = {}  # the job's counters at the latest update's header (data-parallel)
        self._last = (0.0, 0, 0, 0)  # loop time, env steps, generated rows, generation batches at the last row

    def published(self) -> dict:
        """The latest published weights (what the generator acts with; only what trains under LoRA)."""
        return self._published

    @property
    def busy_s(self) -> float:
        """Seconds in updates (loop time under virtual time)."""
        return self.stage.busy_s

    def counters(self, now: float) -> dict[str, float]:
        """Its counters at loop time ``now`` (the update in progress counted up to ``now``)."""
        return {"updates": self.stats.updates, "learner_busy": self.stage.busy_until_now(now)}

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per update so far (``RunResult.history``)."""
        return self.metrics.rows

    async def run(self) -> None:
        """The learner's one loop: wait until an update is due, take its segments, train. A rank
        of a data-parallel job (:mod:`ebrl.distributed`) joins every update of the job instead,
        asked for by whichever rank's queue falls due first (:meth:`_joint_due`)."""
        if self.remote is None and not is_virtual():  # every update runs in this one thread
            self.stage.start_thread()
        try:
            joint = self.dp is not None
            if joint:
                await self._first_step()
            while joint or not self.state.stopping:  # a rank stops with its job, at the same update
                if joint:
                    if not await self._joint_due():
                        break
                else:
                    await self.rollout.wait_due()
                    if self.state.stopping:
                        break
                if self.pause_generation:
                    # the running batch finishes first, so its actions are in flight (and awaited) before the cut
                    await self.generator.pause()
                slots = await self.rollout.take(self.version, joint=joint)
                if slots is None:
                    break
                await self.train(slots)
                if joint and self.job["done"] == self.dp.world_size:  # every rank handed everything over
                    break
            if self.remote is not None and not is_virtual():
                # joining the learner process (its trained state comes back first) would take the
                # loop ~15 ms
                await in_thread(self.close, name="ebrl-learner-close")
        finally:
            self.close()

    async def _first_step(self) -> None:
        """A rank joins updates once it has a step to store."""
        rollout = self.rollout
        while not rollout.steps_per_env.any() and not (rollout.finished or self.state.stopping):
            await asyncio.sleep(JOINT_POLL_S)

    async def _joint_due(self) -> bool:
        """This rank's part of a job-wide update: ask for one when this queue is due (every rank
        asks under lockstep schedules and lag 0, whose queues stay due until they train), join
        when another rank asked, then share each rank's state (done, stopping, steps) in a
        header that also checks the weights agree. False: the job stops here, on every rank.
        Keys are per round, not per version: a skipped update must not re-fire its key."""
        dp, rollout = self.dp, self.rollout
        everyone = self.pause_generation
        self._rounds += 1
        asked = False
        while True:
            # a rank that is done asks once (under sync: every round, where it never holds one up)
            done = rollout.finished and (everyone or not self._said_done)
            if not asked and (self.state.stopping or done or (not rollout.finished and rollout.due())):
                dp.request(self._rounds, stop=self.state.stopping)
                self._said_done, asked = self._said_done or rollout.finished, True
            if dp.requested(self._rounds, dp.world_size if everyone else 1):
                break
            await rollout.wait_changed(JOINT_POLL_S)
        mine = [float(rollout.finished), float(self.state.stopping), float(self.stats.simulated),
                float(self.stats.trained)]
        rows = await self.stage.aside(dp.header, mine, self.published() if self.version else None)
        self.job = {"done": sum(r[0] for r in rows), "stopping": sum(r[1] for r in rows),
                    "env_steps": int(sum(r[2] for r in rows)), "trained": int(sum(r[3] for r in rows)),
                    "rank_env_steps": [int(r[2]) for r in rows]}
        if self.job["stopping"]:
            self.state.stop()  # every rank stops at the same update
            return False
        if not rollout.steps_per_env.any():  # a rank must have stored a step to bring its (empty) batch
            raise RuntimeError(f"rank {dp.rank} ended before recording any step: it cannot take part in updates")
        return True

    def close(self) -> None:
        """Join the learner's thread (after the update in flight, ``CLOSE_WAIT_S`` at most: then
        a learner process is killed, which ends the thread's wait on it) and its process, if any."""
        running = self.stage.close(CLOSE_WAIT_S)
        if running:
            if self.remote is not None:
                log.warning("learner_update_abandoned", wait_s=CLOSE_WAIT_S)
                self.remote.kill()  # the thread's pipe read ends with it
                for t in running:
                    t.join(1.0)
            else:
                log.warning("learner_thread_left_running", wait_s=CLOSE_WAIT_S)
        if self.remote is not None:
            remote, self.remote = self.remote, None
            remote.close(self.policy, self.algo)

    async def train(self, slots: list[int]) -> None:
        """Train on the rollout's ``slots``: gathered into a batch in the stage's thread (inline
        under virtual time), then given back to the rollout."""
        loop = asyncio.get_running_loop()
        n = self.rollout.steps_in(slots)
        self.untrained_in_hand = n
        lt0 = loop.time()
        virtual = is_virtual(loop)
        rollout, version, taken = self.rollout, self.version, list(slots)
        threads = self.threads
        update = (lambda b: self.remote.update(b, threads)) if self.remote is not None else self._update

        def work():
            batch = collate(rollout, taken, version)
            if virtual:  # inline: the slots are free while the update's declared cost is slept
                rollout.release(taken)
                taken.clear()
            return update(batch)

        limit = None if virtual or self.remote is not None else self.update_timeout_s
        try:
            try:
                async with asyncio.timeout(limit):
                    metrics, state, lags = await self.stage.call(work, thread=not virtual, size=n)
            except TimeoutError:
                raise LearnerError(f"an update ran past faults.update_timeout_s={limit:g} s; the learner's "
                                   "thread is left to finish it") from None
        except LearnerError:
            if self.checkpoint is not None:  # what the generator acts with: the last published weights
                await self._write_checkpoint(self._published, algo=False)
            raise
        finally:
            rollout.release(taken)
        if virtual:
            metrics["publish_s"] = 0.0  # only the loop clock means anything here (as for update_s)
        lt1, spent = loop.time(), self.stage.last_s
        if self._timeline is not None:
            self._timeline.record("learner", "update", lt0, lt1, n)
        skipped = await self._skip_if_nonfinite(metrics, state, n, loop)
        if not skipped:
            self._published = state
            self.version += 1
            self.generator.publish(state, self.version, self._event)
            self.stats.published_bytes += int(metrics.get("publish_bytes", 0))
            self.stats.publish_snapshot_s += metrics.get("publish_s", 0.0)
        if self.pause_generation:
            self.generator.resume()
        self.untrained_in_hand = 0
        if skipped:
            return
        st = self.stats
        st.trained += n
        st.updates += 1
        if st.updates == 1:  # RunResult.first_update_s and the steady-state rate after it
            st.first_update_at, st.steps_at_first_update = lt1, st.simulated
        values, counts = np.unique(lags, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            st.lag[v] += c
        st.last_metrics = metrics
        self.metrics.record(self._row(metrics, lags, spent, lt1))
        if self.checkpoint is not None and self.checkpoint.due(loop.time()):
            await self._write_checkpoint(state)

    async def _skip_if_nonfinite(self, metrics: dict[str, float], state: dict, n: int, loop) -> bool:
        """An update whose loss or new weights hold NaN/inf: raise (``faults.nonfinite='raise'``),
        or undo it (the training copy back to the last published weights, a fresh optimiser),
        publish nothing, and count its ``n`` steps as dropped (``nonfinite_update``)."""
        bad = nonfinite_weights(state)
        if not bad and not metrics.get("nonfinite_loss"):
            return False
        what = (f"update {self.version + 1} produced NaN/inf weights in {', '.join(bad[:4])}" if bad else
                f"update {self.version + 1}'s loss was NaN/inf (after {int(metrics.get('minibatches', 0))} "
                "minibatch steps)")
        if self.nonfinite is NonFinite.RAISE:
            raise NonFiniteError(what + "; nothing was published. Set faults.nonfinite='drop' to skip such "
                                 "updates instead")
        log.warning("update_skipped", reason=what, steps=n)
        if self.remote is not None:  # never under virtual time: a learner process is a real-time mode
            await self.stage.aside(self.remote.restore, self._published)
        else:
            restore(self.policy, self.algo, self._published)
        self.stats.skipped_updates += 1
        self.stats.drop("nonfinite_update", n)
        return True

    def _row(self, metrics: dict[str, float], lags: np.ndarray, update_s: float, now: float) -> dict[str, Any]:
        """The update's row: counters, rates since the previous row and overall, the batch's
        policy lag, then the algorithm's metrics (the runtime's own keys win a clash)."""
        st, gen = self.stats, self.generator.batch_sizes
        rows, batches = sum(k * v for k, v in gen.items()), sum(gen.values())
        last_t, last_steps, last_rows, last_batches = self._last
        self._last = (now - self.t0, st.simulated, rows, batches)
        elapsed, interval = now - self.t0, now - self.t0 - last_t
        row = {"update": self.version, "env_steps": st.simulated, "trained": st.trained, "time": elapsed,
               "mean_return": st.mean_return,
               "success_once": (sum(st.success_once) / len(st.success_once)) if st.success_once else None,
               "success_at_end": (sum(st.success_at_end) / len(st.success_at_end)) if st.success_at_end else None,
               "episodes": st.episodes,
               "episode_length": (sum(st.lengths) / len(st.lengths)) if st.lengths else math.nan,
               "env_steps_per_s": (st.simulated - last_steps) / interval if interval > 0 else math.nan,
               "env_steps_per_s_overall": st.simulated / elapsed if elapsed > 0 else math.nan,
               "update_s": update_s,
               "lag_mean": float(lags.mean()) if lags.size else 0.0,
               "lag_max": int(lags.max()) if lags.size else 0,
               "gen_batch_mean": (rows - last_rows) / (batches - last_batches) if batches > last_batches else math.nan,
               "dropped": sum(st.dropped.values()), "env_failures": st.env_failures}
        if self.job:  # data-parallel: the job's env steps (every rank's, at this update's start)
            row["job_env_steps"] = self.job["env_steps"]
        row.update((k, v) for k, v in metrics.items() if k not in row)
        return row

    async def _write_checkpoint(self, policy_state: dict, algo: bool = True) -> None:
        """The weights just trained and the algorithm's state (``algo``: else none, as when the
        learner process died with it), written off the loop."""
        cp, loop = self.checkpoint, asyncio.get_running_loop()
        cp.last = loop.time()
        job = self.job  # a data-parallel job's counters (every rank's) at the latest update
        meta = {"env_steps": cp.base_env_steps + job.get("env_steps", self.stats.simulated),
                "trained": job.get("trained", self.stats.trained),
                "updates": self.version, "periodic": True}

        def work() -> None:  # the learner's thread: idle between updates, so the algo is not mid-update
            state = None
            if algo:
                try:
                    state = self.remote.algo_state() if self.remote is not None else algo_state(self.algo)
                except LearnerError:  # the learner process died while asked: its weights are still here
                    write_checkpoint(cp.path, policy_state, None, cp.policy_class, **meta)
                    raise
            write_checkpoint(cp.path, policy_state, state, cp.policy_class, **meta)

        await self.stage.aside(work)  # inline under virtual time
        log.info("checkpoint", path=str(cp.path), **meta)

    def _update(self, batch: Batch):
        # in the learner's thread: a data-parallel update's statistics and gradients are joint
        with self.dp.active() if self.dp is not None else contextlib.nullcontext():
            if self.streams is None:
                return update_once(self.policy, self.algo, batch)
            with self.streams.training():  # the stream is per thread: entered in the learner's thread
                out = update_once(self.policy, self.algo, batch)
                self._event = self.streams.publish()  # after the snapshot: generation waits for it
            return out
