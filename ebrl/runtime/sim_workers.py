"""ProcessSimPool: envs hosted in worker processes, for GIL-bound Python envs.

Env ``i`` lives in worker ``i % W``. The event loop talks to each worker over a pipe it
watches with ``add_reader`` (no thread in between): requests made in one loop iteration go
out as one message per worker, so a worker steps the ready subset of its envs per trip.

Transport: for Box observations and Box or Discrete actions, actions, observations, rewards
and done flags live in shared memory, and a step request or reply is just the packed env
ids, so nothing is pickled per step. Only episode ends (the final observation and info),
per-step success flags and errors are pickled. Other spaces fall back to pickling each
step. ``StepOut.info`` on this backend carries only the success keys (``is_success``,
``success``); ``final_info`` is complete.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.sim_types import (
    EnvFn,
    EnvStepError,
    SimPool,
    StepOut,
    close_quietly,
    describe,
    step_env,
)

INFO_KEYS = ("is_success", "success")  # per-step info worth a pickle
_STEP, _PICKLED, _QUIT = b"S", b"P", b"Q"
TERMINATED, TRUNCATED, NONFINITE = 1, 2, 4


def _shareable(space: gym.Space) -> bool:
    return isinstance(space, (gym.spaces.Box, gym.spaces.Discrete))


class SharedArrays:
    """Per-env slots for actions, observations, rewards and done flags, in shared memory."""

    def __init__(self, num_envs: int, obs_space: gym.Space, act_space: gym.Space, names: list[str] | None = None):
        specs = [(tuple(obs_space.shape), obs_space.dtype),
                 (tuple(act_space.shape), act_space.dtype if isinstance(act_space, gym.spaces.Box) else np.int64),
                 ((), np.float64), ((), np.uint8)]
        self.blocks: list[shared_memory.SharedMemory] = []
        arrays = []
        for k, (shape, dtype) in enumerate(specs):
            nbytes = max(1, num_envs * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
            if names is None:
                block = shared_memory.SharedMemory(create=True, size=nbytes)
            else:
                # workers share the parent's resource tracker (started before they are), so
                # attaching registers nothing new; the parent unlinks the block once, at close
                block = shared_memory.SharedMemory(name=names[k])
            self.blocks.append(block)
            arrays.append(np.ndarray((num_envs, *shape), dtype=dtype, buffer=block.buf))
        self.obs, self.act, self.reward, self.flags = arrays
        self.names = [b.name for b in self.blocks]

    def close(self, unlink: bool) -> None:
        self.obs = self.act = self.reward = self.flags = None
        for block in self.blocks:
            block.close()
            if unlink:
                block.unlink()
        self.blocks = []


def _worker_main(conn, env_fn: EnvFn, env_ids: list[int], num_envs: int) -> None:
    """A worker process: hosts its envs and answers requests until told to quit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    envs: dict[int, gym.Env] = {}
    shm: SharedArrays | None = None
    try:
        try:
            for i in env_ids:
                envs[i] = env_fn(i)
        except Exception as exc:
            conn.send_bytes(pickle.dumps(("error", describe(exc))))
            return
        first = envs[env_ids[0]]
        conn.send_bytes(pickle.dumps(("ready", first.observation_space, first.action_space)))
        msg = pickle.loads(conn.recv_bytes())
        if msg[0] == "attach":
            shm = SharedArrays(num_envs, first.observation_space, first.action_space, names=msg[1])
        while True:
            raw = conn.recv_bytes()
            kind, body = raw[:1], raw[1:]
            if kind == _STEP:
                conn.send_bytes(_step_shared(envs, shm, np.frombuffer(body, np.int32)))
            elif kind == _PICKLED:
                conn.send_bytes(_PICKLED + pickle.dumps(_serve(envs, env_fn, pickle.loads(body))))
            else:
                break
    except (EOFError, KeyboardInterrupt, BrokenPipeError, OSError):
        pass
    finally:
        if shm is not None:
            shm.close(unlink=False)
        for env in envs.values():
            close_quietly(env)


