"""Segments and the RolloutQueue between the envs and the learner.

Each env fills an open :class:`Segment` of up to ``T`` transitions, every one tagged with
the policy version that chose its action. A full segment closes and joins the queue.

Bounded policy lag without waiting on stragglers: update ``u`` trains at weights version
``u``, so a transition made by version ``v`` must be trained by update ``v + max_lag``.
When update ``u`` starts, :meth:`RolloutQueue.take` hands over the ``S`` oldest closed
segments and every segment holding a transition with version ``<= u - max_lag``; an open
segment in that state is *cut* (its completed prefix goes now, the env keeps stepping into
a fresh segment). A transition whose simulation is still running when it falls due is
awaited: one step, never a whole segment. Hence every trained transition has lag
``<= max_lag`` and a slow env never holds an update back by more than one step.

Backpressure, not dropping: an env may not start a new segment while the queue is full.
Under ``async`` the queue holds ``(max_lag + 1) * S`` closed segments, so fast envs run
ahead of slow ones; under the lockstep schedules each env holds at most one closed
segment, which makes an update wait for the whole rollout (their defining barrier).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import numpy as np

from ebrl.runtime.stats import RunStats
from ebrl.spaces import empty_like, index, stack, tree_map, write


class Segment:
    """Up to ``capacity`` consecutive transitions of one env, in preallocated arrays."""

    __slots__ = ("env_id", "seq", "capacity", "n", "obs", "actions", "logprobs", "values", "rewards",
                 "terminated", "truncated", "versions", "final_obs", "bootstrap_obs", "min_version")

    def __init__(self, env_id: int, seq: int, capacity: int):
        self.env_id, self.seq, self.capacity, self.n = env_id, seq, capacity, 0
        self.obs = self.actions = None
        self.logprobs = np.empty(capacity, np.float32)
        self.values = np.empty(capacity, np.float32)
        self.rewards = np.empty(capacity, np.float32)
        self.terminated = np.zeros(capacity, bool)
        self.truncated = np.zeros(capacity, bool)
        self.versions = np.empty(capacity, np.int64)
        self.final_obs: dict[int, Any] = {}
        self.bootstrap_obs: Any = None
        self.min_version: int | None = None

    def add(self, obs, action, logprob, value, version, reward, terminated, truncated, next_obs, final_obs) -> None:
        t = self.n
        if self.obs is None:
            self.obs = empty_like(obs, self.capacity)
            self.actions = empty_like(action, self.capacity)
            self.min_version = version
        write(self.obs, t, obs)
        write(self.actions, t, action)
        self.logprobs[t] = logprob
        self.values[t] = value
        self.versions[t] = version
        self.rewards[t] = reward
        self.terminated[t] = terminated
        self.truncated[t] = truncated
        if truncated and not terminated:  # a terminal state needs no bootstrap value
            self.final_obs[t] = final_obs
        self.bootstrap_obs = next_obs
        self.n = t + 1

    @property
    def full(self) -> bool:
        return self.n >= self.capacity


class RolloutQueue:
    """Open segments per env, closed segments in order, and the rules that bound lag."""

    def __init__(self, num_envs: int, segment_len: int, batch_segments: int, max_lag: int,
                 stats: RunStats, lockstep: bool = False):
        self.T = segment_len
        self.S = batch_segments
        self.max_lag = max_lag
        self.lockstep = lockstep
        self.stats = stats
        self.open: list[Segment | None] = [None] * num_envs
        self.closed: deque[Segment] = deque()
        self.closed_per_env = [0] * num_envs
        self.inflight: list[int | None] = [None] * num_envs  # version of an action being simulated
        self.steps_per_env = [0] * num_envs
        self.finished = False
        self.drivers = 0  # env tasks or lockstep groups still running; set by the schedule
        self.blocked = 0  # drivers waiting for queue space
        self._seq = 0
        # the learner's wake-up, set only by what can make an update due or unblock a take: a
        # segment closing, a driver blocking or ending, the run finishing, or a stale in-flight
        # step clearing (never by an ordinary record: that would wake it once per env step)
        self._changed = asyncio.Event()
        self._stale_limit: int | None = None  # set while take() waits for in-flight steps <= it
        self._space = asyncio.Event()  # the envs' wake-up: the learner took segments

    # ---------------------------------------------------------------- env side

    def can_start(self, env_id: int) -> bool:
        """May ``env_id`` start a new segment now? (Always true mid-segment.)"""
        seg = self.open[env_id]
        if seg is not None and seg.n:
            return True
        if self.lockstep:
            return self.closed_per_env[env_id] == 0
        return len(self.closed) < (self.max_lag + 1) * self.S

    async def wait_can_start(self, env_id: int) -> None:
        while not self.can_start(env_id):
            self._space.clear()
            await self._space.wait()

    def mark_inflight(self, env_id: int, version: int) -> None:
        self.inflight[env_id] = version

    def clear_inflight(self, env_id: int) -> None:
        self._clear_inflight(env_id)

    def _clear_inflight(self, env_id: int) -> bool:
        """Clear ``env_id``'s in-flight mark; wake the learner if it waits for exactly this step."""
        version, self.inflight[env_id] = self.inflight[env_id], None
        if version is not None and self._stale_limit is not None and version <= self._stale_limit:
            self._wake()
            return True
        return False

    def _wake(self) -> None:
        self.stats.learner_wakeups += 1
        self._changed.set()

    def record(self, env_id: int, obs, action, logprob, value, version, reward, terminated, truncated,
               next_obs, final_obs) -> None:
        seg = self.open[env_id]
        if seg is None:
            self._seq += 1
            seg = self.open[env_id] = Segment(env_id, self._seq, self.T)
        seg.add(obs, action, logprob, value, version, reward, terminated, truncated, next_obs, final_obs)
        self.steps_per_env[env_id] += 1
        if not self._clear_inflight(env_id) and seg.full:
            self._wake()
        if seg.full:
            self._close(env_id)

    def drop_open(self, env_id: int, reason: str) -> int:
        """Drop env ``env_id``'s open segment (the env failed); returns the steps dropped."""
        seg, self.open[env_id] = self.open[env_id], None
        self._clear_inflight(env_id)
        n = seg.n if seg is not None else 0
        self.stats.drop(reason, n)
        return n

    def _close(self, env_id: int) -> None:
        seg, self.open[env_id] = self.open[env_id], None
        self.closed.append(seg)
        self.closed_per_env[env_id] += 1

    def set_blocked(self, delta: int) -> None:
        self.blocked += delta
        if delta > 0:  # fewer blocked drivers never make an update due
            self._wake()

    def driver_done(self) -> None:
        self.drivers -= 1
        if self.drivers <= 0:
            self.finish()
        self._wake()

    def finish(self) -> None:
        """No env will record again: the next take hands over everything."""
        self.finished = True
        self._wake()

    # ---------------------------------------------------------------- learner side

    def _stale_inflight(self, limit: int) -> bool:
        return any(v is not None and v <= limit for v in self.inflight)

    def due(self) -> bool:
        """An update is due: ``S`` segments closed, every driver blocked on a full queue, or the end."""
        return (self.finished or len(self.closed) >= self.S
                or (self.blocked > 0 and self.blocked >= self.drivers))

    async def wait_due(self) -> None:
        while not self.due():
            self._changed.clear()
            await self._changed.wait()

    async def take(self, update: int) -> list[Segment] | None:
        """Segments for update ``update`` (see module docstring); ``None`` once finished and empty."""
        await self.wait_due()
        limit = update - self.max_lag  # transitions of versions <= limit are due now
        self._stale_limit = limit
        try:
            while not self.finished and self._stale_inflight(limit):
                self._changed.clear()
                await self._changed.wait()
        finally:
            self._stale_limit = None
        if self.finished:
            for env_id, seg in enumerate(self.open):
                if seg is not None and seg.n:
                    self._close(env_id)
            taken = list(self.closed)
            self.closed.clear()
        else:
            taken = []
            for _ in range(len(self.closed)):
                seg = self.closed.popleft()
                if len(taken) < self.S or seg.min_version <= limit:
                    taken.append(seg)
                else:
                    self.closed.append(seg)  # keeps the order of the rest
            for env_id, seg in enumerate(self.open):
                if seg is not None and seg.n and seg.min_version <= limit:
                    self._close(env_id)
                    taken.append(self.closed.pop())
        for seg in taken:
            self.closed_per_env[seg.env_id] -= 1
        self._space.set()
        if not taken:
            if self.finished:
                return None
            raise RuntimeError("update fell due with nothing to take")  # blocked drivers imply closed segments
        taken.sort(key=lambda s: (s.env_id, s.seq))  # deterministic batch layout
        return taken

    def pending_steps(self) -> int:
        """Transitions recorded but not handed to the learner."""
        return sum(s.n for s in self.closed) + sum(s.n for s in self.open if s is not None)


