"""Input handling of fb.round / fb.encode / fb.decode: array types, dtypes, shapes, strides,
out=, and clear errors for everything else."""
import math

import numpy as np
import pytest
import torch

import fewbits as fb
from helpers import assert_same, generator, ml_dtypes_rounds_exactly, reference_round

ml_dtypes = pytest.importorskip("ml_dtypes")

FMT = "fp8_e4m3"
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NP_FLOATS = [np.float16, np.float32, np.float64]


def sample(shape=(5, 7), dtype=torch.float32, seed=0):
    g = generator(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 30).to(dtype)


def expected_round(x: torch.Tensor, fmt=FMT, mode="nearest_even", overflow=None, seed=0):
    return reference_round(x, fmt, mode, overflow, seed).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# types, dtypes, shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_torch_float_dtypes_keep_their_dtype(dtype):
    x = sample(dtype=dtype)
    y = fb.round(x, FMT)
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.shape == x.shape
    assert_same(y, expected_round(x), x)
    assert not torch.equal(x, y)  # something was rounded
    assert y.data_ptr() != x.data_ptr()  # x is left alone
    assert_same(fb.round(x, FMT), y)


@pytest.mark.parametrize("dtype", NP_FLOATS, ids=lambda d: d.__name__)
def test_numpy_in_numpy_out(dtype):
    x = sample(dtype=torch.float64).numpy().astype(dtype)
    before = x.copy()
    y = fb.round(x, FMT)
    assert isinstance(y, np.ndarray) and y.dtype == dtype and y.shape == x.shape
    assert_same(y, expected_round(torch.from_numpy(x)).numpy(), x)
    assert np.array_equal(x, before)  # the input is not modified
    codes = fb.encode(x, FMT)
    assert isinstance(codes, np.ndarray) and codes.dtype == np.uint8 and codes.shape == x.shape
    assert_same(fb.decode(codes, FMT).astype(np.float64), y.astype(np.float64))


def test_numpy_bfloat16_in_same_dtype_out():
    x = sample(dtype=torch.float32).numpy().astype(ml_dtypes.bfloat16)
    y = fb.round(x, FMT)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    assert_same(y.astype(np.float32), expected_round(xt).float().numpy(), x.astype(np.float32))
    # non-contiguous bfloat16 arrays too
    xt2 = x.T
    y2 = fb.round(xt2, FMT)
    assert y2.dtype == x.dtype and y2.shape == xt2.shape
    assert_same(y2.astype(np.float32), y.T.astype(np.float32))
    y3 = fb.round(x[:, ::-1], FMT)  # negative strides
    assert_same(y3.astype(np.float32), y[:, ::-1].astype(np.float32))


@pytest.mark.parametrize("n", [4, 3])
def test_encode_numpy_bfloat16_gives_codes(n):
    x = np.array([1.0, 2.0, 3.0, 4.0][:n], dtype=ml_dtypes.bfloat16)
    codes = fb.encode(x, FMT)
    assert codes.dtype == np.uint8 and codes.tolist() == [56, 64, 68, 72][:n]


def test_numpy_non_native_byte_order_input():
    x = sample(dtype=torch.float32).numpy()
    xb = x.astype(">f4")
    y = fb.round(xb, FMT)
    assert_same(np.asarray(y, dtype=np.float32), fb.round(x, FMT), x)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (17,), (2, 3, 4, 5), (1, 1, 1, 1, 1, 3)], ids=str)
def test_any_shape(shape):
    x = sample(shape)
    y = fb.round(x, FMT)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_same(y, expected_round(x), x)
    assert fb.encode(x, FMT).shape == x.shape
    assert fb.decode(fb.encode(x, FMT), FMT).shape == x.shape
    xn = x.numpy()
    yn = fb.round(xn, FMT)
    assert isinstance(yn, np.ndarray) and yn.shape == xn.shape


