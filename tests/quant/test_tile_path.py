"""QuantLinear's tile path: a float32 batch of more than LUT4_MAX_BATCH rows that tile_batch sends to
the tiles (rows x in_features <= tile_limit()) on the CPU, for a weight-only layer held prepared for lut4.c (dequant kernel) or int8w.c
(int8pack), goes straight to its AMX tile call where the build has the tiles (forward() skips the
general path's Python, ~20 us of a 576 x 576 layer's ~50 us). It must give what the general path
gives, bit for bit, and step aside wherever that path does something else. Where the tiles are
not there (AMD machines) the direct call never runs and both paths are the general one."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fewbits.kernels import native
from fewbits.quant import lowbit_ops as ops
from fewbits.quant import modules as qm
from fewbits.quant.modules import QuantLinear

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="needs the native library")
TILES = LIB is not None and native.tiles(LIB) and ops.fast_bf16_matmul()
SCHEMES = ["nf4", "int4", "nvfp4", "mxfp4", "q4_0", "q4_1", "fp4", "int4_asym", "int8", "int8_tensor"]


def _layer(scheme: str, n: int = 96, k: int = 320, bias: bool = False, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear.from_linear(torch.nn.Linear(k, n, bias=bias), scheme)


def _calls(monkeypatch) -> list:
    """The names of the tile calls forward() makes itself."""
    seen = []
    real = native.library

    class Spy:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            if name in ("fb_lut4_tiles", "fb_int8w_tiles"):
                seen.append(name)
            return getattr(self._lib, name)

    monkeypatch.setattr(native, "library", lambda: None if real() is None else Spy(real()))
    return seen


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bias", [False, True])
def test_batches_equal_the_general_path(scheme, bias, monkeypatch):
    q = _layer(scheme, bias=bias)
    assert q._tiles is not None, q.kernel
    seen = _calls(monkeypatch)
    g = torch.Generator().manual_seed(1)
    for shape in [(qm.LUT4_MAX_BATCH + 1, 320), (3, 5, 320), (2, 2, 4, 320), (qm.tile_limit() // 320, 320)]:
        x = torch.randn(shape, generator=g)
        seen.clear()
        with torch.inference_mode():
            y = q(x)
            assert seen == ([q._tiles[0]] if TILES else [])
            want = q._forward_eager(x)
        assert y.shape == want.shape == (*shape[:-1], 96) and y.dtype == torch.float32
        assert torch.equal(y, want), (scheme, shape)


def test_the_general_path_where_the_tile_path_does_not_apply(monkeypatch):
    q = _layer("nf4", bias=True)
    seen = _calls(monkeypatch)
    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(qm.LUT4_MAX_BATCH, 320, generator=g),  # the fused matmul's rows
              torch.randn(qm.tile_limit() // 320 + 1, 320, generator=g),  # oneDNN's blocks
              torch.randn(16, 640, generator=g)[:, ::2],  # not contiguous
              torch.randn(16, 320, generator=g).half(), torch.randn(16, 320, generator=g).to(torch.bfloat16)):
        y = q(x)
        assert y.dtype == x.dtype
        assert torch.equal(y, q._forward_eager(x.contiguous()))
    assert seen == []
    x = torch.randn(16, 320, generator=g, requires_grad=True)
    q(x).sum().backward()  # autograd: the reference path
    assert x.grad is not None and seen == []
    with native.turned_off():  # the torch path (bf16 blocks where the CPU has bf16 products)
        x1 = torch.randn(16, 320, generator=g)
        torch.testing.assert_close(q(x1), q.reference_forward(x1), rtol=2e-2, atol=2e-2)
    assert seen == []


def test_kernels_without_the_tile_path():
    assert _layer("w8a8")._tiles is None
    assert _layer("w4a8")._tiles is None  # its batches quantize the activations first
    assert QuantLinear.from_linear(torch.nn.Linear(64, 32), "nf4", kernel="dequant_fp32")._tiles is None


def test_the_tile_path_follows_the_weight():
    a, b = _layer("nvfp4", seed=3), _layer("nvfp4", seed=4)
    x = torch.randn(20, 320)
    want = a(x)
    assert not torch.equal(b(x), want)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x), want)
    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert c._tiles is not None and c._tiles[1] != a._tiles[1]
        assert torch.equal(c(x), want)
    del a
    assert torch.equal(b(x), want)


@pytest.mark.skipif(not TILES, reason="this build has no AMX tiles")
@pytest.mark.parametrize("scheme", ["nf4", "nvfp4", "int4", "int8"])
def test_tile_batches_within_the_bf16_bound(scheme):
    """The tile path against the float64 product of bf16(x) and bf16(dequantize()) (int8: the codes,
    times the scales after): within the float32 summation bound."""
    q = _layer(scheme, n=70, k=320)
    x = torch.randn(33, 320)
    y = q(x)
    w = q.qweight.dequantize(torch.float32)
    xb = x.to(torch.bfloat16).double()
    if scheme == "int8":
        codes = q.qweight.codes.view(torch.int8).view(70, 320).double()
        s = q._prepared.scales_f32.double()
        ref, bound = (xb @ codes.t()) * s, 320 * 2.0 ** -24 * (xb.abs() @ codes.abs().t()) * s + 1e-30
        bound = bound + ref.abs() * 2.0 ** -24
    else:
        wb = w.to(torch.bfloat16).double()
        ref, bound = xb @ wb.t(), 320 * 2.0 ** -24 * (xb.abs() @ wb.abs().t())
    assert bool(((y.double() - ref).abs() <= bound).all())
