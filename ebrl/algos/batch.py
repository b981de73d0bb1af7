"""The training batch the learner hands to an algorithm: segments padded to ``[S, T]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """``S`` segments, each a contiguous piece of one env's trajectory, left-aligned in ``T`` slots.

    Step ``t`` of segment ``s`` is valid where ``mask[s, t]``. Segments are cut at arbitrary
    points (a segment's end is not an episode end): the value after the last valid step is
    bootstrapped from ``bootstrap_obs[s]``. An episode that ended by time limit at step ``t``
    (``truncated[s, t]`` and not ``terminated[s, t]``: termination wins, as in gymnasium)
    bootstraps from ``final_obs[k]`` where ``final_index[k] == (s, t)``; the observation
    stored at ``t + 1`` is then the first of the next episode. ``mask`` is a bool tensor.
    """

    obs: torch.Tensor  # [S, T, *obs_shape]
    actions: torch.Tensor  # [S, T, *act_shape]; float32 for Box, int64 for Discrete
    logprobs: torch.Tensor  # [S, T] behaviour log-probs (of the policy version that acted)
    values: torch.Tensor  # [S, T] behaviour value estimates
    rewards: torch.Tensor  # [S, T] float32
    terminated: torch.Tensor  # [S, T] bool: episode ended in a terminal state at this step
    truncated: torch.Tensor  # [S, T] bool: episode ended by time limit at this step
    mask: torch.Tensor  # [S, T] bool: step is valid
    versions: torch.Tensor  # [S, T] int64: policy version that produced each action
    bootstrap_obs: torch.Tensor  # [S, *obs_shape]: observation after each segment's last valid step
    final_obs: torch.Tensor  # [K, *obs_shape]: terminal observations of truncated steps
    final_index: torch.Tensor  # [K, 2] int64: (segment, step) of each truncated step
    learner_version: int = 0  # version of the weights this update starts from
    # [S] int64, with RunConfig.segment_cut="episode" (one episode per segment, cut at its end):
    # the reset seed of the episode segment s starts with (envs of a reset group share it, so
    # equal keys mean episodes from the same start), or -1 where the segment does not start at
    # a reset (the rest of an episode longer than segment_len). None otherwise.
    group: torch.Tensor | None = None
    # action chunks (a policy acting K steps per decision, ebrl.envs.chunks.ActionChunk): the
    # per-step rewards inside each decision's chunk, [S, T, K] float32 zero-padded, and the
    # steps it took, [S, T] int64 (0 where the env reported none: one step with ``rewards``).
    # ``rewards`` is their sum; see :func:`ebrl.algos.advantages.chunk_discounting`. None for
    # other action spaces.
    chunk_rewards: torch.Tensor | None = None
    chunk_steps: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return int(self.mask.sum())

    @property
    def lags(self) -> torch.Tensor:
        """Policy lag of every valid step: learner version minus the acting version."""
        return self.learner_version - self.versions[self.mask]


def _pad_steps(x: torch.Tensor, T: int) -> torch.Tensor:
    """``x [S, t, ...]`` padded with zeros to ``[S, T, ...]``."""
    if x.shape[1] == T:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], T - x.shape[1], *x.shape[2:]))], 1)


def select_segments(batch: Batch, keep: torch.Tensor) -> Batch:
    """The segments ``keep`` (``[S]`` bool) of ``batch``, as a batch of their own (truncation
    observations renumbered; the learner version is ``batch``'s)."""
    from ebrl.spaces import tree_map

    keep = keep.bool()
    new_index = torch.cumsum(keep.long(), 0) - 1  # old segment -> new
    rows = keep[batch.final_index[:, 0]] if batch.final_index.numel() else keep[:0]
    final_index = batch.final_index[rows].clone()
    if final_index.numel():
        final_index[:, 0] = new_index[final_index[:, 0]]

    def seg(x):
        return None if x is None else x[keep]

    return Batch(obs=tree_map(seg, batch.obs), actions=seg(batch.actions), logprobs=seg(batch.logprobs),
                 values=seg(batch.values), rewards=seg(batch.rewards), terminated=seg(batch.terminated),
                 truncated=seg(batch.truncated), mask=seg(batch.mask), versions=seg(batch.versions),
                 bootstrap_obs=tree_map(seg, batch.bootstrap_obs), final_obs=tree_map(lambda x: x[rows], batch.final_obs),
                 final_index=final_index, learner_version=batch.learner_version, group=seg(batch.group),
                 chunk_rewards=seg(batch.chunk_rewards), chunk_steps=seg(batch.chunk_steps))


def concat_segments(batches: list[Batch]) -> Batch:
    """One batch of every segment of ``batches`` (padded to the longest ``T``), with the last
    batch's learner version. ``group`` and the chunk fields must be set in all or none."""
    from ebrl.spaces import tree_map

    if len(batches) == 1:
        return batches[0]
    T = max(b.mask.shape[1] for b in batches)
    offsets = torch.tensor([0] + [b.mask.shape[0] for b in batches[:-1]]).cumsum(0)
    final_index = torch.cat([b.final_index + torch.tensor([int(o), 0]) for b, o in zip(batches, offsets)])

    def steps(name):
        xs = [getattr(b, name) for b in batches]
        return None if xs[0] is None else tree_map(lambda *ys: torch.cat([_pad_steps(y, T) for y in ys]), *xs)

    def segs(name):
        xs = [getattr(b, name) for b in batches]
        return None if xs[0] is None else tree_map(lambda *ys: torch.cat(ys), *xs)

    return Batch(obs=steps("obs"), actions=steps("actions"), logprobs=steps("logprobs"), values=steps("values"),
                 rewards=steps("rewards"), terminated=steps("terminated"), truncated=steps("truncated"),
                 mask=steps("mask"), versions=steps("versions"), bootstrap_obs=segs("bootstrap_obs"),
                 final_obs=segs("final_obs"), final_index=final_index, learner_version=batches[-1].learner_version,
                 group=segs("group"), chunk_rewards=steps("chunk_rewards"), chunk_steps=steps("chunk_steps"))
