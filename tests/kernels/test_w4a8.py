"""w4a8.c (4-bit integer weights x int8 activations in blocks of 32) against its torch reference,
bit for bit, in three builds: the library fewbits loads (-march=native: VNNI where the CPU has
AVX512-VNNI), x86-64-v3 and baseline x86-64 (scalar C); and the vector path against the scalar
one inside the native build. The reference below spells out w4a8.c's header: exact integer sums
per lane of 8 columns, then float32 operations in a fixed order."""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native
from helpers import build_c_source

SRC = native.SOURCE_DIR / "w4a8.c"
BUILDS = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(scope="module", params=BUILDS)
def lib(request, tmp_path_factory):
    # with rowquant.c, whose activation quantizer fb_w4a8_linear calls
    return build_c_source(SRC, request.param, tmp_path_factory.mktemp(request.param), native.declare_w4a8,
                          ("-fopenmp", str(SRC.with_name("rowquant.c"))))


def _nibbles(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    c = codes.view(n, k // 2).to(torch.int64)
    return torch.stack([c & 0xF, c >> 4], dim=-1).reshape(n, k)


def reference(xq, sx, codes, scales, mins, signed, n, k):
    """w4a8.c's arithmetic with torch ops (float32 ops one at a time, integer sums in int64)."""
    m = xq.shape[0]
    chunks = -(-k // 128)
    lanes = chunks * 16
    kp = chunks * 128
    u = _nibbles(codes, n, k)
    if signed:
        u = u ^ 8
    u = torch.nn.functional.pad(u, (0, kp - k)).view(n, lanes, 8)
    x = torch.nn.functional.pad(xq.to(torch.int64), (0, kp - k)).view(m, lanes, 8)
    isum = torch.einsum("nlt,mlt->mnl", u, x)
    ssum = x.sum(-1)  # [m, lanes]
    if signed:
        isum = isum - 8 * ssum[:, None, :]
    blocks = k // 32
    lane_block = torch.arange(lanes) // 4
    valid = lane_block < blocks
    idx = lane_block.clamp(max=blocks - 1)
    sb = torch.where(valid, scales.float().view(n, blocks)[:, idx], torch.zeros(()))  # [n, lanes]
    sxl = torch.where(valid, sx.view(m, blocks)[:, idx], torch.zeros(()))            # [m, lanes]
    mb = None if mins is None else torch.where(valid, mins.float().view(n, blocks)[:, idx], torch.zeros(()))
    acc = torch.zeros(m, n, 16, dtype=torch.float32)
    jf = isum.to(torch.float32)
    sf = ssum.to(torch.float32)
    for c in range(chunks):
        sl = slice(16 * c, 16 * c + 16)
        acc = acc + (sb[None, :, sl] * sxl[:, None, sl]) * jf[:, :, sl]
        if mb is not None:
            acc = acc + (mb[None, :, sl] * sxl[:, None, sl]) * sf[:, None, sl]
    w = 8
    while w >= 1:
        acc = acc[..., :w] + acc[..., w:2 * w]
        w //= 2
    return acc[..., 0]


def _case(m, n, k, seed, signed=True, kind=torch.float32, with_mins=False):
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    sx = torch.rand(m, k // 32, generator=g) * 0.1
    codes = torch.randint(0, 256, (n * k // 2,), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).to(kind)
    mins = (torch.randn(n, k // 32, generator=g) * 0.1).to(kind) if with_mins else None
    return xq, sx, codes, scales, mins


SHAPES = [(1, 64, 576), (3, 70, 128), (1, 33, 32), (2, 16, 96), (5, 130, 1536), (1, 1, 160), (8, 67, 224), (6, 40, 576)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["signed", "uint4 + minimum"])
def test_w4a8_matmul_is_its_reference_bit_for_bit(lib, m, n, k, kind, variant):
    signed = variant == "signed"
    xq, sx, codes, scales, mins = _case(m, n, k, m * 1000 + n + k, signed, kind, with_mins=not signed)
    w = native.W4A8Weight(codes, scales, n, k, signed, mins)
    y = w.matmul(lib, xq, sx)
    ref = reference(xq, sx, codes, scales, mins, signed, n, k)
    assert torch.equal(y, ref), (y - ref).abs().max()


@pytest.mark.parametrize("variant", ["signed", "uint4 + minimum"])
def test_vector_path_equals_scalar_path(variant):
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    signed = variant == "signed"
    for m, n, k in SHAPES:
        xq, sx, codes, scales, mins = _case(m, n, k, 7 + k, signed, torch.float16, with_mins=not signed)
        w = native.W4A8Weight(codes, scales, n, k, signed, mins)
        assert torch.equal(w.matmul(lib, xq, sx), w.matmul(lib, xq, sx, force_scalar=True))


def test_the_sum_is_the_dequantized_product_up_to_float32_rounding():
    """Mathematically sum (xq * sx) * w: against float64 of the dequantized operands."""
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    for signed in (True, False):
        m, n, k = 2, 48, 576
        xq, sx, codes, scales, mins = _case(m, n, k, 3, signed, torch.float32, with_mins=not signed)
        w = native.W4A8Weight(codes, scales, n, k, signed, mins)
        u = _nibbles(codes, n, k).double()
        if signed:
            u = torch.where(u >= 8, u - 16, u)  # two's complement int4
        s = scales.double().repeat_interleave(32, dim=1)
        wd = u * s + (mins.double().repeat_interleave(32, dim=1) if mins is not None else 0)
        xd = xq.double() * sx.double().repeat_interleave(32, dim=1)
        exact = xd @ wd.T
        bound = 1e-5 * (xd.abs() @ wd.abs().T) + 1e-30
        assert ((w.matmul(lib, xq, sx).double() - exact).abs() <= bound).all()


def test_bad_arguments_are_refused():
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    codes = torch.zeros(64 * 16, dtype=torch.uint8)
    scales = torch.ones(64, 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.W4A8Weight(codes, scales, 64, 40, True)
    with pytest.raises(ValueError, match="no minimums"):
        native.W4A8Weight(codes, scales, 64, 32, True, minimums=scales)
    with pytest.raises(ValueError, match="scales needs"):
        native.W4A8Weight(codes, torch.ones(64, 2), 64, 32, True)
    w = native.W4A8Weight(codes, scales, 64, 32, True)
    with pytest.raises(ValueError, match="xq must be"):
        w.matmul(lib, torch.zeros(1, 32), torch.ones(1, 1))
    with pytest.raises(ValueError, match="xq must be"):
        w.matmul(lib, torch.zeros(1, 32, dtype=torch.int8), torch.ones(1, 2))
    assert w.matmul(lib, torch.zeros(0, 32, dtype=torch.int8), torch.ones(0, 1)).shape == (0, 64)


def test_each_build_runs_the_path_its_instruction_set_has(lib, request):
    """x86-64: scalar C; x86-64-v3: AVX2; native: AVX512-VNNI where the CPU has it (else AVX2 or
    scalar), so the bit-for-bit tests above cover every path."""
    build = request.node.callspec.params["lib"]
    got = lib.fb_w4a8_vectorized()
    if build == "x86-64":
        assert got == 0
    elif build == "x86-64-v3":
        assert got == 1
    else:
        flags = native.cpu_flags()
        want = 2 if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags else 1 if {"avx2", "f16c"} <= flags else 0
        assert got == want


@pytest.mark.parametrize("layout", ["expanded", "overlapping rows", "one row, row stride 1"])
def test_linear_takes_rows_of_any_stride(layout):
    lib = native.library()
    if lib is None:
        pytest.skip(native.status()["reason"])
    n, k = 64, 256
    _, _, codes, scales, _ = _case(1, n, k, 11)
    w = native.W4A8Weight(codes, scales, n, k, True)
    base = torch.randn(2 * k)
    if layout == "expanded":
        x = base[:k].view(1, k).expand(4, k)
    elif layout == "overlapping rows":
        x = base.as_strided((3, k), (10, 1))
    else:
        x = torch.randn(k, 1).t()  # [1, k] with strides (1, 1)
    assert torch.equal(w.linear(lib, x), w.linear(lib, x.contiguous()))
