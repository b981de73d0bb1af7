"""What SAC's critics are made of: an ensemble of Q networks evaluated as one batched network, and
DrQ's random-shift augmentation of camera frames.

:class:`QEnsemble` holds ``members`` MLPs ``Q(features, action)`` as stacked weights, so ten
critics (RLPD's ensemble) cost one batched matrix product per layer, not ten; with
``layer_norm`` each hidden layer is ``Linear -> LayerNorm -> ReLU`` (RLPD's critics), else
``Linear -> ReLU``.

    >>> import torch
    >>> q = QEnsemble(5, hidden=(16, 16), members=3, layer_norm=True, generator=torch.Generator().manual_seed(0))
    >>> q(torch.zeros(4, 3), torch.zeros(4, 2)).shape  # [members, batch]
    torch.Size([3, 4])
    >>> x = torch.arange(2 * 6 * 6 * 1, dtype=torch.uint8).reshape(2, 6, 6, 1)
    >>> random_shift(x, pad=2, channels_first=False, generator=torch.Generator().manual_seed(0)).shape
    torch.Size([2, 6, 6, 1])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class EnsembleLinear(nn.Module):
    """``members`` linear layers ``[E, B, d_in] -> [E, B, d_out]``, each initialised as
    ``nn.Linear`` is (uniform in ``1 / sqrt(d_in)``), from ``generator``."""

    def __init__(self, members: int, d_in: int, d_out: int, generator: torch.Generator):
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)
        self.weight = nn.Parameter((torch.rand(members, d_in, d_out, generator=generator) * 2 - 1) * bound)
        self.bias = nn.Parameter((torch.rand(members, 1, d_out, generator=generator) * 2 - 1) * bound)

    def forward(self, x: Tensor) -> Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class QEnsemble(nn.Module):
    """``members`` Q networks on ``[features, action]`` (``in_dim`` numbers), ``hidden`` units each."""

    def __init__(self, in_dim: int, *, hidden: Sequence[int] = (256, 256), members: int = 2, layer_norm: bool = False,
                 generator: torch.Generator | None = None):
        super().__init__()
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        dims = [in_dim, *hidden]
        self.members = members
        self.layers = nn.ModuleList(EnsembleLinear(members, a, b, gen) for a, b in itertools.pairwise(dims))
        # LayerNorm's affine part, one per member
        self.norms = nn.ParameterList(
            [p for d in hidden for p in (nn.Parameter(torch.ones(members, 1, d)), nn.Parameter(torch.zeros(members, 1, d)))]
        ) if layer_norm else None
        self.out = EnsembleLinear(members, dims[-1], 1, gen)

    def forward(self, features: Tensor, actions: Tensor) -> Tensor:
        """``[members, B]`` Q-values of ``actions [B, ...]`` (flattened) in ``features [B, F]``."""
        x = torch.cat([features, actions.reshape(len(actions), -1).to(features.dtype)], -1)
        x = x.unsqueeze(0).expand(self.members, *x.shape)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.norms is not None:
                x = F.layer_norm(x, x.shape[-1:]) * self.norms[2 * i] + self.norms[2 * i + 1]
            x = torch.relu(x)
        return self.out(x).squeeze(-1)


def random_shift(x: Tensor, pad: int, channels_first: bool, generator: torch.Generator) -> Tensor:
    """DrQ's augmentation (Kostrikov et al. 2020): each frame of ``x`` ([N, H, W, C], or [N, C, H,
    W] with ``channels_first``) padded by ``pad`` pixels repeating its border, then cropped back
    to its size at a random offset. Done by clamped indexing, in the frames' own dtype."""
    if pad <= 0 or x.shape[0] == 0:
        return x
    frames = x if channels_first else x.permute(0, 3, 1, 2)
    n, _, h, w = frames.shape
    dy = torch.randint(0, 2 * pad + 1, (n, 1), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (n, 1), generator=generator).to(x.device)
    rows = (torch.arange(h, device=x.device) + dy - pad).clamp(0, h - 1)  # [N, H]
    cols = (torch.arange(w, device=x.device) + dx - pad).clamp(0, w - 1)  # [N, W]
    out = frames[torch.arange(n, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # [N, H, W, C]
    return out.permute(0, 3, 1, 2).contiguous() if channels_first else out.contiguous()


def augment_images(obs: Any, images: Sequence[Any], pad: int, generator: torch.Generator) -> Any:
    """``obs`` with every camera of ``images`` (a policy's :class:`~ebrl.policies.encoders.ObsEntry`
    images) randomly shifted (:func:`random_shift`); other entries as they are."""
    if pad <= 0 or not images:
        return obs
    for entry in images:
        shift = (lambda a, e=entry: random_shift(a, pad, e.channels_first, generator))
        if not entry.path:
            return shift(obs)
        obs = _replace(obs, entry.path, shift)
    return obs


def _replace(tree: Any, path: tuple[str, ...], fn) -> Any:
    """A copy of ``tree`` with the leaf at ``path`` (nested, or under the key ``"/".join(path)``) replaced by ``fn(leaf)``."""
    joined = "/".join(path)
    if joined in tree:
        return {**tree, joined: fn(tree[joined])}
    head = path[0]
    if len(path) == 1:
        return {**tree, head: fn(tree[head])}
    return {**tree, head: _replace(tree[head], path[1:], fn)}
