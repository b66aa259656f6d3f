"""The w8a8_fp8 scheme (E4M3 weights per channel, dynamic E4M3 activations per token) and its
kernel: torch._scaled_mm on the codes and float32 scales quantize() makes, against the slow
reference (the activations quantized and dequantized, F.linear with the dequantized weight).

On this CPU, torch's _scaled_mm is its reference loop: auto picks dequant, and the FP8 kernel
runs only when asked for, which is how these tests reach the code that runs on FP8 GPUs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbits.quant import QuantLinear, get_scheme, quantize, quantize_model
from fewbits.quant.modules import available_kernels


def _layer(n=48, k=64, seed=0, bias=True, kernel="auto"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    return QuantLinear(quantize(w, get_scheme("w8a8_fp8")), b, kernel=kernel)


def test_the_scheme_reads_as_what_it_is():
    s = get_scheme("w8a8_fp8")
    assert s.format.name == "fp8_e4m3" and s.granularity == "channel"
    assert s.activations.format.name == "fp8_e4m3" and s.activations.axis == 0
    assert "activations fp8_e4m3 dynamic per token" in s.describe()


def test_auto_keeps_dequant_on_a_cpu_and_offers_the_fp8_kernel_last():
    kernels = available_kernels("w8a8_fp8", (48, 64))
    assert kernels[0] == "dequant" and kernels[-1] == "w8a8_fp8"
    assert _layer().kernel == "dequant"
    # int8 w8a8 is not an FP8 scheme
    assert "w8a8_fp8" not in available_kernels("w8a8", (48, 64))


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("bias", [True, False])
def test_the_fp8_kernel_is_the_reference_up_to_float32_sums(rows, bias):
    layer = _layer(bias=bias, kernel="w8a8_fp8")
    assert layer.kernel == "w8a8_fp8"
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    x[0, :4] = torch.tensor([1e-3, -300.0, 0.0, 7.0])  # a wide row: its scale from the 300
    with torch.no_grad():
        got = layer(x)
        want = layer.reference_forward(x)
    assert got.shape == want.shape == (rows, 48) and got.dtype == torch.float32
    # _scaled_mm sums the exact E4M3 x E4M3 products and scales once; the reference sums
    # products of dequantized values (each rounded once in float32): a few float32 ulps of
    # the sum of |terms|
    xd = quantize(x, get_scheme("w8a8_fp8").activations).dequantize()
    wd = layer.qweight.dequantize()
    bound = 8 * 2.0 ** -24 * (xd.abs() @ wd.abs().t()) + 1e-30
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())


def test_dequant_kernel_equals_the_reference_exactly():
    layer = _layer()
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(layer(x), layer.reference_forward(x))


def test_state_round_trips_into_the_fp8_kernel():
    src = _layer(kernel="w8a8_fp8")
    dst = QuantLinear.empty("w8a8_fp8", (48, 64), torch.float32, bias=True)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(dst(x), src.reference_forward(x))  # dst picked dequant: exact
        again = QuantLinear(dst.qweight, dst.bias, kernel="w8a8_fp8")
        assert torch.equal(again(x), src(x))
    assert torch.equal(src.qweight.codes, dst.qweight.codes)


def test_a_model_quantized_to_w8a8_fp8_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(6, 32)
    with torch.no_grad():
        ref = model(x)
    qmodel = quantize_model(model, "w8a8_fp8")
    with torch.no_grad():
        out = qmodel(x)
    assert all(isinstance(m, QuantLinear) for m in (qmodel[0], qmodel[2]))
    rel = float((out - ref).norm() / ref.norm())
    assert rel < 0.08, rel  # E4M3 keeps 3 mantissa bits for weights and activations
