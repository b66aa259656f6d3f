"""Quantized tensors against independent implementations: bitsandbytes' NF4 (codes, absmax and
dequantized values, both nibble orders) and torchao's MX casts in every scale mode and NVFP4.

Deliberate difference: bitsandbytes blocks the flattened tensor; fewbits groups along the last
axis per row, so the two agree whenever the last dimension is a multiple of the block size
(as it is for every Linear layer with blocks of 64).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fewbits as fb
from fewbits.quant import get_scheme, quantize


def _data(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x.view(-1)[:64] = 0.0                      # an all-zero block
    x.view(-1)[100] = 1e-30                    # a tiny value
    x.view(-1)[200] *= 1000.0                  # an outlier
    return x


@pytest.fixture(scope="module")
def bnbf():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("shape", [(64, 256), (3, 128), (1, 64 * 5)])
def test_nf4_equals_bitsandbytes(bnbf, shape):
    x = _data(shape, 0, 0.05)
    q = quantize(x, "nf4")
    packed, state = bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4")
    assert torch.equal(q.scales.reshape(-1), state.absmax)
    ours_high = fb.pack(q.element_codes().reshape(-1).to(torch.uint8), 4, order="high_first")
    assert torch.equal(ours_high, packed.reshape(-1))           # bitsandbytes' nibble order
    theirs_low = fb.pack(fb.unpack(packed.reshape(-1), 4, x.numel(), order="high_first"), 4, order="low_first")
    assert torch.equal(q.codes, theirs_low)                      # fewbits' (torch/ONNX) order
    assert torch.equal(q.dequantize(), bnbf.dequantize_4bit(packed, state))


@pytest.fixture(scope="module")
def mx():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        const = pytest.importorskip("torchao.prototype.mx_formats.constants")
    return mod, const


def _torchao_codes(data, dtype, n):
    if dtype == torch.float4_e2m1fn_x2:
        return fb.unpack(data.view(torch.uint8).reshape(-1), 4, n, order="low_first").to(torch.int64)
    return data.view(torch.uint8).reshape(-1).to(torch.int64)


@pytest.mark.parametrize("preset", ["mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e2m3", "mxfp4"])
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_mx_equals_torchao(mx, preset, mode):
    mod, const = mx
    dtype = {"mxfp8": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6": const.DTYPE_FP6_E3M2,
             "mxfp6_e2m3": const.DTYPE_FP6_E2M3, "mxfp4": torch.float4_e2m1fn_x2}[preset]
    x = _data((16, 256), 1, 3.0)
    s = get_scheme(preset).with_(mx_scale_mode=mode)
    q = quantize(x, s)
    scale, data = mod.to_mx(x, dtype, 32, getattr(mod.ScaleCalculationMode, mode.upper()))
    assert torch.equal(scale.view(torch.uint8).reshape(q.scales.shape), q.scales)
    assert torch.equal(_torchao_codes(data, dtype, x.numel()), q.element_codes().reshape(-1))


def test_nvfp4_equals_torchao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = _data((32, 256), 2, 2.0)
    q = quantize(x, "nvfp4")
    pts = nv.per_tensor_amax_to_scale(x.abs().amax())
    scale, data = nv.nvfp4_quantize(x, 16, pts)
    assert q.tensor_scale.item() == pts.item()
    assert torch.equal(scale.view(torch.uint8).reshape(q.scales.shape), q.scales)
    codes = fb.unpack(data.reshape(-1), 4, x.numel(), order="low_first").to(torch.int64)
    assert torch.equal(codes, q.element_codes().reshape(-1))
