"""The attention pieces SmolVLA defines for itself rather than taking from transformers.

LeRobot's SmolVLA (``lerobot/policies/smolvla/smolvlm_with_expert.py`` and ``modeling_smolvla.py``)
runs the SmolVLM text layers and its action expert through its own attention, not the layers'
``forward``: rotary embeddings with a wavelength of 10 000 whatever the text config's
``rope_theta`` says, eager attention with float32 logits and ``finfo.min`` at masked keys, and
masks built from big_vision's ``att_masks`` cumulative-sum rule. These functions are those
definitions, written for EBRL; the tests check each against a direct computation.

    >>> import torch
    >>> pad = torch.tensor([[True, True, True, False]])
    >>> make_att_2d_masks(pad, torch.tensor([[0, 0, 1, 1]])).int()  # a block of two, then one more
    tensor([[[1, 1, 0, 0],
             [1, 1, 0, 0],
             [1, 1, 1, 0],
             [0, 0, 0, 0]]], dtype=torch.int32)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ROPE_WAVELENGTH = 10_000  # LeRobot's apply_rope default, which SmolVLA never overrides


def make_att_2d_masks(pad_masks: Tensor, att_masks: Tensor) -> Tensor:
    """``[B, N, N]`` booleans, query by key: a token sees the valid tokens whose cumulative
    ``att_masks`` is at most its own (``att_masks`` 1 opens a new block that earlier tokens
    cannot see; 0 joins the previous block)."""
    if att_masks.ndim != 2 or pad_masks.ndim != 2:
        raise ValueError(f"pad_masks and att_masks must be [B, N], got {tuple(pad_masks.shape)} and "
                         f"{tuple(att_masks.shape)}")
    cumsum = torch.cumsum(att_masks, dim=1)
    blocks = cumsum[:, None, :] <= cumsum[:, :, None]
    valid = pad_masks[:, None, :] * pad_masks[:, :, None]
    return blocks & valid


def rope(x: Tensor, positions: Tensor, max_wavelength: float = ROPE_WAVELENGTH) -> Tensor:
    """Rotary embedding of ``x`` ``[B, L, H, D]`` at ``positions`` ``[B, L]``, computed in float32:
    the first and second halves of the head dim rotate as pairs (not interleaved)."""
    half = x.shape[-1] // 2
    dtype = x.dtype
    x = x.to(torch.float32)
    exponents = (2.0 / x.shape[-1]) * torch.arange(half, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**exponents
    radians = positions[..., None].to(torch.float32) / timescale[None, None, :]
    radians = radians[..., None, :]  # broadcast over heads
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale_dim: int) -> Tensor:
    """Grouped-query attention, ``[B, Lq, H, D]`` queries over ``[B, Lk, Hkv, D]`` keys and values
    (query head ``h`` reads key/value head ``h // (H / Hkv)``), ``mask`` ``[B, Lq, Lk]`` True where
    a query sees a key. Logits in float32 scaled by ``scale_dim ** -0.5`` (SmolVLA passes the VLM's
    head dim), ``finfo(float32).min`` where masked (a row with no visible key averages them all, as
    LeRobot's does). Returns ``[B, Lq, H * D]`` in ``value``'s dtype."""
    batch, _, heads, head_dim = query.shape
    groups = heads // key.shape[2]
    key = key.repeat_interleave(groups, dim=2)
    value = value.repeat_interleave(groups, dim=2)
    q = query.to(torch.float32).transpose(1, 2)
    k = key.to(torch.float32).transpose(1, 2)
    logits = torch.matmul(q, k.transpose(2, 3)) * scale_dim**-0.5
    logits = torch.where(mask[:, None, :, :], logits, torch.finfo(torch.float32).min)
    probs = torch.softmax(logits, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value.transpose(1, 2))
    return out.transpose(1, 2).reshape(batch, -1, heads * head_dim)


def sinusoidal_time_embedding(time: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """``[B, dim]``: ``sin`` then ``cos`` of ``2 pi t / period`` for ``dim / 2`` periods spaced
    geometrically from ``min_period`` to ``max_period``, computed in float64 (float32 on MPS)."""
    if dim % 2:
        raise ValueError(f"the time embedding's dimension ({dim}) must be even")
    if time.ndim != 1:
        raise ValueError(f"time must be [B], got {tuple(time.shape)}")
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    scaling = 1.0 / period * 2 * math.pi
    angle = scaling[None, :] * time[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)


__all__ = ["ROPE_WAVELENGTH", "attention", "make_att_2d_masks", "rope", "sinusoidal_time_embedding"]
