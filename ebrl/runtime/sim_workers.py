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
    ...     await pool.start()
    ...     obs, _ = await pool.reset(3, seed=0)
    ...     pool.submit(np.array([3]), np.array([1]))  # env 3, action 1
    ...     block = await pool.recv()  # one Block per reply
    ...     pool.close()
    ...     return obs.shape, block.ids, block.reward
    >>> asyncio.run(demo())
    ((4,), array([3]), array([1.]))
"""

from __future__ import annotations

import asyncio
import pickle
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import FaultConfig, SimBackend, SimConfig
from ebrl.runtime.errors import EnvStepError, Fault, TimedOut, WorkerDied
from ebrl.runtime.probe import EnvProbe
from ebrl.runtime.sim_types import ElasticPool, EnvFn, StepRows
from ebrl.runtime.sim_worker_link import WorkerLink
from ebrl.runtime.sim_worker_process import ERRORS, PICKLED, READY, release_shared, shm_alloc
from ebrl.runtime.sim_workers_elastic import ElasticWorkers
from ebrl.runtime.threads import forget, in_thread
from ebrl.spaces import index
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")


class ProcessSimPool(ElasticWorkers, ElasticPool):
    """Envs hosted in worker processes; steps travel through shared memory as env-id blocks.

    ``placement[i]`` is env ``i``'s worker (round-robin at start); :meth:`migrate` moves an idle
    env to another worker, :meth:`resize` adds empty workers or retires empty ones.
    """

    backend = SimBackend.PROCESS

    def __init__(self, env_fn: EnvFn, num_envs: int, num_workers: int, start_method: str | None = None,
                 reply_hold_s: float = 0.002, spaces: tuple[gym.Space, gym.Space] | None = None,
                 build_timeout_s: float | None = None):
        super().__init__(env_fn, num_envs)
        self._num_workers = max(1, min(num_workers, num_envs))
        self.start_method = start_method  # None: fork-safe choice per start (ebrl.runtime.children)
        self.reply_hold_s = reply_hold_s
        self.build_timeout_s = build_timeout_s
        if spaces is not None:  # env 0's, from the start-up probe: start() then builds nothing here
            self.observation_space, self.action_space = spaces
        self._workers: list[WorkerLink] = []
        self._retired: list[WorkerLink] = []  # told to quit by resize, joined at close
        self._starting: list[WorkerLink] = []  # forked by grow(), not yet serving
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
        # envs not built where they are placed (their worker died while they were idle, or their
        # build timed out or died), not yet rebuilt: why, as their next step or reset fails
        self._lost: dict[int, Fault] = {}
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

    def _spawn(self, w: int) -> WorkerLink:
        return WorkerLink.spawn(self.start_method, self._loop, w, self.env_fn, self.num_envs, self.reply_hold_s,
                                self._attach)

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (CPU affinity is set per process)."""
        return [w.process.pid for w in self._workers if w.dead is None and w.process.pid is not None]

    async def start(self) -> None:
        """Start the workers and build every env in its worker, each build under
        ``build_timeout_s``. A build that raises (or whose worker dies in it) fails the start
        with that env's :class:`EnvStepError`; one past its deadline kills its worker (respawned
        empty): that env and its worker-mates are then lost, and their first reset fails at once
        (``timeout``, ``worker_died``) for the driver to rebuild them."""
        self._loop = asyncio.get_running_loop()
        try:
            if self.observation_space is None:  # no spaces given: env 0 is built once, in a probe's child, to read them
                sim = SimConfig(backend=SimBackend.PROCESS, start_method=self.start_method)
                async with EnvProbe(self.env_fn, sim, FaultConfig(build_timeout_s=self.build_timeout_s)) as probe:
                    facts = await probe.facts()
                self.observation_space, self.action_space = facts.observation_space, facts.action_space
            # the shared memory first (its resource tracker is then the workers' too: a worker
            # starting its own would unlink the blocks when it exits). Starting the tracker forks
            await in_thread(self._make_rows, name="ebrl-sim-shm")

            def spawn(w: int) -> None:
                self._starting.append(self._spawn(w))  # close() finds it there, whatever happens to the caller

            # a fork copies this process's page tables holding the GIL (~6 ms with torch loaded):
            # one at a time, off the loop, so the caller's tasks run between them
            for w in range(self._num_workers):
                await in_thread(spawn, w, name="ebrl-sim-spawn")
            self._workers, self._starting = self._starting, []
            for worker in self._workers:
                worker.watch(self._on_readable, worker)
            # every worker builds its envs in order, the workers in parallel
            await self._build({i: self._request("rebuild", i, None) for i in range(self.num_envs)})
        except BaseException:
            self.close()
            raise

    async def _build(self, builds: dict[int, asyncio.Future]) -> None:
        """Await the start's builds; a build running past ``build_timeout_s`` (or a worker that
        never started serving) gets its worker killed. See :meth:`start`."""
        limit, pending = self.build_timeout_s, dict(builds)
        while pending:
            await asyncio.wait(pending.values(), timeout=0.25 if limit is None else min(0.25, limit / 4),
                               return_when=asyncio.FIRST_COMPLETED)
            for env_id, fut in list(pending.items()):
                if not fut.done():
                    if limit is not None and self.abandon(env_id, limit):
                        log.warning("env_build_timed_out", env=env_id, limit_s=limit)
                    continue
                del pending[env_id]
                exc = fut.exception()
                if exc is None:
                    continue
                if isinstance(exc, EnvStepError) and exc.reason in ("timeout", "worker_died"):
                    self._lost[env_id] = exc.detail  # rebuilt by the driver, like a hung or dead worker's env
                    continue
                for other in pending.values():
                    other.add_done_callback(forget)  # the start failed on another env
                if isinstance(exc, EnvStepError):  # a build that raised, or whose worker died in it
                    raise EnvStepError(env_id, "env_fn", f"in worker {self._placement[env_id]}: {exc.detail}") from None
                raise exc

    def _make_rows(self) -> None:
        resource_tracker.ensure_running()  # before the first worker starts (see start()); a no-op once running
        self._rows = StepRows(self.num_envs, self.observation_space, self.action_space,
                              alloc=shm_alloc(self._blocks))
        self._attach = ([b.name for b in self._blocks], self.observation_space, self.action_space)

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
        if self._lost:  # envs not built where they are: their step fails at once
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

    def _flush_worker(self, worker: WorkerLink) -> None:
        if worker.dead is not None:  # steps submitted to a dead worker fail as a block
            if worker.steps:
                self._fail_steps(worker, np.concatenate(worker.steps))
            return
        if not worker.flush(self._sent_at):
            self._fail_worker(worker)

    def _on_readable(self, worker: WorkerLink) -> None:
        """Handle every whole reply the worker has sent (:meth:`WorkerLink.read_replies`); its
        pipe closed means it died."""
        replies = worker.read_replies()
        if replies is None:  # the worker's end closed: it died
            self._fail_worker(worker)
            return
        for raw in replies:
            if worker.dead is not None:
                break
            self._on_reply(worker, raw)

    def _on_reply(self, worker: WorkerLink, raw: bytes) -> None:
        kind, body = raw[:1], raw[1:]
        if kind == READY:  # it is serving (WorkerLink.read_replies marked it heard)
            return
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
        self.outbox.put(self._rows.block(ids, errors))

    def _fail_steps(self, worker: WorkerLink, ids: np.ndarray) -> None:
        worker.steps = []
        self._busy[ids] = False
        errors = [(int(i), self._fault(int(i), worker.dead)) for i in ids]
        self.outbox.put(self._rows.block(np.zeros(0, np.int64), errors))

    def _fault(self, env_id: int, why: str):
        if env_id in self._timed_out:
            self._timed_out.discard(env_id)
            return TimedOut(f"it ran past its deadline (faults.step_timeout_s for a step, build_timeout_s for a build or "
                            f"reset); {why} (killed for it) and was respawned")
        return WorkerDied(why + (" and was respawned" if not self._closed else ""))

    def _fail_worker(self, worker: WorkerLink) -> None:
        """A worker's pipe closed: it died (a signal, OOM) or was killed for a hung call. Its
        requests fail, its steps in flight come back as errors (``worker_died``, or ``timeout``
        for the hung one), and a new worker takes its place, hosting no env: each env is built
        there again when the driver rebuilds it. The envs it hosted that were not stepping fail
        their next step or reset the same way. An env whose build, reset or move was running when
        the worker died on its own is blamed for it (an ``env_error``: a simulator that crashes
        its process is charged to the failure budget, not respawned for ever); so are the
        requests of a worker that died before it said it was ready (it cannot start at all)."""
        if worker.dead is not None:
            return
        worker.mark_dead()
        running = set()
        if self._rows is not None:  # its starts are stale: a rebuild queued in the new worker is not late
            running = {e for e, _, _ in worker.waiting if self._rows.started[e] > 0}
            self._rows.started[np.flatnonzero(self._placement == worker.index)] = 0.0
            self._rows.started[[e for e, _, _ in worker.waiting]] = 0.0  # an adopt (migration) too
        for env_id, op, fut in worker.waiting:
            fault = self._fault(env_id, worker.dead)
            if env_id in running and not worker.killed:
                doing = "resetting" if op == "reset" else "building"
                fault = Fault(f"{worker.dead} while {doing} it")
            elif not worker.heard and not worker.killed:  # a worker that cannot start: charged, not respawned for ever
                fault = Fault(f"{worker.dead} before it started (its stderr says why)")
            if not fut.done():
                fut.set_exception(EnvStepError(env_id, op, fault))
        worker.waiting.clear()  # sent or not: every request's future is in waiting
        worker.requests = []
        hosted = self._placement == worker.index
        in_flight = np.flatnonzero(self._busy & hosted)
        for env_id in np.flatnonzero(~self._busy & hosted).tolist():
            self._lost.setdefault(env_id, WorkerDied(f"{worker.dead}; the env was not rebuilt yet"))
        if not self._closed and self._workers[worker.index] is worker:
            self._respawn(worker)
        if len(in_flight):
            self._fail_steps(worker, in_flight)

    def _respawn(self, dead: WorkerLink) -> None:
        # forked on the loop (a few ms): a fault's path, not a step's
        new = self._spawn(dead.index)
        self._workers[dead.index] = new
        new.watch(self._on_readable, new)
        self._retired.append(dead)  # joined at close
        self.respawns += 1
        log.warning("sim_worker_respawned", worker=dead.index, reason=dead.dead)

    def _report_lost(self, ids: list[int]) -> None:
        self.outbox.put(self._rows.block(np.zeros(0, np.int64), [(i, self._lost[i]) for i in ids]))

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
            self._timed_out.add(env_id)
            worker.kill()  # its pipe closes: _on_readable sees it and respawns the worker
            out.append(env_id)
        return out

    def abandon(self, env_id: int, limit_s: float) -> bool:
        """Give up env ``env_id``'s build or reset if it has run over ``limit_s`` (timed from
        its start in the worker), or if its worker has not started serving ``limit_s`` after it
        was started: the worker is SIGKILLed and respawned (its other steps in flight come back
        as ``worker_died``, its other envs are rebuilt), the call fails as ``timeout``, and the
        driver rebuilds the env in the new worker."""
        if self._rows is None or env_id in self._moving or self._busy[env_id]:
            return False
        started = self._rows.started[env_id]
        worker = self._workers[self._placement[env_id]]
        if worker.dead is not None or worker.killed:
            return False
        now = time.perf_counter()
        if not (started and now - started > limit_s) and (worker.heard or now - worker.spawned_at <= limit_s):
            return False
        self._timed_out.add(env_id)
        worker.kill()  # its pipe closes: _on_readable sees it and respawns the worker
        return True

    def _request(self, op: str, env_id: int, arg: Any) -> asyncio.Future:
        self._check_open()
        if env_id in self._moving:
            raise ValueError(f"env {env_id} is migrating")
        return self._request_to(self._workers[self._placement[env_id]], op, env_id, arg)

    def _request_to(self, worker: WorkerLink, op: str, env_id: int, arg: Any) -> asyncio.Future:
        fut = worker.request(op, env_id, arg)
        self._schedule_flush()
        return fut

    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]:
        if env_id in self._lost:  # not built where it is: the driver rebuilds it
            raise EnvStepError(env_id, "env_fn", self._lost[env_id])
        return await self._request("reset", env_id, seed)

    async def rebuild(self, env_id: int) -> None:
        await self._request("rebuild", env_id, None)
        self._lost.pop(int(env_id), None)  # built anew in its (perhaps respawned) worker

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.unwatch()
        WorkerLink.stop(self._workers + self._retired + self._starting)
        self._workers, self._retired, self._starting = [], [], []
        release_shared(self._rows, self._blocks, unlink=True)
        self._rows = None
        self.outbox.close()
