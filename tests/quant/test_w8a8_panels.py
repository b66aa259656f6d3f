"""The int8 panel kernels: w8a8_amx (AMX machines) and w8a8_vnni (AVX512-VNNI, tiles or not). The int8
weight is packed once into int8mm.c's AMX panels; one row runs VNNI dot products over them
(fb_amx_gemv_u8, called from forward() as one C call that also quantizes the row); batches run on
the int8 tiles (w8a8_amx: fb_amx_gemm_s8) or with the same VNNI dot products (w8a8_vnni:
fb_vnni_gemm_u8). The sums are exact int32, so every output must equal, bit for bit, the
obviously-correct arithmetic (float32(q_x @ q_w.T in int64) * s_x) * s_w (+ bias) with the
activations quantized by quantize_rows_int8 -- whether its row came alone or in a batch."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fewbits.kernels import int8 as kernels_int8
from fewbits.kernels import native
from fewbits.quant import modules as qm
from fewbits.quant.modules import QuantLinear, available_kernels

LIB = native.library()
READY = {"w8a8_amx": LIB is not None and native.amx_w8a8_ready(LIB),
         "w8a8_vnni": LIB is not None and native.vnni_w8a8_ready(LIB)}
pytestmark = pytest.mark.skipif(not any(READY.values()), reason="needs AVX512-VNNI (and AMX for w8a8_amx)")


@pytest.fixture(params=list(READY))
def kernel(request):
    if not READY[request.param]:
        pytest.skip(f"{request.param} does not run here")
    return request.param


def _layer(n: int, k: int, bias: bool = False, seed: int = 0, kernel: str = "w8a8_amx") -> QuantLinear:
    torch.manual_seed(seed)
    q = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=bias), "w8a8", kernel=kernel)
    assert q.kernel == kernel
    return q


def test_auto_picks_the_tiles_else_vnni():
    want = "w8a8_amx" if READY["w8a8_amx"] else "w8a8_vnni"
    assert QuantLinear.from_linear(torch.nn.Linear(64, 32), "w8a8").kernel == want


def _reference(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """(float32(exact sums) * s_x) * s_w (+ bias), each a float32 operation."""
    n, k = q.out_features, q.in_features
    qx, sx = kernels_int8.quantize_rows_int8(x, True)
    qw = q.qweight.codes.view(torch.int8).view(n, k)
    acc = qx.long() @ qw.long().t()
    y = acc.to(torch.float32) * sx.reshape(-1, 1)
    y = y * q.qweight.kernel_tensors["weight_scales"].reshape(1, -1)
    return y if q.bias is None else y + q.bias.detach()


@pytest.mark.parametrize("n,k", [(96, 320), (70, 100), (17, 64), (33, 1040), (48, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_and_batches_are_the_exact_sums_rescaled(kernel, n, k, bias):
    q = _layer(n, k, bias, kernel=kernel)
    g = torch.Generator().manual_seed(n + k)
    with torch.inference_mode():
        for m in (1, 2, 6, 13, 31, 32, 33, 65):
            x = torch.randn(m, k, generator=g) * 3
            y = q(x)
            assert torch.equal(y, _reference(q, x)), (m, n, k)
            if m > 1:  # each row alone (the one-row kernel) gives its bits within the batch
                for i in (0, m - 1):
                    assert torch.equal(q(x[i:i + 1]), y[i:i + 1])
            torch.testing.assert_close(y, q.reference_forward(x), rtol=1e-5, atol=1e-5)


def test_worst_case_sums_stay_exact(kernel):
    """Every code at its extreme: the largest sums the kernels can meet (127 * 128 * k)."""
    n, k = 40, 4096
    q = _layer(n, k, kernel=kernel)
    w = torch.full((n, k), -128, dtype=torch.int8)
    w[1::2] = 127
    codes = w.view(torch.uint8).reshape(-1)
    qt = q.qweight.plain()
    qt2 = type(qt).from_state_dict(qt.scheme, qt.shape, qt.dtype, {**qt.state_dict(), "codes": codes})
    q2 = QuantLinear(qt2, kernel=kernel)
    assert q2.kernel == kernel
    x = torch.ones(11, k)
    x[1] = -1.0
    with torch.inference_mode():
        assert torch.equal(q2(x), _reference(q2, x))
        assert torch.equal(q2(x[1:2]), _reference(q2, x[1:2]))


def test_the_one_row_call_is_the_general_path(kernel):
    q = _layer(96, 320, bias=True, kernel=kernel)
    assert q._row is not None and q._row[0] == "fb_w8a8_amx_row"
    x = torch.randn(1, 320)
    with torch.inference_mode():
        assert torch.equal(q(x), q._forward_eager(x))
        assert torch.equal(q(x.reshape(1, 1, 320)), q._forward_eager(x).reshape(1, 1, 96))
    bad = x.clone()
    bad[0, 3] = float("inf")
    with pytest.raises(ValueError, match=native.NONFINITE_ACTIVATIONS[:20]):
        q(bad)
    with pytest.raises(ValueError, match=native.NONFINITE_ACTIVATIONS[:20]):
        q._forward_eager(bad)
    with native.turned_off():  # the exact torch path
        torch.testing.assert_close(q(x), q.reference_forward(x), rtol=1e-5, atol=1e-5)


def test_the_panels_are_the_only_copy_and_follow_the_weight(kernel):
    a, b = _layer(64, 256, seed=1, kernel=kernel), _layer(64, 256, seed=2, kernel=kernel)
    x = torch.randn(5, 256)
    want = a(x)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x), want)
    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert c.kernel == kernel and torch.equal(c(x), want) and torch.equal(c(x[:1]), want[:1])
    assert a.qweight.codes_derived


@pytest.mark.parametrize("n,k", [(1, 1), (15, 63), (33, 65), (64, 128)])
def test_codes_come_back_from_the_panels(n, k):
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    p = native.Int8Panels(LIB, w)
    assert torch.equal(native.Int8Panels.codes(p.panels, n, k), w)
    assert torch.equal(p.colsum128, w.sum(1, dtype=torch.int32) * 128)


def test_rows_too_long_for_exact_sums_take_another_kernel(kernel):
    assert kernel in available_kernels("w8a8", (8, native.AMX_GEMV_MAX_K))
    assert kernel not in available_kernels("w8a8", (8, native.AMX_GEMV_MAX_K + 64))
    assert qm.KERNELS.index("w8a8_amx") < qm.KERNELS.index("w8a8_vnni") < qm.KERNELS.index("w8a8_onednn")


@pytest.mark.parametrize("m", [1, 2, 40])
def test_a_strided_bias_is_read_while_it_lives(kernel, m):
    q = _layer(40, 100, bias=True, kernel=kernel)
    q.bias = torch.nn.Parameter(torch.randn(80)[::2])  # float32, not contiguous
    x = torch.randn(m, 100)
    with torch.inference_mode():
        assert torch.equal(q._forward_eager(x), _reference(q, x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_float32_bias_is_added_before_the_one_rounding_to_x_dtype(kernel, dtype):
    q = _layer(96, 320, bias=True, kernel=kernel)
    x = (torch.randn(4, 320, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(q(x), _reference(q, x.float()).to(dtype))
        assert torch.equal(q(x[:1]), _reference(q, x[:1].float()).to(dtype))


def test_onednn_w8a8_takes_per_tensor_activations():
    """kernel="w8a8_onednn" with one activation scale per tensor: the scale applies to every row."""
    from fewbits.quant import get_scheme
    s = get_scheme("w8a8")
    s = s.with_(activations=s.activations.with_(granularity="tensor"))
    torch.manual_seed(4)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(5, 64)
    for kernel in ("w8a8_onednn", "w8a8_amx", "w8a8_vnni"):
        if kernel not in available_kernels(s, (32, 64)):
            continue
        q = QuantLinear.from_linear(lin, s, kernel=kernel)
        torch.testing.assert_close(q(x), q.reference_forward(x), rtol=1e-5, atol=1e-5)
