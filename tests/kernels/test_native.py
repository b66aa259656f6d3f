"""The C kernels of fewbits.kernels.native against their torch references, bit for bit, and the
build: where it is cached, and how a missing or failing compiler falls back to torch."""
import shutil

import pytest
import torch

from fewbits.kernels import native
from fewbits.quant import get_scheme, quantize
from fewbits.quant import lowbit_ops as ops
from fewbits.quant import scales as sc

HAVE_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """native with no library loaded, its cache in tmp_path; the real one restored after."""
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    native.reset()
    yield tmp_path
    native.reset()


def _awkward_rows(seed=0):
    """Rows of float32 that exercise every branch: widths around the 16-lane vectors, ties,
    zero rows, negative extremes, huge and subnormal magnitudes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in (1, 5, 15, 16, 17, 31, 64, 100, 4096 + 3):
        x = torch.randn(9, k, generator=g) * torch.logspace(-30, 30, 9).unsqueeze(1)
        x[1] = 0.0
        x[2] = -x[2].abs()
        x[3, 0] = -127.0 if k > 1 else x[3, 0]
        if k > 4:
            x[3, 1:4] = torch.tensor([0.5, 1.5, -2.5])  # with amax 127: scale 1, ties to even
        x[5] = 2e-38  # scale 1.57e-40: subnormal, its reciprocal overflows to inf
        x[5, ::2] = 0.0  # ... and 0 * inf is read as 0
        x[6, ::3] = -1e-45
        out.append(x)
    return out


def test_the_library_builds_here_and_is_cached(lib):
    st = native.status()
    assert st["available"] and st["path"].endswith(".so")
    assert native.library() is lib  # loaded once per process


def test_row_absmax_equals_torch(lib):
    for x in _awkward_rows():
        amax, bad = native.row_absmax(lib, x)
        assert bad == 0
        assert torch.equal(amax, torch.maximum(x.amax(1), -x.amin(1)))
        strided = torch.cat([x, x], dim=1)[:, : x.shape[1]]  # row stride 2k
        assert torch.equal(native.row_absmax(lib, strided)[0], amax)


def test_row_absmax_counts_rows_with_nan_or_inf(lib):
    x = torch.randn(6, 40)
    x[1, 39] = float("nan")  # in the scalar tail
    x[3, 0] = float("-inf")  # in a vector
    x[4, 17] = float("inf")
    _, bad = native.row_absmax(lib, x)
    assert bad == 3
    _, _, bad = native.row_int8_scales(lib, x)
    assert bad == 3


def test_int8_scales_equal_torchs_division(lib):
    for x in _awkward_rows(1):
        scale, recip, bad = native.row_int8_scales(lib, x)
        want = torch.maximum(x.amax(1), -x.amin(1)) / 127.0
        assert bad == 0 and torch.equal(scale, want)
        assert torch.equal(recip, sc.reciprocal(want))


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("offset", [False, True])
def test_quantize_rows_native_equals_torch_and_quantize(per_row, offset, lib):
    act = get_scheme("w8a8").activations.with_(granularity="channel" if per_row else "tensor")
    for scale_format in ("fp32", "bf16", "fp16"):
        a = act.with_(scale_format=scale_format)
        round_scale = None if scale_format == "fp32" else (lambda v, f=scale_format: sc.round_scales(v, f))
        for x in _awkward_rows(2):
            got = ops.quantize_rows_int8(x, per_row, round_scale, offset=offset, backend="native")
            want = ops.quantize_rows_int8(x, per_row, round_scale, offset=offset, backend="torch")
            assert got[0].dtype == want[0].dtype == (torch.uint8 if offset else torch.int8)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (scale_format, x.shape)
            qt = quantize(x, a)
            codes = got[0].to(torch.int64) - (128 if offset else 0)
            assert torch.equal(codes, qt.int_codes().reshape(x.shape)), (scale_format, x.shape)
            assert torch.equal(got[1], qt.scale_values().reshape(-1))


def test_quantize_rows_takes_any_layout_and_dtype(lib):
    x = torch.randn(12, 80, dtype=torch.float64)
    for view in (x[:, 3:70], x.t()[:40].t(), x[::2], x.to(torch.bfloat16), x.to(torch.float16)):
        got = ops.quantize_rows_int8(view, True, backend="native")
        want = ops.quantize_rows_int8(view, True, backend="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = ops.quantize_rows_int8(torch.zeros(0, 8), True, backend="native")
    assert empty[0].shape == (0, 8) and empty[1].shape == (0,)


def test_quantize_rows_rejects_nan_and_inf_either_way(lib):
    x = torch.randn(3, 20)
    x[2, 19] = float("nan")
    for backend in ("native", "torch"):
        with pytest.raises(ValueError, match="NaN or inf"):
            ops.quantize_rows_int8(x, True, backend=backend)


def test_scale_rows_is_one_fma_per_value(lib):
    """Values with few enough bits that y * s + b is exact in float64: its float32 rounding is
    then the single-rounding fma, which a separate multiply and add miss on many values."""
    g = torch.Generator().manual_seed(5)
    for m, n in ((3, 7), (5, 16), (40, 37)):
        y = torch.randint(-2 ** 20, 2 ** 20, (m, n), generator=g).float()
        s = torch.randint(1, 2 ** 12, (m,), generator=g).float() / 2 ** 12
        b = torch.randint(-2 ** 20, 2 ** 20, (n,), generator=g).float() / 2 ** 12
        fma = (y.double() * s.double().unsqueeze(1) + b.double()).float()
        got = native.scale_rows_(lib, y.clone(), s, b)
        assert torch.equal(got, fma), (m, n)
        assert torch.equal(native.scale_rows_(lib, y.clone(), s), y * s.unsqueeze(1))
    assert not torch.equal(y * s.unsqueeze(1) + b, fma)  # the test tells the two apart
    with pytest.raises(ValueError, match="bias must be float32"):
        native.scale_rows_(lib, torch.zeros(2, 4), torch.ones(2), torch.zeros(3))
    with pytest.raises(ValueError, match="unit column stride"):
        native.scale_rows_(lib, torch.zeros(4, 2).t(), torch.ones(2))


def test_turned_off_falls_back_to_torch(monkeypatch, fresh_native):
    monkeypatch.setenv("FEWBITS_NATIVE", "0")
    assert native.library() is None
    assert "FEWBITS_NATIVE" in native.status()["reason"]
    x = torch.randn(4, 32)
    q, s = ops.quantize_rows_int8(x, True)  # auto: the torch path
    assert torch.equal(q, ops.quantize_rows_int8(x, True, backend="torch")[0])
    with pytest.raises(RuntimeError, match="not available"):
        ops.quantize_rows_int8(x, True, backend="native")


def test_turned_off_in_a_block(lib):
    with native.turned_off():
        assert native.library() is None and not native.status()["available"]
        x = torch.randn(3, 40)
        with pytest.raises(RuntimeError, match="turned off"):
            ops.quantize_rows_int8(x, True, backend="native")
    assert native.library() is lib


def test_missing_or_failing_compiler_falls_back(monkeypatch, fresh_native):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native.library() is None and "no C compiler" in native.status()["reason"]
    native.reset()
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` program to stand in for a failing compiler")
    monkeypatch.setenv("CC", false)
    assert native.library() is None and "build failed" in native.status()["reason"]
    assert not list(fresh_native.rglob("*.so*")), "a failed build leaves no file behind"
    assert not list(fresh_native.rglob(".building-*"))


def test_build_goes_to_the_cache_and_is_reused(fresh_native):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    assert native.library() is not None
    built = list(fresh_native.glob("native/fewbits_native_*.so"))
    assert len(built) == 1 and native.status()["path"] == str(built[0])
    mtime = built[0].stat().st_mtime_ns
    native.reset()
    assert native.library() is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_lut4_matmul_equals_the_decoded_product_and_checks_its_arguments(lib):
    g = torch.Generator().manual_seed(7)
    table = torch.randn(16, generator=g)
    for n, k, row_len, group in ((70, 96, 96, 16), (5, 64, 128, 64), (130, 256, 256, 256)):
        codes = torch.randint(0, 256, (n * row_len // 2,), generator=g, dtype=torch.uint8)
        scales = torch.rand(n, row_len // group, generator=g) + 0.5
        nib = torch.stack([codes & 15, codes >> 4], dim=1).reshape(n, row_len).long()
        w = table[nib] * scales.repeat_interleave(group, dim=1)  # float32, one rounding: as in C
        for m in (1, 8, 13):
            x = torch.randn(m, k, generator=g)
            y = native.Lut4Weight(codes, scales, table, n, row_len, group).matmul(lib, x)
            ref = x.double() @ w[:, :k].double().t()
            bound = 64 * 2.0 ** -24 * (x.abs().double() @ w[:, :k].abs().double().t())
            assert bool(((y.double() - ref).abs() <= bound + 1e-30).all()), (n, k, m)
    with pytest.raises(ValueError, match="multiples of 32"):
        native.Lut4Weight(torch.zeros(48, dtype=torch.uint8), torch.ones(2, 3), table, 2, 48, 16)
    with pytest.raises(ValueError, match="float32"):
        native.Lut4Weight(torch.zeros(64, dtype=torch.uint8), torch.ones(2, 1), table, 2, 64, 64).matmul(
            lib, torch.zeros(1, 64, dtype=torch.float64))
