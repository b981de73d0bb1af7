"""What every sim pool shares: the :class:`SimPool` interface, the :class:`StepRows` it writes
step results into, the :class:`Block` it hands back, and stepping one env with same-step autoreset.

The block path: the driver hands a pool a block of env ids and their action rows
(:meth:`SimPool.submit`); wherever the steps run (the event loop, a lane thread, a worker
process), each result is written into that env's row of :class:`StepRows` (plain NumPy, or
shared memory for worker processes: one array per observation key, plus the env's fields of
the transition from :mod:`ebrl.runtime.fields`, flags and final observations); the pool then
puts a :class:`Block` naming the envs whose steps are done in its
:class:`~ebrl.runtime.outbox.Outbox`, and the driver's loop takes it with ``await pool.recv()``.
Nothing per env crosses the event loop as a Python object.

Every backend resets an env in the same call as the step that ends its episode
(gymnasium's ``AutoresetMode.SAME_STEP``): the row's observation is then the first of the
next episode, and ``final_obs`` the last one of the episode that ended.

    >>> import gymnasium as gym
    >>> env = gym.make("CartPole-v1")
    >>> obs, _ = reset_env(env, seed=0)
    >>> rows = StepRows(2, env.observation_space, env.action_space)
    >>> rows.write(1, step_env(env, 1))
    >>> block = rows.block(np.array([1]))
    >>> block.obs.shape, block.reward, block.finite, block.success
    ((1, 4), array([1.]), array([ True]), array([-1], dtype=int8))
"""

from __future__ import annotations

import math
import traceback
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import SimBackend
from ebrl.runtime.fields import space_rows, transition_fields
from ebrl.runtime.outbox import Outbox
from ebrl.spaces import all_finite, copy_tree, index, tree_map, write

EnvFn = Callable[[int], gym.Env]
SUCCESS_KEYS = ("is_success", "success")  # the info keys read as an episode's success flag
# StepRows.flags bits
TERMINATED, TRUNCATED, NONFINITE, SUCCESS_KNOWN, SUCCESS = 1, 2, 4, 8, 16
# StepRows.cost columns
STEPS, WALL, CPU, QUEUE = 0, 1, 2, 3


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

    @property
    def success(self) -> int:
        """The step's success flag (from ``final_info`` at an episode's end): 1, 0, or -1 if none."""
        return success_flag(self.final_info if self.final_info is not None else self.info)


def success_flag(info: dict) -> int:
    """An info dict's success flag (``is_success`` or ``success``): 1, 0, or -1 if it has none."""
    for key in SUCCESS_KEYS:
        if key in info:
            return int(bool(info[key]))
    return -1


@dataclass(slots=True, eq=False)  # arrays inside: compared by identity
class Block:
    """The finished steps of some envs: row ``k`` belongs to env ``ids[k]``.

    Observations are copies (the envs' rows are rewritten by their next step). ``final_obs``
    maps a row to the last observation of an episode that ended by time limit (truncated, not
    terminated): only those need a bootstrap value. ``errors`` names envs whose step raised
    instead (they are not in ``ids``), with the exception as ``"TypeName: message"``.
    """

    ids: np.ndarray  # int64 [B]
    obs: Any  # array tree [B, ...]: the next observation (a new episode's first after an end)
    reward: np.ndarray  # float64 [B]
    terminated: np.ndarray  # bool [B]
    truncated: np.ndarray  # bool [B]
    finite: np.ndarray  # bool [B]: reward and observations free of NaN/inf
    success: np.ndarray  # int8 [B]: 1, 0, or -1 where the step's info had no success flag
    final_obs: dict[int, Any] = field(default_factory=dict)
    errors: list[tuple[int, str]] = field(default_factory=list)
    clean: bool = False  # known: no episode ended, every row finite, no success flag
    # action chunks (ebrl.runtime.fields): float32 [B, K] and int64 [B]; None unless Box(K, ...) actions
    chunk_rewards: np.ndarray | None = None
    chunk_steps: np.ndarray | None = None

    def take(self, keep: np.ndarray) -> Block:
        """The rows ``keep`` (final observations renumbered; no errors)."""
        where = {int(r): k for k, r in enumerate(keep.tolist())}
        rows = {f.name: index(v, keep) for f in fields(self)
                if f.name not in ("final_obs", "errors", "clean") and (v := getattr(self, f.name)) is not None}
        return Block(**rows, final_obs={where[r]: o for r, o in self.final_obs.items() if r in where})