def test_zero_dim_values():
    assert fb.round(torch.tensor(1.3), FMT).item() == 1.25
    assert fb.round(np.array(1.3, dtype=np.float32), FMT).item() == 1.25
    assert fb.round(torch.tensor(1.3, dtype=torch.float64), "int4").item() == 1.0
    assert fb.encode(torch.tensor(1.0), FMT).item() == 0x38


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nearest_even", "stochastic"])
def test_non_contiguous_inputs(dtype, mode):
    base = sample((8, 12), dtype=dtype, seed=1)
    views = {
        "transposed": base.t(),
        "strided rows": base[::2],
        "strided cols": base[:, ::3],
        "negative-free slice": base[1:7, 2:9],
        "expanded": base[:1].expand(5, 12),
        "3d permuted": base.reshape(2, 4, 12).permute(2, 0, 1),
    }
    for what, v in views.items():
        assert not v.is_contiguous() or what == "negative-free slice"
        got = fb.round(v, FMT, mode, generator=generator(3))
        want = fb.round(v.contiguous(), FMT, mode, generator=generator(3))
        assert got.shape == v.shape and got.dtype == dtype
        assert_same(got, want, v, what)
        assert_same(got, expected_round(v.contiguous(), FMT, mode, seed=3), v, what)
        assert torch.equal(fb.encode(v, FMT, mode, generator=generator(3)),
                           fb.encode(v.contiguous(), FMT, mode, generator=generator(3)))


def test_non_contiguous_numpy():
    x = sample((6, 8), dtype=torch.float64).numpy()
    for v in (x.T, x[::2, 1::3]):
        assert_same(fb.round(v, FMT), fb.round(np.ascontiguousarray(v), FMT), v)


@pytest.mark.parametrize("dtype", NP_FLOATS, ids=lambda d: d.__name__)
def test_negative_stride_numpy(dtype):
    x = sample((6, 8), dtype=torch.float64).numpy().astype(dtype)
    v = x[:, ::-1]
    assert_same(fb.round(v, FMT), fb.round(np.ascontiguousarray(v), FMT), v)


def test_every_format_accepts_every_input_dtype():
    for fmt in fb.list_formats():
        for dtype in FLOAT_DTYPES:
            x = sample((4, 4), dtype=dtype, seed=2) / 30
            y = fb.round(x, fmt)
            assert y.dtype == dtype and y.shape == x.shape, fmt.name


# ---------------------------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_out_argument(dtype):
    x = sample(dtype=dtype)
    expected = expected_round(x)
    out = torch.empty_like(x)
    r = fb.round(x, FMT, out=out)
    assert r is out
    assert_same(out, expected, x)
    # in place
    xc = x.clone()
    r = fb.round(xc, FMT, out=xc)
    assert r is xc
    assert_same(xc, expected, x)
    # a non-contiguous out of the right shape and dtype
    out_t = torch.empty(x.shape[::-1], dtype=dtype).t()
    fb.round(x, FMT, out=out_t)
    assert_same(out_t, expected, x)
    # in place on a non-contiguous view writes through to its base
    base = sample((7, 5), dtype=dtype)
    view = base.t()
    fb.round(view, FMT, out=view)
    assert_same(base, expected_round(sample((7, 5), dtype=dtype)), base)


def test_out_with_stochastic_and_other_formats():
    x = sample((64,), dtype=torch.float32)
    for fmt in ("nf4", "int4", "e8m0", "bf16", "fp4_e2m1"):
        out = torch.full_like(x, 123.0)
        fb.round(x, fmt, "stochastic", generator=generator(4), out=out)
        assert_same(out, fb.round(x, fmt, "stochastic", generator=generator(4)), x, fmt)


def test_numpy_out():
    x = sample(dtype=torch.float32).numpy()
    out = np.zeros_like(x)
    r = fb.round(x, FMT, out=out)
    assert r is out
    assert_same(out, fb.round(x, FMT), x)
    xc = x.copy()
    fb.round(xc, FMT, out=xc)
    assert_same(xc, out, x)
    xb = x.astype(ml_dtypes.bfloat16)
    ob = np.zeros_like(xb)
    fb.round(xb, FMT, out=ob)
    assert_same(ob.astype(np.float32), fb.round(xb, FMT).astype(np.float32))


