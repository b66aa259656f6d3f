"""introw.c (GGUF's Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K as fewbits holds them, read as stored)
against the obviously-correct arithmetic, in three builds: the library fewbits loads (-march=native:
AVX-512 VBMI where the CPU has it), x86-64-v3 (AVX2 and BMI2: the parameters' fast path, the
matmul's scalar loop) and baseline x86-64 (scalar C). Every build must give:
- decode: QuantizedTensor.dequantize()'s float32 weights bit for bit (plain and two-level scales,
  float minimums, rows that end inside a super-block);
- the matmul (1 to 9 rows of x, x narrower than the rows): within float32 summation error of the
  float64 product of x with those weights; a non-finite scale's inf / NaN products where the
  decoded weights put them, and none from the padding columns past x.
"""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native
from fewbits.quant.linear_kernels.dequant import DequantWeight, introw_shape
from fewbits.quant.tensor import quantize
from helpers import build_c_source

SRC = native.SOURCE_DIR / "introw.c"
SCHEMES = ["q8_0", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1"]
SHAPES = [(70, 576), (33, 512), (5, 800), (3, 32)]  # 576, 800: rows ending inside a super-block of 256


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64"])
def lib(request, tmp_path_factory):
    return build_c_source(SRC, request.param, tmp_path_factory.mktemp(request.param), native.declare_introw, ())


def _weight(scheme: str, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n * k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    qt = quantize(w, scheme)
    assert introw_shape(qt.scheme, qt.shape)
    prepared = DequantWeight(qt, rows=True)
    iw = prepared.introw if prepared.introw is not None else _introw_of(prepared)
    return qt, iw


def _introw_of(prepared):
    from fewbits.quant.linear_kernels.rows import RowDecoder

    prepared.decoder = prepared.decoder or RowDecoder(prepared.qweight)
    return prepared.new_introw_weight()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 summation error of x @ w.T over k terms (k eps |x| @ |w|.T, with room)."""
    k = x.shape[1]
    return 2 * k * 2.0 ** -24 * (x.abs().double() @ w.abs().double().t()) + 1e-30


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_is_dequantize_bit_for_bit(lib, scheme, n, k):
    qt, iw = _weight(scheme, n, k)
    want = qt.dequantize(torch.float32)
    got = iw.decode(lib, 0, n)[:, :k]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    part = iw.decode(lib, 1, min(n, 3))[:, :k]
    assert torch.equal(part.view(torch.int32), want[1:min(n, 3)].view(torch.int32))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matmul_is_the_product_with_the_decoded_weight(lib, scheme, n, k):
    qt, iw = _weight(scheme, n, k, seed=1)
    w = qt.dequantize(torch.float32)
    g = torch.Generator().manual_seed(7)
    for m in (1, 3, 9):  # one row (the decoder's), a few, more than one pass of 8
        for kx in sorted({k, max(1, k - 5), 1}):
            x = torch.randn(m, kx, generator=g)
            y = iw.matmul(lib, x)
            ref = x.double() @ w[:, :kx].double().t()
            assert bool(((y.double() - ref).abs() <= _bound(x, w[:, :kx])).all()), (m, kx)
    assert iw.matmul(lib, torch.zeros(1, k)).abs().sum() == 0


def test_one_row_call_is_the_matmul_bit_for_bit():
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    import ctypes

    _, iw = _weight("q4_k", 67, 512)  # more than the 64 rows from which rows are shared out over threads
    for kx in (512, 500):
        x = torch.randn(1, kx, generator=torch.Generator().manual_seed(kx))
        y = torch.empty(67)
        addr = iw.row_call(kx)
        native.introw_rc(lib.fb_introw_row(ctypes.c_void_p(addr), x.data_ptr(), y.data_ptr()))
        assert torch.equal(y, iw.matmul(lib, x)[0])


@pytest.mark.parametrize("scheme", ["q5_0", "q4_k"])
def test_a_nonfinite_scale_gives_the_decoded_weights_inf_and_nan(lib, scheme):
    """A group whose (fp16) scale is inf: its decoded weights are +-inf (a zero code: NaN), and so
    are their products; the padding columns past x stay out of the sum."""
    qt, _ = _weight(scheme, 4, 512)
    key = "scales" if scheme == "q5_0" else "super_scales"
    t = getattr(qt, key).clone()
    t.view(-1)[0] = float("inf")
    setattr(qt, key, t)
    iw = _introw_of(DequantWeight(qt, rows=False))
    w = qt.dequantize(torch.float32)
    assert not bool(torch.isfinite(w[0]).all())
    assert torch.equal(iw.decode(lib, 0, 4).view(torch.int32), w.view(torch.int32))
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3))
    y = iw.matmul(lib, x)[0]
    ref = (x.double() @ w.double().t())[0]
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and bool((y[1:] - ref[1:]).abs().max() < 1e-3)
    if not torch.isnan(ref[0]):
        assert y[0] == ref[0]
    # x past the first 16 columns only: row 0's infinite weights there multiply x, none of padding
    xs = torch.randn(1, 20, generator=torch.Generator().manual_seed(4))
    ys = iw.matmul(lib, xs)[0]
    refs = (xs.double() @ w[:, :20].double().t())[0]
    assert torch.equal(torch.isnan(ys), torch.isnan(refs))


def test_bad_arguments_are_refused(lib):
    qt, iw = _weight("q5_0", 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        iw.matmul(lib, torch.zeros(1, 65))
    with pytest.raises(ValueError, match="kx"):
        iw.row_call(65)
    with pytest.raises(ValueError, match="rows"):
        iw.decode(lib, 2, 5)
    with pytest.raises(ValueError, match="groups of a multiple of 16"):
        native.IntRowWeight(qt.codes, 5, True, 4, 64, 24, qt.scales)
    with pytest.raises(ValueError, match="codes"):
        native.IntRowWeight(qt.codes[:10], 5, True, 4, 64, 32, qt.scales)
    with pytest.raises(ValueError, match="scales needs"):
        native.IntRowWeight(qt.codes, 5, True, 4, 64, 32, qt.scales[:1, :1])
    with pytest.raises(ValueError, match="n must be"):
        native.IntRowWeight(qt.codes, 5, True, -4, 64, 32, qt.scales)
    with pytest.raises(ValueError, match="per_super"):
        native.TwoLevel(qt.codes, 6, False, qt.scales, 0)
    empty = native.IntRowWeight(qt.codes[:0], 5, True, 0, 64, 32, qt.scales[:0])
    assert empty.matmul(lib, torch.ones(2, 64)).shape == (2, 0) and empty.decode(lib, 0, 0).shape == (0, 64)


def test_each_build_says_whether_it_unpacks_16_codes_a_step(lib, request):
    """The AVX-512 VBMI loop where the build's target has it (the native build on a CPU with
    AVX512-VBMI, BW and VL: Zen 4, Ice Lake and later Xeons), the scalar loop elsewhere."""
    build = request.node.callspec.params["lib"]
    vbmi = {"avx512f", "avx512bw", "avx512vl", "avx512vbmi"} <= native.cpu_flags()
    assert native.introw_vector(lib) == (build == "native" and vbmi)
