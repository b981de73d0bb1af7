"""Learner: takes segments from the RolloutQueue, runs ``algo.update`` off the event loop,
publishes the new weights to the Generator.

The update runs off the event loop, so rollout continues while it trains, in one of two
places (:class:`~ebrl.config.LearnerMode`):

- a thread of this process: right for a GPU, where torch ops are asynchronous launches;
- a child process (:class:`LearnerProcess`): right on a CPU host. There, a learner thread
  and the event loop convoy on the GIL: every small torch op, BLAS call or pipe write
  releases it and waits for the other thread's next op to get it back. Measured on 2 cores
  with HalfCheetah and PPO: see the README's design section.

Weights are published as a snapshot taken right after the update, so the generator never
sees a half-written tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import pickle
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
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
from ebrl.policies.base import load_published, published_state, state_nbytes
from ebrl.runtime.errors import LearnerError, NonFiniteError
from ebrl.runtime.generation import Generator
from ebrl.runtime.rollout import RolloutQueue, collate
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats
from ebrl.runtime.threads import ignore_stop_signals, in_thread
from ebrl.runtime.virtual_time import is_virtual
from ebrl.telemetry.logging import get_logger
from ebrl.telemetry.metrics import MetricsLog

if TYPE_CHECKING:
    from ebrl.distributed import DataParallel
    from ebrl.runtime.profiler import Timeline
    from ebrl.runtime.resources.gpu import GpuStreams

log = get_logger("ebrl.learner")
JOINT_POLL_S = 0.005  # how often a data-parallel rank waiting for its queue looks for another rank's request
CLOSE_WAIT_S = 1.0  # how long close() waits for the update in flight (see sim_local)
ANSWER_WAIT_S = 2.0  # and for the learner process's trained state (a child still warming up takes ~1 s)


def snapshot(state: dict) -> dict:
    """A detached copy of a state dict (tensors cloned, other values as they are)."""
    return {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in state.items()}


def update_once(policy, algo, batch: Batch):
    """Update, snapshot what publication carries (the trainable tensors of a policy with a frozen
    part, else the state_dict): the learner's unit of work, wherever it runs. The metrics gain
    the publication's size and the snapshot's seconds."""
    lags = batch.lags.numpy()
    metrics = {k: float(v) for k, v in (algo.update(policy, batch) or {}).items()}
    t0 = time.perf_counter()
    state = snapshot(published_state(policy))
    metrics["publish_s"] = time.perf_counter() - t0
    metrics["publish_bytes"] = float(state_nbytes(state))
    return metrics, state, lags


def nonfinite_weights(state: dict) -> list[str]:
    """The names of a state dict's floating-point tensors holding NaN or inf."""
    return [k for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def restore(policy, algo, state: dict) -> None:
    """Undo an update: the weights as published last, and a fresh optimiser (its moments may
    hold the NaN) where the algorithm can reset one."""
    load_published(policy, state)
    reset = getattr(algo, "reset_optimizer", None)
    if callable(reset):
        reset()


def _send(conn, msg) -> None:
    # plain pickle copies tensors by value; Connection.send would route them through
    # torch's shared-memory handles, which need the sender alive to be opened
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _learner_main(conn, policy, algo, torch_threads: int | None) -> None:
    ignore_stop_signals()  # the parent decides when we stop
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        while True:
            msg = _recv(conn)
            if msg[0] == "update":
                if len(msg) > 2 and msg[2] is not None:  # the resource controller's thread count
                    torch.set_num_threads(msg[2])
                try:
                    metrics, state, lags = update_once(policy, algo, msg[1])
                    _send(conn, ("ok", metrics, state, lags))
                except Exception as exc:
                    _send(conn, ("error", "".join(traceback.format_exception(exc))))
            elif msg[0] == "algo_state":  # for a checkpoint
                _send(conn, ("algo_state", algo_state(algo)))
            elif msg[0] == "restore":  # a skipped update (NaN/inf): back to the last published weights
                restore(policy, algo, msg[1])
                _send(conn, ("restored",))
            else:  # "close": hand the trained state back
                _send(conn, ("final", policy.state_dict(), algo_state(algo)))
                return
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass


class LearnerProcess:
    """The policy's and algorithm's training copies, in a child process."""

    def __init__(self, policy, algo, torch_threads: int | None, start_method: str | None = None):
        if start_method is None:
            start_method = "fork" if sys.platform.startswith("linux") else "spawn"
        ctx = mp.get_context(start_method)
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_learner_main, args=(child, policy, algo, torch_threads),
                                   name="ebrl-learner-process", daemon=True)
        self.process.start()
        child.close()

    def update(self, batch: Batch, threads: int | None = None):
        """Blocking: called from the learner's thread, which waits in the pipe without the GIL.
        ``threads``: torch's intra-op threads in the learner process from this update on."""
        _send(self.conn, ("update", batch, threads))
        msg = self._recv()
        if msg[0] == "error":
            raise LearnerError("algo.update failed in the learner process:\n" + msg[1])
        _, metrics, state, lags = msg
        return metrics, state, lags

    def restore(self, state: dict) -> None:
        """Blocking, like :meth:`update`: :func:`restore` in the learner process."""
        _send(self.conn, ("restore", state))
        self._recv()

    def algo_state(self) -> dict | None:
        """Blocking, like :meth:`update`: the algorithm's state, for a checkpoint."""
        _send(self.conn, ("algo_state",))
        return self._recv()[1]

    def _recv(self):
        try:
            return _recv(self.conn)
        except (EOFError, OSError):
            self.process.join(1.0)
            code = self.process.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise LearnerError(f"the learner process died ({how})") from None

    def close(self, policy, algo) -> None:
        """Load the trained state into the caller's ``policy`` and ``algo``; end the process
        (waiting ``ANSWER_WAIT_S`` at most for its answer: a hung or dead learner is killed)."""
        try:
            if self.process.is_alive():
                _send(self.conn, ("close",))
                if not self.conn.poll(ANSWER_WAIT_S):
                    log.warning("learner_process_unanswered", wait_s=ANSWER_WAIT_S)
                    return
                _, policy_state, algo_state = self._recv()
                policy.load_state_dict(policy_state)
                if algo_state is not None:
                    algo.load_state_dict(algo_state)
        except (LearnerError, BrokenPipeError, OSError) as exc:
            log.warning("learner_process_lost", error=str(exc))  # the run's own error says more
        finally:
            self.process.join(timeout=5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.conn.close()


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
                 nonfinite: NonFinite = NonFinite.RAISE, dp: DataParallel | None = None):
        self.policy = policy
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
        self.busy_s = 0.0  # time in updates: loop time (virtual seconds under virtual time)
        self._update_t0: float | None = None  # loop time the update in progress started
        self.untrained_in_hand = 0  # taken for an update that has not finished
        self.state = state  # state.stopping: finish the update in flight, take no more
        self.t0 = 0.0  # loop time at the run's start; history times are relative to it
        self._executor: ThreadPoolExecutor | None = None
        self._virtual_cost = getattr(algo, "virtual_cost", None)
        self.remote = remote
        self._timeline = timeline  # records lane "learner", "update" (arg: steps trained) per update
        self.checkpoint = checkpoint
        self.dp = dp  # one rank of a data-parallel job (ebrl.distributed), or None
        self.job: dict[str, Any] = {}  # the job's counters at the latest update's header (data-parallel)
        self._last = (0.0, 0, 0, 0)  # loop time, env steps, generated rows, generation batches at the last row

    def published(self) -> dict:
        """The latest published weights (what the generator acts with; only what trains under LoRA)."""
        return self._published

    def busy_until_now(self, now: float) -> float:
        """``busy_s`` with the update in progress counted up to loop time ``now``: an update
        longer than a profile window shows in every window it spans, not only in the last."""
        return self.busy_s + (now - self._update_t0 if self._update_t0 is not None else 0.0)

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per update so far (``RunResult.history``)."""
        return self.metrics.rows

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        if self.remote is None and not is_virtual(loop):  # every update runs in this one thread
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ebrl-learner")
        if self.dp is not None:
            try:
                await self._run_joint()
            finally:
                self.close()
            return
        try:
            while not self.state.stopping:
                await self.rollout.wait_due()
                if self.state.stopping:
                    break
                if self.pause_generation:
                    # the running batch finishes first, so its actions are in flight (and awaited) before the cut
                    await self.generator.pause()
                slots = await self.rollout.take(self.version)
                if slots is None:
                    break
                await self.train(slots)
            if self.remote is not None and not is_virtual(loop):
                # joining the learner process (its trained state comes back first) would take the
                # loop ~15 ms
                await in_thread(self.close, name="ebrl-learner-close")
        finally:
            self.close()

    async def _run_joint(self) -> None:
        """Updates as one rank of a data-parallel job (:mod:`ebrl.distributed`): every rank
        joins every update, asked for by whichever rank's queue falls due first, with what it
        holds; a header first shares each rank's state (done, stopping, steps) and checks that
        the weights agree. The job ends when every rank is done, all at the same update."""
        dp, loop = self.dp, asyncio.get_running_loop()
        rollout = self.rollout
        while rollout.fields is None and not (rollout.finished or self.state.stopping):
            await asyncio.sleep(JOINT_POLL_S)  # a rank joins updates once it has a step to store
        # lockstep schedules and lag 0 pause generation to train, so a rank's queue stays due
        # until it trains: an update waits for every rank (a job-wide sync), else for the first
        everyone = self.pause_generation
        said_done = False
        rounds = 0  # keys are per round, not per version: a skipped update must not re-fire its key
        while True:
            rounds += 1
            asked = False
            while True:  # ask when this queue is due; join when another rank asked (every rank, under sync)
                # a rank that is done asks once (under sync: every round, where it never holds one up)
                done = rollout.finished and (everyone or not said_done)
                if not asked and (self.state.stopping or done or (not rollout.finished and rollout.due())):
                    dp.request(rounds, stop=self.state.stopping)
                    said_done, asked = said_done or rollout.finished, True
                if dp.requested(rounds, dp.world_size if everyone else 1):
                    break
                await rollout.wait_changed(JOINT_POLL_S)
            mine = [float(rollout.finished), float(self.state.stopping), float(self.stats.simulated),
                    float(self.stats.trained)]
            published = self._published if self.version else None
            rows = await loop.run_in_executor(self._executor, dp.header, mine, published)
            self.job = {"done": sum(r[0] for r in rows), "stopping": sum(r[1] for r in rows),
                        "env_steps": int(sum(r[2] for r in rows)), "trained": int(sum(r[3] for r in rows)),
                        "rank_env_steps": [int(r[2]) for r in rows]}
            if self.job["stopping"]:
                self.state.stop()  # every rank stops at the same update
                rollout.poke()
                return
            if rollout.fields is None:  # a rank must have stored a step to bring its (empty) batch
                raise RuntimeError(f"rank {dp.rank} ended before recording any step: it cannot take part in updates")
            if self.pause_generation:
                await self.generator.pause()
            slots = await rollout.take(self.version, joint=True)
            await self.train(slots)
            if self.job["done"] == dp.world_size:  # each rank handed over everything: the last update
                return

    def close(self) -> None:
        """Join the learner's thread (after the update in flight, ``CLOSE_WAIT_S`` at most: then
        a learner process is killed, which ends the thread's wait on it) and its process, if any."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown(wait=False, cancel_futures=True)
            threads = list(getattr(executor, "_threads", ()))  # the one thread it started, if it did
            deadline = time.monotonic() + CLOSE_WAIT_S
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in threads):
                if self.remote is not None:
                    log.warning("learner_update_abandoned", wait_s=CLOSE_WAIT_S)
                    self.remote.process.kill()  # the thread's pipe read ends with it
                    for t in threads:
                        t.join(1.0)
                else:
                    log.warning("learner_thread_left_running", wait_s=CLOSE_WAIT_S)
        if self.remote is not None:
            remote, self.remote = self.remote, None
            remote.close(self.policy, self.algo)

    async def train(self, slots: list[int]) -> None:
        """Train on the rollout's ``slots``: gathered into a batch (off the loop, except under
        virtual time), then given back to the rollout."""
        loop = asyncio.get_running_loop()
        n = self.rollout.steps_in(slots)
        self.untrained_in_hand = n
        t0, lt0 = time.perf_counter(), loop.time()
        self._update_t0 = lt0
        virtual = is_virtual(loop)
        rollout, version = self.rollout, self.version
        threads = self.threads
        work = (lambda b: self.remote.update(b, threads)) if self.remote is not None else self._update
        try:
            if virtual:
                batch = collate(rollout, slots, version)
                rollout.release(slots)
                slots = []
                metrics, state, lags = self._update(batch)
                metrics["publish_s"] = 0.0  # only the loop clock means anything here (as for update_s)
                if self._virtual_cost is not None:
                    await asyncio.sleep(float(self._virtual_cost(n)))
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="ebrl-learner")
                metrics, state, lags = await loop.run_in_executor(
                    self._executor, lambda: work(collate(rollout, slots, version)))
        except LearnerError:
            if self.checkpoint is not None:  # what the generator acts with: the last published weights
                await self._write_checkpoint(self._published, algo=False)
            raise
        finally:
            rollout.release(slots)
            self._update_t0 = None
        lt1 = loop.time()
        # under virtual time only the loop clock means anything (the update's cost is slept in it)
        spent = lt1 - lt0 if virtual else time.perf_counter() - t0
        self.busy_s += spent
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
            await loop.run_in_executor(self._executor, self.remote.restore, self._published)
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
                state = self.remote.algo_state() if self.remote is not None else algo_state(self.algo)
            write_checkpoint(cp.path, policy_state, state, cp.policy_class, **meta)

        if is_virtual(loop):  # everything runs inline under virtual time
            work()
        else:
            await loop.run_in_executor(self._executor, work)
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
