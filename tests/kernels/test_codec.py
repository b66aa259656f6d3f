"""encode/decode: every code of every format up to 16 bits against the reference, round trips,
code dtypes, and NaN into formats without NaN."""
import math

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits import FloatFormat, LookupFormat
from fewbits.formats import decode_value, encode_value
from fewbits.kernels import code_dtype
from helpers import (assert_same, boundary_inputs, boundary_reference, fmt_id, generator,
                     random_wide_floats, reference_encode, reference_round, same_mask, valid_overflows)

F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(autouse=True)
def _eager_kernels():
    """Eager kernels: the compiled ones are specialised per format and take seconds each to
    compile; they are compared with the reference in test_round_exact.py."""
    with fb.use_backend("eager"):
        yield


CUSTOM = [fb.get_format(n) for n in ("e5m7", "ue4m3", "e3m2nosub", "e4m3fnu", "e5m2b13", "int12", "uint10",
                                     "uint1")] + [
    FloatFormat(3, 1, specials="none", zero=False, subnormals=False),
    FloatFormat(4, 3, specials="fnuz", subnormals=False),
    FloatFormat(2, 0, specials="fn"),
    FloatFormat(8, 0, bias=130, specials="fn", subnormals=False, zero=False, signed=False),
    LookupFormat("uneven", [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0, 8.0, 9.0, 100.0]),
]
UP_TO_16 = [f for f in fb.list_formats() if f.bits <= 16] + CUSTOM
UP_TO_8 = [f for f in UP_TO_16 if f.bits <= 8]
ALL = fb.list_formats() + CUSTOM


def n_codes(fmt) -> int:
    return fmt.num_values if fmt.kind == "lookup" else 2 ** fmt.bits


def is_canonical(fmt, code: int) -> bool:
    """False for codes encode never produces: NaN payloads other than the format's NaN codes and
    the duplicate zeros of formats without subnormals."""
    if not isinstance(fmt, FloatFormat):
        return True
    kind = fmt.code_kind(code)
    if kind == "nan":
        return code in (fmt.nan_code(False), fmt.nan_code(True))
    if kind == "finite" and fmt.decode_code(code) == 0:
        return code == 0 or (fmt.has_negative_zero and code == 1 << (fmt.bits - 1))
    return True


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", UP_TO_16, ids=fmt_id)
def test_decode_every_code_equals_reference(fmt):
    codes = torch.arange(n_codes(fmt), dtype=torch.int64)
    expected = torch.tensor([decode_value(c, fmt) for c in codes.tolist()], dtype=torch.float64)
    got = fb.decode(codes, fmt)
    float32_holds_all = bool(same_mask(expected.float(), expected).all())
    assert got.shape == codes.shape and got.dtype in (torch.float32, torch.float64)
    assert float32_holds_all or got.dtype == torch.float64
    if fmt.kind != "float" or fmt.emin >= -126:  # every value a normal float32 or zero: float32
        assert got.dtype == torch.float32
    assert_same(got, expected, codes, f"{fmt.name} decode")
    assert_same(fb.decode(codes, fmt, dtype=torch.float64), expected, codes, f"{fmt.name} decode float64")
    # any integer dtype that holds the codes, any shape
    small = codes.to(code_dtype(fmt.bits))
    assert_same(fb.decode(small.reshape(-1, 1), fmt).reshape(-1), got, codes, "code dtype")


@pytest.mark.parametrize("values", [[-1.0, 0.0, 1.0], [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0]], ids=["3", "5"])
def test_decode_codebook_of_any_size(values):
    book = LookupFormat("book", values)
    codes = torch.arange(len(values))
    assert fb.decode(codes, book).tolist() == values
    assert fb.decode(fb.encode(torch.tensor(values), book), book).tolist() == values


def test_decode_codebook_with_float64_values_is_exact():
    book = LookupFormat("f64_only", [1 + 2.0 ** -40, 1 + 2.0 ** -30, 1 + 2.0 ** -20, 2.5])
    got = fb.decode(torch.arange(4), book)
    assert got.tolist() == list(book.table)


@pytest.mark.parametrize("name", ["tf32", "fp32", "fp64", "int24", "int32", "uint32"])
def test_decode_wide_formats_on_sampled_codes(name):
    fmt = fb.get_format(name)
    g = np.random.default_rng(0)
    codes = [int(c) for c in g.integers(0, 2 ** fmt.bits, 5000, dtype=np.uint64)] + [0, 1, 2 ** fmt.bits - 1]
    expected = torch.tensor([decode_value(c, fmt) for c in codes], dtype=torch.float64)
    if name == "fp64":
        t = torch.tensor(np.array(codes, dtype=np.uint64).view(np.int64))  # bit patterns as int64
    else:
        t = torch.tensor(codes, dtype=torch.int64)
    got = fb.decode(t, fmt, dtype=torch.float64)
    assert_same(got, expected, None, f"{name} decode")