def _step_shared(envs: dict[int, gym.Env], shm: SharedArrays, ids: np.ndarray) -> bytes:
    extras: dict[int, tuple] = {}
    for i in ids.tolist():
        try:
            out = step_env(envs[i], shm.act[i].copy())
        except Exception as exc:
            extras[i] = ("error", describe(exc))
            continue
        shm.obs[i] = out.obs
        shm.reward[i] = out.reward
        shm.flags[i] = TERMINATED * out.terminated | TRUNCATED * out.truncated | NONFINITE * (not out.finite)
        small = {k: out.info[k] for k in INFO_KEYS if k in out.info}
        if out.final_info is not None:
            extras[i] = ("done", small, out.final_obs, out.final_info)
        elif small:
            extras[i] = ("info", small)
    if not extras:
        return _STEP + ids.tobytes()
    return _PICKLED + pickle.dumps(("step", ids.tobytes(), extras))


def _serve(envs: dict[int, gym.Env], env_fn: EnvFn, requests: list[tuple[str, int, Any]]) -> list:
    replies = []
    for op, i, arg in requests:
        try:
            if op == "step":
                replies.append((i, True, step_env(envs[i], arg)))
            elif op == "reset":
                replies.append((i, True, envs[i].reset(seed=arg)))
            elif op == "rebuild":
                close_quietly(envs[i])
                envs[i] = env_fn(i)
                replies.append((i, True, None))
        except Exception as exc:
            replies.append((i, False, describe(exc)))
    return replies


class _Worker:
    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.steps: list[int] = []  # env ids whose action is in shared memory
        self.requests: list[tuple[str, int, Any]] = []  # pickled requests
        self.waiting: dict[int, tuple[str, asyncio.Future]] = {}