def test_numpy_bfloat16_non_contiguous_out():
    xb = sample((4, 6), dtype=torch.float32).numpy().astype(ml_dtypes.bfloat16)
    out = np.zeros((6, 4), dtype=ml_dtypes.bfloat16).T
    fb.round(xb, FMT, out=out)
    assert_same(out.astype(np.float32), fb.round(xb, FMT).astype(np.float32))


def test_numpy_non_native_byte_order_out():
    x = sample(dtype=torch.float32).numpy().astype(">f4")
    out = np.zeros_like(x)
    fb.round(x, FMT, out=out)
    assert_same(out.astype(np.float32), fb.round(x.astype(np.float32), FMT), x.astype(np.float32))


@pytest.mark.parametrize("bad_out", [
    torch.empty(7, 5), torch.empty(5, 7, dtype=torch.float64), torch.empty(35), torch.empty(5, 7, 1),
    torch.empty(5, 7, dtype=torch.float16),
], ids=["transposed shape", "float64", "flat", "extra dim", "float16"])
def test_wrong_out_is_a_value_error(bad_out):
    x = sample()
    before = bad_out.clone()
    with pytest.raises(ValueError, match="out"):
        fb.round(x, FMT, out=bad_out)
    assert torch.equal(bad_out.isnan(), before.isnan())


def test_wrong_numpy_out_is_a_value_error():
    x = sample().numpy()
    with pytest.raises(ValueError, match="out"):
        fb.round(x, FMT, out=np.zeros((7, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="out"):
        fb.round(x, FMT, out=np.zeros((5, 7), dtype=np.float64))
    with pytest.raises(TypeError):
        fb.round(x, FMT, out=[0.0] * 35)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    torch.arange(5), torch.arange(5, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8),
    torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.complex64), torch.ones(3, dtype=torch.complex128),
    torch.zeros(2, dtype=torch.float8_e4m3fn),
], ids=lambda t: str(t.dtype))
def test_non_float_tensors_are_type_errors_naming_the_dtype(bad):
    for fn in (fb.round, fb.encode):
        with pytest.raises(TypeError) as err:
            fn(bad, FMT)
        assert str(bad.dtype) in str(err.value)


@pytest.mark.parametrize("bad", [np.arange(5), np.arange(5, dtype=np.uint8), np.ones(3, dtype=bool),
                                 np.ones(3, dtype=np.complex64), np.array(["a"]),
                                 np.zeros(2, dtype=ml_dtypes.float8_e4m3fn)], ids=lambda a: str(a.dtype))
def test_non_float_arrays_are_type_errors_naming_the_dtype(bad):
    for fn in (fb.round, fb.encode):
        with pytest.raises(TypeError) as err:
            fn(bad, FMT)
        assert str(bad.dtype) in str(err.value)


@pytest.mark.parametrize("bad", [[1.0, 2.0], 1.5, (1.0,), None, "1.0"], ids=repr)
def test_non_arrays_are_type_errors(bad):
    with pytest.raises(TypeError, match="torch.Tensor or numpy.ndarray"):
        fb.round(bad, FMT)


@pytest.mark.parametrize("mode", ["nearest", "round_half_even", "NEAREST_EVEN", "", "truncate"])
def test_unknown_mode_lists_the_modes(mode):
    for fn in (fb.round, fb.encode):
        with pytest.raises(ValueError) as err:
            fn(sample(), FMT, mode=mode)
        msg = str(err.value)
        assert repr(mode) in msg and all(m in msg for m in fb.MODES)


@pytest.mark.parametrize("fmt,overflow", [("fp8_e4m3", "inf"), ("fp8_e4m3fnuz", "inf"), ("fp4_e2m1", "inf"),
                                          ("fp4_e2m1", "nan"), ("int8", "nan"), ("nf4", "inf"), ("e8m0", "inf"),
                                          ("fp8_e4m3", "clamp"), ("bf16", "Saturate")])
def test_invalid_overflow_is_a_value_error(fmt, overflow):
    for fn in (fb.round, fb.encode):
        with pytest.raises(ValueError, match="overflow|infinity|NaN"):
            fn(sample(), fmt, overflow=overflow)


