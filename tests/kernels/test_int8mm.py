"""int8mm.c (the AMX int8 GEMM of training's int8-mixed policy and its operand quantizers and
packers) against the torch reference, bit for bit, in three builds: the library fewbits loads
(-march=native: AMX tiles on CPUs with them), x86-64-v3 (AVX2: scalar quantizers, no tiles) and
baseline x86-64, as AMD and older machines build it.

- quantizing bfloat16 lines (rows, or the columns of memory of a transposed view, written out
  either way): kernels.int8.quantize_rows_int8(x.float(), nonfinite="keep")'s codes and scales,
  non-finite lines included (zero codes, a NaN / inf scale);
- packing B and B^T into AMX's VNNI panels: the same bytes, and the layout the docstring states;
- the GEMM (where AMX is there): int32 sums equal torch._int_mm's, the rescaled bfloat16 /
  float32 result equals kernels.int8.rescale's, for shapes that need padding, a transposed second
  operand, per-row / per-tensor factors and a bias; without AMX it says so and writes nothing.
"""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import int8, native
from helpers import build_c_source

SRC = native.SOURCE_DIR / "int8mm.c"
BUILDS = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(scope="module", params=BUILDS)
def lib(request, tmp_path_factory):
    # with rowquant.c, whose activation quantizer fb_w8a8_amx_row calls
    return build_c_source(SRC, request.param, tmp_path_factory.mktemp(request.param), native.declare_int8mm,
                          ("-fopenmp", str(SRC.with_name("rowquant.c"))))


def _bf16(shape, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).bfloat16()


