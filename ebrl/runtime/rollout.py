"""Rollout storage: segments of ``T`` steps in preallocated ``[slots, T]`` arrays, and the rules
that bound policy lag (docs/policy-lag.md).

Batch-first, as in rsl_rl: each field of the transition (:mod:`ebrl.runtime.fields`) is one
array ``[M, T, ...]`` of ``M`` segment slots, written a block of finished steps at a time with
one fancy-indexed assignment per field. The storage owns the whole transition, the step in
flight included: ``obs`` is each env's current observation, :meth:`RolloutQueue.begin` keeps
the behaviour data of its step in flight, and :meth:`RolloutQueue.record` stores both and
overwrites ``obs`` with the next observations. A segment's bootstrap observation is ``obs`` at
the moment it closes; with ``cut_at_episode_end`` a segment also closes at every episode end
and remembers the key of the episode it starts with (``Batch.group``, -1 mid-episode).
With ``stream`` (``segment_cut="stream"``, off-policy algorithms) an update is due once every
env could have recorded a step since the last (``num_envs`` steps), and takes everything
recorded, open segments cut there, without waiting for steps in flight: no lag bound.

Update ``u`` takes the ``S`` oldest closed segments and every segment holding a transition of
version ``<= u - max_lag``, cutting open ones and awaiting such a step still in flight: every
trained transition has lag ``<= max_lag`` and a slow env never holds an update back by more
than one step. An env may not open a segment while the queue is full (backpressure, never
dropping): ``(max_lag + 1) * S`` closed segments under ``async``, one per env under the
lockstep schedules. The learner is woken only by what can make an update due or unblock a take.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ebrl.runtime.fields import ENV, OBS, POLICY, RUN, Field
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunStats
from ebrl.spaces import index, part, tree_map, write

if TYPE_CHECKING:
    from ebrl.policies.base import ActResult
    from ebrl.runtime.sim.block import Block


def _grow(buf: Any, extra: int) -> Any:
    return tree_map(lambda a: np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)]), buf)


class RolloutQueue:
    """Slots, open segments per env, closed segments in order, and the rules that bound lag."""

    def __init__(self, num_envs: int, segment_len: int, batch_segments: int, max_lag: int,
                 stats: RunStats, fields: tuple[Field, ...], lockstep: bool = False, state: RunState | None = None,
                 cut_at_episode_end: bool = False, stream: bool = False):
        self.T = segment_len
        self.cut_at_episode_end = cut_at_episode_end
        self.stream = stream
        self.untaken = 0  # steps recorded since the last take (kept under stream)
        self.S = batch_segments
        self.max_lag = max_lag
        self.lockstep = lockstep
        self.stats = stats
        self.state = state if state is not None else RunState(budget=0, active=num_envs)
        self.state.watch(self._wake)  # envs parked, finished or stopped: an update may now be due
        self.num_envs = num_envs
        self.capacity = num_envs if lockstep else (max_lag + 1) * batch_segments  # closed segments
        self.schema = fields
        m = 2 * num_envs + self.capacity
        # [N] per env, the fields not from the block: its current observation, and the behaviour
        # data of its step in flight (from begin()); [M, T] per slot: every field, and
        # bootstrap_obs [M]. The policy's actions, stored as it gives them, from the first begin().
        self.held = {f.name: f.alloc((num_envs,)) for f in fields if f.source != ENV}
        self.store = {f.name: f.alloc((m, self.T)) for f in fields}
        obs = next(f for f in fields if f.source == OBS)
        self.obs, self.store["bootstrap_obs"] = self.held[obs.name], obs.alloc((m,))
        self._copies = self._outcome = self._acted = None  # what begin() and record() write (_bind)
        # per slot
        self.slot_env = np.full(m, -1, np.int64)
        self.slot_seq = np.zeros(m, np.int64)
        self.slot_n = np.zeros(m, np.int64)
        self.slot_min_version = np.zeros(m, np.int64)
        self.slot_group = np.full(m, -1, np.int64)  # the key of the episode the slot starts with, -1: mid-episode
        self.slot_final: list[dict[int, Any]] = [{} for _ in range(m)]  # t -> final obs (truncated steps)
        self.free: list[int] = list(range(m - 1, -1, -1))
        # per env
        self.open_slot = np.full(num_envs, -1, np.int64)
        self.closed: deque[int] = deque()
        self.closed_per_env = np.zeros(num_envs, np.int64)
        self.inflight = np.full(num_envs, -1, np.int64)  # version of an action being simulated, -1: none
        self.steps_per_env = np.zeros(num_envs, np.int64)
        self.episode_key = np.full(num_envs, -1, np.int64)  # the driver's: key of each env's current episode
        self.at_start = np.ones(num_envs, bool)  # the env's next recorded step is its episode's first
        self.finished = False
        self.on_space: Callable[[], None] | None = None  # the driver's: segments were taken, parked envs may go
        self._seq = 0
        self._changed = asyncio.Event()  # the learner's wake-up
        self._stale_limit: int | None = None  # set while take() waits for in-flight steps <= it

    # ---------------------------------------------------------------- env side

    def set_obs(self, ids: Any, obs: Any) -> None:
        """Envs ``ids`` start from ``obs`` (rows): after a reset."""
        write(self.obs, ids, obs)
        self.at_start[ids] = True

    def current_obs(self, ids: np.ndarray) -> Any:
        return index(self.obs, ids)

    def need_space(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` may not start their next step now (they would open a segment, and
        the queue is full)."""
        fresh = self.open_slot[ids] < 0
        if self.lockstep:
            return fresh & (self.closed_per_env[ids] > 0)
        return fresh if len(self.closed) >= self.capacity else np.zeros(len(ids), bool)

    def mark_inflight(self, ids: np.ndarray, version: int) -> None:
        self.inflight[ids] = version

    def _clear_inflight(self, ids: Any) -> bool:
        """Clear the in-flight marks of ``ids``; wake the learner if it waits for one of them."""
        limit = self._stale_limit
        was = None if limit is None else self.inflight[ids]  # None: the learner waits for no step
        self.inflight[ids] = -1
        if was is None or not ((was >= 0) & (was <= limit)).any():
            return False
        self._wake()
        return True

    def _wake(self) -> None:
        self.stats.learner_wakeups += 1
        self._changed.set()

    def _open(self, env_id: int, version: int) -> int:
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self._seq += 1
        self.slot_env[slot], self.slot_seq[slot], self.slot_n[slot] = env_id, self._seq, 0
        self.slot_min_version[slot] = version
        self.slot_group[slot] = self.episode_key[env_id] if self.at_start[env_id] else -1
        self.open_slot[env_id] = slot
        return slot

    def _grow(self) -> None:
        m = len(self.slot_env)
        extra = max(m, 1)
        self.slot_env = np.concatenate([self.slot_env, np.full(extra, -1, np.int64)])
        for name in ("slot_seq", "slot_n", "slot_min_version"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, np.int64)]))
        self.slot_group = np.concatenate([self.slot_group, np.full(extra, -1, np.int64)])
        self.slot_final += [{} for _ in range(extra)]
        self.free += list(range(m + extra - 1, m - 1, -1))
        self.store = {k: v if v is None else _grow(v, extra) for k, v in self.store.items()}
        if self._copies is not None:
            self._bind(None)

    def _bind(self, result: ActResult | None) -> None:
        """Allocate the fields the policy shapes as its first output (``result``) and list the
        arrays :meth:`begin` and :meth:`record` write: (slot storage, per-env rows) leaf by leaf."""
        for f in self.schema:
            if self.store[f.name] is None:
                like = getattr(result, f.attr)
                self.held[f.name] = f.alloc((self.num_envs,), like)
                self.store[f.name] = f.alloc((len(self.slot_env), self.T), like)
        self._copies = []
        for name, rows in self.held.items():
            tree_map(lambda a, b: self._copies.append((a, b)), self.store[name], rows)
        self._outcome = [(self.store[f.name], f.attr) for f in self.schema if f.source == ENV]
        self._acted = [(self.held[f.name], None if f.source == RUN else f.attr)
                       for f in self.schema if f.source in (POLICY, RUN)]

    def begin(self, ids: np.ndarray, result: ActResult, lo: int = 0, hi: int | None = None,
              version: int = 0) -> None:
        """Envs ``ids`` step with rows ``lo:hi`` of ``result`` (a batch's policy output), made by
        weights ``version``: kept until :meth:`record` stores their step."""
        if self._copies is None:
            self._bind(result)
        n = len(result.logprobs)
        hi = n if hi is None else hi
        for rows, attr in self._acted:  # the policy's output, and the version (RUN)
            write(rows, ids, version if attr is None else part(getattr(result, attr), lo, hi, n))

    def record(self, block: Block) -> None:
        """Store one finished step of each env of ``block`` (distinct ids, every row finite):
        the block's outcome (its fields of the schema; None: 0) with the observation acted on and
        the behaviour data :meth:`begin` kept; ``final_obs`` by row."""
        ids = block.ids
        slots = self.open_slot[ids]
        fresh = slots < 0
        if np.count_nonzero(fresh):  # a fifth of .any()'s cost on a block's few rows
            for k in fresh.nonzero()[0].tolist():
                slots[k] = self._open(int(ids[k]), int(self.held["versions"][ids[k]]))
        pos = self.slot_n[slots]
        where = (slots, pos)
        for buf, rows in self._copies:
            buf[where] = rows[ids]
        for buf, attr in self._outcome:
            value = getattr(block, attr)
            buf[where] = 0 if value is None else value
        for row, o in block.final_obs.items():
            self.slot_final[slots[row]][int(pos[row])] = o
        write(self.obs, ids, block.obs)
        pos += 1
        self.slot_n[slots] = pos
        self.steps_per_env[ids] += 1
        woke = self._clear_inflight(ids)
        full = pos >= self.T
        ended = block.terminated | block.truncated
        self.at_start[ids] = ended
        if self.cut_at_episode_end:
            full |= ended
        due_now = False  # under stream: this block makes an update due
        if self.stream:
            self.untaken += len(ids)
            due_now = self.untaken >= self.num_envs > self.untaken - len(ids)
        if np.count_nonzero(full):
            for k in full.nonzero()[0].tolist():
                self._close(int(ids[k]))
            due_now = True
        if due_now and not woke:
            self._wake()

    def drop_open(self, env_id: int, reason: str) -> int:
        """Drop env ``env_id``'s open segment (the env failed); returns the steps dropped."""
        slot = int(self.open_slot[env_id])
        self._clear_inflight(env_id)
        if slot < 0:
            return 0
        self.open_slot[env_id] = -1
        n = int(self.slot_n[slot])
        if self.stream:
            self.untaken -= n
        self.release([slot])
        self.stats.drop(reason, n)
        return n

    def _close(self, env_id: int) -> None:
        slot = int(self.open_slot[env_id])
        self.open_slot[env_id] = -1
        write(self.store["bootstrap_obs"], slot, index(self.obs, env_id))
        self.closed.append(slot)
        self.closed_per_env[env_id] += 1

    def finish(self) -> None:
        """No env will record again: the next take hands over everything."""
        self.finished = True
        self._wake()

    # ---------------------------------------------------------------- learner side

    def due(self) -> bool:
        """An update is due: ``S`` segments closed, every env parked on a full queue, the end,
        or a stop (the learner then ends without waiting for more)."""
        return (self.finished or len(self.closed) >= self.S or self.state.all_parked or self.state.stopping
                or (self.stream and self.untaken >= self.num_envs))

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the learner's wake-up fires (a segment closed, envs parked, the end) or
        ``timeout_s`` passes: how a data-parallel rank waits while it also watches its peers."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):  # the timeout is the usual way out: the caller looks again
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def wait_due(self) -> None:
        while not self.due():
            self._changed.clear()
            await self._changed.wait()

    async def take(self, update: int, joint: bool = False) -> list[int] | None:
        """Slots for update ``update`` (see module docstring), sorted by env and age, to
        :meth:`release` once collated; ``None`` once finished and empty, or on a stop while the
        update waits for steps in flight. ``joint``: a data-parallel update another rank may have
        asked for: no wait for this queue to fall due, and the list may be empty (the same lag rule
        otherwise, so a rank's segments are never cut shorter than on one process)."""
        if not joint:
            await self.wait_due()
        limit = update - self.max_lag  # transitions of versions <= limit are due now
        self._stale_limit = limit
        try:
            while not (self.finished or self.stream) and ((self.inflight >= 0) & (self.inflight <= limit)).any():
                if self.state.stopping and not joint:  # a stop: those steps may never come back (a hung env)
                    return None
                self._changed.clear()
                await self._changed.wait()
        finally:
            self._stale_limit = None
        open_envs = np.flatnonzero(self.open_slot >= 0).tolist()
        if self.finished or self.stream:
            for env_id in open_envs:
                self._close(env_id)
            taken = list(self.closed)
            self.closed.clear()
            self.untaken = 0
        else:
            taken = []
            for _ in range(len(self.closed)):
                slot = self.closed.popleft()
                if len(taken) < self.S or self.slot_min_version[slot] <= limit:
                    taken.append(slot)
                else:
                    self.closed.append(slot)  # keeps the order of the rest
            for env_id in open_envs:
                if self.slot_min_version[self.open_slot[env_id]] <= limit:
                    self._close(env_id)
                    taken.append(self.closed.pop())
        np.subtract.at(self.closed_per_env, self.slot_env[taken], 1)
        if self.on_space is not None:
            self.on_space()
        if not taken:
            if joint:
                return []
            if self.finished:
                return None
            raise RuntimeError("update fell due with nothing to take")  # parked envs imply closed segments
        taken.sort(key=lambda s: (self.slot_env[s], self.slot_seq[s]))  # deterministic batch layout
        return taken

    def release(self, slots: list[int]) -> None:
        """These slots are free again (the learner has its copy, or their env failed)."""
        for s in slots:
            self.slot_env[s] = -1
            self.slot_final[s] = {}
            self.free.append(s)

    def steps_in(self, slots: list[int]) -> int:
        return int(self.slot_n[slots].sum())

    def pending_steps(self) -> int:
        """Transitions recorded but not handed to the learner."""
        open_slots = self.open_slot[self.open_slot >= 0]
        return int(self.slot_n[list(self.closed)].sum() + self.slot_n[open_slots].sum())