def test_errors_come_before_any_write():
    x = sample()
    out = torch.full_like(x, 7.0)
    with pytest.raises(ValueError):
        fb.round(x, FMT, mode="nope", out=out)
    with pytest.raises(ValueError):
        fb.round(x, FMT, overflow="inf", out=out)
    assert bool((out == 7.0).all())


def test_unknown_format_name_in_round():
    with pytest.raises(ValueError, match="did you mean"):
        fb.round(sample(), "fp8_e4m4x")


def test_requires_grad_input():
    x = sample().requires_grad_()
    y = fb.round(x, FMT)
    assert_same(y, expected_round(x.detach()), x.detach())
    assert torch.equal(fb.encode(x, FMT), fb.encode(x.detach(), FMT))


def test_special_values_pass_through():
    x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0])
    y = fb.round(x, "fp8_e5m2")
    assert torch.isnan(y[:2]).all()
    assert y[2:].tolist() == [math.inf, -math.inf, 0.0, -0.0]
    assert torch.signbit(y[5]) and not torch.signbit(y[4])
    assert fb.round(x[2:], "fp8_e4m3").tolist() == [448.0, -448.0, 0.0, -0.0]
    assert torch.signbit(fb.round(x, "fp8_e4m3fnuz")[4:]).tolist() == [False, False]  # fnuz: no -0


# ---------------------------------------------------------------------------------------------
# issue 12, item 6: decode's dtype, and clear errors instead of internal ones
# ---------------------------------------------------------------------------------------------
from fractions import Fraction  # noqa: E402

from fewbits.kernels import dtypes as value_dtypes  # noqa: E402

F32_MAX = float(torch.finfo(torch.float32).max)
TORCH_FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def test_decode_of_formats_wider_than_float32_gives_float64():
    codes = fb.encode(torch.tensor([1e300, -2.5e-310, 1 / 3], dtype=torch.float64), "fp64")
    v = fb.decode(codes, "fp64")
    assert v.dtype == torch.float64 and v.tolist() == [1e300, -2.5e-310, 1 / 3]
    for name, x in (("e8m30", 1 + 2.0 ** -30), ("e11m40", (1 + 2.0 ** -40) * 2.0 ** 1000), ("e11m4", 1.0625 * 2.0 ** 200)):
        v = fb.decode(fb.encode(torch.tensor([x], dtype=torch.float64), name), name)
        assert v.dtype == torch.float64 and v.item() == x, name
    for name in ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "e8m0", "nf4", "int8", "fp4_e2m1"):
        assert fb.decode(torch.tensor([1]), name).dtype == torch.float32, name


@pytest.mark.parametrize("bad", [torch.int8, torch.int64, torch.uint8, torch.bool, torch.complex64, "int8", "bool"],
                         ids=str)
def test_decode_refuses_non_float_dtypes(bad):
    with pytest.raises(TypeError, match="not a floating dtype"):
        fb.decode(torch.tensor([126]), FMT, dtype=bad)  # 448 wrapped to -64 in int8


@pytest.mark.parametrize("bad", ["nope", "randn", 3, object()], ids=repr)
def test_decode_refuses_what_is_no_dtype(bad):
    with pytest.raises(TypeError, match="dtype"):
        fb.decode(torch.tensor([126]), FMT, dtype=bad)


def test_decode_dtype_by_name_or_numpy_dtype():
    codes = torch.tensor([126, 1, 0x80])
    want = fb.decode(codes, FMT, dtype=torch.float32)
    for spelling in ("float32", "torch.float32", "float", np.float32, np.dtype("float32")):
        got = fb.decode(codes, FMT, dtype=spelling)
        assert got.dtype == torch.float32 and torch.equal(got, want), spelling
    assert fb.decode(codes, FMT, dtype="bfloat16").dtype == torch.bfloat16
    assert fb.decode(codes, FMT, dtype=ml_dtypes.bfloat16).dtype == torch.bfloat16
    got = fb.decode(codes.numpy(), FMT, dtype="float16")
    assert isinstance(got, np.ndarray) and got.dtype == np.float16 and got.tolist()[0] == 448.0
    with pytest.raises(TypeError, match="numpy codes"):
        fb.decode(codes.numpy(), FMT, dtype=torch.bfloat16)