def _same_scales(a, b) -> bool:
    """Equal float32 scales, NaN where the other is NaN (its payload and the sign of a zero
    scale carry no meaning: the codes of such a line are all zero either way)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _reference(x):
    return int8.quantize_rows_int8(x.float(), True, nonfinite="keep", backend="torch")


SHAPES = [(64, 512), (100, 130), (3, 7), (128, 16), (256, 96), (1, 5), (5, 1), (70, 64)]


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("layout", ["rows", "transposed view -> contiguous", "transposed view -> view"])
def test_quantized_lines_are_the_torch_reference(lib, m, k, layout):
    x = _bf16((m, k), m * 131 + k)
    x[0, 0] = 0.0
    if m > 2 and k > 2:
        x[1, 2] = float("inf")      # a line with an inf: zero codes, an infinite scale
        x[2, 1] = float("nan")      # with a NaN: zero codes, a NaN scale
        x[-1] = 0.0                 # an all-zero line: scale 0, codes 0
    if layout != "rows":
        x = x.t().contiguous().t()  # the same values, columns contiguous in memory
    q, s = native.q8_bf16(lib, x, contiguous=layout != "transposed view -> view")
    want_q, want_s = _reference(x)
    assert q.shape == want_q.shape and torch.equal(q, want_q)
    assert _same_scales(s, want_s)
    if layout != "transposed view -> view":
        assert q.is_contiguous()


def test_extreme_values_round_as_the_reference(lib):
    """Ties, the largest bfloat16, subnormals and a line whose scale is subnormal."""
    vals = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, 3.3895e38, -3.3895e38, 1e-40, -1e-39, 0.0, 63.5],
                        dtype=torch.float32)
    x = torch.stack([vals, vals * 1e-38, torch.full_like(vals, 1e-41), vals.flip(0)]).bfloat16()
    q, s = native.q8_bf16(lib, x)
    want_q, want_s = _reference(x)
    assert torch.equal(q, want_q) and _same_scales(s, want_s)


def _pack_reference(b: torch.Tensor) -> torch.Tensor:
    """The docstring's layout, element by element: panel (nb, kb), row r, byte 4c + j =
    B[16 nb + c][64 kb + 4 r + j], zero outside B, whole 32-column blocks."""
    n, k = b.shape
    npanels, kblocks = -(-n // 32) * 2, -(-k // 64)
    padded = torch.zeros(npanels * 16, kblocks * 64, dtype=torch.int8)
    padded[:n, :k] = b
    # [nb, c, kb, r, j] -> [nb, kb, r, c, j]
    return padded.reshape(npanels, 16, kblocks, 16, 4).permute(0, 2, 3, 1, 4).reshape(-1)


@pytest.mark.parametrize("n,k", [(32, 64), (48, 100), (17, 64), (64, 256), (1, 3), (96, 200)])
def test_packing_b_and_its_transpose_give_the_documented_panels(lib, n, k):
    g = torch.Generator().manual_seed(n * k)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    size = lib.fb_amx_packed_bytes(n, k)
    want = _pack_reference(b)
    assert size == want.numel()
    out = torch.full((size,), 99, dtype=torch.int8)
    lib.fb_amx_pack_b(b.data_ptr(), n, k, k, out.data_ptr())
    assert torch.equal(out, want)
    bt = b.t().contiguous()
    out2 = torch.full((size,), 99, dtype=torch.int8)
    lib.fb_amx_pack_bt(bt.data_ptr(), k, n, n, out2.data_ptr())
    assert torch.equal(out2, want)


def _amx(lib) -> bool:
    return native.amx_int8_ready(lib)


GEMMS = [(64, 64, 32), (100, 130, 70), (32, 64, 17), (96, 200, 48), (256, 512, 160), (40, 1100, 64)]


@pytest.mark.parametrize("m,k,n", GEMMS)
def test_amx_gemm_is_the_torch_reference(lib, m, k, n):
    g = torch.Generator().manual_seed(m + 7 * k + 31 * n)
    qa = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    qb = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    qa[0] = -128                   # the most negative products: sums far from zero
    qb[0] = -128
    da, db = torch.rand(m, generator=g) + 1e-3, torch.rand(n, generator=g) * 1e-2
    bias = torch.randn(n, generator=g)
    if not _amx(lib):
        assert native.amx_int8_gemm(lib, qa, qb, da, db, bias, torch.bfloat16) is None
        out = torch.zeros(32, 32, dtype=torch.int32)
        assert lib.fb_amx_gemm_s8(qa.data_ptr(), 32, 64, k, qb.data_ptr(), 32, None, None, None, 32, 32,
                                  out.data_ptr(), 32, 2) == -1
        assert not out.any()
        return
    sums = native.amx_int8_gemm(lib, qa, qb, None, None, None, torch.int32)
    assert torch.equal(sums, torch._int_mm(qa, qb.t()))
    for second in (qb, qb.t().contiguous().t()):           # a transposed view is packed from its transpose
        for dt in (torch.bfloat16, torch.float32):
            for f_a, f_b, b in ((da, db, bias), (da, None, None), (None, db, bias)):
                got = native.amx_int8_gemm(lib, qa, second, f_a, f_b, b, dt)
                want = int8.rescale(torch._int_mm(qa, qb.t()), f_a, f_b, b, dt)
                assert got.dtype == dt and torch.equal(got.view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                                                       want.view(torch.int16 if dt == torch.bfloat16 else torch.int32))


def test_int8_gemm_dispatch_is_bit_for_bit_the_torch_path():
    g = torch.Generator().manual_seed(5)
    qa = torch.randint(-128, 128, (96, 192), generator=g, dtype=torch.int8)
    qb = torch.randint(-128, 128, (64, 192), generator=g, dtype=torch.int8)
    da, db = torch.rand(96, generator=g), torch.rand(64, generator=g)
    for fa, fb in ((da, db), (torch.tensor(0.5), db), (da, torch.tensor(0.25))):
        auto = int8.int8_gemm(qa, qb, fa, fb, None, torch.bfloat16)
        ref = int8.int8_gemm(qa, qb, fa, fb, None, torch.bfloat16, backend="torch")
        assert torch.equal(auto.view(torch.int16), ref.view(torch.int16))
    lib = native.library()
    if lib is not None and native.amx_int8_ready(lib):
        assert int8.int8_kernel() == "fewbits AMX int8 GEMM"
    else:
        with pytest.raises(ValueError, match="AMX"):
            int8.int8_gemm(qa, qb, da, db, None, torch.bfloat16, backend="amx")
    with pytest.raises(ValueError, match="backend"):
        int8.int8_gemm(qa, qb, backend="fast")


def test_amx_gemm_refuses_bad_operands():
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    qa = torch.zeros(32, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        native.amx_int8_gemm(lib, qa.float(), qa, None, None, None, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        native.amx_int8_gemm(lib, qa, torch.zeros(32, 65, dtype=torch.int8), None, None, None, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        native.amx_int8_gemm(lib, qa, qa, torch.ones(31), None, None, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        native.amx_int8_gemm(lib, qa, qa, None, None, None, torch.float16)
    with pytest.raises(ValueError, match="bfloat16"):
        native.q8_bf16(lib, torch.zeros(4, 4))


@pytest.mark.parametrize("m,k", [(64, 512), (100, 130), (3, 7), (128, 16), (70, 64)])
@pytest.mark.parametrize("layout", ["rows", "transposed view -> contiguous", "transposed view -> view"])
def test_stochastic_rounding_is_the_torch_reference(lib, m, k, layout):
    """With a seed the codes are floor(x / scale + u), u from the counter-based word of the
    element's index in the logical operand, in every build and layout: the same bits."""
    x = _bf16((m, k), m * 7 + k)
    if m > 2 and k > 2:
        x[1, 2] = float("nan")
        x[-1] = 0.0
    if layout != "rows":
        x = x.t().contiguous().t()
    seed = (12345 + m, 987654321 - k)
    q, s = native.q8_bf16(lib, x, contiguous=layout != "transposed view -> view", seed=seed)
    want_q, want_s = int8.quantize_rows_int8(x.float(), True, nonfinite="keep", backend="torch", seed=seed)
    assert torch.equal(q, want_q) and _same_scales(s, want_s)
    nearest, _ = _reference(x)
    assert not torch.equal(q, nearest) or m * k < 8  # it does round differently
    assert bool(((q.int() - nearest.int()).abs() <= 1).all())  # one step at most


def test_stochastic_rounding_is_unbiased():
    x = torch.full((1, 4096), 0.3).bfloat16()
    x[0, 0] = 127 * 0.5  # the scale: 0.5; so the others sit at 0.3 / 0.5 = 0.6 of a step
    q, s = int8.quantize_lines(x, seed=(1, 2))
    assert float(s[0]) == 0.5
    mean = float(q[0, 1:].float().mean())
    assert abs(mean - float(x[0, 1]) / 0.5) < 0.03, mean  # E[q] = x / scale