def test_decode_rejects_bad_codes():
    with pytest.raises(ValueError, match="outside"):
        fb.decode(torch.tensor([256]), "fp8_e4m3")
    with pytest.raises(ValueError, match="outside"):
        fb.decode(torch.tensor([-1]), "fp8_e4m3")
    with pytest.raises(ValueError, match="outside"):
        fb.decode(torch.tensor([16]), "nf4")
    with pytest.raises(ValueError, match="outside"):
        fb.decode(torch.tensor([16]), "fp4_e2m1")
    with pytest.raises(TypeError, match="integer"):
        fb.decode(torch.tensor([1.0]), "fp8_e4m3")
    with pytest.raises(TypeError, match="integer"):
        fb.decode(torch.tensor([True]), "fp8_e4m3")
    with pytest.raises(TypeError, match="integer"):
        fb.decode(np.array([1.0]), "fp8_e4m3")
    with pytest.raises(TypeError):
        fb.decode([1, 2], "fp8_e4m3")


def test_decode_numpy_in_numpy_out():
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    out = fb.decode(codes, "fp8_e5m2")
    assert isinstance(out, np.ndarray) and out.shape == (16, 16) and out.dtype == np.float32
    assert_same(out, fb.decode(torch.from_numpy(codes), "fp8_e5m2"))
    assert fb.decode(np.array([0x3C00], dtype=np.uint16), "fp16").tolist() == [1.0]
    assert fb.decode(np.array([], dtype=np.uint8), "fp8_e4m3").shape == (0,)


# ---------------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", UP_TO_16 + [fb.get_format("tf32")], ids=fmt_id)
def test_encode_of_decode_is_identity_on_canonical_codes(fmt):
    codes = torch.arange(n_codes(fmt), dtype=torch.int64)
    values = fb.decode(codes, fmt, dtype=torch.float64)
    back = fb.encode(values, fmt).to(torch.int64)
    canonical = torch.tensor([is_canonical(fmt, c) for c in codes.tolist()]) if fmt.bits <= 16 else None
    if canonical is None:  # tf32: NaN payloads are the only non-canonical codes
        canonical = ~torch.isnan(values) | (codes == fmt.nan_code(False)) | (codes == fmt.nan_code(True))
    bad = canonical & (back != codes)
    assert not bad.any(), f"{fmt.name}: codes {codes[bad][:8].tolist()} -> {back[bad][:8].tolist()}"
    # non-canonical codes go to the canonical code of the same value (and sign)
    for c in codes[~canonical].tolist()[:64]:
        v = decode_value(c, fmt)
        assert int(back[c]) == encode_value(v, fmt), (fmt.name, c)


@pytest.mark.parametrize("name", ["fp32", "fp64"])
def test_encode_of_decode_wide(name):
    fmt = fb.get_format(name)
    x = random_wide_floats(5000, seed=4, dtype=torch.float64 if name == "fp64" else torch.float32,
                           lo=-1100 if name == "fp64" else -160, hi=1000 if name == "fp64" else 130)
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, 5e-324, 1e-45], dtype=x.dtype)])
    codes = fb.encode(x, fmt)
    assert codes.dtype == torch.int64
    itype = torch.int64 if name == "fp64" else torch.int32
    assert torch.equal(codes.to(itype), x.view(itype)), "codes are the IEEE bit patterns"
    assert_same(fb.decode(codes, fmt, dtype=x.dtype), x, x, f"{name} round trip")


@pytest.mark.parametrize("fmt", ALL, ids=fmt_id)
def test_decode_of_encode_equals_round(fmt):
    for dtype in (torch.float32, torch.float64):
        x = torch.cat([random_wide_floats(1200, seed=fmt.bits, dtype=dtype, lo=-40, hi=40),
                       (torch.rand(600, generator=generator(1), dtype=torch.float64) * 2 - 1).to(dtype) * fmt.max,
                       torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45], dtype=dtype)])
        if fmt.has_nan:
            x = torch.cat([x, torch.tensor([math.nan, -math.nan], dtype=dtype)])
        for mode in fb.MODES:
            for ovf in valid_overflows(fmt):
                c = fb.encode(x, fmt, mode, ovf, generator=generator(3))
                assert c.dtype == code_dtype(fmt.bits) and c.shape == x.shape
                back64 = fb.decode(c, fmt, dtype=torch.float64)
                if dtype == torch.float32 and bool((back64.isfinite() & (back64.abs() > F32_MAX)).any()):
                    # a finite result float32 cannot hold is refused, never a silent inf (fp64 saturating inf)
                    with pytest.raises(ValueError, match="beyond float32's range"):
                        fb.round(x, fmt, mode, ovf, generator=generator(3))
                    continue
                r = fb.round(x, fmt, mode, ovf, generator=generator(3))
                assert_same(back64.to(dtype), r, x, f"{fmt.name} {mode} {ovf} {dtype}")


