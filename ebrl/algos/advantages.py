"""Generalised advantage estimation on padded ``[S, T]`` segments (see :class:`ebrl.algos.Batch`).

Segments are left-aligned: step ``t`` of segment ``s`` is valid where ``mask[s, t]``. A segment is
a contiguous piece of one env's trajectory; it may contain several episode ends and may stop in
the middle of an episode (its tail is bootstrapped). All functions are vectorised over segments
and loop over time only.

Example::

    >>> import torch
    >>> from ebrl.algos.advantages import build_next_values, gae
    >>> values = torch.tensor([[1.0, 2.0, 0.0]]); mask = torch.tensor([[True, True, False]])
    >>> no = torch.zeros(1, 3, dtype=torch.bool)
    >>> nv = build_next_values(values, torch.tensor([3.0]), torch.zeros(0), torch.zeros(0, 2, dtype=torch.long), no, mask)
    >>> nv
    tensor([[2., 3., 0.]])
    >>> adv, ret = gae(torch.ones(1, 3), values, nv, no, no, mask, gamma=1.0, lam=1.0)
    >>> adv, ret
    (tensor([[4., 2., 0.]]), tensor([[5., 4., 0.]]))
"""

from __future__ import annotations

import torch
from torch import Tensor


def _last_valid(mask: Tensor) -> Tensor:
    """``[S, T]`` bool: ``t`` is valid and ``t + 1`` is not (or is past the end)."""
    after = torch.zeros_like(mask)
    after[:, :-1] = mask[:, 1:]
    return mask & ~after


def build_next_values(
    values: Tensor,
    bootstrap_values: Tensor,
    final_values: Tensor,
    final_index: Tensor,
    truncated: Tensor,
    mask: Tensor,
) -> Tensor:
    """``V`` of the state after each step, ``[S, T]``; 0 at invalid slots.

    Reference semantics, for every valid ``(s, t)``:

    * ``values[s, t + 1]`` when ``t + 1`` is valid in segment ``s``;
    * ``bootstrap_values[s]`` (``V(bootstrap_obs[s])``) when ``t`` is the segment's last valid step;
    * ``final_values[k]`` (``V(final_obs[k])``) when ``(s, t) == final_index[k]``: a step that ended an
      episode by time limit, whose stored successor is the next episode's first observation. This
      overrides both rules above.

    Terminated steps get whatever the rules give; ``gae`` multiplies it by ``1 - terminated``.

    ``truncated`` marks the steps that *must* have a final value: a valid truncated step without
    one, or a ``final_index`` pointing at an invalid slot, raises ``ValueError`` (silently using the
    next episode's first value would be a wrong bootstrap). Pass ``truncated & ~terminated`` if
    steps that both terminate and truncate come without a final observation.
    """
    nv = torch.zeros_like(values)
    nv[:, :-1] = values[:, 1:]
    nv = torch.where(_last_valid(mask), bootstrap_values.to(values.dtype).unsqueeze(1), nv)

    has_final = torch.zeros_like(mask)
    if final_index.numel():
        s, t = final_index[:, 0], final_index[:, 1]
        if not bool(mask[s, t].all()):
            raise ValueError("final_index points at a step outside the segment mask")
        nv[s, t] = final_values.to(values.dtype)
        has_final[s, t] = True
    missing = truncated & mask & ~has_final
    if bool(missing.any()):
        raise ValueError(
            f"truncated steps without a final value at (segment, step) "
            f"{missing.nonzero().tolist()[:5]}: every truncated step needs an entry in final_index"
        )
    return torch.where(mask, nv, torch.zeros_like(nv))


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    episode_end: Tensor,
    mask: Tensor,
    gamma: float | Tensor,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)``, both ``[S, T]`` with 0 at invalid slots.

    ``gamma`` is a float, or ``[S, T]`` per-step discounts (``gamma ** chunk_steps`` for action
    chunks, from :func:`chunk_discounting`).

    Reference semantics, for every valid ``(s, t)``::

        delta[t] = rewards[t] + gamma * next_values[t] * (1 - terminated[t]) - values[t]
        adv[t]   = delta[t]                                  if episode_end[t] or t is the last valid step
                 = delta[t] + gamma * lam * adv[t + 1]       otherwise
        ret[t]   = adv[t] + values[t]

    ``episode_end`` is ``terminated | truncated``: the recursion never crosses an episode
    boundary, and a truncated step still bootstraps through ``next_values`` (its final value).
    Invalid slots may hold anything (even NaN); they never reach a valid one.
    """
    terminated, episode_end, mask = terminated.bool(), episode_end.bool(), mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    next_v = torch.where(terminated, zero, next_values)
    delta = torch.where(mask, rewards + gamma * next_v - values, zero)
    # cont[s, t]: adv[t] includes adv[t + 1] (same episode, and t + 1 is valid).
    cont = mask & ~episode_end & ~_last_valid(mask)

    adv = torch.zeros_like(delta)
    last = torch.zeros_like(delta[:, 0])
    gl = gamma * lam
    per_step = isinstance(gl, Tensor)
    for t in reversed(range(delta.shape[1])):
        last = delta[:, t] + torch.where(cont[:, t], (gl[:, t] if per_step else gl) * last, zero)
        adv[:, t] = last
    returns = torch.where(mask, adv + values, zero)
    return adv, returns


def chunk_discounting(rewards: Tensor, chunk_rewards: Tensor, chunk_steps: Tensor,
                      gamma: float) -> tuple[Tensor, Tensor]:
    """``(rewards, discounts)``, both ``[S, T]``, for decisions that each ran an action chunk.

    A decision whose chunk took ``n = chunk_steps[s, t]`` env steps with rewards ``r_0..r_{n-1}``
    (``chunk_rewards[s, t, :n]``) earns ``sum_j gamma**j * r_j``, and the value after it is
    ``n`` steps away, so it is discounted by ``gamma**n`` (the semi-MDP view of a chunk).
    Where ``chunk_steps`` is 0 (no chunk reported) the decision is one step: ``rewards`` and
    ``gamma``. Pass ``discounts`` as :func:`gae`'s ``gamma``.

        >>> import torch
        >>> r, d = chunk_discounting(torch.tensor([[3.0, 5.0]]), torch.tensor([[[1.0, 2.0], [5.0, 0.0]]]),
        ...                          torch.tensor([[2, 1]]), gamma=0.5)
        >>> r, d
        (tensor([[2., 5.]]), tensor([[0.2500, 0.5000]]))
    """
    k = chunk_rewards.shape[-1]
    powers = gamma ** torch.arange(k, dtype=torch.float64, device=rewards.device)
    has = chunk_steps > 0
    inner = (chunk_rewards.double() * powers).sum(-1)
    out = torch.where(has, inner, rewards.double()).to(rewards.dtype)
    discounts = torch.where(has, torch.full_like(inner, gamma) ** chunk_steps.double(),
                            torch.full_like(inner, gamma))
    return out, discounts.to(rewards.dtype)
