"""One worker process of :class:`~ebrl.runtime.sim.workers.WorkerHost`: the parent's handle on
it (:class:`WorkerLink`: its :class:`~ebrl.runtime.children.Child`, what is queued for it and
what it owes) and the process's own loop (:func:`worker_main`), which steps its envs with the
hosts' one stepping function. The child's life (start, reader, death, kill, reap) is the Child's.

Every array of :class:`StepRows` is a shared-memory block made by the parent, so a step request
or reply is a 1-byte tag and the int32 env ids: only errors, resets, rebuilds and migrations are
pickled. A worker adds each step's wall time, its process's CPU time during it (a simulator's
helper threads included) and its wait in the worker to the env's row of ``cost``.

A worker steps a message's envs cheapest first (by an EWMA of each env's step wall time) and
streams replies, so no env waits for the slowest of its message: it sends the ids finished so
far (a) before stepping an env whose EWMA cost exceeds ``reply_hold_s``, or 3x the mean of the
envs stepped before it in the message and 100 µs (a straggler), and (b) after a step, once the
oldest unsent one finished over ``reply_hold_s`` ago. Envs of even cost thus come back in one
reply per message, or one per ``reply_hold_s`` (each reply costs the event loop a block: too fine
a stream spends the CPU that CPU-bound simulators need).
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections import deque
from multiprocessing import shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.children import READY, Child
from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.sim.block import STEPS, WALL, StepRows, release_shared, shm_alloc
from ebrl.runtime.sim.stepping import EnvFn, close_quietly, describe, reset_env, step_unit
from ebrl.runtime.threads import CLOSE_WAIT_S

# message tags, beside the Child's READY (once, serving) and QUIT. Parent to worker: step ids,
# pickled requests. Worker to parent: step ids, pickled (step ids, errors), pickled request replies.
STEP, ERRORS, PICKLED = b"S", b"E", b"P"
_ALPHA = 0.1  # EWMA weight of the latest step time (low: a step preempted by another process is noise)
_STRAGGLER = 3.0  # an env expected to take this many times its message-mates' mean is a straggler
# ... and to take at least this long: each reply costs the event loop a block (about 0.2 ms of
# CPU at 32 envs), so holding the finished envs for less than that is cheaper than splitting.
# Without it, the timing noise of microsecond steps made ~7% of replies single envs.
_STRAGGLER_MIN_S = 100e-6


def worker_main(conn, env_fn: EnvFn, num_envs: int, hold_s: float, attach: tuple) -> None:
    """A worker process: maps the shared memory (``attach``: the block names and the spaces),
    then hosts the envs it is asked to build and answers requests until told to quit."""
    envs: dict[int, gym.Env] = {}
    blocks: list[shared_memory.SharedMemory] = []
    rows = None
    try:
        names, obs_space, act_space = attach
        rows = StepRows(num_envs, obs_space, act_space, alloc=shm_alloc(blocks, names))
        conn.send_bytes(READY)  # started: the parent's start-up deadline ends here
        # EWMA of each env's step wall time, by env id (any env may be adopted later)
        cost: list[float | None] = [None] * num_envs
        while True:
            raw = conn.recv_bytes()
            kind, body = raw[:1], raw[1:]
            if kind == STEP:
                _step_message(conn, envs, rows, cost, np.frombuffer(body, np.int32).tolist(), hold_s)
            elif kind == PICKLED:
                replies = _serve(envs, env_fn, pickle.loads(body), rows, cost)
                conn.send_bytes(PICKLED + pickle.dumps(replies))
            else:  # QUIT
                break
    except (EOFError, OSError):
        pass
    finally:
        release_shared(rows, blocks, unlink=False)
        for env in envs.values():
            close_quietly(env)


def _step_message(conn, envs, rows: StepRows, cost: list, ids: list[int], hold_s: float) -> None:
    """Step ``ids`` cheapest first, streaming replies by the rule in the module docstring."""
    arrived = time.perf_counter()  # the envs' QUEUE cost: from here to their step's start
    done: list[int] = []
    errors: list[tuple[int, str]] = []
    since = 0.0  # when the oldest unsent env finished

    def send() -> None:
        raw = np.asarray(done, np.int32).tobytes()
        conn.send_bytes(ERRORS + pickle.dumps((raw, list(errors))) if errors else STEP + raw)
        done.clear()
        errors.clear()

    stepped, total = 0, 0.0  # envs of this message stepped so far, and their summed expected cost
    cpu = time.process_time  # the whole process: a simulator's helper threads count too
    for i in sorted(ids, key=lambda j: cost[j] or 0.0):
        expect = cost[i] or 0.0
        if (done or errors) and (expect > hold_s or (stepped and expect > max(_STRAGGLER * total / stepped,
                                                                               _STRAGGLER_MIN_S))):
            send()  # (a): a known-slow env (slow outright, or next to its message-mates) must not hold the finished ones
        stepped, total = stepped + 1, total + expect
        c0, t0 = cpu(), time.perf_counter()
        rows.started[i] = t0  # the parent's step timeout counts from here
        try:
            step_unit(envs[i], rows, i)
            done.append(i)
        except Exception as exc:
            errors.append((i, describe(exc)))
        t1 = time.perf_counter()
        rows.started[i] = 0.0
        rows.add_cost(i, t1 - t0, cpu() - c0, t0 - arrived)  # before the reply: the parent reads it after
        c = cost[i]
        cost[i] = t1 - t0 if c is None else c + _ALPHA * (t1 - t0 - c)
        if len(done) + len(errors) == 1:
            since = t1
        elif t1 - since > hold_s:
            send()  # (b): the oldest unsent one has waited long enough
    if done or errors:
        send()


def _serve(envs: dict[int, gym.Env], env_fn: EnvFn, requests: list[tuple[str, int, Any]], rows: StepRows,
           cost: list) -> list:
    """Answer pickled requests ``(op, env_id, arg)`` in order, one reply ``(env_id, ok, payload)``
    each (a failure's payload: its description). ``reset`` (arg: seed) -> (obs, info); ``rebuild``
    (also an env's first build) -> None; ``adopt`` (:func:`_adopt`); ``drop`` closes the env -> None."""
    replies = []
    for op, i, arg in requests:
        rows.started[i] = time.perf_counter()  # the parent's reset timeout counts from here
        try:
            if op == "adopt":
                replies.append(_adopt(envs, env_fn, i, arg, rows, cost))
                continue
            if op == "drop":
                close_quietly(envs.pop(i))
                cost[i] = None
                replies.append((i, True, None))
                continue
            if op == "rebuild":  # the env may be missing: its worker was respawned, or a build failed
                old = envs.pop(i, None)
                if old is not None:
                    close_quietly(old)
                envs[i] = env_fn(i)
            if op == "reset" and i not in envs:
                raise LookupError(f"env {i} is not built in this worker (its build failed, or the worker was "
                                  "respawned): rebuild the env")
            replies.append((i, True, reset_env(envs[i], seed=arg) if op == "reset" else None))
        except Exception as exc:
            replies.append((i, False, describe(exc)))
        finally:
            rows.started[i] = 0.0
    return replies


def _adopt(envs: dict[int, gym.Env], env_fn: EnvFn, i: int, seed: Any, rows: StepRows, cost: list) -> tuple:
    """The reply to ``adopt`` (arg: seed): the env built and reset here -> (obs, info), or, keeping
    nothing, ``(op, description)`` naming the part that failed (``env_fn`` or ``reset``)."""
    stale = envs.pop(i, None)  # a copy left by a cancelled migration: the parent's placement decides
    if stale is not None:
        close_quietly(stale)
    try:
        env = env_fn(i)
    except Exception as exc:  # noqa: BLE001 (the reply says it)
        return i, False, ("env_fn", describe(exc))
    try:
        out = reset_env(env, seed=seed)
    except Exception as exc:  # noqa: BLE001 (the reply says it)
        close_quietly(env)
        return i, False, ("reset", describe(exc))
    envs[i] = env
    if rows.cost[i, STEPS] > 0:  # seed the step-order EWMA with the env's mean step time where it ran before
        cost[i] = float(rows.cost[i, WALL] / rows.cost[i, STEPS])
    return i, True, out


class WorkerLink:
    """Worker ``index``: its child process, and its queues."""

    def __init__(self, index: int, child: Child):
        self.index, self.child = index, child
        self.steps: list[np.ndarray] = []  # ids whose actions are written, not yet sent
        self.requests: list[tuple[str, int, Any]] = []  # pickled requests, not yet sent
        self.waiting: deque[tuple[int, str, asyncio.Future]] = deque()  # sent requests, in order
        self.dead: str | None = None  # why it is gone

    def request(self, op: str, env_id: int, arg: Any) -> asyncio.Future:
        """Queue request ``op`` (sent, pickled, by the next :meth:`flush`); the future gets its reply."""
        if self.dead is not None:
            raise RuntimeError(f"env {env_id}: {self.dead}")
        fut = asyncio.get_running_loop().create_future()
        self.requests.append((op, env_id, arg))
        self.waiting.append((env_id, op, fut))
        return fut

    def answered(self, replies: list[tuple[int, bool, Any]]) -> None:
        """Settle the futures of the requests these replies answer (in the order they were sent)."""
        for env_id, ok, payload in replies:
            _, op, fut = self.waiting.popleft()
            if not ok and isinstance(payload, tuple):  # (the part of the request that failed, why)
                op, payload = payload
            if not fut.done():
                fut.set_result(payload) if ok else fut.set_exception(EnvStepError(env_id, op, payload))

    def flush(self, sent_at: np.ndarray) -> bool:
        """Send the queued steps (one message; ``sent_at`` of their envs gets the send time) and
        requests (another). False if the pipe is broken: the worker died."""
        try:
            if self.steps:
                ids = np.concatenate(self.steps).astype(np.int32)
                self.steps = []
                sent_at[ids] = time.perf_counter()
                self.child.send_bytes(STEP + ids.tobytes())
            if self.requests:
                reqs, self.requests = self.requests, []
                self.child.send_bytes(PICKLED + pickle.dumps(reqs))
        except OSError:
            return False
        return True

    def retire(self) -> None:
        """Stop watching it and tell it to quit (after what it was sent); its requests' futures
        are cancelled. :meth:`stop` joins it later."""
        self.child.unwatch()
        self.child.quit()
        self._cancel_waiting()

    def _cancel_waiting(self) -> None:
        for _, _, fut in self.waiting:
            fut.cancel()
        self.waiting.clear()

    @staticmethod
    def stop(links: list[WorkerLink]) -> None:
        """End ``links``' workers (``CLOSE_WAIT_S`` in all, then killed: a worker hung in a step
        never reads its QUIT); their requests' futures are cancelled."""
        Child.reap_all([link.child for link in links], CLOSE_WAIT_S)
        for link in links:
            link._cancel_waiting()
