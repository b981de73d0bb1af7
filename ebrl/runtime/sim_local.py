"""The sim pools that keep their envs in this process: inline and thread.

- ``InlineSimPool`` steps on the event loop thread. Right for envs whose step costs less
  than a thread hop, and for virtual time, where each step's declared cost is charged
  with ``asyncio.sleep`` while holding one of ``num_lanes`` lanes.
- ``ThreadSimPool`` runs a resizable set of lane threads sharing one request queue. Right
  for simulators that release the GIL while stepping (MuJoCo's ``mj_step``, C++ or GPU sims,
  anything that sleeps). Shrinking never interrupts a running step.

Both also host vector envs (:mod:`ebrl.runtime.vector_envs`), one unit per vector env.

    >>> import asyncio, gymnasium as gym
    >>> async def demo():
    ...     pool = InlineSimPool(lambda i: gym.make("CartPole-v1"), 2)
    ...     await pool.start()
    ...     obs, _ = await pool.reset(1, seed=0)
    ...     out = await pool.step(1, 0)
    ...     pool.close()
    ...     return obs.shape, out.reward
    >>> asyncio.run(demo())
    ((4,), 1.0)
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import gymnasium as gym

from ebrl.config import SimBackend
from ebrl.runtime.sim_types import (
    EnvFn,
    EnvStepError,
    SimPool,
    StepOut,
    close_quietly,
    describe,
    reset_env,
    single_spaces,
    step_env,
)
from ebrl.runtime.vector_envs import check_vector_env, reset_vector_env, step_vector_env
from ebrl.runtime.virtual_time import is_virtual


class _LocalEnvs:
    """Envs living in this process (inline and thread backends).

    With ``vector_size > 1`` each unit is a vectorised env (see :mod:`ebrl.runtime.vector_envs`):
    ``step`` takes its envs' actions and returns one ``StepOut`` per env, and ``reset`` takes a
    list of seeds (every env) or ``{row: seed}`` (some).
    """

    vector_size = 1
    _step_fn = staticmethod(step_env)
    _reset_fn = staticmethod(reset_env)

    def _host_vectors(self, vector_size: int) -> None:
        if vector_size > 1:
            self.vector_size = vector_size
            self._step_fn, self._reset_fn = step_vector_env, reset_vector_env

    def _build_all(self) -> None:
        self.envs = [self._build(i) for i in range(self.num_envs)]
        self.observation_space, self.action_space = single_spaces(self.envs[0])

    def _build(self, env_id: int) -> gym.Env:
        try:
            env = self.env_fn(env_id)
        except Exception as exc:
            raise EnvStepError(env_id, "env_fn", describe(exc)) from exc
        if self.vector_size > 1:
            try:
                check_vector_env(env, env_id, self.vector_size)
            except (TypeError, ValueError):
                close_quietly(env)
                raise  # a configuration error, not an env failure to retry
        return env

    def _rebuild_local(self, env_id: int) -> None:
        close_quietly(self.envs[env_id])
        self.envs[env_id] = self._build(env_id)

    def _close_envs(self) -> None:
        for env in getattr(self, "envs", []):
            close_quietly(env)
        self.envs = []


class InlineSimPool(_LocalEnvs, SimPool):
    """Steps on the event loop. Under virtual time, charges each step's cost on one of ``num_lanes`` lanes."""

    backend = SimBackend.INLINE
    resizable = True

    def __init__(self, env_fn: EnvFn, num_envs: int, num_lanes: int = 1, vector_size: int = 1):
        super().__init__(env_fn, num_envs)
        self._host_vectors(vector_size)
        self._lanes = num_lanes
        self._virtual = False
        self._lane_sem: asyncio.Semaphore | None = None

    async def start(self) -> None:
        self._virtual = is_virtual()
        self._lane_sem = asyncio.Semaphore(self._lanes)
        self._build_all()

    @property
    def size(self) -> int:
        return self._lanes

    def resize(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        delta, self._lanes = n - self._lanes, n
        for _ in range(max(delta, 0)):
            self._lane_sem.release()
        for _ in range(max(-delta, 0)):  # shrink lazily: lanes are taken as steps finish
            asyncio.get_running_loop().create_task(self._lane_sem.acquire())

    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]:
        try:
            return self._reset_fn(self.envs[env_id], seed)
        except Exception as exc:
            raise EnvStepError(env_id, "reset", describe(exc)) from exc

    async def step(self, env_id: int, action: Any) -> StepOut:
        if not self._virtual:
            try:
                return self._step_fn(self.envs[env_id], action)
            except Exception as exc:
                raise EnvStepError(env_id, "step", describe(exc)) from exc
        async with self._lane_sem:
            try:
                out = self._step_fn(self.envs[env_id], action)
            except Exception as exc:
                raise EnvStepError(env_id, "step", describe(exc)) from exc
            cost = out[0].cost_s if isinstance(out, list) else out.cost_s  # a vector env's steps share one cost
            if cost > 0:
                await asyncio.sleep(cost)
            return out

    async def rebuild(self, env_id: int) -> None:
        self._rebuild_local(env_id)

    def close(self) -> None:
        self._close_envs()


class ThreadSimPool(_LocalEnvs, SimPool):
    """Lane threads take step requests from one queue and resolve their futures on the loop."""

    backend = SimBackend.THREAD
    resizable = True

    def __init__(self, env_fn: EnvFn, num_envs: int, num_threads: int, vector_size: int = 1):
        super().__init__(env_fn, num_envs)
        self._host_vectors(vector_size)
        self._target = num_threads
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_lane = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._build_all()
        self.resize(self._target)

    @property
    def size(self) -> int:
        return self._target

    def resize(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"sim pool size must be >= 1, got {n}")
        self._threads = [t for t in self._threads if t.is_alive()]
        self._target = n
        for _ in range(n - len(self._threads)):
            t = threading.Thread(target=self._lane, name=f"ebrl-sim-{self._next_lane}", daemon=True)
            self._next_lane += 1
            t.start()
            self._threads.append(t)
        for _ in range(len(self._threads) - n):
            self._requests.put(None)  # a lane exits after the step it is running

    def _lane(self) -> None:
        resolve = _resolve
        while (item := self._requests.get()) is not None:
            fn, args, fut = item
            try:
                result, exc = fn(*args), None
            except BaseException as e:  # handed to the awaiting coroutine
                result, exc = None, e
            try:
                self._loop.call_soon_threadsafe(resolve, fut, result, exc)
            except RuntimeError:  # loop closed during shutdown
                return

    async def _submit(self, env_id: int, op: str, fn, *args):
        fut = self._loop.create_future()
        self._requests.put((fn, args, fut))
        try:
            return await fut
        except EnvStepError:
            raise
        except Exception as exc:
            raise EnvStepError(env_id, op, describe(exc)) from exc

    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]:
        return await self._submit(env_id, "reset", self._reset_fn, self.envs[env_id], seed)

    async def step(self, env_id: int, action: Any) -> StepOut:
        return await self._submit(env_id, "step", self._step_fn, self.envs[env_id], action)

    async def rebuild(self, env_id: int) -> None:
        await self._submit(env_id, "env_fn", self._rebuild_local, env_id)

    def close(self) -> None:
        for _ in self._threads:
            self._requests.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        self._close_envs()


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)
