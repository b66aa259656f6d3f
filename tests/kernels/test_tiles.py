"""The fused bf16 batch matmuls (csrc/tiles.h, used by lut4.c and int8w.c) -- on AMX tiles, or with
AVX512-BF16 dot products where the CPU has no AMX -- against the obviously-correct arithmetic: x
and the weight as bfloat16 -- the weight exactly as Lut4Weight.decode(..., torch.bfloat16) gives it
(itself checked bit for bit against dequantize() in test_lut4_isa.py), or the int8 codes, which
bfloat16 holds exactly -- their products summed in float64, then (int8) times the row's scale. The
kernel sums the exact products in float32 in an order of the hardware's own, so each output must
lie within kx * 2^-24 * sum |x| |w| of that (the float32 summation bound).

Where the build has no AVX512-BF16 (e.g. AMD EPYC before Zen 4) the calls return None, and that is
what is checked there.
"""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no native library")
KIND = LIB is not None and native.tiles_kind(LIB)  # 2: AMX tiles, 1: AVX512-BF16 dot products, 0: neither
TILES = bool(KIND)


def test_tiles_where_the_cpu_has_them():
    """The AMX tiles run exactly where the CPU has AMX-BF16, the dot products where it has
    AVX512-BF16 without (the build is -march=native), and a weight's tile_matmul says None where
    neither does."""
    flags = native.cpu_flags()
    if "avx512_bf16" not in flags:
        assert KIND == 0
    elif "amx_bf16" not in flags:
        assert KIND == 1
    w = native.Lut4Weight(torch.zeros(32 * 16, dtype=torch.uint8), torch.ones(32, 1), torch.arange(16.0), 32, 32, 32)
    y = w.tile_matmul(LIB, torch.ones(3, 32, dtype=torch.bfloat16))
    q = native.Int8Weight(torch.ones(32, 32, dtype=torch.int8), torch.ones(32))
    z = q.tile_matmul(LIB, torch.ones(3, 32, dtype=torch.bfloat16))
    if TILES:
        assert torch.equal(y, torch.zeros(3, 32)) and torch.equal(z, torch.full((3, 32), 32.0))
    else:
        assert y is None and z is None


needs_tiles = pytest.mark.skipif(not TILES, reason="this build has neither AMX tiles nor AVX512-BF16")


def _nibbles(codes: torch.Tensor, n: int, row_len: int) -> torch.Tensor:
    return torch.stack([codes & 15, codes >> 4], dim=1).reshape(n, row_len).long()


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """y against x [M, kx] @ w[:, :kx].T in float64 (times scale per column), within the bound."""
    kx = x.shape[1]
    xd, wd = x.double(), w[:, :kx].double()
    ref = xd @ wd.t()
    bound = kx * 2.0 ** -24 * (xd.abs() @ wd.abs().t())
    if scale is not None:
        ref, bound = ref * scale.double(), bound * scale.double().abs() + (ref * scale.double()).abs() * 2.0 ** -24
    assert y.dtype == torch.float32 and y.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y), nan)
    err = (y.double() - ref).abs()[~nan]
    assert bool((err <= bound[~nan]).all()), float((err - bound[~nan]).max())


LUT4_CASES = [  # (n, row_len, group, rows of x, kx): partial blocks of 32 weight rows, of 16 / 32
    (70, 96, 16, 1, 96),  # rows of x, kx short of the row (odd, one column, below a tile's 32)
    (32, 128, 32, 16, 128),
    (33, 128, 32, 17, 101),
    (40, 256, 64, 33, 256),
    (9, 512, 256, 64, 500),
    (64, 96, 48, 31, 96),
    (50, 640, 128, 130, 576),  # int4 g128's padded rows
    (3, 32, 32, 5, 1),
]


@needs_tiles
@pytest.mark.parametrize("n,row_len,group,m,kx", LUT4_CASES)
def test_lut4_tiles_are_the_bf16_product(n, row_len, group, m, kx):
    g = torch.Generator().manual_seed(n + row_len + m)
    table = torch.randn(16, generator=g) * 3
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, row_len // group, generator=g) + 0.5
    x = torch.randn(m, kx, generator=g).to(torch.bfloat16)
    for weight in (native.Lut4Weight(codes, scales, table, n, row_len, group),
                   native.Lut4Weight(codes, scales, table, n, row_len, group,  # zero points, minimums
                                     zero_points=torch.randint(0, 16, scales.shape, generator=g).float(),
                                     minimums=torch.randn(scales.shape, generator=g)),
                   native.Lut4Weight(codes, (torch.randint(0, 256, scales.shape, generator=g, dtype=torch.uint8),
                                             torch.rand(256, generator=g) + 0.25, 0.375), table, n, row_len, group)):
        _check(weight.tile_matmul(LIB, x), x, weight.decode(LIB, 0, n, torch.bfloat16))


