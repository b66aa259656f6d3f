"""lut4.c's three builds (AVX-512, AVX2+FMA, scalar C) against the obviously-correct arithmetic.

The library fewbits loads is built with -march=native, so a machine tests only its own build;
here lut4.c is also compiled for the x86-64-v3 (AVX2) and baseline x86-64 levels, as the AMD and
older machines that run fewbits build it, and for Skylake's AVX-512 (no VBMI: coded scales looked
up one at a time), and every build must give:
- decode to float32: QuantizedTensor.dequantize()'s weights bit for bit (table value times scale,
  one float32 rounding), for float32 scales and for MX / NVFP4 scales kept as byte codes;
- decode to bfloat16: that float32 weight rounded to nearest even, bit for bit (NaN -> 0x7FC0);
- the fused matmul: x @ W.T within float32 summation error of the float64 product, for batches
  inside one 8-row chunk and across chunks, x narrower than the rows (padding) and strided x.
"""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native
from helpers import build_c_source

SRC = native.SOURCE_DIR / "lut4.c"
BUILDS = ["native", "skylake-avx512", "x86-64-v3", "x86-64"]  # skylake-avx512: AVX-512 without VBMI


def _flags() -> frozenset[str]:
    return native.cpu_flags()


@pytest.fixture(scope="module", params=BUILDS)
def lib(request, tmp_path_factory):
    return build_c_source(SRC, request.param, tmp_path_factory.mktemp(request.param), native.declare_lut4, ())


def _nibbles(codes: torch.Tensor, n: int, row_len: int) -> torch.Tensor:
    return torch.stack([codes & 15, codes >> 4], dim=1).reshape(n, row_len).long()


CASES = [  # (n, row_len, group): groups of 16 (NVFP4), 32 (MX), 48 (steps spanning groups), 64, 256
    (70, 96, 16), (33, 128, 32), (17, 96, 48), (40, 256, 64), (9, 512, 256), (3, 32, 32)]


