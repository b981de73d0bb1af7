"""SimPool: where ``env.step`` runs, behind one awaitable interface.

Three backends (:class:`~ebrl.config.SimBackend`):

- ``InlineSimPool`` steps on the event loop thread. Right for envs whose step costs less
  than a thread hop, and for virtual time, where each step's declared cost is charged
  with ``asyncio.sleep`` while holding one of ``num_lanes`` lanes.
- ``ThreadSimPool`` runs a resizable set of lane threads sharing one request queue. Right
  for simulators that release the GIL while stepping (MuJoCo's ``mj_step``, C++ or GPU sims,
  anything that sleeps). Shrinking never interrupts a running step.
- ``ProcessSimPool`` (in ``sim_workers.py``) hosts the envs in worker processes. Right for
  GIL-bound Python envs, which is most gymnasium envs.

Every backend resets an env in the same call as the step that ends its episode
(gymnasium's ``AutoresetMode.SAME_STEP``): ``StepOut.obs`` is then the first observation
of the next episode and ``final_obs`` the last one of the episode that ended.

    >>> import asyncio, gymnasium as gym
    >>> from ebrl.runtime.sim_pool import make_sim_pool
    >>> from ebrl.config import SimConfig
    >>> async def demo():
    ...     pool = make_sim_pool(lambda i: gym.make("CartPole-v1"), 2, SimConfig(backend="thread"))
    ...     await pool.start()
    ...     obs, _ = await pool.reset(0, seed=0)
    ...     out = await pool.step(0, 1)
    ...     pool.close()
    ...     return out.obs.shape
    >>> asyncio.run(demo())
    (4,)
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import ConfigError, SimBackend, SimConfig
from ebrl.runtime.virtual_time import is_virtual

EnvFn = Callable[[int], gym.Env]


@dataclass(slots=True)
class StepOut:
    """One env step. When the episode ended, ``obs``/``info`` already belong to the next one."""

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict
    final_obs: Any = None  # last observation of the episode that ended at this step
    final_info: dict | None = None
    cost_s: float = 0.0  # declared cost (virtual time); 0 for real envs
    finite: bool = True  # reward and observation free of NaN/inf (checked where the step ran)


class EnvStepError(RuntimeError):
    """An env raised inside ``step``, ``reset`` or its constructor."""

    def __init__(self, env_id: int, op: str, detail: str):
        super().__init__(f"env {env_id} failed in {op}: {detail}")
        self.env_id, self.op, self.detail = env_id, op, detail


def all_finite(x: Any) -> bool:
    """No NaN or inf in an observation (an array, or a dict of arrays)."""
    if isinstance(x, dict):
        return all(all_finite(v) for v in x.values())
    a = np.asarray(x)
    return a.dtype.kind not in "fc" or bool(np.isfinite(a).all())


def own(obs: Any) -> Any:
    """A copy of an observation: some envs return the same array every step and write into it,
    and the runtime keeps each observation until its transition is recorded."""
    if isinstance(obs, dict):
        return {k: own(v) for k, v in obs.items()}
    return np.array(obs, copy=True)


def reset_env(env: gym.Env, seed: int | None = None) -> tuple[Any, dict]:
    obs, info = env.reset(seed=seed)
    return own(obs), info


def step_env(env: gym.Env, action: Any) -> StepOut:
    """One step with same-step autoreset; the NaN/inf check runs here, in the lane or worker."""
    obs, reward, terminated, truncated, info = env.step(action)
    obs = own(obs)
    cost = getattr(env.unwrapped, "virtual_step_cost", 0.0)
    reward = float(reward)
    finite = math.isfinite(reward) and all_finite(obs)
    if terminated or truncated:
        final_obs, final_info = obs, info
        obs, info = reset_env(env)
        return StepOut(obs, reward, bool(terminated), bool(truncated), info, final_obs, final_info, cost, finite)
    return StepOut(obs, reward, False, False, info, None, None, cost, finite)


def single_spaces(env: gym.Env | gym.vector.VectorEnv) -> tuple[gym.Space, gym.Space]:
    """The observation and action spaces of one env, also when ``env`` is a vector env."""
    if isinstance(env, gym.vector.VectorEnv):
        return env.single_observation_space, env.single_action_space
    return env.observation_space, env.action_space


def close_quietly(env: gym.Env) -> None:
    """Close an env that is being replaced or shut down; its own errors no longer matter."""
    try:
        env.close()
    except Exception:
        pass


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


class SimPool(ABC):
    """An awaitable home for ``num_envs`` envs built by ``env_fn(i)``."""

    backend: SimBackend
    resizable = False

    def __init__(self, env_fn: EnvFn, num_envs: int):
        self.env_fn = env_fn
        self.num_envs = num_envs
        self.observation_space: gym.Space | None = None
        self.action_space: gym.Space | None = None

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]: ...

    @abstractmethod
    async def step(self, env_id: int, action: Any) -> StepOut: ...

    @abstractmethod
    async def rebuild(self, env_id: int) -> None:
        """Close env ``env_id`` (ignoring its errors) and build it anew from ``env_fn``."""

    @abstractmethod
    def close(self) -> None:
        """Release every thread, process and env. Safe to call twice."""

    @property
    def size(self) -> int:
        return 1

    def resize(self, n: int) -> None:
        raise ValueError(f"the {self.backend.value} sim backend has a fixed size ({self.size})")


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
            from ebrl.runtime.vector_envs import reset_vector_env, step_vector_env

            self.vector_size = vector_size
            self._step_fn, self._reset_fn = step_vector_env, reset_vector_env

    def _build_all(self) -> None:
        self.envs = [self._build(i) for i in range(self.num_envs)]
        self.observation_space, self.action_space = single_spaces(self.envs[0])

    def _build(self, env_id: int) -> gym.Env:
        try:
            env = self.env_fn(env_id)
        except Exception as exc:
            raise EnvStepError(env_id, "env_fn", _describe(exc)) from exc
        if self.vector_size > 1:
            from ebrl.runtime.vector_envs import check_vector_env

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
            raise EnvStepError(env_id, "reset", _describe(exc)) from exc

    async def step(self, env_id: int, action: Any) -> StepOut:
        if not self._virtual:
            try:
                return self._step_fn(self.envs[env_id], action)
            except Exception as exc:
                raise EnvStepError(env_id, "step", _describe(exc)) from exc
        async with self._lane_sem:
            try:
                out = self._step_fn(self.envs[env_id], action)
            except Exception as exc:
                raise EnvStepError(env_id, "step", _describe(exc)) from exc
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
            raise EnvStepError(env_id, op, _describe(exc)) from exc

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


# ---------------------------------------------------------------- choosing a backend


def measure_step_cost(env_fn: EnvFn, steps: int = 100, rounds: int = 3) -> tuple[float, bool]:
    """Seconds per random-action step of ``env_fn(0)`` (best of ``rounds``, after a warm-up),
    and whether the env says it releases the GIL (``metadata["ebrl.releases_gil"]``)."""
    env = env_fn(0)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        actions = [env.action_space.sample() for _ in range(steps)]

        def one_round() -> float:
            t0 = time.perf_counter()
            for a in actions:
                _, _, term, trunc, _ = env.step(a)
                if term or trunc:
                    env.reset()
            return (time.perf_counter() - t0) / steps

        one_round()  # warm-up: first calls pay for caches and lazy imports
        cost = min(one_round() for _ in range(rounds))
        releases_gil = bool(env.metadata.get("ebrl.releases_gil", False))
    finally:
        env.close()
    return cost, releases_gil


def decide_backend(cost_s: float, releases_gil: bool, cfg: SimConfig, cpus: int | None = None) -> SimBackend:
    """The AUTO rule: inline if a step is cheaper than a thread hop; threads if the env
    releases the GIL (or there is one core); worker processes otherwise."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    if cost_s < cfg.inline_below_s:
        return SimBackend.INLINE
    if releases_gil or cpus < 2:
        return SimBackend.THREAD
    return SimBackend.PROCESS


