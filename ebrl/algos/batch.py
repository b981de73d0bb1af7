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
