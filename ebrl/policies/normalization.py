"""Dataset statistics applied to a feature, with LeRobot's modes and formulas.

A checkpoint trained on a dataset reads its state and writes its actions in normalised units:
:class:`FeatureNorm` maps env values there (:meth:`~FeatureNorm.normalize`) and back
(:meth:`~FeatureNorm.unnormalize`), exactly as LeRobot's ``NormalizerProcessorStep`` and
``UnnormalizerProcessorStep`` do (``lerobot/processor/normalize_processor.py``), ``eps = 1e-8``:

==============  ==========================================  ======================================
mode            normalize                                   unnormalize
==============  ==========================================  ======================================
``IDENTITY``    ``x``                                       ``x``
``MEAN_STD``    ``(x - mean) / (std + eps)``                ``x * std + mean``
``MIN_MAX``     ``2 (x - min) / d - 1``, ``d = max - min``  ``(x + 1) / 2 * d + min``
``QUANTILES``   ``2 (x - q01) / d - 1``, ``d = q99 - q01``  ``(x + 1) d / 2 + q01``
``QUANTILE10``  ``2 (x - q10) / d - 1``, ``d = q90 - q10``  ``(x + 1) d / 2 + q10``
==============  ==========================================  ======================================

(``d`` is ``eps`` where it is 0.) Statistics cover a feature's first ``n`` dims; longer inputs
(the model's padded dims) keep the rest as they are.

    >>> import torch
    >>> norm = FeatureNorm("MIN_MAX", {"min": torch.tensor([0.0, -2.0]), "max": torch.tensor([1.0, 2.0])})
    >>> norm.normalize(torch.tensor([[0.5, 2.0]]))
    tensor([[0., 1.]])
    >>> norm.unnormalize(torch.tensor([[0.0, 1.0]]))
    tensor([[0.5000, 2.0000]])
    >>> FeatureNorm("QUANTILES", {"mean": torch.zeros(2)})
    Traceback (most recent call last):
    ...
    ValueError: QUANTILES normalisation needs the statistics ['q01', 'q99'], got ['mean']
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import torch
from torch import Tensor, nn

EPS = 1e-8


class NormalizationMode(str, enum.Enum):
    """LeRobot's ``NormalizationMode`` (``lerobot/configs/types.py``), by value."""

    IDENTITY = "IDENTITY"
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    QUANTILE10 = "QUANTILE10"


# the statistics each mode reads: (offset, other)
STATS = {NormalizationMode.MEAN_STD: ("mean", "std"), NormalizationMode.MIN_MAX: ("min", "max"),
         NormalizationMode.QUANTILES: ("q01", "q99"), NormalizationMode.QUANTILE10: ("q10", "q90")}


class FeatureNorm(nn.Module):
    """One feature's normalisation: a mode and its statistics (buffers, not saved with the
    policy's weights: they come from the checkpoint's files each time it loads)."""

    def __init__(self, mode: str | NormalizationMode, stats: Mapping[str, Tensor] | None = None, eps: float = EPS):
        super().__init__()
        try:
            self.mode = NormalizationMode(mode.value if isinstance(mode, NormalizationMode) else str(mode))
        except ValueError:
            raise ValueError(f"normalisation mode {mode!r} is not one of "
                             f"{[m.value for m in NormalizationMode]}") from None
        self.eps = float(eps)
        stats = dict(stats or {})
        if self.mode is NormalizationMode.IDENTITY:
            return
        names = STATS[self.mode]
        if any(n not in stats for n in names):
            raise ValueError(f"{self.mode.value} normalisation needs the statistics {list(names)}, got {sorted(stats)}")
        lo, hi = (torch.as_tensor(stats[n], dtype=torch.float32).reshape(-1) for n in names)
        if lo.shape != hi.shape:
            raise ValueError(f"{self.mode.value} normalisation: {names[0]} has {lo.numel()} entries, "
                             f"{names[1]} {hi.numel()}")
        self.register_buffer("offset", lo, persistent=False)
        self.register_buffer("other", hi, persistent=False)

    @property
    def size(self) -> int | None:
        """How many leading dims the statistics cover (None: identity, any)."""
        return None if self.mode is NormalizationMode.IDENTITY else int(self.offset.numel())

    def stats(self) -> dict[str, Tensor]:
        """The statistics by LeRobot's names (``mean``/``std``, ``min``/``max``, ...)."""
        if self.mode is NormalizationMode.IDENTITY:
            return {}
        lo, hi = STATS[self.mode]
        return {lo: self.offset, hi: self.other}

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        n = min(x.shape[-1], self.offset.numel())
        return x[..., :n], x[..., n:], self.offset[:n].to(x.dtype), self.other[:n].to(x.dtype)

    def _span(self, lo: Tensor, hi: Tensor) -> Tensor:
        d = hi - lo
        return torch.where(d == 0, torch.tensor(self.eps, device=d.device, dtype=d.dtype), d)

    def normalize(self, x: Tensor) -> Tensor:
        """Env units -> the model's."""
        if self.mode is NormalizationMode.IDENTITY:
            return x
        head, rest, lo, hi = self._split(x)
        if self.mode is NormalizationMode.MEAN_STD:
            head = (head - lo) / (hi + self.eps)
        else:
            head = 2 * (head - lo) / self._span(lo, hi) - 1
        return torch.cat([head, rest], -1)

    def unnormalize(self, x: Tensor) -> Tensor:
        """The model's units -> env units."""
        if self.mode is NormalizationMode.IDENTITY:
            return x
        head, rest, lo, hi = self._split(x)
        if self.mode is NormalizationMode.MEAN_STD:
            head = head * hi + lo
        elif self.mode is NormalizationMode.MIN_MAX:
            head = (head + 1) / 2 * self._span(lo, hi) + lo
        else:
            head = (head + 1.0) * self._span(lo, hi) / 2.0 + lo
        return torch.cat([head, rest], -1)


__all__ = ["EPS", "FeatureNorm", "NormalizationMode"]
