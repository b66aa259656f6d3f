"""QuantLinear's one-row path: a single float32 row on the CPU, for a weight held prepared
for lut4.c (dequant kernel), w4a8.c (w4a8) or int8w.c (int8pack), goes straight to its C call
(forward() skips ~10 us of Python per call; compiled models' op too). It must give what the
general path gives, bit for bit, and step aside wherever that path does something else."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fewbits.kernels import native
from fewbits.quant.modules import QuantLinear

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library")

SCHEMES = ["nf4", "iq4_nl", "int4", "nvfp4", "mxfp4", "q4_0", "q4_1", "fp4", "w4a8", "int8", "int8_tensor"]


def _layer(scheme: str, n: int = 96, k: int = 320, bias: bool = False, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear.from_linear(torch.nn.Linear(k, n, bias=bias), scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_the_general_path(scheme, bias):
    q = _layer(scheme, bias=bias)
    assert q._row is not None, q.kernel
    g = torch.Generator().manual_seed(1)
    for shape in [(320,), (1, 320), (1, 1, 320), (1, 1, 1, 320)]:
        x = torch.randn(shape, generator=g)
        with torch.inference_mode():
            y = q(x)
            want = q._forward_eager(x)
        assert y.shape == want.shape == (*shape[:-1], 96)
        assert torch.equal(y, want), (scheme, shape)
        torch.testing.assert_close(y, q.reference_forward(x), rtol=1e-4, atol=1e-4)


def test_the_general_path_where_the_row_path_does_not_apply():
    q = _layer("nf4", bias=True)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(1, 640, generator=g)
    strided = wide[:, ::2]  # not contiguous
    assert torch.equal(q(strided), q._forward_eager(strided.contiguous()))
    half = torch.randn(1, 320, generator=g).half()
    assert q(half).dtype == torch.float16
    assert torch.equal(q(half), q._forward_eager(half))
    x = torch.randn(1, 320, generator=g, requires_grad=True)
    y = q(x)  # autograd: the reference path
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    two = torch.randn(2, 320, generator=g)
    assert torch.equal(q(two), q._forward_eager(two))
    with native.turned_off():  # the torch path: no C call
        x1 = torch.randn(1, 320, generator=g)
        torch.testing.assert_close(q(x1), q.reference_forward(x1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="in_features"):
        q(torch.randn(1, 321))


def test_the_row_path_follows_the_weight():
    a, b = _layer("nvfp4", seed=3), _layer("nvfp4", seed=4)
    x = torch.randn(1, 320)
    want = a(x)
    assert not torch.equal(b(x), want)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x), want)
    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert c._row is not None and c._row[1] != a._row[1]
        assert torch.equal(c(x), want)
    del a
    assert torch.equal(b(x), want)


def test_kernels_without_the_row_path():
    assert QuantLinear.from_linear(torch.nn.Linear(64, 32), "w8a8", kernel="dequant")._row is None
    assert QuantLinear.from_linear(torch.nn.Linear(64, 32), "nf4", kernel="dequant_fp32")._row is not None
    assert QuantLinear.from_linear(torch.nn.Linear(64, 32), "w4a8", kernel="dequant")._row is None  # activations


def test_w4a8_row_refuses_nonfinite_activations():
    q = _layer("w4a8")
    x = torch.randn(1, 320)
    x[0, 7] = float("nan")
    with pytest.raises(ValueError, match=native.NONFINITE_ACTIVATIONS[:20]):
        q(x)


@pytest.mark.parametrize("scheme", ["nf4", "w4a8", "int8"])
def test_one_row_under_another_default_dtype(scheme):
    q = _layer(scheme)
    x = torch.randn(1, 320)
    want = q._forward_eager(x)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # float64 only: a wider buffer, nothing written past it
    try:
        y = q(x)
    finally:
        torch.set_default_dtype(before)
    assert y.dtype == torch.float32 and torch.equal(y, want)


@pytest.mark.parametrize("scheme", ["nf4", "w4a8", "int8"])
def test_a_captured_row_call_keeps_its_weight_alive(scheme):
    import gc
    import weakref

    a, b = _layer(scheme, seed=5), _layer(scheme, seed=6)
    held = a._row[4]  # the prepared weight (Lut4Weight, W4A8Weight, Int8Weight)
    codes = weakref.ref(held._codes if hasattr(held, "_codes") else held._q)
    del held
    row = a._row  # what _row_forward holds during its C call
    a.load_state_dict({k: v.clone() for k, v in b.state_dict().items()})  # another thread, meanwhile
    gc.collect()
    assert row is not None and codes() is not None  # the codes row[1] points into are still there
