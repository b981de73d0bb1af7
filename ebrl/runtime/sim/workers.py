"""The worker host: envs in worker processes, for GIL-bound Python envs.

Env ``i`` lives in worker ``placement[i]``: round-robin (``i % W``) at start, changed only by
:meth:`WorkerHost.adopt`. :meth:`WorkerHost.grow` adds empty workers; :meth:`WorkerHost.resize`
retires the last ones once no env is placed on them. The event loop watches each worker's pipe
with ``add_reader`` (no thread in between); the protocol, and what runs in a worker:
:mod:`ebrl.runtime.sim.worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.children import READY, Child, child_context
from ebrl.runtime.errors import EnvStepError, Fault, TimedOut, WorkerDied
from ebrl.runtime.sim.block import Outbox, StepRows, release_shared, shm_alloc
from ebrl.runtime.sim.stepping import EnvFn
from ebrl.runtime.sim.worker import ERRORS, PICKLED, WorkerLink, worker_main
from ebrl.runtime.threads import forget, helpers_scope, in_thread
from ebrl.spaces import index
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")
NOWHERE = -1  # the placement of an env no worker hosts (it is on the pool's lanes)


class WorkerHost:
    """Envs hosted in worker processes; steps travel through shared memory as env-id blocks."""

    def __init__(self, env_fn: EnvFn, num_envs: int, outbox: Outbox, num_workers: int,
                 start_method: str | None = None, reply_hold_s: float = 0.002, build_timeout_s: float | None = None):
        self.env_fn, self.num_envs, self.outbox = env_fn, num_envs, outbox
        self._num_workers = max(1, min(num_workers, num_envs))
        self.start_method = start_method  # None: fork-safe choice per start (ebrl.runtime.children)
        self.reply_hold_s = reply_hold_s
        self.build_timeout_s = build_timeout_s
        self.spaces: tuple[gym.Space, gym.Space] | None = None
        self._workers: list[WorkerLink] = []
        self._retired: list[WorkerLink] = []  # told to quit by resize, joined at close
        self._loop: asyncio.AbstractEventLoop | None = None
        self.rows: StepRows | None = None
        self._blocks: list[shared_memory.SharedMemory] = []
        self._busy = np.zeros(num_envs, bool)  # steps in flight, to report if a worker dies
        # perf_counter when each env's latest step message was sent: a step cannot have started
        # before it, so an older StepRows.started is stale and never times a step out
        self._sent_at = np.zeros(num_envs)
        self._stale_starts = 0
        self._placement = np.arange(num_envs, dtype=np.int64) % self._num_workers  # env -> worker
        self._moving: dict[int, int] = {}  # envs being migrated -> their target worker
        # envs not built where they are placed (their worker died, or their build timed out),
        # not yet rebuilt: why, as their next step or reset fails
        self._lost: dict[int, Fault] = {}
        self._timed_out: set[int] = set()  # envs whose worker was killed for their hung step
        self.respawns = 0  # workers replaced after dying
        self.migrations = 0  # completed migrations
        self._flush_scheduled = False
        self._closed = False
        self._helpers = contextlib.ExitStack()  # a fork server its workers need ends with it

    workers = property(lambda self: self._num_workers)  # a dead one still counts: it holds its envs' places
    placement = property(lambda self: self._placement.copy())  # env -> worker (a copy; NOWHERE: not hosted here)

    def _worker(self, w: int) -> tuple:
        """Worker ``w``'s name, main and arguments (it hosts no env yet, and maps the shared memory at once)."""
        attach = ([b.name for b in self._blocks], *self.spaces)
        return f"ebrl-sim-worker-{w}", worker_main, self.env_fn, self.num_envs, self.reply_hold_s, attach

    def worker_pids(self) -> list[int]:  # the live ones' (CPU affinity is set per process)
        return [w.child.pid for w in self._workers if w.dead is None]

    async def start(self, spaces: tuple[gym.Space, gym.Space], hosted: set[int] | None = None
                    ) -> tuple[gym.Space, gym.Space]:
        """Start the workers and build every env in its worker (with ``hosted`` empty: none, until
        :meth:`grow` and :meth:`adopt`). A build that raises fails the start with that env's
        :class:`EnvStepError`; one past ``build_timeout_s`` kills its worker (respawned empty),
        and that env's and its worker-mates' first resets fail for the driver to rebuild them."""
        self._loop = asyncio.get_running_loop()
        self._helpers.enter_context(helpers_scope())
        self.spaces, n, self._num_workers = spaces, self._num_workers, 0
        if hosted is not None and not hosted:
            self._placement[:] = NOWHERE
            return spaces
        try:
            await self.grow(n)
            # every worker builds its envs in order, the workers in parallel
            await self._build({i: self._request("rebuild", i, None) for i in range(self.num_envs)})
        except BaseException:
            self.close()
            raise
        return spaces

    async def _build(self, pending: dict[int, asyncio.Future]) -> None:
        """Await the start's builds, killing the worker of one past ``build_timeout_s`` (or not serving by then)."""
        limit = self.build_timeout_s
        while pending:
            await asyncio.wait(pending.values(), timeout=min(0.25, (limit or 1.0) / 4),
                               return_when=asyncio.FIRST_COMPLETED)
            for env_id, fut in list(pending.items()):
                if not fut.done():
                    if limit is not None and self.abandon(env_id, limit):
                        log.warning("env_build_timed_out", env=env_id, limit_s=limit)
                    continue
                exc = pending.pop(env_id).exception()
                if isinstance(exc, EnvStepError) and exc.reason in ("timeout", "worker_died"):
                    self._lost[env_id] = exc.detail  # rebuilt by the driver, like a hung or dead worker's env
                elif exc is not None:
                    for other in pending.values():
                        other.add_done_callback(forget)  # the start failed on another env
                    if isinstance(exc, EnvStepError):  # a build that raised, or whose worker died in it
                        raise EnvStepError(env_id, "env_fn", f"in worker {self._placement[env_id]}: {exc.detail}")
                    raise exc

    def _make_rows(self) -> None:
        resource_tracker.ensure_running()  # before the first worker starts (see grow()); a no-op once running
        self.rows = StepRows(self.num_envs, *self.spaces, alloc=shm_alloc(self._blocks))

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _check_open(self) -> None:
        if self._closed or self.rows is None:
            raise RuntimeError(f"sim pool is {'closed' if self._closed else 'not started'}")

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
                self._loop.call_soon(self._put_errors, [(i, self._lost[i]) for i in ids[lost].tolist()])
                ids, actions = ids[~lost], index(actions, np.flatnonzero(~lost))
                if not len(ids):
                    return
        self.rows.set_actions(ids, actions)  # the envs are idle: nobody reads their slots now
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
        """Every whole reply the worker has sent; its pipe closed means it died."""
        replies = worker.child.frames()
        if replies is None:  # the worker's end closed: it died
            self._fail_worker(worker)
            return
        for raw in replies:
            kind, body = raw[:1], raw[1:]
            if worker.dead is not None:
                break
            if kind == PICKLED:
                worker.answered(pickle.loads(body))
            elif kind != READY:  # READY: it is serving (frames() marked it heard)
                errors: list[tuple[int, str]] = []
                if kind == ERRORS:
                    body, errors = pickle.loads(body)
                    self._busy[[i for i, _ in errors]] = False
                ids = np.frombuffer(body, np.int32).astype(np.int64)
                self._busy[ids] = False
                self.outbox.put(self.rows.block(ids, errors))

    def _fail_steps(self, worker: WorkerLink, ids: np.ndarray) -> None:
        worker.steps = []
        self._busy[ids] = False
        self._put_errors([(int(i), self._fault(int(i), worker.dead)) for i in ids])

    def _put_errors(self, errors: list[tuple[int, Any]]) -> None:
        self.outbox.put(self.rows.block(np.zeros(0, np.int64), errors))

    def _fault(self, env_id: int, why: str):
        if env_id in self._timed_out:
            self._timed_out.discard(env_id)
            return TimedOut(f"it ran past its deadline (faults.step_timeout_s for a step, build_timeout_s for a build or "
                            f"reset); {why} (killed for it) and was respawned")
        return WorkerDied(why + (" and was respawned" if not self._closed else ""))

    def _fail_worker(self, worker: WorkerLink) -> None:
        """A worker's pipe closed: it died, or was killed for a hung call. Its requests fail, its
        steps in flight come back as errors (``worker_died``; ``timeout`` for the hung one), its
        idle envs fail their next step or reset the same way, and a new worker takes its place,
        empty: the driver rebuilds each env there. A build, reset or move running when a worker
        died on its own (or one that died before it was ready) is charged as an ``env_error``:
        a simulator that crashes its process must not be respawned for ever."""
        if worker.dead is not None:
            return
        worker.child.unwatch()
        worker.dead = f"worker {worker.index} died ({worker.child.exit_reason()})"
        running = set()
        if self.rows is not None:  # its starts are stale: a rebuild queued in the new worker is not late
            running = {e for e, _, _ in worker.waiting if self.rows.started[e] > 0}
            self.rows.started[np.flatnonzero(self._placement == worker.index)] = 0.0
            self.rows.started[[e for e, _, _ in worker.waiting]] = 0.0  # an adopt (migration) too
        for env_id, op, fut in worker.waiting:
            fault = self._fault(env_id, worker.dead)
            if env_id in running and not worker.child.killed:
                doing = "resetting" if op == "reset" else "building"
                fault = Fault(f"{worker.dead} while {doing} it")
            elif not worker.child.heard and not worker.child.killed:  # a worker that cannot start: charged, not respawned for ever
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
        new = WorkerLink(dead.index, Child.start(*self._worker(dead.index), ctx=child_context(self.start_method)[0]))
        self._workers[dead.index] = new
        new.child.watch(self._loop, self._on_readable, new)
        self._retired.append(dead)  # joined at close
        self.respawns += 1
        log.warning("sim_worker_respawned", worker=dead.index, reason=dead.dead)

    def abandon_late(self, limit_s: float) -> list[int]:
        """SIGKILL each worker whose running step started over ``limit_s`` ago (respawned: :meth:`_fail_worker`)."""
        if self.rows is None:
            return []
        # one read of the shared row, which the workers write meanwhile (read twice, a step ending
        # between the reads would pass "> 0", then time out at now - 0)
        started = self.rows.started.copy()
        over = self._busy & (started > 0) & (time.perf_counter() - started > limit_s)
        stale = over & (started < self._sent_at)
        if stale.any():  # a start left by something else (a worker killed mid-request): never a timeout
            self._stale_starts += int(stale.sum())
            log.warning("stale_step_start_ignored", envs=np.flatnonzero(stale).tolist(), count=self._stale_starts)
        return [env_id for env_id in np.flatnonzero(over & ~stale).tolist() if self._kill_for(env_id)]

    def _kill_for(self, env_id: int) -> bool:
        """SIGKILL env ``env_id``'s worker for its hung call (:meth:`_on_readable` sees it die); False
        if it is dead or dying already."""
        worker = self._workers[self._placement[env_id]]
        if worker.dead is not None or worker.child.killed:
            return False
        self._timed_out.add(env_id)
        worker.child.kill()
        return True

    def abandon(self, env_id: int, limit_s: float) -> bool:
        """Give up env ``env_id``'s build or reset if it has run over ``limit_s`` in its worker
        (or the worker has not started serving ``limit_s`` after its start): the worker is
        SIGKILLed and respawned, as for a hung step."""
        if self.rows is None or env_id in self._moving or self._busy[env_id]:
            return False
        started, worker, now = self.rows.started[env_id], self._workers[self._placement[env_id]], time.perf_counter()
        if not (started and now - started > limit_s) and (worker.child.heard or now - worker.child.started_at <= limit_s):
            return False
        return self._kill_for(env_id)

    def _request(self, op: str, env_id: int, arg: Any, worker: WorkerLink | None = None) -> asyncio.Future:
        """Send request ``op`` to ``worker`` (default: the env's, which must not be migrating)."""
        self._check_open()
        if worker is None:
            if env_id in self._moving:
                raise ValueError(f"env {env_id} is migrating")
            worker = self._workers[self._placement[env_id]]
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

    async def evict(self, env_id: int) -> None:
        """Close idle env ``env_id`` in its worker and host it no more (it moved to the lanes)."""
        self._check_idle(env_id)
        worker = self._workers[self._placement[env_id]]
        self._placement[env_id] = NOWHERE
        if worker.dead is None:
            await self._request("drop", env_id, None, worker)

    def _check_idle(self, env_id: int) -> None:
        self._check_open()
        if self._busy[env_id] or env_id in self._moving:
            raise ValueError(f"env {env_id} is stepping or migrating: move it between steps")

    async def adopt(self, env_id: int, worker: int, seed: int | None = None) -> tuple[Any, dict]:
        """Move idle env ``env_id`` to ``worker`` (from another worker, or from the lanes), built
        and reset there first: if that raises (:class:`EnvStepError`, op ``env_fn`` or ``reset``)
        the env stays where it was; only then is the old copy closed. See :meth:`SimPool.migrate`."""
        self._check_idle(env_id)
        if not 0 <= worker < self._num_workers:
            raise ValueError(f"no worker {worker}: the pool has {self._num_workers}")
        old = int(self._placement[env_id])
        if worker == old:
            raise ValueError(f"env {env_id} is already on worker {worker}")
        source, target = (None if old == NOWHERE else self._workers[old]), self._workers[worker]
        if source is not None and any(e == env_id for e, _, _ in source.waiting):
            raise ValueError(f"env {env_id} has a reset or rebuild in flight")
        adopt = self._request("adopt", env_id, seed, target)
        self._moving[env_id] = worker
        try:
            out = await adopt
        except EnvStepError as exc:
            raise EnvStepError(env_id, exc.op, f"in worker {worker}: {exc.detail}") from None
        except asyncio.CancelledError:
            if target.dead is None and not self._closed:  # it may have built the env: it must not keep it
                self._request("drop", env_id, None, target).add_done_callback(forget)
            raise
        finally:
            del self._moving[env_id]
        self._placement[env_id] = worker
        self._lost.pop(env_id, None)
        self.migrations += 1
        if source is not None and source.dead is None:
            self._request("drop", env_id, None, source).add_done_callback(forget)
        return out

    def resize(self, n: int) -> None:
        """Retire workers ``n..``, which must host no env (ValueError, naming those still on them)."""
        self._check_open()
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        hosted = sorted(np.flatnonzero(self._placement >= n).tolist() + [i for i, w in self._moving.items() if w >= n])
        if hosted:
            raise ValueError(f"workers {n}..{self._num_workers - 1} still host envs {hosted}: migrate them first")
        for worker in self._workers[n:]:
            self._flush_worker(worker)  # a drop not yet sent still closes its env
            worker.retire()
            self._retired.append(worker)  # joined at close
        del self._workers[n:]
        self._num_workers = min(self._num_workers, n)

    async def grow(self, n: int) -> None:
        """Start workers up to ``n``, each forked off the event loop (a fork copies this process's
        page tables holding the GIL: milliseconds with torch loaded). The first makes the shared memory."""
        if self.rows is None and self._loop is not None and not self._closed:
            # the shared memory first: its resource tracker is then the workers' too (a worker
            # starting its own would unlink the blocks when it exits). Starting the tracker forks
            await in_thread(self._make_rows, name="ebrl-sim-shm")
        self._check_open()
        for w in range(self._num_workers, int(n)):
            child = await Child.start_off_loop(*self._worker(w), ctx=child_context(self.start_method)[0])
            worker = WorkerLink(w, child)
            if self._closed:  # closed while it forked: close() has joined the others
                WorkerLink.stop([worker])
                return
            self._workers.append(worker)
            worker.child.watch(self._loop, self._on_readable, worker)
            self._num_workers = w + 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        WorkerLink.stop(self._workers + self._retired)
        self._workers, self._retired = [], []
        release_shared(self.rows, self._blocks, unlink=True)
        self.rows = None
        self._helpers.close()
