"""What a sim pool hands the driver: :class:`Block`, the :class:`StepRows` it is cut from, and
the :class:`Outbox` it waits in.

Wherever a step runs (the event loop, a lane thread, a worker process), its results are written
into the env's rows of :class:`StepRows` (plain NumPy, or shared memory for worker processes), and
a :class:`Block` naming the finished envs goes through the :class:`Outbox` to ``await pool.recv()``.
Nothing per env crosses the event loop as a Python object.

    >>> import gymnasium as gym
    >>> from ebrl.runtime.sim.stepping import reset_unit, step_unit
    >>> env = gym.make("CartPole-v1")
    >>> obs, _ = reset_unit(env, 0)
    >>> rows = StepRows(2, env.observation_space, env.action_space)
    >>> rows.set_actions(np.array([1]), np.array([1]))
    >>> step_unit(env, rows, 1)
    0.0
    >>> block = rows.block(np.array([1]))
    >>> block.obs.shape, block.reward, block.finite, block.success
    ((1, 4), array([1.]), array([ True]), array([-1], dtype=int8))
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing import shared_memory
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.errors import PoolClosed
from ebrl.runtime.fields import space_rows, transition_fields
from ebrl.spaces import index, tree_map, write

# StepRows.flags bits
TERMINATED, TRUNCATED, NONFINITE, SUCCESS_KNOWN, SUCCESS = 1, 2, 4, 8, 16
# StepRows.cost columns
STEPS, WALL, CPU, QUEUE = 0, 1, 2, 3


@dataclass(slots=True, eq=False)  # arrays inside: compared by identity
class Block:
    """The finished steps of some envs: row ``k`` belongs to env ``ids[k]``; observations are copies.
    ``final_obs`` maps a row to the last observation of an episode that ended by time limit (only
    those need a bootstrap value); ``errors`` names envs whose step raised instead (not in ``ids``).
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
    """Per-env rows for the latest step of every env, written where the step runs and read into
    a :class:`Block`. Env ``i``'s rows are touched only while its step runs: no locks needed."""

    def __init__(self, num_envs: int, obs_space: gym.Space, act_space: gym.Space,
                 alloc: Callable[[tuple, np.dtype], np.ndarray] | None = None):
        self.obs = space_rows(obs_space, num_envs, alloc)
        self.final_obs = space_rows(obs_space, num_envs, alloc)
        self.act = space_rows(act_space, num_envs, alloc)
        make = alloc or (lambda shape, dtype: np.zeros(shape, dtype))
        # the env's fields of the transition by Block attribute (ebrl.runtime.fields): reward, and an
        # action chunk's rewards and length
        self.columns = {f.attr: make((num_envs, *f.shape), f.step_dtype)
                        for f in transition_fields(obs_space, act_space) if f.step_dtype is not None}
        self.reward, self.chunk_steps = self.columns["reward"], self.columns.get("chunk_steps")
        self._chunk = [(k, v) for k, v in self.columns.items() if k != "reward"]  # Block's, None by default
        self.flags = make((num_envs,), np.dtype(np.uint8))
        # what each env's steps cost where they ran, summed: STEPS, WALL (in env.step), CPU (of the
        # stepping thread or worker) and QUEUE (the wait for a lane or for the worker's other envs)
        self.cost = make((num_envs, 4), np.dtype(np.float64))
        # perf_counter (one clock for every process) when the env's running step started, 0: idle
        self.started = make((num_envs,), np.dtype(np.float64))
        # the seed + 1 of the reset inside the step that ends env i's episode, 0: unseeded
        # (zero-filled, so a worker attaching later never clobbers what the driver wrote)
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

    def write(self, ids: int | np.ndarray, obs: Any, reward, terminated, truncated, finite, success,
              final_obs: dict[int, Any], chunks: tuple[Any, Any] | None = None) -> None:
        """Store the step of env ``ids`` (an int: a plain env, scalars) or of envs ``ids`` (an
        array: a vector env's rows). ``final_obs`` maps a row (0 for a plain env) to its ended
        episode's last observation."""
        write(self.obs, ids, obs)
        self.reward[ids] = reward
        if isinstance(ids, int):  # a plain env's step: Python scalars, a fifth of NumPy's cost here
            self.flags[ids] = (TERMINATED * terminated | TRUNCATED * truncated | NONFINITE * (not finite)
                               | (SUCCESS_KNOWN | SUCCESS * success if success >= 0 else 0))
            if final_obs and truncated and not terminated:
                write(self.final_obs, ids, final_obs[0])
        else:
            self.flags[ids] = (TERMINATED * terminated | TRUNCATED * truncated | NONFINITE * ~finite
                               | SUCCESS_KNOWN * (success >= 0) | SUCCESS * (success > 0)).astype(np.uint8)
            for row, o in final_obs.items():
                if truncated[row] and not terminated[row]:
                    write(self.final_obs, int(ids[row]), o)
        if self.chunk_steps is not None:
            rewards, steps = chunks if chunks is not None else (0, 0)
            self.columns["chunk_rewards"][ids], self.chunk_steps[ids] = rewards, steps

    def set_actions(self, ids: np.ndarray, actions: Any) -> None:
        write(self.act, ids, actions)

    def block(self, ids: np.ndarray, errors: list[tuple[int, str]] | None = None) -> Block:
        """The finished steps of envs ``ids`` (copied out of the rows)."""
        flags = self.flags[ids]
        if not np.count_nonzero(flags):  # the common step: no episode end, no NaN, no success flag
            no = np.zeros(len(ids), bool)
            block = Block(ids, index(self.obs, ids), self.reward[ids], no, no, ~no, np.full(len(ids), -1, np.int8),
                          errors=errors or [], clean=True)
        else:
            terminated, truncated = (flags & TERMINATED) != 0, (flags & TRUNCATED) != 0
            boot = (truncated & ~terminated).nonzero()[0]
            block = Block(ids, index(self.obs, ids), self.reward[ids], terminated, truncated, (flags & NONFINITE) == 0,
                          np.where(flags & SUCCESS_KNOWN, (flags & SUCCESS) != 0, -1).astype(np.int8),
                          {int(r): tree_map(np.copy, index(self.final_obs, int(ids[r]))) for r in boot}, errors or [])
        for name, column in self._chunk:
            setattr(block, name, column[ids])
        return block

    def close(self) -> None:
        """Drop every array: a live view or export would keep a shared-memory block from closing."""
        if self._cost_flat is not None:  # closed twice: nothing left
            self._cost_flat.release()
        for name in vars(self):
            setattr(self, name, None)


def shm_alloc(blocks: list[shared_memory.SharedMemory], names: list[str] | None = None):
    """An ``alloc`` for :class:`StepRows`: a new shared-memory block per array, or the next of
    ``names`` (a worker: same spaces, same call order, so the same sequence)."""

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


class Outbox:
    """Finished blocks on their way to :meth:`SimPool.recv`, in order; a waiting reader costs one
    future a wake-up, not one an env step.

        >>> async def demo():
        ...     box = Outbox()
        ...     box.put("block 1")            # a host puts blocks as steps finish ...
        ...     first = await box.get()       # ... the driver takes them in order
        ...     box.close()
        ...     try:
        ...         await box.get()
        ...     except PoolClosed as exc:
        ...         return first, str(exc)
        >>> asyncio.run(demo())
        ('block 1', 'the sim pool was closed')
    """

    __slots__ = ("blocks", "waiter", "closed")

    def __init__(self):
        self.blocks: deque[Block] = deque()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def put(self, block: Block) -> None:
        self.blocks.append(block)
        self._wake()

    async def get(self) -> Block:
        while not self.blocks:
            if self.closed:
                raise PoolClosed("the sim pool was closed")
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.blocks.popleft()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