def test_decode_refuses_a_dtype_too_narrow_for_the_format():
    """Never a silent inf or NaN: the dtype must span the format's range and special values."""
    with pytest.raises(ValueError, match="cannot hold the range or special values of fp64"):
        fb.decode(torch.tensor([0]), "fp64", dtype=torch.float32)  # 1e300 -> inf
    with pytest.raises(ValueError, match="cannot hold the range or special values of bf16"):
        fb.decode(torch.tensor([0x7F7F]), "bf16", dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot hold"):
        fb.decode(torch.tensor([0x7C]), "fp8_e5m2", dtype=torch.float8_e4m3fn)  # inf
    with pytest.raises(ValueError, match="cannot hold"):
        fb.decode(torch.tensor([0x80]), FMT, dtype=torch.float8_e8m0fnu)  # no zero, no sign
    # exact ones are accepted, and float64 always
    assert fb.decode(torch.tensor([0x7E]), FMT, dtype=torch.float8_e4m3fn).float().item() == 448.0
    assert fb.decode(torch.tensor([0x7E]), FMT, dtype=torch.float16).item() == 448.0
    assert fb.decode(torch.tensor([0x7FFF]), "e3m56", dtype=torch.float64).dtype == torch.float64


def test_decode_to_a_coarser_dtype_of_the_same_range_rounds_like_a_cast():
    book = fb.LookupFormat("f64_only", [-1.0, 0.0, 1 + 2.0 ** -40, 2.5])
    v = fb.decode(torch.tensor([2, 3]), book, dtype=torch.float32)  # as quantized layers compute
    assert v.dtype == torch.float32 and v.tolist() == [1.0, 2.5]
    assert fb.decode(torch.tensor([2]), book).dtype == torch.float64  # the default loses nothing
    half = fb.encode(torch.tensor([1 + 2.0 ** -8, 3 + 2.0 ** -7]), "fp16")
    assert fb.decode(half, "fp16", dtype=torch.bfloat16).tolist() == [1.0, 3.0]  # ties to even, as .to()
    with pytest.raises(ValueError, match="of tf32"):  # tf32's max rounds to 2^128 in bfloat16
        fb.decode(half, "tf32", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", TORCH_FLOATS, ids=str)
def test_holds_agrees_with_the_casts_of_every_value(dtype):
    """The layout rule deciding decode's dtypes, against torch's own cast of every value."""
    for fmt in fb.list_formats() + [fb.get_format(n) for n in ("e8m3fn", "ue5m3", "e3m2nosub", "int16")]:
        if fmt.bits > 16:
            continue
        v = fb.decode(torch.arange(fmt.num_values if isinstance(fmt, fb.LookupFormat) else 2 ** fmt.bits),
                      fmt, dtype=torch.float64)
        back = v.to(dtype).to(torch.float64)
        exact = bool((((back == v) & (torch.signbit(back) == torch.signbit(v))) | (v.isnan() & back.isnan())).all())
        assert value_dtypes.holds(dtype, fmt) == exact, (fmt.name, dtype)


def test_wide_formats_are_held_as_the_layouts_say():
    assert value_dtypes.holds(torch.float64, fb.get_format("fp32"))
    assert value_dtypes.holds(torch.float32, fb.get_format("tf32"))
    assert value_dtypes.holds(torch.float32, fb.get_format("int25"))  # -2^24 .. 2^24 - 1
    assert not value_dtypes.holds(torch.float32, fb.get_format("uint25"))
    for name in ("fp64", "e8m30", "e11m40", "e8m23fn"):  # e8m23fn: fp32's layout, larger max
        assert not value_dtypes.holds(torch.float32, fb.get_format(name)), name


@pytest.mark.parametrize("bad", [0, 1234, np.random.default_rng(0), np.random.RandomState(0), "seed"], ids=repr)
def test_generator_must_be_a_torch_generator(bad):
    x = sample()
    out = torch.full_like(x, 7.0)
    for mode in ("stochastic", "nearest_even"):
        with pytest.raises(TypeError, match="torch.Generator or None"):
            fb.round(x, FMT, mode, generator=bad, out=out)
        with pytest.raises(TypeError, match="torch.Generator or None"):
            fb.encode(x, FMT, mode, generator=bad)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("to_sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
def test_sparse_tensors_are_type_errors(to_sparse):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: sparse CSR support is in beta
        s = to_sparse(sample((4, 4)))
        codes = to_sparse(torch.ones(4, 4, dtype=torch.int64))
    for fn in (fb.round, fb.encode):
        with pytest.raises(TypeError, match="sparse.*to_dense"):
            fn(s, FMT)
    with pytest.raises(TypeError, match="sparse"):
        fb.decode(codes, FMT)
    with pytest.raises(TypeError, match="out is a sparse"):
        fb.round(sample((4, 4)), FMT, out=s)


def test_uint64_codes_above_2_63_are_reported_as_they_are():
    big = np.array([2 ** 63 + 5, 3], dtype=np.uint64)
    with pytest.raises(ValueError, match=f"codes range 3..{2 ** 63 + 5} is outside 0..255"):
        fb.decode(big, FMT)
    with pytest.raises(ValueError, match=f"codes range {2 ** 64 - 1}..{2 ** 64 - 1} is outside"):
        fb.decode(np.array([2 ** 64 - 1], dtype=np.uint64), FMT)
    with pytest.raises(ValueError, match=f"codes range 3..{2 ** 63 + 5} is outside"):
        fb.decode(torch.from_numpy(big.view(np.int64)).view(torch.uint64), FMT)
    assert fb.decode(np.array([0x7E, 1], dtype=np.uint64), FMT).tolist() == [448.0, 2.0 ** -9]
    # 64-bit formats read uint64 codes as their bit patterns
    v = fb.decode(np.array([0x8000000000000000, 0x3FF0000000000000], dtype=np.uint64), "fp64")
    assert v.dtype == np.float64 and v.tolist() == [0.0, 1.0] and np.signbit(v[0])


def test_a_group_longer_than_any_row_is_refused_before_allocating():
    scheme = fb.QuantScheme("int4", "group", group_size=10 ** 9)
    with pytest.raises(ValueError, match="group_size 1000000000 is longer than the rows"):
        fb.quantize(torch.randn(8, 64), scheme)  # was: an attempt to allocate 32 GB
    with pytest.raises(ValueError, match="group_size"):
        fb.quantize(torch.randn(8, 64), fb.QuantScheme("int8", "group", group_size=2 ** 20))
    # groups somewhat longer than short rows stay allowed (a preset's 128 on a 40-wide layer)
    q = fb.quantize(torch.randn(6, 40), "int4")
    assert q.dequantize().shape == (6, 40)


# ---------------------------------------------------------------------------------------------
# issue 12, item 10: formats beyond float32's range given float32 input; E8M0 against torch
# ---------------------------------------------------------------------------------------------
def test_float32_results_beyond_float32_are_refused_not_inf():
    e11m4 = fb.FloatFormat(11, 4)
    x = torch.tensor([3.35e38, 1.0], dtype=torch.float32)  # 3.35e38 rounds to 2^128
    for ovf in ("saturate", "inf", None):
        with pytest.raises(ValueError, match="beyond float32's range"):
            fb.round(x, e11m4, overflow=ovf)
    with pytest.raises(ValueError, match="beyond float32's range"):
        fb.round(x.numpy(), e11m4)
    out = torch.full_like(x, 7.0)
    with pytest.raises(ValueError, match="beyond float32's range"):
        fb.round(x, e11m4, out=out)
    assert bool((out == 7.0).all())
    assert fb.round(x.double(), e11m4, overflow="saturate").tolist() == [2.0 ** 128, 1.0]
    inf = torch.tensor([math.inf, -math.inf])
    with pytest.raises(ValueError, match="beyond float32's range"):
        fb.round(inf, "fp64", overflow="saturate")  # fp64's max is no float32
    with pytest.raises(ValueError, match="beyond float32's range"):  # no inf: inf saturates in every mode
        fb.round(inf, fb.FloatFormat(9, 4, specials="none"), mode="toward_zero")
    assert fb.round(inf, e11m4, mode="toward_zero").tolist() == [math.inf, -math.inf]  # inf is a value of e11m4


def test_float32_results_within_float32_stay_float32_and_exact():
    e11m4 = fb.FloatFormat(11, 4)
    x = sample((64,)) * 1e30
    x = torch.cat([x, torch.tensor([3.2e38, -1e-45, math.inf, math.nan])])
    for mode in fb.MODES:
        y = fb.round(x, e11m4, mode, generator=generator(5))
        want = fb.round(x.double(), e11m4, mode, generator=generator(5))
        assert y.dtype == torch.float32 and torch.equal(y.double().nan_to_num(7.0), want.nan_to_num(7.0)), mode
        out = torch.empty_like(x)
        fb.round(x, e11m4, mode, generator=generator(5), out=out)
        assert torch.equal(out.nan_to_num(7.0), y.nan_to_num(7.0))
    assert torch.equal(fb.round(x, "fp64").nan_to_num(7.0), x.nan_to_num(7.0))  # identity, float32


def _e8m0_subnormals():
    """float32 values from 2^-127 to 2^-126: the subnormals in between, ties and ends."""
    inner = torch.arange(0x00400000, 0x00800000 + 1, 0x1000, dtype=torch.int32)
    edges = torch.tensor([0x00400000, 0x00400001, 0x005FFFFF, 0x00600000, 0x00600001, 0x007FFFFF], dtype=torch.int32)
    return torch.cat([inner, edges]).view(torch.float32)


def test_e8m0_float32_subnormals_against_torch_and_ml_dtypes():
    """Documented in fb.round: torch (and ml_dtypes before 0.7) give 2^-126 for every float32
    strictly between 2^-127 and 2^-126; fewbits (and ml_dtypes 0.7+) give the nearest power of
    two, fewbits also under nearest_away."""
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch has no float8_e8m0fnu")
    lo, hi = 2.0 ** -127, 2.0 ** -126
    x = _e8m0_subnormals()
    inside = (x > lo) & (x < hi)
    torch_v = x.to(torch.float8_e8m0fnu).float()
    ml_v = torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert bool((torch_v[inside] == hi).all())
    if ml_dtypes_rounds_exactly():
        assert torch.equal(ml_v, fb.round(x, "e8m0", "nearest_away", overflow="torch"))
    else:
        assert torch.equal(torch_v, ml_v)
    tie = 1.5 * lo
    for mode in ("nearest_even", "nearest_away"):
        ours = fb.round(x, "e8m0", mode, overflow="torch")
        nearest = torch.where(x < tie, lo, hi)
        if mode == "nearest_even":
            nearest = torch.where(x == tie, lo, nearest)  # the tie goes to the even code (2^-127)
        assert torch.equal(ours, nearest.float()), mode
        differ = ours != torch_v
        assert bool(inside[differ].all()) and bool(differ[(x > lo) & (x < tie)].all()), mode
    # elsewhere nearest_away with overflow="torch" equals torch (ml_dtypes too, but for 0 -> NaN)
    other = torch.tensor([0x3FC00000, 0x00C00000, 0x00FFFFFF, 0x7F400000, 0x7F7FFFFF, 0x7F800000, 0x00000001,
                          0x003FFFFF, 0x00000000], dtype=torch.int32).view(torch.float32)
    other = torch.cat([other, sample((256,)).abs() * 1e3])
    ours = fb.round(other, "e8m0", "nearest_away", overflow="torch")
    theirs = other.to(torch.float8_e8m0fnu).float()
    assert torch.equal(ours.nan_to_num(-1.0), theirs.nan_to_num(-1.0))


def test_pack_and_unpack_refuse_sparse_tensors():
    with pytest.raises(TypeError, match="codes is a sparse_coo tensor"):
        fb.pack(torch.ones(4, dtype=torch.uint8).to_sparse(), 4)
    with pytest.raises(TypeError, match="packed is a sparse_coo tensor"):
        fb.unpack(torch.ones(4, dtype=torch.uint8).to_sparse(), 4, 8)
