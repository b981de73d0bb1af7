"""bfloat16 / float16 weights on CPUs without low-precision matrix units.

A bf16 ``nn.Linear`` on a CPU without AVX512-BF16 or AMX runs 10-100x slower than in float32
(measured on an AVX2 EPYC: 15 GFLOP/s for bf16 ``F.linear``, 1 for bf16 ``matmul``, 80-140 for
float32). :func:`fast_low_precision_linears` keeps such weights in their dtype (the memory a bf16
checkpoint was chosen for) and computes each product in float32: the inputs are upcast, the sum
accumulates in float32 and the output is rounded back to the input's dtype, which is what a native
bf16 GEMM does too. The backward pass upcasts the saved bf16 weight again instead of keeping a
float32 copy alive, so gradient checkpointing and LoRA keep their memory.

>>> import torch
>>> layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
>>> converted = fast_low_precision_linears(layer, force=True)
>>> converted, type(layer).__name__, layer.weight.dtype
(1, 'Float32ComputeLinear', torch.bfloat16)
>>> layer(torch.ones(2, 4, dtype=torch.bfloat16)).dtype
torch.bfloat16
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Float32ComputeLinear", "cpu_has_low_precision_matmul", "fast_low_precision_linears"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def cpu_has_low_precision_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (x86: AVX512-BF16 or AMX; Arm: the BF16 extension)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: Apple silicon has bf16 units from M2 on; assume the fast path
        return platform.machine() in ("arm64", "aarch64")
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


class _Float32Product(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        dx = (g @ weight.float()).to(grad.dtype) if ctx.needs_input_grad[0] else None
        dw = db = None
        if ctx.needs_input_grad[1]:
            dw = (g.reshape(-1, g.shape[-1]).T @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, db


class Float32ComputeLinear(nn.Linear):
    """An ``nn.Linear`` whose low-precision weights multiply in float32 on the CPU (elsewhere: as usual)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or self.weight.dtype not in LOW_PRECISION:
            return super().forward(x)
        return _Float32Product.apply(x, self.weight, self.bias)


def fast_low_precision_linears(model: nn.Module, *, force: bool = False) -> int:
    """Make every bf16/fp16 ``nn.Linear`` in ``model`` a :class:`Float32ComputeLinear` where this CPU
    has no low-precision matrix units (``force``: whatever the CPU). Names, weights, state dicts and
    peft's wrapping stay as they were. Returns how many layers changed."""
    if not force and cpu_has_low_precision_matmul():
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in LOW_PRECISION:
            module.__class__ = Float32ComputeLinear
            changed += 1
    return changed
