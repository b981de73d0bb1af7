"""Off-policy transitions ``(obs, action, n-step reward, discount, next obs)`` from the runtime's
padded segments (:func:`batch_transitions`) and from demonstrations (:func:`demo_transitions`).

An n-step transition from step ``t`` sums the rewards of up to ``n`` decisions,
``R = r_t + d_t r_{t+1} + ... ``, where ``d_j`` is a decision's own discount (``gamma``, or
``gamma ** steps`` for an action chunk that ran ``steps`` env steps), and bootstraps from the
observation after the window's last step with ``discount`` = the product of the ``d_j``. The
window stops early:

- at a **termination**: ``discount`` is 0 (nothing after a terminal state);
- at a **truncation** (time limit): it bootstraps from that episode's final observation, not
  from the next episode's first one (the runtime's ``final_obs``);
- at the **end of the segment**: it bootstraps from ``bootstrap_obs`` (the observation after the
  segment's last step). The last ``n - 1`` steps of a segment so get shorter windows, which are
  correct targets too (a segment's next part arrives in a later batch).

    >>> import torch
    >>> from ebrl.algos.transitions import nstep_windows
    >>> r = torch.tensor([[1.0, 1.0, 1.0, 1.0]]); d = torch.full((1, 4), 0.5)
    >>> term = torch.tensor([[False, True, False, False]]); stop = torch.tensor([[False, False, False, True]])
    >>> ret, disc, last = nstep_windows(r, d, term, stop, torch.ones(1, 4, dtype=torch.bool), n=3)
    >>> ret.tolist(), disc.tolist(), last.tolist()
    ([[1.5, 1.0, 1.5, 1.0]], [[0.0, 0.0, 0.25, 0.5]], [[1, 1, 3, 3]])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ebrl.algos.advantages import _last_valid, chunk_discounting
from ebrl.algos.batch import Batch
from ebrl.spaces import tree_map


def nstep_windows(rewards: Tensor, discounts: Tensor, terminated: Tensor, stop: Tensor, mask: Tensor,
                  n: int) -> tuple[Tensor, Tensor, Tensor]:
    """For every valid ``(s, t)`` of ``[S, T]`` steps: ``(return, discount, last)``, the window's
    discounted reward sum, the discount onto its bootstrap (0 after a termination) and the step
    ``last`` whose successor observation it bootstraps from. A window covers at most ``n`` steps
    and ends at a step that ``terminated`` or that ``stop`` marks (a truncation, the segment's end).
    Invalid slots hold zeros (``last``: ``t``)."""
    S, T = rewards.shape
    terminated, stop, mask = terminated.bool(), stop.bool(), mask.bool()
    ret = torch.zeros(S, T, dtype=torch.float64)
    disc = torch.ones(S, T, dtype=torch.float64)
    last = torch.arange(T).expand(S, T).clone()
    running = mask.clone()
    for k in range(n):
        j = torch.arange(T) + k
        inside = j < T
        jc = j.clamp(max=T - 1)
        step = running & inside & mask[:, jc]
        ret = torch.where(step, ret + disc * rewards[:, jc].double(), ret)
        last = torch.where(step, j.expand(S, T), last)
        term = terminated[:, jc]
        disc = torch.where(step, disc * torch.where(term, 0.0, discounts[:, jc].double()), disc)
        running = step & ~term & ~stop[:, jc]
    disc = torch.where(mask, disc, torch.zeros_like(disc))
    return ret.float(), disc.float(), last


def batch_transitions(batch: Batch, gamma: float, n_step: int = 1) -> dict[str, Any]:
    """The batch's valid steps as n-step transitions (module docstring), on the CPU, in the
    batch's step order: ``obs``, ``actions``, ``rewards`` [N], ``discounts`` [N], ``next_obs``
    (observations as the batch holds them: tensors, or dicts of them with their dtypes)."""
    mask = batch.mask.bool().cpu()
    S, T = mask.shape
    rewards, discounts = batch.rewards.cpu(), torch.full((S, T), float(gamma))
    if batch.chunk_steps is not None:  # action chunks: discounted inside each chunk, and by its length
        rewards, discounts = chunk_discounting(rewards, batch.chunk_rewards.cpu(), batch.chunk_steps.cpu(), gamma)
    terminated, truncated = batch.terminated.bool().cpu(), batch.truncated.bool().cpu()
    ends = _last_valid(mask)
    ret, disc, last = nstep_windows(rewards, discounts, terminated, (truncated & ~terminated) | ends, mask, n_step)
    # each step's successor in one pool [obs (S * T) | bootstrap_obs (S) | final_obs (K)]
    succ = torch.arange(S * T).reshape(S, T) + 1
    succ = torch.where(ends, S * T + torch.arange(S)[:, None], succ)
    if batch.final_index.numel():
        s, t = batch.final_index[:, 0].cpu(), batch.final_index[:, 1].cpu()
        succ[s, t] = S * T + S + torch.arange(len(s))
    rows = mask.reshape(-1).nonzero().squeeze(1)
    nxt = succ.gather(1, last).reshape(-1)[rows]

    def pool(o, b, f):
        o, b, f = o.cpu(), b.cpu(), f.cpu()
        return torch.cat([o.reshape(S * T, *o.shape[2:]), b, f.to(o.dtype)])[nxt]

    return {"obs": tree_map(lambda o: o.cpu().reshape(S * T, *o.shape[2:])[rows], batch.obs),
            "actions": batch.actions.cpu().reshape(S * T, *batch.actions.shape[2:])[rows],
            "rewards": ret.reshape(-1)[rows], "discounts": disc.reshape(-1)[rows],
            "next_obs": tree_map(pool, batch.obs, batch.bootstrap_obs, batch.final_obs)}


def demo_transitions(demos, observation_space, action_shape: tuple[int, ...], gamma: float, n_step: int = 1,
                     time_limit: int | None = None) -> dict[str, Any]:
    """A dataset's frames (:class:`~ebrl.demos.Demos`, as :func:`~ebrl.demos.lerobot.read_lerobot`
    reads it) as n-step transitions for an env of ``observation_space`` acting with actions of
    ``action_shape`` (a chunk ``(K, A)`` of per-step frames: each frame's next ``K`` actions, its
    window ``n_step * K`` steps). A frame's successor is the episode's next frame. The dataset
    stores no observation after an episode's last frame, so that frame is a terminal step when
    its ``next.done`` is set and the episode ended before ``time_limit`` frames (LeRobot's own
    reading of ``next.done`` without a ``time_limit``), and is otherwise left out: a time limit or
    a cut recording has no successor to bootstrap from, and the frame before it bootstraps from its
    observation."""
    from ebrl.demos.features import ObsFeatures
    from ebrl.sft import demo_actions

    obs = ObsFeatures(observation_space).observations(demos.frames)
    actions = demo_actions(demos, tuple(action_shape))
    reward = np.asarray(demos.frames.get("next.reward", np.zeros(len(actions))), np.float32).reshape(-1)
    done = np.asarray(demos.frames.get("next.done", np.zeros(len(actions), bool))).reshape(-1).astype(bool)
    spans = [(lo, hi) for lo, hi in demos.episodes if hi > lo]
    E, L = len(spans), max((hi - lo for lo, hi in spans), default=1)
    rows = torch.zeros(E, L, dtype=torch.long)
    r, mask, term = torch.zeros(E, L), torch.zeros(E, L, dtype=torch.bool), torch.zeros(E, L, dtype=torch.bool)
    for e, (lo, hi) in enumerate(spans):
        terminal = bool(done[hi - 1]) and (time_limit is None or hi - lo < time_limit)
        use = hi - lo if terminal else hi - lo - 1
        rows[e, :hi - lo] = torch.arange(lo, hi)
        r[e, :hi - lo] = torch.from_numpy(reward[lo:hi])
        mask[e, :use] = True
        term[e, use - 1] = terminal and use > 0
    ends = _last_valid(mask)
    window = n_step * (action_shape[0] if len(action_shape) == 2 else 1)
    ret, disc, last = nstep_windows(r, torch.full((E, L), float(gamma)), term, ends, mask, window)
    valid = mask.reshape(-1).nonzero().squeeze(1)
    frame = rows.reshape(-1)[valid].numpy()
    # the successor frame of the window's last step (a terminal step's is never read: itself)
    nxt = (rows.gather(1, last) + (~term.gather(1, last)).long()).reshape(-1)[valid].numpy()
    return {"obs": tree_map(lambda a: torch.from_numpy(np.ascontiguousarray(a[frame])), obs),
            "actions": torch.from_numpy(actions[frame]), "rewards": ret.reshape(-1)[valid],
            "discounts": disc.reshape(-1)[valid],
            "next_obs": tree_map(lambda a: torch.from_numpy(np.ascontiguousarray(a[nxt])), obs)}