@pytest.mark.parametrize("fmt", UP_TO_8, ids=fmt_id)
def test_encode_equals_reference_on_boundaries(fmt):
    """Codes equal encode_value's in every mode and policy. The code of a result is the reference
    code of the reference's rounded value, so the cached reference rounding is reused."""
    x = boundary_inputs(fmt, torch.float32)
    keep = torch.ones_like(x, dtype=torch.bool) if fmt.has_nan else ~torch.isnan(x)
    code_of = {}
    for mode in fb.MODES:
        for ovf in valid_overflows(fmt):
            if mode == "stochastic" and not fmt.has_nan:  # the random words follow the element index
                ref = reference_round(x[keep], fmt, mode, ovf, 7)
            else:
                ref = boundary_reference(fmt, torch.float32, mode, ovf, 7)[keep]
            expected = []
            for v in ref.tolist():
                key = (v, math.copysign(1, v)) if not math.isnan(v) else ("nan", math.copysign(1, v))
                if key not in code_of:
                    code_of[key] = encode_value(v, fmt)
                expected.append(code_of[key])
            got = fb.encode(x[keep], fmt, mode, ovf, generator=generator(7))
            assert got.tolist() == expected, f"{fmt.name} {mode} {ovf}"


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "e8m0", "nf4", "int4", "uint3", "ue4m3"])
def test_encode_equals_encode_value_directly(name):
    fmt = fb.get_format(name)
    x = boundary_inputs(fmt, torch.float64)
    x = x if fmt.has_nan else x[~torch.isnan(x)]
    x = x[torch.randperm(x.numel(), generator=generator(0))[:600]]
    for mode in fb.MODES:
        for ovf in valid_overflows(fmt):
            got = fb.encode(x, fmt, mode, ovf, generator=generator(5))
            assert got.tolist() == reference_encode(x, fmt, mode, ovf, seed=5), f"{name} {mode} {ovf}"


@pytest.mark.parametrize("fmt,dtype", [
    ("fp4_e2m1", torch.uint8), ("nf4", torch.uint8), ("int8", torch.uint8), ("uint2", torch.uint8),
    ("fp8_e4m3", torch.uint8), ("e8m0", torch.uint8), ("e3m2nosub", torch.uint8),
    ("bf16", torch.int32), ("fp16", torch.int32), ("e5m7", torch.int32), ("int12", torch.int32),
    ("uint16", torch.int32), ("tf32", torch.int64), ("fp32", torch.int64), ("int24", torch.int64),
    ("fp64", torch.int64),
])
def test_code_dtypes(fmt, dtype):
    x = torch.tensor([[0.5, -1.0], [2.0, 3.0]])
    codes = fb.encode(x, fmt)
    assert codes.dtype == dtype and codes.shape == (2, 2)
    npc = fb.encode(x.numpy(), fmt)
    assert isinstance(npc, np.ndarray) and npc.dtype == torch.empty(0, dtype=dtype).numpy().dtype
    assert npc.tolist() == codes.tolist()
    assert fb.encode(torch.empty(0, 3), fmt).shape == (0, 3)


def test_integer_codes_are_twos_complement():
    assert fb.encode(torch.tensor([-1.0, -8.0, 7.0, 0.0]), "int4").tolist() == [15, 8, 7, 0]
    assert fb.encode(torch.tensor([-1.0, 100.0]), "int8").tolist() == [255, 100]
    assert fb.encode(torch.tensor([-1.0, 300.0]), "uint8").tolist() == [0, 255]
    assert fb.encode(torch.tensor([-1.0]), "int24").tolist() == [2 ** 24 - 1]
    assert fb.decode(torch.tensor([15, 8]), "int4").tolist() == [-1.0, -8.0]


@pytest.mark.parametrize("name", [f.name for f in fb.list_formats() if not f.has_nan])
def test_nan_into_format_without_nan_is_refused(name):
    x = torch.tensor([1.0, math.nan, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        fb.encode(x, name)
    with pytest.raises(ValueError, match="NaN"):
        fb.encode(x.double().numpy(), name, mode="stochastic")
    fmt = fb.get_format(name)
    if fmt.kind == "float" and fmt.specials == "none":
        with pytest.raises(ValueError):
            encode_value(math.nan, fmt)
    assert torch.isnan(fb.round(x, name))[1]  # round() keeps NaN as a float NaN


@pytest.mark.parametrize("name", [f.name for f in fb.list_formats() if f.has_nan and f.bits <= 16])
def test_nan_into_format_with_nan_gets_its_nan_code(name):
    fmt = fb.get_format(name)
    codes = fb.encode(torch.tensor([math.nan, -math.nan]), fmt).tolist()
    assert codes == [fmt.nan_code(False), fmt.nan_code(True)]
    assert all(math.isnan(decode_value(c, fmt)) for c in codes)