class StepRows:
    """Per-env rows for the latest step of every env: observation (tree), final observation
    (tree), action (tree), the env's ``columns`` of the transition and flags. Written where the
    step runs, read by the pool when it builds a :class:`Block`. Env ``i``'s rows are touched
    only while its step runs, so writers and readers never overlap.
    """

    def __init__(self, num_envs: int, obs_space: gym.Space, act_space: gym.Space,
                 alloc: Callable[[tuple, np.dtype], np.ndarray] | None = None):
        self.num_envs = num_envs
        self.obs = space_rows(obs_space, num_envs, alloc)
        self.final_obs = space_rows(obs_space, num_envs, alloc)
        self.act = space_rows(act_space, num_envs, alloc)
        make = alloc or (lambda shape, dtype: np.zeros(shape, dtype))
        # the env's fields of the transition by Block attribute (ebrl.runtime.fields): reward and an
        # action chunk's rewards and length (from the step's info; 0: the env reported none)
        self.columns = {f.attr: make((num_envs, *f.shape), f.step_dtype)
                        for f in transition_fields(obs_space, act_space) if f.step_dtype is not None}
        self.reward, self.chunk_steps = self.columns["reward"], self.columns.get("chunk_steps")
        self._chunk = [(k, v) for k, v in self.columns.items() if k != "reward"]  # Block's, None by default
        self.flags = make((num_envs,), np.dtype(np.uint8))
        # what each env's steps cost where they ran, summed since the start: columns STEPS, WALL
        # (seconds in env.step), CPU (CPU seconds of the stepping thread, or of the worker
        # process) and QUEUE (seconds from reaching the pool, or the worker, to the step's start:
        # the wait for a lane or for the worker's other envs). Only the env's stepper writes its
        # row; the profiler reads snapshots.
        self.cost = make((num_envs, 4), np.dtype(np.float64))
        # perf_counter (CLOCK_MONOTONIC: one clock for every process) when the env's running step
        # started, 0 when it is not stepping: what step timeouts are measured from
        self.started = make((num_envs,), np.dtype(np.float64))
        # the seed + 1 of the reset inside the step that ends env i's episode, 0: unseeded (the
        # driver writes it under RunConfig.reset_group; zero-filled, so a worker attaching later
        # never clobbers it)
        self.reset_seed = make((num_envs,), np.dtype(np.int64))
        # a flat view for per-step adds: a memoryview item costs a third of a NumPy scalar's
        self._cost_flat = memoryview(self.cost).cast("B").cast("d")

    def add_cost(self, i: int, wall_s: float, cpu_s: float, queue_s: float = 0.0) -> None:
        """Count one step of env ``i`` that took these times."""
        flat, k = self._cost_flat, 4 * i
        flat[k] += 1.0
        flat[k + 1] += wall_s
        flat[k + 2] += cpu_s
        flat[k + 3] += queue_s

    def write(self, i: int, out: StepOut) -> None:
        """Store env ``i``'s step."""
        write(self.obs, i, out.obs)
        self.reward[i] = out.reward
        success = out.success
        flags = (TERMINATED * out.terminated | TRUNCATED * out.truncated | NONFINITE * (not out.finite)
                 | (SUCCESS_KNOWN | SUCCESS * success if success >= 0 else 0))
        if out.final_obs is not None and out.truncated and not out.terminated:
            write(self.final_obs, i, out.final_obs)
        self.flags[i] = flags
        if self.chunk_steps is not None:
            self._write_chunk(i, out.final_info if out.final_info is not None else out.info)

    def _write_chunk(self, i: int, info: dict) -> None:
        n = info.get("chunk_steps")
        if n is None:  # no chunk reported: one step
            self.chunk_steps[i] = 0
            return
        rows, rewards = self.columns["chunk_rewards"], np.asarray(info["chunk_rewards"], np.float32)
        if rewards.shape != rows.shape[1:] or not 1 <= n <= len(rewards):
            raise ValueError(f"info['chunk_rewards'] of shape {rewards.shape} with chunk_steps={n}: expected "
                             f"{rows.shape[1]} rewards (zero-padded) and 1 <= chunk_steps <= that")
        rows[i], self.chunk_steps[i] = rewards, n

    def write_many(self, ids: np.ndarray, step: Block) -> None:
        """Store the steps of envs ``ids`` at once (a vector env's, by row:
        :class:`~ebrl.runtime.vector_envs.VectorStep`)."""
        write(self.obs, ids, step.obs)
        for name, column in self.columns.items():  # None: the env reported no chunks
            value = getattr(step, name)
            column[ids] = 0 if value is None else value
        terminated, truncated, success = step.terminated, step.truncated, step.success
        self.flags[ids] = (TERMINATED * terminated | TRUNCATED * truncated | NONFINITE * ~step.finite
                           | SUCCESS_KNOWN * (success >= 0) | SUCCESS * (success > 0)).astype(np.uint8)
        for row, o in step.final_obs.items():
            if truncated[row] and not terminated[row]:
                write(self.final_obs, int(ids[row]), o)

    def actions(self, ids: np.ndarray) -> Any:
        return index(self.act, ids)

    def set_actions(self, ids: np.ndarray, actions: Any) -> None:
        write(self.act, ids, actions)

    def block(self, ids: np.ndarray, errors: list[tuple[int, str]] | None = None) -> Block:
        """The finished steps of envs ``ids`` (copied out of the rows)."""
        flags = self.flags[ids]
        n = len(ids)
        if not np.count_nonzero(flags):  # the common step: no episode end, no NaN, no success flag
            no = np.zeros(n, bool)
            block = Block(ids, index(self.obs, ids), self.reward[ids], no, no, ~no, np.full(n, -1, np.int8),
                          {}, errors or [], True)
        else:
            terminated = (flags & TERMINATED) != 0
            truncated = (flags & TRUNCATED) != 0
            success = np.where(flags & SUCCESS_KNOWN, (flags & SUCCESS) != 0, -1).astype(np.int8)
            boot = (truncated & ~terminated).nonzero()[0]
            final_obs = {int(r): tree_map(np.copy, index(self.final_obs, int(ids[r]))) for r in boot}
            block = Block(ids, index(self.obs, ids), self.reward[ids], terminated, truncated,
                          (flags & NONFINITE) == 0, success, final_obs, errors or [])
        for name, column in self._chunk:
            setattr(block, name, column[ids])
        return block

    def close(self) -> None:
        if self._cost_flat is not None:
            self._cost_flat.release()  # a live export would keep a shared-memory block from closing
        self._cost_flat = None
        self.obs = self.final_obs = self.act = self.reward = self.flags = self.cost = self.started = None
        self.reset_seed = self.chunk_steps = None
        self.columns, self._chunk = {}, []