def collate(segments: list[Segment], learner_version: int):
    """Pad segments into a :class:`~ebrl.algos.batch.Batch` (left-aligned, masked)."""
    import torch

    from ebrl.algos.batch import Batch

    S, T = len(segments), max(s.n for s in segments)
    mask = np.zeros((S, T), bool)
    for i, s in enumerate(segments):
        mask[i, : s.n] = True

    def pad_leaf(*bufs, fill):  # one leaf of every segment's buffer: [capacity, ...] each
        out = np.full((S, T, *bufs[0].shape[1:]), fill, dtype=bufs[0].dtype)
        for i, (s, buf) in enumerate(zip(segments, bufs)):
            out[i, : s.n] = buf[: s.n]
        return torch.from_numpy(out)

    def pad(get, fill=0):
        return tree_map(lambda *bufs: pad_leaf(*bufs, fill=fill), *(get(s) for s in segments))

    def stack_torch(xs):
        return tree_map(torch.from_numpy, stack(xs))

    finals = [(i, t, o) for i, s in enumerate(segments) for t, o in sorted(s.final_obs.items())]
    boot = stack_torch([s.bootstrap_obs for s in segments])
    if finals:
        final_obs = stack_torch([o for _, _, o in finals])
        final_index = torch.tensor([(i, t) for i, t, _ in finals], dtype=torch.int64)
    else:
        final_obs = index(boot, slice(0, 0))
        final_index = torch.zeros((0, 2), dtype=torch.int64)
    return Batch(
        obs=pad(lambda s: s.obs),
        actions=pad(lambda s: s.actions),
        logprobs=pad(lambda s: s.logprobs),
        values=pad(lambda s: s.values),
        rewards=pad(lambda s: s.rewards),
        terminated=pad(lambda s: s.terminated, False),
        truncated=pad(lambda s: s.truncated, False),
        mask=torch.from_numpy(mask),
        versions=pad(lambda s: s.versions, learner_version),
        bootstrap_obs=boot,
        final_obs=final_obs,
        final_index=final_index,
        learner_version=learner_version,
    )