def choose_backend(env_fn: EnvFn, cfg: SimConfig) -> tuple[SimBackend, float]:
    cost, releases_gil = measure_step_cost(env_fn)
    return decide_backend(cost, releases_gil, cfg), cost


def make_sim_pool(env_fn: EnvFn, num_envs: int, cfg: SimConfig, backend: SimBackend | None = None) -> SimPool:
    """A pool for ``num_envs`` envs: ``num_envs // cfg.vector_size`` vector envs when that is > 1."""
    backend = backend or cfg.backend
    size = cfg.vector_size
    if size > 1:
        # a vectorised (typically GPU) simulator lives in this process, and one call steps many
        # envs, so it is worth a thread hop
        if backend is SimBackend.PROCESS:
            raise ConfigError("sim.backend", "process", f"vector envs (sim.vector_size={size}) step in this "
                              "process: use 'thread', 'inline' or 'auto'")
        if backend is SimBackend.AUTO:
            backend = SimBackend.THREAD
    elif backend is SimBackend.AUTO:
        backend, _ = choose_backend(env_fn, cfg)
    units = num_envs // size
    if backend is SimBackend.INLINE:
        return InlineSimPool(env_fn, units, num_lanes=cfg.num_threads, vector_size=size)
    if backend is SimBackend.THREAD:
        return ThreadSimPool(env_fn, units, cfg.num_threads, vector_size=size)
    from ebrl.runtime.sim_workers import ProcessSimPool

    return ProcessSimPool(env_fn, num_envs, cfg.num_workers or os.cpu_count() or 1, cfg.start_method)
