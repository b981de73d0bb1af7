"""Learner: one loop that takes segments from the RolloutQueue, has an update worker train on
them, publishes the new weights to the Generator, and runs its hooks.

    while an update is due:        (this queue's; or the job's, for a data-parallel rank)
        take the segments
        metrics = worker.update(batch)           off the event loop
        hooks accept it?  (NaN rollback)  -> publish the weights
        hooks after it    (metric rows, checkpoints)

The worker runs updates in the learner stage's thread (:class:`InThread`: right for a GPU, where
torch ops are asynchronous launches, and for a data-parallel rank, whose gradients meet in the
optimiser step) or in a child process that thread waits on (:class:`InProcess`: right on a CPU
host, where a learner thread and the event loop convoy on the GIL). Weights are published as a
snapshot taken right after the update, so the generator never sees a half-written tensor.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
# torch.optim imports torch._dynamo (about 1.2 s on the reference machine) the first time an
# optimiser is built or stepped. Imported here, with the runtime, it is paid before run() and
# before any fork: the learner process and the sim workers inherit it, and no run's first
# update waits for it (a 160-step run took 1.35 s with it inside run(), 0.15 s without).
import torch._dynamo  # noqa: F401

from ebrl.algos.batch import Batch
from ebrl.checkpoint import algo_state, write_checkpoint
from ebrl.config import NonFinite
from ebrl.policies.base import published_state
from ebrl.runtime.collate import collate
from ebrl.runtime.errors import LearnerError, NonFiniteError
from ebrl.runtime.generation import Generator
from ebrl.runtime.learner_process import LearnerProcess, nonfinite_weights, restore, snapshot, update_once
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.stage import Stage
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats, mean
from ebrl.runtime.threads import CLOSE_WAIT_S, in_thread
from ebrl.telemetry.logging import get_logger
from ebrl.telemetry.metrics import MetricsLog

if TYPE_CHECKING:
    from ebrl.distributed import DataParallel
    from ebrl.runtime.resources.gpu import GpuStreams
    from ebrl.telemetry.timeline import Timeline

log = get_logger("ebrl.learner")
JOINT_POLL_S = 0.005  # how often a rank waiting for its queue looks for another rank's request


class InThread:
    """An update worker (its methods block: the learner calls them from its stage's thread) that
    trains the caller's own ``policy`` and ``algo`` in that thread: on a GPU's training stream
    (``streams``), and for a rank of a data-parallel job (``dp``), with its statistics and
    gradients joint across ranks."""

    pid = None  # the process updates run in (None: this one)

    def __init__(self, policy, algo, *, streams: GpuStreams | None = None, dp: DataParallel | None = None,
                 timeout_s: float | None = None, clock=None):
        self.policy, self.algo, self.streams, self.dp = policy, algo, streams, dp
        self.timeout_s = timeout_s  # faults.update_timeout_s, which the learner applies (a thread cannot be killed)
        self.clock = clock  # what the publication snapshot is timed on (the stage's)
        self.event = None  # the CUDA event recorded after the latest update's weight snapshot

    def update(self, batch: Batch, threads: int | None) -> tuple[dict, dict, np.ndarray]:
        """The metrics, the published state and each transition's policy lag."""
        with self.dp.active() if self.dp is not None else nullcontext():
            if self.streams is None:
                return update_once(self.policy, self.algo, batch, clock=self.clock)
            with self.streams.training():  # the stream is per thread: entered in the learner's thread
                out = update_once(self.policy, self.algo, batch, clock=self.clock)
                self.event = self.streams.publish()  # after the snapshot: generation waits for it
            return out

    def restore(self, published: dict) -> None:
        restore(self.policy, self.algo, published)

    def algo_state(self) -> dict | None:
        return algo_state(self.algo)

    def kill(self) -> None:
        """End an update in flight (a stop that cannot wait for it): a thread is left to finish."""

    def close(self) -> None:
        """Leave the trained state in the caller's ``policy`` and ``algo`` (here: it trained them)."""


class InProcess(LearnerProcess):
    """Updates in a :class:`~ebrl.runtime.learner_process.LearnerProcess`, which applies
    ``faults.update_timeout_s`` itself (killing the process, which ends the stage thread's wait)."""

    timeout_s = None
    event = None

    def __init__(self, policy, algo, *args, **kwargs):
        super().__init__(policy, algo, *args, **kwargs)
        self.policy, self.algo = policy, algo

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def close(self) -> None:
        super().close(self.policy, self.algo)


@dataclass
class Update:
    """One finished update, as the hooks see it."""

    metrics: dict[str, float]
    state: dict  # the published tensors
    lags: np.ndarray  # each transition's policy lag
    steps: int
    seconds: float  # its stage call's
    ended: float  # loop time


class Hook:
    """Called by the learner around each update; every method may be left as it is."""

    async def accept(self, learner: Learner, update: Update) -> bool:
        """False: the update is undone and not published (its steps are dropped)."""
        return True

    async def after(self, learner: Learner, update: Update) -> None:
        """After a published update."""

    async def failed(self, learner: Learner) -> None:
        """After an update failed with :class:`LearnerError` (the run ends)."""


class NonFiniteGuard(Hook):
    """An update whose loss or new weights hold NaN/inf: raise (``faults.nonfinite='raise'``), or
    undo it (the training copy back to the last published weights, a fresh optimiser), publish
    nothing, and count its steps as dropped (``nonfinite_update``)."""

    def __init__(self, mode: NonFinite):
        self.mode = mode

    async def accept(self, learner: Learner, update: Update) -> bool:
        metrics = update.metrics
        bad = nonfinite_weights(update.state)
        if not bad and not metrics.get("nonfinite_loss"):
            return True
        what = (f"update {learner.version + 1} produced NaN/inf weights in {', '.join(bad[:4])}" if bad else
                f"update {learner.version + 1}'s loss was NaN/inf (after {int(metrics.get('minibatches', 0))} "
                "minibatch steps)")
        if self.mode is NonFinite.RAISE:
            raise NonFiniteError(what + "; nothing was published. Set faults.nonfinite='drop' to skip such "
                                 "updates instead")
        log.warning("update_skipped", reason=what, steps=update.steps)
        await learner.stage.aside(learner.worker.restore, learner.published())
        learner.stats.skipped_updates += 1
        learner.stats.drop("nonfinite_update", update.steps)
        return False


class MetricRows(Hook):
    """One row per update into ``metrics`` (``RunResult.history``, ``history.jsonl``, TensorBoard):
    counters, rates since the previous row and overall, the batch's policy lag, then the
    algorithm's metrics (the runtime's own keys win a clash)."""

    def __init__(self, metrics: MetricsLog):
        self.metrics = metrics
        self._last = (0.0, 0, 0, 0)  # run time, env steps, generated rows, generation batches at the last row

    async def after(self, learner: Learner, update: Update) -> None:
        st, gen, lags = learner.stats, learner.generator.batch_sizes, update.lags
        rows, batches = sum(k * v for k, v in gen.items()), sum(gen.values())
        last_t, last_steps, last_rows, last_batches = self._last
        elapsed = update.ended - learner.t0
        self._last = (elapsed, st.simulated, rows, batches)
        interval = elapsed - last_t
        row = {"update": learner.version, "env_steps": st.simulated, "trained": st.trained, "time": elapsed,
               "mean_return": st.mean_return, "success_once": mean(st.success_once, None),
               "success_at_end": mean(st.success_at_end, None), "episodes": st.episodes,
               "episode_length": mean(st.lengths),
               "env_steps_per_s": (st.simulated - last_steps) / interval if interval > 0 else math.nan,
               "env_steps_per_s_overall": st.simulated / elapsed if elapsed > 0 else math.nan,
               "update_s": update.seconds,
               "lag_mean": float(lags.mean()) if lags.size else 0.0, "lag_max": int(lags.max()) if lags.size else 0,
               "gen_batch_mean": (rows - last_rows) / (batches - last_batches) if batches > last_batches else math.nan,
               "dropped": sum(st.dropped.values()), "env_failures": st.env_failures}
        if learner.job:  # data-parallel: the job's env steps (every rank's, at this update's start)
            row["job_env_steps"] = learner.job["env_steps"]
        row.update((k, v) for k, v in update.metrics.items() if k not in row)
        self.metrics.record(row)


@dataclass
class Checkpointing(Hook):
    """Checkpoints every ``every_s`` (``RunConfig.checkpoint_every_s``), and one of the last published
    weights when an update fails; ``base_env_steps``: those of the runs this one continues."""

    path: Path
    every_s: float
    policy_class: str
    base_env_steps: int = 0
    last: float = field(default=-math.inf)

    async def after(self, learner: Learner, update: Update) -> None:
        if math.isfinite(self.every_s) and asyncio.get_running_loop().time() - self.last >= self.every_s:
            await self.write(learner, update.state)

    async def failed(self, learner: Learner) -> None:
        await self.write(learner, learner.published(), algo=False)  # what the generator acts with

    async def write(self, learner: Learner, policy_state: dict, algo: bool = True) -> None:
        """The weights and the algorithm's state (``algo``: else none, as when the learner
        process died with it), written in the learner's stage, between updates."""
        self.last = asyncio.get_running_loop().time()
        job = learner.job  # a data-parallel job's counters (every rank's) at the latest update
        meta = {"env_steps": self.base_env_steps + job.get("env_steps", learner.stats.simulated),
                "trained": job.get("trained", learner.stats.trained),
                "updates": learner.version, "periodic": True}

        def work() -> None:
            try:
                state = learner.worker.algo_state() if algo else None
            except LearnerError:  # the learner process died while asked: its weights are still here
                write_checkpoint(self.path, policy_state, None, self.policy_class, **meta)
                raise
            write_checkpoint(self.path, policy_state, state, self.policy_class, **meta)

        await learner.stage.aside(work)
        log.info("checkpoint", path=str(self.path), **meta)


class Learner:
    """The learner's loop (see the module docstring). ``worker`` holds the caller's policy and
    algorithm; ``stage`` is where its calls run (the platform's); ``hooks`` are called in order
    around each update; ``dp``: a rank of a data-parallel job (:mod:`ebrl.distributed`)."""

    def __init__(self, worker: InThread | InProcess, rollout: RolloutQueue, generator: Generator, stats: RunStats,
                 state: RunState, *, stage: Stage, hooks: list[Hook], dp: DataParallel | None = None,
                 timeline: Timeline | None = None):
        self.worker, self.stage, self.hooks, self.dp = worker, stage, hooks, dp
        self.rollout, self.generator, self.stats, self.state = rollout, generator, stats, state
        # lag 0 and lockstep schedules: no overlap of rollout and training
        self.pause_generation = rollout.lockstep or rollout.max_lag == 0
        self._timeline = timeline  # records lane "learner", "update" (arg: steps trained) per update
        self._published = snapshot(published_state(worker.policy))  # what an update that went NaN is undone to
        self.threads: int | None = None  # torch threads for a learner process (the controller's), None: as started
        self.version = 0
        self.untrained_in_hand = 0  # taken for an update that has not finished
        self.held = 0  # steps the algorithm keeps for a later update (its metric steps_held)
        self.t0 = 0.0  # loop time at the run's start; history times are relative to it
        self._rounds, self._said_done = 0, False  # a data-parallel rank: updates joined, done announced
        self.job: dict[str, Any] = {}  # the job's counters at the latest update's header (data-parallel)

    def published(self) -> dict:
        """The latest published weights (what the generator acts with; only what trains under LoRA)."""
        return self._published

    def counters(self, now: float) -> dict[str, float]:
        """Its counters at loop time ``now`` (the update in progress counted up to ``now``)."""
        return {"updates": self.stats.updates, "learner_busy": self.stage.busy_until_now(now)}

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per update so far (``RunResult.history``): its :class:`MetricRows` hook's."""
        return next((h.metrics.rows for h in self.hooks if isinstance(h, MetricRows)), [])

    async def run(self) -> None:
        """Wait until an update is due, take its segments, train; until the run stops."""
        joint = self.dp is not None
        if self.worker.pid is None:  # every update runs in this one thread
            self.stage.start_thread()
        try:
            if joint:
                await self._first_step()
            while await (self._joint_due() if joint else self._due()):
                if self.pause_generation:
                    # the running batch finishes first, so its actions are in flight (and awaited) before the cut
                    await self.generator.pause()
                slots = await self.rollout.take(self.version, joint=joint)
                if slots is None:
                    break
                await self.train(slots)
                if joint and self.job["done"] == self.dp.world_size:  # every rank handed everything over
                    break
            if self.worker.pid is not None:
                # joining a learner process (its trained state comes back first) would take the loop ~15 ms
                await in_thread(self.close, name="ebrl-learner-close")
        finally:
            self.close()

    async def _due(self) -> bool:
        await self.rollout.wait_due()
        return not self.state.stopping

    async def train(self, slots: list[int]) -> None:
        """Train on the rollout's ``slots``: gathered into a batch in the stage's thread, given back
        to the rollout as soon as they are (the rollout refills them meanwhile), then the update."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        n = self.untrained_in_hand = self.rollout.steps_in(slots)
        rollout, version, taken, threads = self.rollout, self.version, list(slots), self.threads

        def give_back() -> None:
            rollout.release(taken)
            taken.clear()

        def work():
            batch = collate(rollout, taken, version)
            loop.call_soon_threadsafe(give_back)
            return self.worker.update(batch, threads)

        limit = self.worker.timeout_s
        try:
            async with asyncio.timeout(limit):
                metrics, state, lags = await self.stage.call(work, thread=True, size=n)
        except (LearnerError, TimeoutError) as exc:
            for hook in self.hooks:
                await hook.failed(self)
            if isinstance(exc, TimeoutError):
                raise LearnerError(f"an update ran past faults.update_timeout_s={limit:g} s; the learner's "
                                   "thread is left to finish it") from None
            raise
        finally:
            give_back()
        steps, self.held = self.stats.algorithm_steps(n, self.held, metrics)
        done = Update(metrics, state, lags, steps, self.stage.last_s, loop.time())
        if self._timeline is not None:
            self._timeline.record("learner", "update", started, done.ended, n)
        accepted = True
        for hook in self.hooks:
            accepted = accepted and await hook.accept(self, done)
        if accepted:
            self._published = state
            self.version += 1
            self.generator.publish(state, self.version, self.worker.event)
            self.stats.updated(done.steps, lags, metrics, done.ended)
        if self.pause_generation:
            self.generator.resume()
        self.untrained_in_hand = 0
        if accepted:
            for hook in self.hooks:
                await hook.after(self, done)

    def close(self) -> None:
        """Join the learner's thread (after the update in flight, ``CLOSE_WAIT_S`` at most: then
        the worker is killed, which ends a learner process's update and the thread's wait on it),
        and hand the trained state back from the worker."""
        running = self.stage.close(CLOSE_WAIT_S)
        if running:
            log.warning("learner_update_abandoned", wait_s=CLOSE_WAIT_S, worker=type(self.worker).__name__)
            self.worker.kill()
            for t in running:
                t.join(1.0)
        worker, self.worker = self.worker, InThread(None, None)  # closing again does nothing
        worker.close()

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
