"""bf16 weights computing in float32 on CPUs without bf16 units (ebrl.policies.precision)."""

import copy

import pytest
import torch
from torch import nn

from ebrl.policies.precision import Float32ComputeLinear, fast_low_precision_linears


def _pair(bias=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    native = nn.Sequential(nn.Linear(16, 32, bias=bias), nn.Tanh(), nn.Linear(32, 8, bias=bias)).to(dtype)
    converted = copy.deepcopy(native)
    assert fast_low_precision_linears(converted, force=True) == 2
    return native, converted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outputs_and_gradients_are_the_native_layers_up_to_rounding(dtype):
    native, converted = _pair(dtype=dtype)
    assert all(type(m) is Float32ComputeLinear for m in converted if isinstance(m, nn.Linear))
    assert converted.state_dict().keys() == native.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(converted.state_dict().values(), native.state_dict().values()))
    x = torch.randn(4, 5, 16).to(dtype).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    out, ref = converted(x), native(x2)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)  # both round once to dtype
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    for a, b in zip(converted.parameters(), native.parameters()):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(x.grad.float(), x2.grad.float(), rtol=0.05, atol=0.05)


def test_a_frozen_weight_is_saved_in_its_own_dtype_and_the_input_not_at_all():
    _, converted = _pair()
    converted.requires_grad_(False)
    x = torch.randn(4, 16).bfloat16().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        converted(x).float().sum().backward()
    big = [t for t in saved if t is not None and t.numel() >= 16 * 32]
    assert big and all(t.dtype == torch.bfloat16 for t in big)  # no float32 copy of a weight kept alive
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_lora_on_converted_layers_trains_the_adapter_only():
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(16, 16)

        def forward(self, x):
            return self.q_proj(x)

    model = Block().bfloat16()
    fast_low_precision_linears(model, force=True)
    base = model.q_proj.weight.detach().clone()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
    wrapped(torch.randn(3, 16).bfloat16()).float().sum().backward()
    opt.step()
    assert torch.equal(wrapped.base_model.model.q_proj.base_layer.weight, base)
    assert type(wrapped.base_model.model.q_proj.base_layer) is Float32ComputeLinear


def test_float32_layers_and_cpus_with_bf16_units_are_left_alone(monkeypatch):
    model = nn.Linear(4, 4)
    assert fast_low_precision_linears(model, force=True) == 0 and type(model) is nn.Linear
    import ebrl.policies.precision as precision

    monkeypatch.setattr(precision, "cpu_has_low_precision_matmul", lambda: True)
    assert fast_low_precision_linears(nn.Linear(4, 4).bfloat16()) == 0
