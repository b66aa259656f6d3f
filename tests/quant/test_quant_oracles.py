"""Quantized tensors against independent implementations: bitsandbytes' NF4 (codes, absmax and
dequantized values, both nibble orders) and torchao's MX casts in every scale mode and NVFP4.

NF4 codes are compared on random data and on the bucket bounds themselves (blocks built so that
x * (1 / absmax) lands on bitsandbytes' float32 midpoints): the nf4 presets round with mode
"bitsandbytes" (float32 midpoints, ties to the lower code), which exact rounding is not.

Deliberate differences: bitsandbytes blocks the flattened tensor; fewbits groups along the last
axis per row, so the two agree whenever the last dimension is a multiple of the block size
(as it is for every Linear layer with blocks of 64). A block whose absmax is below 1e-38 is
scaled by 1 / 1e-38 in bitsandbytes (its clamp) and by 1 / absmax in fewbits: not compared here.
"""
from __future__ import annotations

import math
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


def _bound_hitting_blocks(seed: int, n_absmax: int = 48) -> torch.Tensor:
    """Blocks of 64 whose scaled values land on bitsandbytes' NF4 bounds: per block an absmax a
    (log-uniform over 2^-30 .. 2^30, plus 1, 0.02 and powers of two; as element 0, either
    sign), then x = float32(y / r) and its float32 neighbours (2 each side) for every bound y,
    both signs, where r = float32(1 / a): so float32(x * r), the value bitsandbytes buckets,
    is y or next to it. [rows, 64] float32."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.exp2(torch.rand(n_absmax, generator=g, dtype=torch.float64) * 60 - 30).float()
    amax = torch.cat([amax, torch.tensor([1.0, 0.02, 2.0 ** -7, 2.0 ** 5])])
    bounds = torch.tensor(fb.get_format("nf4").bitsandbytes_bounds())
    y = torch.cat([bounds, -bounds])
    rows = []
    for i, a in enumerate(amax):
        x = (y / (1.0 / a)).float()
        up, down = [x], [x]
        for _ in range(2):
            up.append(torch.nextafter(up[-1], torch.full_like(x, math.inf)))
            down.append(torch.nextafter(down[-1], torch.full_like(x, -math.inf)))
        xs = torch.cat(up + down[1:])
        body = torch.zeros(-(-xs.numel() // 63) * 63)
        body[:xs.numel()] = xs
        body = body.reshape(-1, 63)
        first = torch.full((body.shape[0], 1), float(a) * (-1 if i % 2 else 1))
        rows.append(torch.cat([first, body], dim=1))
    return torch.cat(rows)


@pytest.mark.parametrize("preset", ["nf4", "nf4_dq"])
def test_nf4_equals_bitsandbytes_on_the_bounds_with_absmax_scaling(bnbf, preset):
    """The scaled case at the bucket bounds (the issue: 10 of NF4's 15 bounds gave another code):
    bitsandbytes scales each block of 64 by x * (1 / absmax) in float32 and buckets the result on
    float32 midpoints with ties to the lower code; the nf4 presets (mode "bitsandbytes") agree
    bit for bit, codes and absmax; exact rounding does not."""
    x = _bound_hitting_blocks(3)
    q = quantize(x, preset)
    packed, state = bnbf.quantize_4bit(x.reshape(-1), blocksize=64, quant_type="nf4",
                                       compress_statistics=preset == "nf4_dq")
    theirs = fb.unpack(packed.reshape(-1), 4, x.numel(), order="high_first").to(torch.int64)
    assert torch.equal(q.element_codes().reshape(-1), theirs)
    if preset == "nf4":
        assert torch.equal(q.scales.reshape(-1), state.absmax)
        assert torch.equal(q.dequantize().reshape(-1), bnbf.dequantize_4bit(packed, state).reshape(-1))
    # the data does sit on the bounds: many scaled values equal one, and exact rounding differs
    scaled = x * (1.0 / x.abs().amax(dim=1, keepdim=True))
    on_bound = torch.isin(scaled, torch.tensor(fb.get_format("nf4").bitsandbytes_bounds()))
    assert int(on_bound.sum()) > 500
    exact = quantize(x, get_scheme(preset).with_(mode="nearest_even")).element_codes().reshape(-1)
    assert int((exact != theirs).sum()) > 300


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