def reset_env(env: gym.Env, seed: int | None = None) -> tuple[Any, dict]:
    obs, info = env.reset(seed=seed)
    return copy_tree(obs), info


def step_env(env: gym.Env, action: Any, reset_seeds: np.ndarray | None = None, i: int = 0) -> StepOut:
    """One step with same-step autoreset; the NaN/inf check runs here, in the lane or worker.
    ``reset_seeds[i] - 1`` (:attr:`StepRows.reset_seed`; 0: unseeded) seeds the autoreset, read
    only when the episode ends: most steps never pay for it."""
    obs, reward, terminated, truncated, info = env.step(action)
    obs = copy_tree(obs)
    cost = getattr(env.unwrapped, "virtual_step_cost", 0.0)
    reward = float(reward)
    finite = math.isfinite(reward) and all_finite(obs)
    if terminated or truncated:
        final_obs, final_info = obs, info
        seed = int(reset_seeds[i]) - 1 if reset_seeds is not None else -1
        obs, info = reset_env(env, seed if seed >= 0 else None)
        finite = finite and all_finite(obs)  # the next episode's first observation comes back with this step
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


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` for an env's exception, as :class:`EnvStepError` reports it."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


class SimPool(ABC):
    """A home for ``num_envs`` envs built by ``env_fn(i)``, stepped a block at a time.

    :meth:`submit` starts the steps of a block of idle envs and returns at once; their results
    come back later from ``await pool.recv()``, in one or more blocks (PufferLib's and EnvPool's
    send/recv). A *unit* is one env, or one vector env of ``vector_size`` envs (``reset`` and
    ``rebuild`` take units; ``submit`` takes env ids, whole units at a time).
    """

    backend: SimBackend
    resizable = False
    vector_size = 1
    respawns = 0  # worker processes replaced after dying (the process and mixed pools count them)

    def __init__(self, env_fn: EnvFn, num_envs: int):
        self.env_fn = env_fn
        self.num_envs = num_envs  # envs (not units)
        self.observation_space: gym.Space | None = None
        self.action_space: gym.Space | None = None
        self.outbox = Outbox()  # a mixed pool's parts share their parent's
        self.virtual_step_cost = 0.0  # the latest step's declared cost (virtual time only)

    @abstractmethod
    async def start(self) -> None:
        """Build the envs; afterwards ``observation_space``/``action_space`` are one env's."""

    @abstractmethod
    def submit(self, ids: np.ndarray, actions: Any) -> None:
        """Start a step for each env in ``ids`` (idle envs) with ``actions`` rows (a tree ``[B, ...]``)."""

    def recv(self) -> Awaitable[Block]:
        """The next block of finished steps (or of step errors), waiting until one is back;
        raises :class:`PoolClosed` once the pool is closed and every block was taken."""
        return self.outbox.get()

    @abstractmethod
    async def reset(self, unit: int, seed: Any = None) -> tuple[Any, Any]:
        """Reset a unit. A plain env: ``(obs, info)``; a vector env takes a list of seeds
        (every row) or ``{row: seed}`` (some rows) and returns ``({row: obs}, {row: info})``."""

    @abstractmethod
    async def rebuild(self, unit: int) -> None:
        """Close unit ``unit`` (ignoring its errors) and build it anew from ``env_fn``."""

    @abstractmethod
    def close(self) -> None:
        """Release every thread, process and env. Safe to call twice."""

    @property
    def size(self) -> int:
        return 1

    def resize(self, n: int) -> None:
        raise ValueError(f"the {self.backend.value} sim backend has a fixed size ({self.size})")

    def abandon_late(self, limit_s: float) -> list[int]:
        """Give up the steps that started more than ``limit_s`` ago (``faults.step_timeout_s``):
        each comes back as a :class:`TimedOut` error and the driver rebuilds its unit. Returns
        the units given up. A step still waiting for a lane or for its worker-mates is not late.
        The inline backend gives up nothing: a hung inline step holds the event loop itself."""
        return []

    def abandon(self, unit: int, limit_s: float) -> bool:
        """Give up unit ``unit``'s reset or rebuild if it has *run* (not waited for a lane or
        for its worker-mates) over ``limit_s``: a thread lane replaced, a worker killed and
        respawned. The driver times those calls and, on True, fails the call as ``timeout``
        and rebuilds the unit; on False it waits on."""
        return False

    def set_reset_seeds(self, ids: np.ndarray, seeds: np.ndarray) -> None:
        """The seeds of the autoresets inside the steps that end these envs' episodes (the
        driver's, under ``RunConfig.reset_group``)."""
        rows = getattr(self, "rows", None)
        if rows is not None:
            rows.reset_seed[ids] = np.asarray(seeds, np.int64) + 1

    def costs(self) -> np.ndarray | None:
        """A copy of the pool's per-env step costs (``[num_envs, 4]``: steps, wall, CPU and queue
        seconds, summed since start; see :attr:`StepRows.cost`), or None before start."""
        rows = getattr(self, "rows", None)
        return None if rows is None or rows.cost is None else rows.cost.copy()


class ElasticPool(SimPool):
    """A pool whose envs live on worker processes and can move between them (the process pool),
    or also to and from thread lanes (the mixed pool: ``mixed``): what the controller's
    ``placement``, ``workers`` and ``backend`` knobs act on. One ``isinstance`` check tells the
    manager and the profiler a pool can do all of it."""

    mixed = False  # envs may also step on thread lanes (placement negative)

    @property
    @abstractmethod
    def placement(self) -> np.ndarray:
        """Env -> worker (a copy); negative: not on a worker (a mixed pool's env on the lanes)."""

    @property
    @abstractmethod
    def workers(self) -> int:
        """Worker processes now."""

    @abstractmethod
    async def migrate(self, env_id: int, worker: int, seed: int | None = None) -> tuple[Any, dict]:
        """Move idle env ``env_id`` to ``worker``, rebuilt there from ``env_fn`` and reset with
        ``seed``; returns that reset's ``(obs, info)``. On failure the env stays where it was."""

    @abstractmethod
    async def grow(self, n: int) -> None:
        """Start workers up to ``n`` (forked off the loop); envs move onto them with :meth:`migrate`."""

    @abstractmethod
    def resize_workers(self, n: int) -> None:
        """Retire the workers past ``n`` (their envs must have moved off first)."""

    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The live workers' process ids (for CPU pinning)."""

