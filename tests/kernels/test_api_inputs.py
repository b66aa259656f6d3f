"""Input handling of fb.round / fb.encode / fb.decode: array types, dtypes, shapes, strides,
out=, and clear errors for everything else."""
import math

import numpy as np
import pytest
import torch

import fewbits as fb
from helpers import assert_same, generator, reference_round

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
