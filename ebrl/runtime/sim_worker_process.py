"""What runs in a worker process of :class:`~ebrl.runtime.sim_workers.ProcessSimPool`: the
message loop, streamed replies, requests (resets, rebuilds, adoptions), and the shared-memory
blocks both sides map. See :mod:`ebrl.runtime.sim_workers` for the protocol.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from multiprocessing import shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.sim_types import STEPS, WALL, EnvFn, StepRows, close_quietly, describe, reset_env, step_env
from ebrl.runtime.threads import ignore_stop_signals
from ebrl.spaces import index, tree_map

# message tags. Parent to worker: step ids, pickled requests, quit. Worker to parent: ready (once,
# serving), step ids, pickled (step ids, errors), pickled request replies.
STEP, ERRORS, PICKLED, QUIT, READY = b"S", b"E", b"P", b"Q", b"R"
_ALPHA = 0.1  # EWMA weight of the latest step time (low: a step preempted by another process is noise)
READ_BYTES = 1 << 20  # the most one read of a worker's pipe takes (more waits for the next)
_STRAGGLER = 3.0  # an env expected to take this many times its message-mates' mean is a straggler
# ... and to take at least this long: each reply costs the event loop a block (about 0.2 ms of
# CPU at 32 envs), so holding the finished envs for less than that is cheaper than splitting.
# Without it, the timing noise of microsecond steps made ~7% of replies single envs.
_STRAGGLER_MIN_S = 100e-6


def shm_alloc(blocks: list[shared_memory.SharedMemory], names: list[str] | None = None):
    """An ``alloc`` for :class:`StepRows`: each array a new block (parent), or the next of
    ``names`` (worker: same spaces, same call order, so the same sequence)."""

    def alloc(shape: tuple, dtype: np.dtype) -> np.ndarray:
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        if names is None:
            block = shared_memory.SharedMemory(create=True, size=nbytes)
        else:
            # workers share the parent's resource tracker (started before they are), so
            # attaching registers nothing new; the parent unlinks each block once, at close
            block = shared_memory.SharedMemory(name=names[len(blocks)])
        blocks.append(block)
        return np.ndarray(shape, dtype, buffer=block.buf)

    return alloc


def release_shared(rows: StepRows | None, blocks: list[shared_memory.SharedMemory], unlink: bool) -> None:
    if rows is not None:
        rows.close()  # drop the arrays first: a block with live views cannot close
    for block in blocks:
        with contextlib.suppress(BufferError):  # a view still held: unlinking still frees the name
            block.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                block.unlink()
    blocks.clear()


def worker_main(conn, env_fn: EnvFn, num_envs: int, hold_s: float, attach: tuple) -> None:
    """A worker process: maps the shared memory (``attach``: the block names and the spaces),
    then hosts the envs it is asked to build and answers requests until told to quit."""
    ignore_stop_signals()  # the parent decides when we stop
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
            else:
                break
    except (EOFError, KeyboardInterrupt, BrokenPipeError, OSError):
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
            rows.write(i, step_env(envs[i], tree_map(lambda a: a.copy(), index(rows.act, i)), rows.reset_seed, i))
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


def _serve(envs: dict[int, gym.Env], env_fn: EnvFn, requests: list[tuple[str, int, Any]],
           rows: StepRows | None = None, cost: list | None = None) -> list:
    """Answer pickled requests ``(op, env_id, arg)`` in order, one reply ``(env_id, ok, payload)``
    each; a failure's payload is its description, or ``(op, description)`` naming the part of
    the request that failed (``adopt``: ``env_fn`` or ``reset``).

    ``reset`` (arg: seed) -> (obs, info); ``rebuild`` (also an env's first build) -> None; ``adopt`` (arg: seed) builds the
    env from ``env_fn`` and resets it -> (obs, info), keeping nothing if either fails; ``drop``
    closes the env and forgets it -> None.
    """
    replies = []
    for op, i, arg in requests:
        if rows is not None:
            rows.started[i] = time.perf_counter()  # the parent's reset timeout counts from here
        try:
            if op == "adopt":
                replies.append((i, True, _adopt(envs, env_fn, i, arg, rows, cost)))
                continue
            if op == "drop":
                close_quietly(envs.pop(i))
                if cost is not None:
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
        except _AdoptError as exc:
            replies.append((i, False, (exc.op, exc.detail)))
        except Exception as exc:
            replies.append((i, False, describe(exc)))
        finally:
            if rows is not None:
                rows.started[i] = 0.0
    return replies


class _AdoptError(Exception):
    def __init__(self, op: str, detail: str):
        super().__init__(op, detail)
        self.op, self.detail = op, detail


def _adopt(envs: dict[int, gym.Env], env_fn: EnvFn, i: int, seed: Any, rows: StepRows | None,
           cost: list | None) -> tuple[Any, dict]:
    stale = envs.pop(i, None)  # a copy left by a cancelled migration: the parent's placement decides
    if stale is not None:
        close_quietly(stale)
    try:
        env = env_fn(i)
    except Exception as exc:
        raise _AdoptError("env_fn", describe(exc)) from exc
    try:
        out = reset_env(env, seed=seed)
    except Exception as exc:
        close_quietly(env)
        raise _AdoptError("reset", describe(exc)) from exc
    envs[i] = env
    if cost is not None and rows is not None and rows.cost[i, STEPS] > 0:
        # seed the step-order EWMA with the env's mean step time where it ran before
        cost[i] = float(rows.cost[i, WALL] / rows.cost[i, STEPS])
    return out
