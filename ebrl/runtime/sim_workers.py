"""ProcessSimPool: envs hosted in worker processes, for GIL-bound Python envs.

Env ``i`` lives in worker ``placement[i]``: round-robin (``i % W``) at start, changed only by
:meth:`ProcessSimPool.migrate`, which moves an idle env (at an episode boundary) by building it
anew in the target worker from ``env_fn(i)`` and resetting it there, and only then closing the
old copy (so an ``env_fn`` that fails in the new worker leaves the env where it was).
:meth:`ProcessSimPool.resize` adds empty workers, or retires the last ones once no env is placed
on them. The event loop watches each worker's pipe with ``add_reader`` (no thread in between);
what runs in the worker is :mod:`ebrl.runtime.sim_worker_process`.
Every array of :class:`StepRows` (one per observation key, for ``obs`` and ``final_obs``, plus
actions, rewards, flags and per-env costs) is a shared-memory block made by the parent, so a
step request or reply is a 1-byte tag and the int32 env ids: nothing is pickled per step. Only
errors, resets, rebuilds and migrations are pickled. Workers add each step's wall time, the
worker process's CPU time during it (helper threads of the simulator included) and its wait in
the worker (from the message's arrival to the step's start) to the env's row of ``cost``;
:meth:`ProcessSimPool.costs` reads a snapshot.

Submits made in one loop iteration go out as one message per worker. The worker steps that
message's envs cheapest first (by an EWMA of each env's step wall time) and streams replies,
so no env waits for the slowest of its message: it sends the ids finished so far (a) before
stepping an env whose EWMA cost exceeds ``reply_hold_s``, or 3x the mean of the envs stepped
before it in the message and 100 µs (a straggler), and (b) after a step, once the oldest unsent one
finished more than ``reply_hold_s`` ago; the rest goes at the end. Envs of even cost thus come
back in one reply per message, or one per ``reply_hold_s`` (each reply costs the event loop a
block: too fine a stream spends the CPU that CPU-bound simulators need).

    >>> import asyncio, gymnasium as gym, numpy as np
    >>> async def demo():
    ...     pool = ProcessSimPool(lambda i: gym.make("CartPole-v1"), num_envs=4, num_workers=2)
    ...     done = asyncio.get_running_loop().create_future()
    ...     pool.on_block = done.set_result  # one Block per reply
    ...     await pool.start()
    ...     obs, _ = await pool.reset(3, seed=0)
    ...     pool.submit(np.array([3]), np.array([1]))  # env 3, action 1
    ...     block = await done
    ...     pool.close()
    ...     return obs.shape, block.ids, block.reward
    >>> asyncio.run(demo())
    ((4,), array([3]), array([1.]))
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from collections import deque
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.sim_types import EnvFn, SimPool, StepRows, TimedOut, WorkerDied
from ebrl.runtime.sim_worker_process import (
    ERRORS,
    PICKLED,
    QUIT,
    READ_BYTES,
    STEP,
    release_shared,
    shm_alloc,
    worker_main,
)
from ebrl.runtime.threads import in_thread
from ebrl.spaces import index
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")
CLOSE_WAIT_S = 1.0  # close() waits this long for the workers to quit, then kills them (see sim_threads)

NOWHERE = -1  # the placement of an env this pool does not host (a mixed pool's env on thread lanes)


class _Worker:
    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.steps: list[np.ndarray] = []  # ids whose actions are written, not yet sent
        self.requests: list[tuple[str, int, Any]] = []  # pickled requests, not yet sent
        self.waiting: deque[tuple[int, str, asyncio.Future]] = deque()  # sent requests, in order
        self.dead: str | None = None  # why it is gone
        self.killed = False  # killed for a hung step (its death is on the way)
        self.inbox = b""  # the start of a reply not yet whole (see ProcessSimPool._on_readable)


def _ignore(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a fire-and-forget request's failure no longer matters


class ProcessSimPool(SimPool):
    """Envs hosted in worker processes; steps travel through shared memory as env-id blocks.

    ``placement[i]`` is env ``i``'s worker (round-robin at start); :meth:`migrate` moves an idle
    env to another worker, :meth:`resize` adds empty workers or retires empty ones.
    """

    backend = SimBackend.PROCESS

    def __init__(self, env_fn: EnvFn, num_envs: int, num_workers: int, start_method: str | None = None,
                 reply_hold_s: float = 0.002):
        super().__init__(env_fn, num_envs)
        self._num_workers = max(1, min(num_workers, num_envs))
        self._ctx = mp.get_context(start_method or ("fork" if sys.platform.startswith("linux") else "spawn"))
        self.reply_hold_s = reply_hold_s
        self._workers: list[_Worker] = []
        self._retired: list[_Worker] = []  # told to quit by resize, joined at close
        self._starting: list[_Worker] = []  # forked by grow(), not yet serving
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rows: StepRows | None = None
        self._blocks: list[shared_memory.SharedMemory] = []
        self._attach: tuple | None = None  # (block names, spaces): what a worker needs to join
        self._busy = np.zeros(num_envs, bool)  # steps in flight, to report if a worker dies
        # perf_counter when each env's latest step message was sent: a step cannot have started
        # before it, so an older StepRows.started is stale and never times a step out
        self._sent_at = np.zeros(num_envs)
        self._stale_starts = 0
        self._placement = np.arange(num_envs, dtype=np.int64) % self._num_workers  # env -> worker
        self._moving: dict[int, int] = {}  # envs being migrated -> their target worker
        self._lost: set[int] = set()  # envs whose worker died while they were idle, not yet rebuilt
        self._timed_out: set[int] = set()  # envs whose worker was killed for their hung step
        self.respawns = 0  # workers replaced after dying
        self.migrations = 0  # completed migrations
        self._flush_scheduled = False
        self._closed = False

    @property
    def size(self) -> int:
        """The number of workers (a dead one still counts: it holds its envs' places)."""
        return self._num_workers

    @property
    def placement(self) -> np.ndarray:
        """A copy of the env -> worker map (int64 ``[num_envs]``)."""
        return self._placement.copy()

    def set_reset_seeds(self, ids: np.ndarray, seeds: np.ndarray) -> None:
        if self._rows is not None:  # shared memory: the worker stepping env i reads it
            self._rows.reset_seed[ids] = np.asarray(seeds, np.int64) + 1

    def costs(self) -> np.ndarray | None:
        rows = self._rows
        return None if rows is None or rows.cost is None else rows.cost.copy()

    def _spawn(self, w: int, env_ids: list[int], attach: tuple | None = None) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_main, name=f"ebrl-sim-worker-{w}", daemon=True,
            args=(child, self.env_fn, env_ids, self.num_envs, self.reply_hold_s, attach))
        proc.start()
        child.close()
        return _Worker(w, proc, parent)

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (CPU affinity is set per process)."""
        return [w.process.pid for w in self._workers if w.dead is None and w.process.pid is not None]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # one resource tracker for parent and workers: a worker forked before the parent's
        # tracker exists starts its own, which unlinks the shared memory when the worker exits.
        # Starting it forks: off the loop
        await in_thread(resource_tracker.ensure_running, name="ebrl-sim-tracker")

        def spawn(w: int) -> None:
            self._workers.append(self._spawn(w, np.flatnonzero(self._placement == w).tolist()))

        try:
            # a fork copies this process's page tables holding the GIL (~6 ms with torch loaded):
            # one at a time, off the loop, so the caller's tasks run between them
            for w in range(self._num_workers):
                await in_thread(spawn, w, name="ebrl-sim-spawn")
            for worker in self._workers:  # they build their envs in parallel
                msg = await self._first_message(worker)
                if msg[0] == "error":
                    raise EnvStepError(msg[1], "env_fn", f"in worker {worker.index}: {msg[2]}")
                if self.observation_space is None:
                    self.observation_space, self.action_space = msg[1], msg[2]
            self._make_rows()
            attach = pickle.dumps(self._attach)
            for worker in self._workers:
                worker.conn.send_bytes(attach)
                self._watch(worker.conn.fileno(), self._on_readable, worker)
        except BaseException:
            self.close()
            raise

    async def start_empty(self, obs_space: gym.Space, act_space: gym.Space) -> None:
        """Start hosting no env and no worker yet (a mixed pool's workers, before any env moves
        there): :meth:`grow` adds workers, :meth:`migrate` moves envs in (placement ``NOWHERE``
        until then). The shared memory is made by the first :meth:`grow`: a run whose envs never
        move here starts no resource tracker and maps nothing."""
        self._loop = asyncio.get_running_loop()
        self.observation_space, self.action_space = obs_space, act_space
        self._placement[:] = NOWHERE
        self._num_workers = 0

    def _make_rows(self) -> None:
        resource_tracker.ensure_running()  # before the first worker's fork (see start()); a no-op once running
        self._rows = StepRows(self.num_envs, self.observation_space, self.action_space,
                              alloc=shm_alloc(self._blocks))
        self._attach = ([b.name for b in self._blocks], self.observation_space, self.action_space)

    async def evict(self, env_id: int) -> None:
        """Close idle env ``env_id`` in its worker and host it no more (it moved out of the pool)."""
        self._check_open()
        env_id = int(env_id)
        if self._busy[env_id] or env_id in self._moving:
            raise ValueError(f"env {env_id} is stepping or migrating")
        worker = self._workers[self._placement[env_id]]
        self._placement[env_id] = NOWHERE
        if worker.dead is None:
            await self._request_to(worker, "drop", env_id, None)

    async def _first_message(self, worker: _Worker):
        ready = self._loop.create_future()
        self._watch(worker.conn.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self._loop.remove_reader(worker.conn.fileno())
        try:
            return pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            worker.process.join(1.0)
            return ("error", worker.index, f"worker exited during start (exit code {worker.process.exitcode})")

    def _watch(self, fd: int, callback, *args) -> None:
        self._loop.add_reader(fd, callback, *args)
        # add_reader makes the socket non-blocking; a message larger than the socket buffer
        # then arrives in pieces and recv_bytes would fail half-way. Readable means a message
        # has started, and the worker writes the rest at once: a blocking read is safe.
        os.set_blocking(fd, True)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _check_open(self) -> None:
        if self._closed or self._rows is None:
            raise RuntimeError("sim pool is closed" if self._closed else "sim pool is not started")

    def submit(self, ids: np.ndarray, actions: Any) -> None:
        self._check_open()
        ids = np.asarray(ids, np.int64)
        if np.count_nonzero(self._busy[ids]):  # count_nonzero: a fifth of .any()'s cost on small arrays
            raise ValueError(f"envs {ids[self._busy[ids]].tolist()} are still stepping")
        if self._moving and not self._moving.keys().isdisjoint(ids.tolist()):
            raise ValueError(f"envs {sorted(self._moving.keys() & set(ids.tolist()))} are migrating")
        if self._lost:  # envs whose worker died: their step fails at once, like the others'
            lost = np.isin(ids, np.fromiter(self._lost, np.int64, len(self._lost)))
            if lost.any():
                self._loop.call_soon(self._report_lost, ids[lost].tolist())
                ids, actions = ids[~lost], index(actions, np.flatnonzero(~lost))
                if not len(ids):
                    return
        self._rows.set_actions(ids, actions)  # the envs are idle: nobody reads their slots now
        self._busy[ids] = True
        owner = self._placement[ids]
        first = int(owner[0])
        if self._num_workers == 1 or (owner == first).all():  # the usual case: a block from one worker's reply
            self._workers[first].steps.append(ids)
        else:
            for w in np.unique(owner).tolist():
                self._workers[w].steps.append(ids[owner == w])
        self._schedule_flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        for worker in self._workers:
            self._flush_worker(worker)

    def _flush_worker(self, worker: _Worker) -> None:
        if worker.dead is not None:  # steps submitted to a dead worker fail as a block
            if worker.steps:
                self._fail_steps(worker, np.concatenate(worker.steps))
            return
        try:
            if worker.steps:
                ids = np.concatenate(worker.steps).astype(np.int32)
                worker.steps = []
                self._sent_at[ids] = time.perf_counter()
                worker.conn.send_bytes(STEP + ids.tobytes())
            if worker.requests:
                reqs, worker.requests = worker.requests, []
                worker.conn.send_bytes(PICKLED + pickle.dumps(reqs))
        except (BrokenPipeError, OSError):
            self._fail_worker(worker)

    def _on_readable(self, worker: _Worker) -> None:
        """Every whole reply the worker has sent. One read takes what the pipe holds (often two
        replies at once); the framing is multiprocessing's (a 4-byte big-endian signed length, -1
        for an 8-byte one), as the worker's ``send_bytes`` writes it. ``Connection.recv_bytes``
        cost two reads and a BytesIO per reply."""
        try:
            data = os.read(worker.conn.fileno(), READ_BYTES)
        except OSError:
            data = b""
        if not data:  # the worker's end closed: it died
            self._fail_worker(worker)
            return
        if worker.inbox:
            data, worker.inbox = worker.inbox + data, b""
        start, end = 0, len(data)
        while worker.dead is None and end - start >= 4:
            n, head = int.from_bytes(data[start:start + 4], "big", signed=True), 4
            if n == -1:  # over 2 GiB (a pickled request's reply, in theory)
                if end - start < 12:
                    break
                n, head = int.from_bytes(data[start + 4:start + 12], "big"), 12
            if end - start < head + n:
                break
            self._on_reply(worker, data[start + head:start + head + n])
            start += head + n
        if start < end and worker.dead is None:
            worker.inbox = data[start:]

    def _on_reply(self, worker: _Worker, raw: bytes) -> None:
        kind, body = raw[:1], raw[1:]
        if kind == PICKLED:
            for env_id, ok, payload in pickle.loads(body):
                _, op, fut = worker.waiting.popleft()
                if not ok and isinstance(payload, tuple):  # (the part of the request that failed, why)
                    op, payload = payload
                if not fut.done():
                    fut.set_result(payload) if ok else fut.set_exception(EnvStepError(env_id, op, payload))
            return
        errors: list[tuple[int, str]] = []
        if kind == ERRORS:
            body, errors = pickle.loads(body)
            self._busy[[i for i, _ in errors]] = False
        ids = np.frombuffer(body, np.int32).astype(np.int64)
        self._busy[ids] = False
        self.on_block(self._rows.block(ids, errors))

    def _fail_steps(self, worker: _Worker, ids: np.ndarray) -> None:
        worker.steps = []
        self._busy[ids] = False
        errors = [(int(i), self._fault(int(i), worker.dead)) for i in ids]
        self.on_block(self._rows.block(np.zeros(0, np.int64), errors))

    def _fault(self, env_id: int, why: str):
        if env_id in self._timed_out:
            self._timed_out.discard(env_id)
            return TimedOut(f"the step ran past faults.step_timeout_s; {why} (killed for it) and was respawned")
        return WorkerDied(why + (" and was respawned" if not self._closed else ""))

    def _fail_worker(self, worker: _Worker) -> None:
        """A worker's pipe closed: it died (a signal, OOM) or was killed for a hung step. Its
        requests fail, its steps in flight come back as errors (``worker_died``, or ``timeout``
        for the hung one), and a new worker takes its place, hosting no env: each env is built
        there again when the driver rebuilds it. The envs it hosted that were not stepping fail
        their next step the same way."""
        if worker.dead is not None:
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(worker.conn.fileno())
        worker.process.join(0.5)  # to learn its exit code; it closed its pipe, so it is exiting
        code = worker.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        worker.dead = f"worker {worker.index} died ({how})"
        if self._rows is not None:  # its starts are stale: a rebuild queued in the new worker is not late
            self._rows.started[np.flatnonzero(self._placement == worker.index)] = 0.0
            self._rows.started[[e for e, _, _ in worker.waiting]] = 0.0  # an adopt (migration) too
        for env_id, op, fut in worker.waiting:
            if not fut.done():
                fut.set_exception(EnvStepError(env_id, op, WorkerDied(worker.dead)))
        worker.waiting.clear()  # sent or not: every request's future is in waiting
        worker.requests = []
        hosted = self._placement == worker.index
        in_flight = np.flatnonzero(self._busy & hosted)
        self._lost.update(np.flatnonzero(~self._busy & hosted).tolist())
        if not self._closed and self._workers[worker.index] is worker:
            self._respawn(worker)
        if len(in_flight):
            self._fail_steps(worker, in_flight)

    def _respawn(self, dead: _Worker) -> None:
        # forked on the loop (a few ms): a fault's path, not a step's
        new = self._spawn(dead.index, [], self._attach)
        self._workers[dead.index] = new
        self._watch(new.conn.fileno(), self._on_readable, new)
        self._retired.append(dead)  # joined at close
        self.respawns += 1
        log.warning("sim_worker_respawned", worker=dead.index, reason=dead.dead)

    def _report_lost(self, ids: list[int]) -> None:
        self.on_block(self._rows.block(np.zeros(0, np.int64),
                                       [(i, WorkerDied("the env's worker died; it was not rebuilt yet")) for i in ids]))

    def abandon_late(self, limit_s: float) -> list[int]:
        """Kill (SIGKILL) each worker whose running step started over ``limit_s`` ago; it is
        respawned, the late step comes back as a ``timeout`` error, the worker's other steps in
        flight as ``worker_died``."""
        if self._rows is None:
            return []
        # one read of the shared row: the workers write it meanwhile. Read twice, a step ending
        # between the reads passed "> 0" with its start, then gave now - 0 (the host's uptime):
        # the false timeout that killed a healthy worker (convergence bench, FetchReach, sync)
        started = self._rows.started.copy()
        over = self._busy & (started > 0) & (time.perf_counter() - started > limit_s)
        stale = over & (started < self._sent_at)
        if stale.any():  # a start left by something else (a worker killed mid-request): never a timeout
            self._stale_starts += int(stale.sum())
            log.warning("stale_step_start_ignored", envs=np.flatnonzero(stale).tolist(), count=self._stale_starts)
        late = np.flatnonzero(over & ~stale)
        out = []
        for env_id in late.tolist():
            worker = self._workers[self._placement[env_id]]
            if worker.dead is not None or worker.killed:
                continue
            worker.killed = True
            self._timed_out.add(env_id)
            worker.process.kill()  # its pipe closes: _on_readable sees it and respawns the worker
            out.append(env_id)
        return out

    def abandon(self, env_id: int, limit_s: float) -> bool:
        """Give up env ``env_id``'s reset or rebuild if it has run over ``limit_s`` (timed from
        its start in the worker): the worker is SIGKILLed and respawned (its other steps in
        flight come back as ``worker_died``, its other envs are rebuilt), and the driver
        rebuilds this env in the new worker."""
        if self._rows is None or env_id in self._moving or self._busy[env_id]:
            return False
        started = self._rows.started[env_id]
        worker = self._workers[self._placement[env_id]]
        if worker.dead is not None or worker.killed or not started or time.perf_counter() - started <= limit_s:
            return False
        worker.killed = True
        worker.process.kill()  # its pipe closes: _on_readable sees it and respawns the worker
        return True

    def _request(self, op: str, env_id: int, arg: Any) -> asyncio.Future:
        self._check_open()
        if env_id in self._moving:
            raise ValueError(f"env {env_id} is migrating")
        return self._request_to(self._workers[self._placement[env_id]], op, env_id, arg)

    def _request_to(self, worker: _Worker, op: str, env_id: int, arg: Any) -> asyncio.Future:
        if worker.dead is not None:
            raise RuntimeError(f"env {env_id}: {worker.dead}")
        fut = self._loop.create_future()
        worker.requests.append((op, env_id, arg))
        worker.waiting.append((env_id, op, fut))
        self._schedule_flush()
        return fut

    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]:
        return await self._request("reset", env_id, seed)

    async def rebuild(self, env_id: int) -> None:
        await self._request("rebuild", env_id, None)
        self._lost.discard(int(env_id))  # built anew in its (perhaps respawned) worker

    async def migrate(self, env_id: int, worker: int, seed: int | None = None) -> tuple[Any, dict]:
        """Move idle env ``env_id`` to ``worker``, where it is built anew from ``env_fn`` and
        reset with ``seed``; returns that reset's ``(obs, info)``. Meant for an episode boundary:
        the env's state is not carried over.

        The new worker builds the env first: if ``env_fn`` (or the reset) raises there, this
        raises :class:`EnvStepError` (op ``env_fn`` or ``reset``) and the env stays, unchanged,
        where it was. Only then is the env placed on ``worker`` and the old copy closed (the old
        worker does that after whatever it is stepping; steps of the env go to ``worker`` from
        the moment this returns). An env on a dead worker can be migrated off it (recovering it).
        Raises ValueError if the env is stepping, migrating, has a reset or rebuild in flight,
        or is on ``worker`` already; RuntimeError if ``worker`` is dead.
        """
        self._check_open()
        env_id, worker = int(env_id), int(worker)
        if not 0 <= env_id < self.num_envs:
            raise ValueError(f"no env {env_id}: the pool has {self.num_envs}")
        if not 0 <= worker < self._num_workers:
            raise ValueError(f"no worker {worker}: the pool has {self._num_workers}")
        if env_id in self._moving:
            raise ValueError(f"env {env_id} is migrating already")
        old = int(self._placement[env_id])
        if worker == old:
            raise ValueError(f"env {env_id} is already on worker {worker}")
        if self._busy[env_id]:
            raise ValueError(f"env {env_id} is stepping: migrate it between steps")
        source, target = (None if old == NOWHERE else self._workers[old]), self._workers[worker]
        if source is not None and any(e == env_id for e, _, _ in source.waiting):
            raise ValueError(f"env {env_id} has a reset or rebuild in flight")
        adopt = self._request_to(target, "adopt", env_id, seed)
        self._moving[env_id] = worker
        try:
            out = await adopt
        except EnvStepError as exc:
            raise EnvStepError(env_id, exc.op, f"in worker {worker}: {exc.detail}") from None
        except asyncio.CancelledError:
            if target.dead is None and not self._closed:  # it may have built the env: it must not keep it
                self._request_to(target, "drop", env_id, None).add_done_callback(_ignore)
            raise
        finally:
            del self._moving[env_id]
        self._placement[env_id] = worker
        self._lost.discard(env_id)
        self.migrations += 1
        if source is not None and source.dead is None:
            self._request_to(source, "drop", env_id, None).add_done_callback(_ignore)
        return out

    def resize(self, n: int) -> None:
        """Grow to ``n`` workers (new ones host no env until :meth:`migrate` moves some there),
        or shrink by retiring workers ``n..size-1``, which must host no env (ValueError, naming
        the envs still on them, otherwise)."""
        self._check_open()
        n = int(n)
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        W = self._num_workers
        if n < W:
            hosted = np.flatnonzero(self._placement >= n).tolist()
            hosted += [i for i, w in self._moving.items() if w >= n]
            if hosted:
                raise ValueError(f"workers {n}..{W - 1} still host envs {sorted(hosted)}: migrate them first")
            for worker in self._workers[n:]:
                self._retire(worker)
            del self._workers[n:]
        for w in range(W, n):
            worker = self._spawn(w, [], self._attach)
            self._workers.append(worker)
            self._watch(worker.conn.fileno(), self._on_readable, worker)
        self._num_workers = n

    async def grow(self, n: int) -> None:
        """:meth:`resize` up to ``n`` workers, forking each off the event loop (a fork copies this
        process's page tables holding the GIL: milliseconds with torch loaded). A worker being
        forked when the caller is cancelled, or the pool closed, is joined by :meth:`close`."""
        if self._rows is None and self._loop is not None and not self._closed:  # started empty
            await in_thread(self._make_rows, name="ebrl-sim-shm")  # starting the tracker forks
        self._check_open()

        def spawn(w: int) -> _Worker:
            worker = self._spawn(w, [], self._attach)
            self._starting.append(worker)  # close() finds it there, whatever happens to the caller
            return worker

        for w in range(self._num_workers, int(n)):
            worker = await in_thread(spawn, w, name="ebrl-sim-spawn")
            if self._closed:  # closed while it forked: close() has joined the others
                self._stop([worker])
                return
            self._starting.remove(worker)
            self._workers.append(worker)
            self._watch(worker.conn.fileno(), self._on_readable, worker)
            self._num_workers = w + 1

    def _retire(self, worker: _Worker) -> None:
        self._flush_worker(worker)  # a drop not yet sent still closes its env
        with contextlib.suppress(Exception):
            self._loop.remove_reader(worker.conn.fileno())
        with contextlib.suppress(Exception):
            worker.conn.send_bytes(QUIT)
        for _, _, fut in worker.waiting:
            fut.cancel()
        worker.waiting.clear()
        self._retired.append(worker)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(worker.conn.fileno())
        self._stop(self._workers + self._retired + self._starting)
        self._workers, self._retired, self._starting = [], [], []
        release_shared(self._rows, self._blocks, unlink=True)
        self._rows = None

    @staticmethod
    def _stop(workers: list[_Worker]) -> None:
        """Tell ``workers`` to quit, then join them (``CLOSE_WAIT_S`` in all, then killed: a
        worker hung in a step never reads the message)."""
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.conn.send_bytes(QUIT)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for worker in workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
            for _, _, fut in worker.waiting:
                fut.cancel()