class ProcessSimPool(SimPool):
    """Envs hosted in worker processes; the event loop batches requests per worker per iteration."""

    backend = SimBackend.PROCESS

    def __init__(self, env_fn: EnvFn, num_envs: int, num_workers: int, start_method: str | None = None):
        super().__init__(env_fn, num_envs)
        self._num_workers = max(1, min(num_workers, num_envs))
        if start_method is None:
            start_method = "fork" if sys.platform.startswith("linux") else "spawn"
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shm: SharedArrays | None = None
        self._flush_scheduled = False
        self._closed = False

    @property
    def size(self) -> int:
        return self._num_workers

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # one resource tracker for parent and workers: a worker forked before the parent's
        # tracker exists starts its own, which unlinks the shared memory when the worker exits
        resource_tracker.ensure_running()
        for w in range(self._num_workers):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main, args=(child, self.env_fn, list(range(w, self.num_envs, self._num_workers)),
                                           self.num_envs),
                name=f"ebrl-sim-worker-{w}", daemon=True)
            proc.start()
            child.close()
            self._workers.append(_Worker(w, proc, parent))
        try:
            for worker in self._workers:
                msg = await self._first_message(worker)  # workers build their envs in parallel
                if msg[0] == "error":
                    raise EnvStepError(worker.index, "env_fn", f"in worker {worker.index}: {msg[1]}")
                self.observation_space, self.action_space = msg[1], msg[2]
            shared = _shareable(self.observation_space) and _shareable(self.action_space)
            if shared:
                self._shm = SharedArrays(self.num_envs, self.observation_space, self.action_space)
            for worker in self._workers:
                worker.conn.send_bytes(pickle.dumps(("attach", self._shm.names) if shared else ("pickle",)))
                self._watch(worker.conn.fileno(), self._on_readable, worker)
        except BaseException:
            self.close()
            raise

    async def _first_message(self, worker: _Worker):
        ready = self._loop.create_future()
        self._watch(worker.conn.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self._loop.remove_reader(worker.conn.fileno())
        try:
            return pickle.loads(worker.conn.recv_bytes())
        except EOFError:
            return ("error", f"worker exited during start (exit code {worker.process.exitcode})")

    def _watch(self, fd: int, callback, *args) -> None:
        self._loop.add_reader(fd, callback, *args)
        # add_reader makes the socket non-blocking; a message larger than the socket buffer
        # (pixels) then arrives in pieces and recv_bytes would fail half-way. Readable means a
        # message has started, and the worker writes the rest at once: a blocking read is safe.
        os.set_blocking(fd, True)

    def _future(self, worker: _Worker, op: str, env_id: int) -> asyncio.Future:
        if self._closed:
            raise RuntimeError("sim pool is closed")
        fut = self._loop.create_future()
        worker.waiting[env_id] = (op, fut)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        return fut

    def _request(self, op: str, env_id: int, arg: Any) -> asyncio.Future:
        worker = self._workers[env_id % self._num_workers]
        worker.requests.append((op, env_id, arg))
        return self._future(worker, op, env_id)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for worker in self._workers:
            try:
                if worker.steps:
                    ids, worker.steps = np.asarray(worker.steps, np.int32), []
                    worker.conn.send_bytes(_STEP + ids.tobytes())
                if worker.requests:
                    reqs, worker.requests = worker.requests, []
                    worker.conn.send_bytes(_PICKLED + pickle.dumps(reqs))
            except (BrokenPipeError, OSError) as exc:
                self._fail_worker(worker, f"pipe to worker {worker.index} broke: {exc}")

    def _on_readable(self, worker: _Worker) -> None:
        try:
            raw = worker.conn.recv_bytes()
        except (EOFError, OSError):
            self._fail_worker(worker, f"worker {worker.index} died (exit code {worker.process.exitcode})")
            return
        kind, body = raw[:1], raw[1:]
        if kind == _STEP:
            self._resolve_steps(worker, np.frombuffer(body, np.int32), {})
            return
        msg = pickle.loads(body)
        if isinstance(msg, tuple) and msg[0] == "step":
            self._resolve_steps(worker, np.frombuffer(msg[1], np.int32), msg[2])
            return
        for env_id, ok, payload in msg:
            op, fut = worker.waiting.pop(env_id)
            if not fut.done():
                fut.set_result(payload) if ok else fut.set_exception(EnvStepError(env_id, op, payload))

    def _resolve_steps(self, worker: _Worker, ids: np.ndarray, extras: dict) -> None:
        shm = self._shm
        for i in ids.tolist():
            _, fut = worker.waiting.pop(i)
            if fut.done():
                continue
            extra = extras.get(i)
            if extra is not None and extra[0] == "error":
                fut.set_exception(EnvStepError(i, "step", extra[1]))
                continue
            flags = int(shm.flags[i])
            out = StepOut(shm.obs[i].copy(), float(shm.reward[i]), bool(flags & TERMINATED),
                          bool(flags & TRUNCATED), extra[1] if extra is not None else {},
                          finite=not flags & NONFINITE)
            if extra is not None and extra[0] == "done":
                out.final_obs, out.final_info = extra[2], extra[3]
            fut.set_result(out)

    def _fail_worker(self, worker: _Worker, why: str) -> None:
        try:
            self._loop.remove_reader(worker.conn.fileno())
        except Exception:
            pass
        for env_id, (op, fut) in worker.waiting.items():
            if not fut.done():
                fut.set_exception(RuntimeError(f"env {env_id}: {why}"))
        worker.waiting.clear()

    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]:
        return await self._request("reset", env_id, seed)

    async def step(self, env_id: int, action: Any) -> StepOut:
        if self._shm is None:
            return await self._request("step", env_id, action)
        worker = self._workers[env_id % self._num_workers]
        self._shm.act[env_id] = action  # the env is idle: nobody reads its slot now
        worker.steps.append(env_id)
        return await self._future(worker, "step", env_id)

    async def rebuild(self, env_id: int) -> None:
        await self._request("rebuild", env_id, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                self._loop.remove_reader(worker.conn.fileno())
            except Exception:
                pass
            try:
                worker.conn.send_bytes(_QUIT)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
            for _, fut in worker.waiting.values():
                fut.cancel()
        self._workers = []
        if self._shm is not None:
            self._shm.close(unlink=True)
            self._shm = None