@pytest.mark.parametrize("n,row_len,group", CASES)
def test_decode_is_the_float32_weight_and_its_bfloat16_rounding(lib, n, row_len, group):
    g = torch.Generator().manual_seed(n * row_len + group)
    table = torch.randn(16, generator=g) * 3
    table[13] = float("nan")  # an unused code of a codebook with fewer than 16 values
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, row_len // group, generator=g) * 4 + 2.0 ** -130  # subnormal products too
    scales[0, 0] = 2.0 ** 120  # products that overflow to inf
    w_ref = table[_nibbles(codes, n, row_len)] * scales.repeat_interleave(group, dim=1)
    weight = native.Lut4Weight(codes, scales, table, n, row_len, group)
    got = weight.decode(lib, 0, n)
    assert torch.equal(got.view(torch.int32), w_ref.view(torch.int32))
    part = weight.decode(lib, 3, min(n, 7))
    assert torch.equal(part.view(torch.int32), w_ref[3:min(n, 7)].view(torch.int32))
    b = weight.decode(lib, 0, n, torch.bfloat16).view(torch.int16)
    nan = torch.isnan(w_ref)
    want = w_ref.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(b[~nan], want[~nan])
    assert bool((b[nan] == 0x7FC0).all())
    # scales kept as byte codes: table[code] * multiplier, one float32 product
    scale_codes = torch.randint(0, 256, (n, row_len // group), generator=g, dtype=torch.uint8)
    scale_table = torch.rand(256, generator=g) + 0.25
    coded = native.Lut4Weight(codes, (scale_codes, scale_table, 0.375), table, n, row_len, group)
    s = scale_table[scale_codes.long()] * 0.375
    w_coded = table[_nibbles(codes, n, row_len)] * s.repeat_interleave(group, dim=1)
    assert torch.equal(coded.decode(lib, 0, n).view(torch.int32), w_coded.view(torch.int32))


@pytest.mark.parametrize("n,row_len,group", CASES)
def test_fused_matmul_is_the_product_with_the_decoded_weight(lib, n, row_len, group):
    g = torch.Generator().manual_seed(7 + n + group)
    table = torch.randn(16, generator=g)
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, row_len // group, generator=g) + 0.5
    w = (table[_nibbles(codes, n, row_len)] * scales.repeat_interleave(group, dim=1)).double()
    weight = native.Lut4Weight(codes, scales, table, n, row_len, group)
    for m, k in ((1, row_len), (2, row_len), (5, row_len - 3), (8, row_len), (13, row_len - 16), (20, 1)):
        x = torch.randn(m, k, generator=g)
        y = weight.matmul(lib, x)
        ref = x.double() @ w[:, :k].t()
        bound = row_len * 2.0 ** -24 * (x.abs().double() @ w[:, :k].abs().t()) + 1e-30
        assert bool(((y.double() - ref).abs() <= bound).all()), (m, k)
    wide = torch.randn(4, 2 * row_len, generator=g)
    strided = wide[:, ::2]  # rows with a stride, columns not unit: copied first
    assert torch.allclose(weight.matmul(lib, strided), weight.matmul(lib, strided.contiguous()), rtol=0, atol=0)
    view = wide[:, :row_len]  # a row stride wider than the row
    assert torch.equal(weight.matmul(lib, view), weight.matmul(lib, view.contiguous()))
    assert weight.matmul(lib, torch.zeros(0, row_len)).shape == (0, n)


def test_bad_arguments_are_refused(lib):
    table = torch.randn(16)
    with pytest.raises(ValueError, match="multiples of 32"):
        native.Lut4Weight(torch.zeros(48, dtype=torch.uint8), torch.ones(2, 3), table, 2, 48, 16)
    w = native.Lut4Weight(torch.zeros(64, dtype=torch.uint8), torch.ones(2, 1), table, 2, 64, 64)
    with pytest.raises(ValueError, match="float32"):
        w.matmul(lib, torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32"):
        w.matmul(lib, torch.zeros(1, 65))
    with pytest.raises(ValueError, match="rows"):
        w.decode(lib, 1, 3)
    with pytest.raises(ValueError, match="bfloat16"):
        w.decode(lib, 0, 2, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parameters_stored_in_16_bits_are_read_exactly(lib, dtype):
    """Scales, zero points and minimums as the QuantizedTensor stores them (GGUF's Q4_0 / Q4_1
    keep float16): read exactly (float16 subnormals, infinities and the 8-wide hardware
    conversion and its scalar tail included), then ((table[code] - z) * s) + m in float32."""
    n, row_len, group = 6, 704, 32  # 22 groups a row: 16 through the vector conversion, 6 after
    g = torch.Generator().manual_seed(3)
    table = torch.arange(16, dtype=torch.float32) - 8
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    groups = row_len // group
    scales = (torch.rand(n, groups, generator=g) * 2).to(dtype)
    if dtype == torch.float16:
        scales[0, :4] = torch.tensor([2.0 ** -24, 3 * 2.0 ** -20, 6.0e-5, 65504.0])  # subnormals, max
    mins = (torch.randn(n, groups, generator=g)).to(dtype)
    zps = torch.randint(0, 16, (n, groups), generator=g).to(torch.float32)
    w = native.Lut4Weight(codes, scales, table, n, row_len, group, zero_points=zps, minimums=mins)
    v = table[_nibbles(codes, n, row_len)]
    rep = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    ref = ((v - rep(zps)) * rep(scales)) + rep(mins)
    assert torch.equal(w.decode(lib, 0, n).view(torch.int32), ref.view(torch.int32))
    x = torch.randn(3, row_len, generator=g)
    torch.testing.assert_close(w.matmul(lib, x), x @ ref.t(), rtol=1e-5, atol=1e-4)


ONE_ROW_CASES = [  # (row_len, group): with AVX-512 one row of x takes lut4.c's one_row, 128 columns a
    # chunk; row_len % 128 of 32, 64 or 96 is a last partial chunk; groups of 16-64 sum per 8 columns
    # then scale, 128 and more look up the scaled table, 48 keeps the two-nibble steps
    (32, 16), (64, 16), (96, 16), (128, 16), (160, 16), (224, 16), (576, 16), (1536, 16),
    (32, 32), (96, 32), (128, 32), (576, 32), (64, 64), (192, 64), (576, 64),
    (128, 128), (1536, 128), (512, 256), (96, 48)]


def _one_row_bound(x: torch.Tensor, w: torch.Tensor, row_len: int) -> torch.Tensor:
    return row_len * 2.0 ** -24 * (x.abs().double() @ w.abs().t()) + 1e-30


@pytest.mark.parametrize("row_len,group", ONE_ROW_CASES)
def test_one_row_is_the_product_with_the_decoded_weight(lib, row_len, group):
    """One row of x (generation's decode step): within float32 summation error of x @ W.T for the
    decoded weight, x narrower than the rows too (its padding read as zero), an unused NaN code,
    float32 scales and MX / NVFP4 byte-coded scales; and within the bounds of the multi-row path's
    first row."""
    g = torch.Generator().manual_seed(row_len * 7 + group)
    n = 67  # more than the 64 rows from which the rows are shared out over threads
    table = torch.randn(16, generator=g)
    table[11] = float("nan")  # never used: the codes below avoid 11
    nib = torch.randint(0, 15, (n, row_len), generator=g)
    nib[nib == 11] = 15
    codes = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8).reshape(-1)
    scale_codes = torch.randint(0, 256, (n, row_len // group), generator=g, dtype=torch.uint8)
    scale_table = torch.rand(256, generator=g) + 0.25
    plain = torch.rand(n, row_len // group, generator=g) + 0.5
    for scales, s in ((plain, plain), ((scale_codes, scale_table, 0.375), scale_table[scale_codes.long()] * 0.375)):
        w = (table[nib] * s.repeat_interleave(group, dim=1)).double()
        weight = native.Lut4Weight(codes, scales, table, n, row_len, group)
        for k in (row_len, row_len - 3, 1):
            x = torch.randn(1, k, generator=g)
            y = weight.matmul(lib, x)
            ref = x.double() @ w[:, :k].t()
            bound = _one_row_bound(x, w[:, :k], row_len)
            assert bool(((y.double() - ref).abs() <= bound).all()), (k, (y.double() - ref).abs().max())
            two = weight.matmul(lib, torch.cat([x, x]))  # two rows: the two-nibble steps
            assert bool(((y.double() - two[:1].double()).abs() <= 2 * bound).all()), k
        assert weight.matmul(lib, torch.zeros(1, row_len)).abs().sum() == 0


@pytest.mark.parametrize("groups", [64, 150, 6])
def test_coded_scales_are_the_float_scales_for_every_code(lib, groups):
    """Byte-coded scales (MX, NVFP4) over rows of many groups (64 codes at a time with AVX512-VBMI,
    a partial last block): every one of the 256 codes, a table with negative, subnormal, infinite
    and NaN values, and a multiplier; decode is table[code] * multiplier times the weight's value
    bit for bit, and every matmul path gives the same bits as with those scales held as float32."""
    g = torch.Generator().manual_seed(groups)
    group, n = 16, 5
    row_len = group * groups
    table = torch.randn(16, generator=g)
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    scale_codes = torch.randperm(256, generator=g).repeat(n * groups // 256 + 1)[: n * groups]
    scale_codes = scale_codes.to(torch.uint8).reshape(n, groups)
    scale_table = torch.randn(256, generator=g) * 4
    scale_table[:8] = torch.tensor([0.0, -0.0, 2.0 ** -140, -(2.0 ** -130), 2.0 ** 100, 1e-20, 3.0, -7.5])
    scale_table[250:] = torch.tensor([float("inf"), -float("inf"), float("nan"), 2.0 ** -149, 1.0, -1.0])
    mul = 0.3
    s = scale_table[scale_codes.long()] * mul  # one float32 product per scale, as the C code's
    coded = native.Lut4Weight(codes, (scale_codes, scale_table, mul), table, n, row_len, group)
    plain = native.Lut4Weight(codes, s.contiguous(), table, n, row_len, group)
    w = table[_nibbles(codes, n, row_len)] * s.repeat_interleave(group, dim=1)
    assert torch.equal(coded.decode(lib, 0, n).view(torch.int32), w.view(torch.int32))
    assert torch.equal(coded.decode(lib, 2, 4).view(torch.int32), w[2:4].view(torch.int32))
    for rows in (1, 3):
        x = torch.randn(rows, row_len, generator=g)
        a, b = coded.matmul(lib, x), plain.matmul(lib, x)
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num().view(torch.int32), b.nan_to_num().view(torch.int32)), rows


@pytest.mark.parametrize("group", [16, 128])
def test_one_row_with_zero_points_and_minimums(lib, group):
    """Zero points and minimums: groups of 128 take one_row's scaled table, groups of 16 the
    two-nibble steps; both within float32 summation error of the decoded weight's product."""
    g = torch.Generator().manual_seed(group)
    n, row_len = 9, 384
    table = torch.arange(16, dtype=torch.float32)
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    groups = row_len // group
    scales = torch.rand(n, groups, generator=g) + 0.5
    zps = torch.randint(0, 16, (n, groups), generator=g).to(torch.float32)
    mins = torch.randn(n, groups, generator=g)
    weight = native.Lut4Weight(codes, scales, table, n, row_len, group, zero_points=zps, minimums=mins)
    rep = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
    w = (((table[_nibbles(codes, n, row_len)] - rep(zps)) * rep(scales)) + rep(mins)).double()
    x = torch.randn(1, row_len, generator=g)
    y = weight.matmul(lib, x)
    assert bool(((y.double() - x.double() @ w.t()).abs() <= _one_row_bound(x, w, row_len)).all())


@pytest.mark.skipif(native.library() is None or "avx512f" not in native.cpu_flags(),
                    reason="one_row is the AVX-512 build's")
@pytest.mark.parametrize("group", [16, 32, 64])
def test_one_row_with_an_infinite_scale_is_the_decoded_weights_nan(group):
    lib = native.library()
    n, row_len = 4, 128
    table = torch.arange(16, dtype=torch.float32) - 8  # code 8: 0.0, code 9: 1.0
    codes = torch.tensor([0x99, 0x88] * (n * row_len // 4), dtype=torch.uint8)  # each lane's 8 weights: 1, 1, 0, 0, ...
    scales = torch.ones(n, row_len // group)
    scales[1, 0] = float("inf")
    weight = native.Lut4Weight(codes, scales, table, n, row_len, group)
    x = torch.ones(2, row_len)
    assert bool(weight.decode(lib, 0, n)[1].isnan().any())
    assert torch.isnan(weight.matmul(lib, x)[0, 1])  # two rows
    assert torch.isnan(weight.matmul(lib, x[:1])[0, 1])  # one row