@needs_tiles
def test_lut4_tiles_read_no_weight_past_x_and_no_row_of_x_past_m():
    """Columns from kx on are padding (codes of a NaN table value here) and rows of x past M are
    another tensor's (NaN): neither reaches the output. NaN and inf weights inside do, as in
    any product."""
    n, row_len, group, kx = 45, 128, 32, 70
    table = torch.arange(16.0) - 8
    table[5] = float("nan")
    g = torch.Generator().manual_seed(3)
    nib = torch.randint(0, 16, (n, row_len), generator=g)
    nib[nib == 5] = 6
    nib[:, kx:] = 5
    codes = (nib[:, 0::2] | nib[:, 1::2] << 4).to(torch.uint8).reshape(-1)
    scales = torch.rand(n, row_len // group, generator=g) + 0.5
    w = native.Lut4Weight(codes, scales, table, n, row_len, group)
    big = torch.full((40, 200), float("nan")).to(torch.bfloat16)
    big[:19, :kx] = torch.randn(19, kx, generator=g).to(torch.bfloat16)
    x = big[:19, :kx]  # strided: row stride 200
    y = w.tile_matmul(LIB, x)
    assert bool(torch.isfinite(y).all())
    _check(y, x, w.decode(LIB, 0, n, torch.bfloat16))
    nib[7, 3] = 5  # a NaN weight inside x's columns
    scales[11, 0] = float("inf")
    codes = (nib[:, 0::2] | nib[:, 1::2] << 4).to(torch.uint8).reshape(-1)
    w = native.Lut4Weight(codes, scales, table, n, row_len, group)
    y = w.tile_matmul(LIB, x)
    _check(y, x, w.decode(LIB, 0, n, torch.bfloat16))
    assert bool(torch.isnan(y[:, 7]).all()) and not bool(torch.isnan(y[:, 8]).any())


@needs_tiles
@pytest.mark.parametrize("n,k,m", [(70, 16, 1), (32, 48, 16), (33, 256, 17), (100, 80, 40), (64, 1040, 130)])
def test_int8_tiles_are_the_sums_times_the_scales(n, k, m):
    g = torch.Generator().manual_seed(n * k + m)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) + 0.01
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = native.Int8Weight(q, s)
    _check(w.tile_matmul(LIB, x), x, q.to(torch.bfloat16), s)


@needs_tiles
def test_tiles_give_the_same_bits_at_any_thread_count_and_leave_onednn_working():
    """Each output is summed by one thread in one order whatever the threads: the same bits at 1
    and 2 threads. The tiles are released after each call: oneDNN's bf16 GEMM (AMX too) still
    gives its right result after one."""
    g = torch.Generator().manual_seed(11)
    n, row_len, group = 300, 512, 32
    codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
    w = native.Lut4Weight(codes, torch.rand(n, row_len // group, generator=g) + 0.5, torch.randn(16, generator=g),
                          n, row_len, group)
    q = native.Int8Weight(torch.randint(-128, 128, (n, row_len), generator=g, dtype=torch.int8), torch.rand(n) + 0.1)
    x = torch.randn(40, row_len, generator=g).to(torch.bfloat16)
    a = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(256, 96, generator=g).to(torch.bfloat16)
    want = a.double() @ b.double()
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append((w.tile_matmul(LIB, x), q.tile_matmul(LIB, x)))
            got = (a @ b).double()
            assert bool(((got - want).abs() <= 2.0 ** -7 * want.abs() + 256 * 2.0 ** -20 * (a.double().abs() @ b.double().abs())).all())
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    finally:
        torch.set_num_threads(threads)


def test_tile_matmuls_refuse_what_they_cannot_take():
    w = native.Lut4Weight(torch.zeros(32 * 16, dtype=torch.uint8), torch.ones(32, 1), torch.arange(16.0), 32, 32, 32)
    q = native.Int8Weight(torch.ones(32, 32, dtype=torch.int8), torch.ones(32))
    for bad in (torch.ones(2, 32, dtype=torch.float16), torch.ones(2, 33, dtype=torch.bfloat16),
                torch.ones(32, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="bfloat16"):
            w.tile_matmul(LIB, bad)
        with pytest.raises(ValueError, match="bfloat16"):
            q.tile_matmul(LIB, bad)
    with pytest.raises(ValueError, match="bfloat16"):
        q.tile_matmul(LIB, torch.ones(2, 31, dtype=torch.bfloat16))
    if TILES:  # no rows, no columns
        assert w.tile_matmul(LIB, torch.ones(0, 32, dtype=torch.bfloat16)).shape == (0, 32)
        assert torch.equal(w.tile_matmul(LIB, torch.ones(2, 0, dtype=torch.bfloat16)), torch.zeros(2, 32))


_WIDE_STRIDE = r'''
import torch
from fewbits.kernels import native
from fewbits.quant.modules import QuantLinear
torch.set_num_threads(1)
LIB = native.library()
g = torch.Generator().manual_seed(1)


def wide(dtype, k):
    """16 rows of x [16, k] whose row stride times 15 is past 2^31 bytes (the pages between the
    rows are never touched: virtual memory only)"""
    ld = 2 ** 31 // (15 * torch.finfo(dtype).bits // 8) + 64
    big = torch.empty(15 * ld + k, dtype=dtype)
    x = big.as_strided((16, k), (ld, 1))
    x.copy_(torch.randn(16, k, generator=g).to(dtype))
    return x


torch.manual_seed(0)
q = QuantLinear.from_linear(torch.nn.Linear(576, 64), "nf4")
x = wide(torch.float32, 576)  # not contiguous: forward's general path, float32 x into the tile call
with torch.inference_mode():
    assert torch.equal(q(x), q(x.contiguous()))
del x
w = native.Int8Weight(torch.randint(-128, 128, (32, 64), generator=g, dtype=torch.int8), torch.rand(32) + 0.1)
x = wide(torch.bfloat16, 64)
assert torch.equal(w.tile_matmul(LIB, x), w.tile_matmul(LIB, x.contiguous()))
print("ok")
'''


@needs_tiles
def test_tiles_take_x_with_a_row_stride_past_int32_offsets():
    """A row-strided view of a large tensor (here 16 rows 143 MB apart) is a valid x: the gathers
    of tiles_pack_x must not overflow their 32-bit offsets (or such an x must be copied first)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _WIDE_STRIDE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])
