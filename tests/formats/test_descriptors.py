"""Format descriptors: layout properties against ml_dtypes/torch finfo and hand-known constants,
decoding of every code against ml_dtypes and torch, names and aliases, and bad input."""
import dataclasses
import math

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits import FloatFormat, IntFormat, LookupFormat
from fewbits.formats import aliases_of, decode_value
from helpers import ORACLE_TYPES, assert_same, fmt_id

ml_dtypes = pytest.importorskip("ml_dtypes")

ALL = fb.list_formats()

SHARED = ORACLE_TYPES


def np_type(name):
    return np.dtype(name).type if name in ("float16", "float32", "float64") else getattr(ml_dtypes, name)


def test_registry_has_everything_the_issue_asks_for():
    names = {f.name for f in ALL}
    needed = {"fp64", "fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e4m3_ieee", "fp8_e4m3fnuz",
              "fp8_e4m3b11fnuz", "fp8_e5m2", "fp8_e5m2fnuz", "fp8_e3m4", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1",
              "e8m0", "nf4", "iq4_nl"}
    needed |= {f"int{b}" for b in range(2, 9)} | {f"uint{b}" for b in range(2, 9)}
    assert needed <= names
    assert len(names) == len(ALL)
    assert {f.kind for f in ALL} == {"float", "int", "lookup"}
    assert fb.list_formats("lookup") == [fb.get_format("nf4"), fb.get_format("iq4_nl")]
    assert all(f.kind == "int" for f in fb.list_formats("int"))


# ---------------------------------------------------------------------------------------------
# self-consistency of every registered format
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [f for f in ALL if f.bits <= 16], ids=fmt_id)
def test_values_agree_with_the_scalar_properties(fmt):
    vals = fmt.values()
    assert vals.dtype == torch.float64
    assert fmt.num_values == vals.numel()
    assert bool((vals[1:] > vals[:-1]).all()), "ascending and distinct"
    assert not torch.signbit(vals[vals == 0]).any(), "zero appears once, as +0"
    assert fmt.max == vals[-1].item()
    assert fmt.lowest == vals[0].item()
    pos = vals[vals > 0]
    if fmt.kind == "float":
        assert fmt.bits == int(fmt.signed) + fmt.exp_bits + fmt.man_bits
        assert pos[0].item() == (fmt.min_subnormal if fmt.subnormals else fmt.min_normal)
        assert fmt.min_normal == 2.0 ** fmt.emin
        if fmt.min_subnormal is not None and fmt.man_bits:
            assert fmt.min_subnormal == fmt.min_normal * 2.0 ** -fmt.man_bits
        if (vals == 1).any():
            i = int((vals == 1).nonzero())
            assert fmt.eps == vals[i + 1].item() - 1
        assert fmt.decimal_digits == pytest.approx((fmt.man_bits + 1) * math.log10(2))
        assert fmt.has_negative_zero == (fmt.signed and fmt.specials not in ("fnuz",) and fmt.zero)
    elif fmt.kind == "int":
        assert fmt.min_normal == 1.0 and fmt.min_subnormal is None and fmt.eps == 1.0
    else:
        assert fmt.min_normal == pos[0].item()
    if fmt.kind == "float":
        assert fmt.lowest == (-fmt.max if fmt.signed else pos[0].item() if not fmt.zero else 0.0)


@pytest.mark.parametrize("fmt", ALL, ids=fmt_id)
def test_specials_flags_match_the_codes(fmt):
    """has_inf/has_nan say whether some code decodes to inf/NaN (all codes up to 16 bits, else a sample)."""
    n = 2 ** fmt.bits if fmt.kind != "lookup" else fmt.num_values
    if n <= 1 << 16:
        codes = range(n)
    else:  # the all-ones exponent field with the smallest and largest mantissa, and some others
        top = fmt.max_field << fmt.man_bits
        codes = [0, 1, n // 2 - 1, n // 2, n // 2 + 1, n - 1, top, top + 1, top + (1 << fmt.man_bits) - 1, top - 1]
    vals = [decode_value(c, fmt) for c in codes]
    assert any(math.isinf(v) for v in vals) == fmt.has_inf
    assert any(math.isnan(v) for v in vals) == fmt.has_nan
    assert fmt.check_overflow(None) == fmt.default_overflow
    assert fmt.default_overflow == ("inf" if fmt.has_inf else "saturate")


def test_formats_are_immutable_hashable_values():
    a = FloatFormat(4, 3, specials="fn")
    assert a == fb.get_format("fp8_e4m3") and hash(a) == hash(fb.get_format("fp8_e4m3"))
    assert FloatFormat(4, 3) != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.man_bits = 2
    assert IntFormat(4) == fb.get_format("int4") and IntFormat(4) != IntFormat(4, signed=False)
    assert hash(IntFormat(4)) == hash(fb.get_format("int4"))
    assert LookupFormat("other", fb.get_format("nf4").table) == fb.get_format("nf4")
    assert len({fb.get_format("e4m3"), FloatFormat(4, 3, specials="fn"), fb.get_format("fp8")}) == 1


# ---------------------------------------------------------------------------------------------
# against ml_dtypes.finfo and torch.finfo
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SHARED)
def test_properties_match_ml_dtypes_finfo(name):
    fmt = fb.get_format(name)
    fi = ml_dtypes.finfo(np_type(SHARED[name][0]))
    assert fmt.bits == fi.bits
    assert fmt.max == float(fi.max)
    assert fmt.lowest == float(fi.min)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.eps == float(fi.eps)
    assert fmt.man_bits == fi.nmant
    if name == "e8m0":
        # ml_dtypes reports its smallest value as "subnormal"; fewbits says E8M0 has no subnormals
        assert fmt.min_subnormal is None and float(fi.smallest_subnormal) == fmt.min_normal
    else:
        assert fmt.min_subnormal == float(fi.smallest_subnormal)


@pytest.mark.parametrize("name", [n for n, (_, t) in SHARED.items() if t])
def test_properties_match_torch_finfo(name):
    fmt = fb.get_format(name)
    fi = torch.finfo(getattr(torch, SHARED[name][1]))
    assert fmt.bits == fi.bits
    assert fmt.max == fi.max
    assert fmt.min_normal == fi.smallest_normal
    if name == "fp8_e5m2fnuz":
        # torch 2.13 reports eps 0.125 for float8_e5m2fnuz although it has 2 mantissa bits
        # (1 and 1.25 are neighbours; ml_dtypes says 0.25); fewbits follows the values
        assert fmt.eps == 0.25
    else:
        assert fmt.eps == fi.eps


HAND_KNOWN = {
    # name: (bits, max, min_normal, min_subnormal, eps, has_inf, has_nan, num_values)
    "fp8_e4m3": (8, 448.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -3, False, True, 253),
    "fp8_e4m3_ieee": (8, 240.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -3, True, True, 239),
    "fp8_e4m3fnuz": (8, 240.0, 2.0 ** -7, 2.0 ** -10, 2.0 ** -3, False, True, 255),
    "fp8_e4m3b11fnuz": (8, 30.0, 2.0 ** -10, 2.0 ** -13, 2.0 ** -3, False, True, 255),
    "fp8_e5m2": (8, 57344.0, 2.0 ** -14, 2.0 ** -16, 2.0 ** -2, True, True, 247),
    "fp8_e5m2fnuz": (8, 57344.0, 2.0 ** -15, 2.0 ** -17, 2.0 ** -2, False, True, 255),
    "fp8_e3m4": (8, 15.5, 2.0 ** -2, 2.0 ** -6, 2.0 ** -4, True, True, 223),
    "fp6_e3m2": (6, 28.0, 2.0 ** -2, 2.0 ** -4, 2.0 ** -2, False, False, 63),
    "fp6_e2m3": (6, 7.5, 1.0, 2.0 ** -3, 2.0 ** -3, False, False, 63),
    "fp4_e2m1": (4, 6.0, 1.0, 0.5, 0.5, False, False, 15),
    "e8m0": (8, 2.0 ** 127, 2.0 ** -127, None, 1.0, False, True, 255),
    "tf32": (19, (2 - 2.0 ** -10) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -136, 2.0 ** -10, True, True,
             2 * (254 * 1024 + 1023) + 1),
    "bf16": (16, (2 - 2.0 ** -7) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -133, 2.0 ** -7, True, True, 65279),
    "fp16": (16, 65504.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -10, True, True, 63487),
    "fp32": (32, float(np.finfo(np.float32).max), 2.0 ** -126, 2.0 ** -149, 2.0 ** -23, True, True,
             2 ** 32 - 2 * 2 ** 23 - 1),
    "fp64": (64, float(np.finfo(np.float64).max), 2.0 ** -1022, 5e-324, 2.0 ** -52, True, True,
             2 ** 64 - 2 * 2 ** 52 - 1),
}


@pytest.mark.parametrize("name", HAND_KNOWN)
def test_hand_known_constants(name):
    fmt = fb.get_format(name)
    bits, mx, mn, sub, eps, inf, nan, count = HAND_KNOWN[name]
    assert (fmt.bits, fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.eps, fmt.has_inf, fmt.has_nan) == \
           (bits, mx, mn, sub, eps, inf, nan)
    assert fmt.num_values == count


def test_small_formats_value_lists():
    assert fb.get_format("fp4_e2m1").values().tolist() == \
        [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    e8 = fb.get_format("e8m0").values()
    assert e8.tolist() == [2.0 ** k for k in range(-127, 128)]
    assert not fb.get_format("e8m0").signed and fb.get_format("e8m0").lowest == 2.0 ** -127
    e2m3 = fb.get_format("fp6_e2m3").values()
    assert e2m3[e2m3 >= 0].tolist() == [i / 8 for i in range(8)] + [1 + i / 8 for i in range(8)] + \
        [2 + i / 4 for i in range(8)] + [4 + i / 2 for i in range(8)]


@pytest.mark.parametrize("bits", range(2, 9))
def test_integer_ranges(bits):
    s, u = fb.get_format(f"int{bits}"), fb.get_format(f"uint{bits}")
    half = 2 ** (bits - 1)
    assert (s.bits, s.max, s.lowest, s.num_values, s.signed) == (bits, half - 1, -half, 2 ** bits, True)
    assert (u.bits, u.max, u.lowest, u.num_values, u.signed) == (bits, 2 ** bits - 1, 0, 2 ** bits, False)
    assert s.values().tolist() == list(range(-2 ** (bits - 1), 2 ** (bits - 1)))
    assert u.values().tolist() == list(range(2 ** bits))
    assert not (s.has_inf or s.has_nan or u.has_inf or u.has_nan)
    # two's complement codes
    assert [decode_value(c, s) for c in range(2 ** bits)] == \
        list(range(2 ** (bits - 1))) + list(range(-2 ** (bits - 1), 0))


# bitsandbytes' NF4 table (dDequantizeNF4 in its CUDA kernels), as float32 literals
BNB_NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


def test_nf4_is_the_bitsandbytes_table():
    nf4 = fb.get_format("nf4")
    assert nf4.bits == 4 and nf4.num_values == 16 and nf4.max == 1.0 and nf4.lowest == -1.0
    assert nf4.table == BNB_NF4
    assert nf4.values().tolist() == list(BNB_NF4)
    for v in nf4.table:
        assert float(np.float32(v)) == v  # float32 values, exactly as bitsandbytes stores them
    assert [decode_value(c, nf4) for c in range(16)] == list(BNB_NF4)
    assert nf4.eps is None and nf4.min_subnormal is None and nf4.min_normal == BNB_NF4[8]
    assert not (nf4.has_inf or nf4.has_nan) and nf4.signed


# ---------------------------------------------------------------------------------------------
# decoding every code, against ml_dtypes' and torch's own decoding
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in SHARED if fb.get_format(n).bits <= 16])
def test_decode_every_code_like_ml_dtypes(name):
    fmt = fb.get_format(name)
    codes = np.arange(2 ** fmt.bits, dtype=np.uint8 if fmt.bits <= 8 else np.uint16)
    theirs = codes.view(np_type(SHARED[name][0])).astype(np.float64)
    ours_ref = np.array([decode_value(int(c), fmt) for c in codes])
    assert_same(ours_ref, theirs, codes.astype(np.float64), f"{name} reference decode vs ml_dtypes")
    ours_kernel = fb.decode(codes, fmt)
    assert isinstance(ours_kernel, np.ndarray)
    assert_same(ours_kernel, theirs, codes.astype(np.float64), f"{name} fb.decode vs ml_dtypes")
    # signed zeros and NaN positions explicitly
    zero = np.flatnonzero(theirs == 0)
    assert [math.copysign(1, ours_ref[i]) for i in zero] == [math.copysign(1, theirs[i]) for i in zero]
    assert np.array_equal(np.isnan(ours_ref), np.isnan(theirs))


@pytest.mark.parametrize("name", [n for n, (_, t) in SHARED.items() if t and fb.get_format(n).bits <= 16])
def test_decode_every_code_like_torch(name):
    fmt = fb.get_format(name)
    codes = torch.arange(2 ** fmt.bits, dtype=torch.int32)
    storage = codes.to(torch.uint8) if fmt.bits <= 8 else codes.to(torch.int16)
    theirs = storage.view(getattr(torch, SHARED[name][1])).double()
    assert_same(fb.decode(codes, fmt), theirs, codes, f"{name} fb.decode vs torch view")


def test_nan_codes_are_where_the_conventions_put_them():
    def nan_codes(name):
        fmt = fb.get_format(name)
        return [c for c in range(2 ** fmt.bits) if math.isnan(decode_value(c, fmt))]

    assert nan_codes("fp8_e4m3") == [0x7F, 0xFF]
    assert nan_codes("fp8_e4m3fnuz") == [0x80] == nan_codes("fp8_e5m2fnuz") == nan_codes("fp8_e4m3b11fnuz")
    assert nan_codes("fp8_e5m2") == [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
    assert nan_codes("e8m0") == [0xFF]
    assert nan_codes("fp4_e2m1") == nan_codes("fp6_e3m2") == []
    assert decode_value(0x80, fb.get_format("fp8_e4m3")) == 0 and \
        math.copysign(1, decode_value(0x80, fb.get_format("fp8_e4m3"))) == -1


# ---------------------------------------------------------------------------------------------
# names, aliases, parsing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL, ids=fmt_id)
def test_every_name_and_alias_resolves_case_and_separator_insensitively(fmt):
    assert fb.get_format(fmt) is fmt
    assert fb.get_format(fmt.name) is fmt
    for alias in [fmt.name] + aliases_of(fmt):
        for spelling in (alias, alias.upper(), alias.title(), f" {alias} "):
            assert fb.get_format(spelling) is fmt, spelling
    spaced = fmt.name.replace("_", " ")
    assert fb.get_format(spaced) is fmt and fb.get_format(fmt.name.replace("_", "-").upper()) is fmt


@pytest.mark.parametrize("spelling,name", [
    ("FP8 E4M3", "fp8_e4m3"), ("fp8-e4m3", "fp8_e4m3"), ("e4m3", "fp8_e4m3"), ("E4M3FN", "fp8_e4m3"),
    ("float8_e4m3fn", "fp8_e4m3"), ("float8_e4m3", "fp8_e4m3_ieee"), ("float8_e4m3fnuz", "fp8_e4m3fnuz"),
    ("float8_e4m3b11fnuz", "fp8_e4m3b11fnuz"), ("Float8_E5M2", "fp8_e5m2"), ("e5m2fnuz", "fp8_e5m2fnuz"),
    ("float8_e3m4", "fp8_e3m4"), ("float6_e3m2fn", "fp6_e3m2"), ("float6_e2m3fn", "fp6_e2m3"),
    ("float4_e2m1fn", "fp4_e2m1"), ("FP4", "fp4_e2m1"), ("float8_e8m0fnu", "e8m0"), ("E8M0", "e8m0"),
    ("bfloat16", "bf16"), ("BFloat16", "bf16"), ("half", "fp16"), ("float16", "fp16"), ("float32", "fp32"),
    ("double", "fp64"), ("tensorfloat32", "tf32"), ("NF4", "nf4"), ("INT8", "int8"), ("uint4", "uint4"),
    ("e8m23", "fp32"), ("e11m52", "fp64"), ("e5m10", "fp16"), ("e8m7", "bf16"),
])
def test_known_spellings(spelling, name):
    assert fb.get_format(spelling) is fb.get_format(name)


@pytest.mark.parametrize("dtype,name", [
    (torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32"), (torch.float64, "fp64"),
    (torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e4m3fnuz, "fp8_e4m3fnuz"), (torch.float8_e5m2, "fp8_e5m2"),
    (torch.float8_e5m2fnuz, "fp8_e5m2fnuz"), (torch.float8_e8m0fnu, "e8m0"), (torch.int8, "int8"),
    (torch.uint8, "uint8"),
])
def test_torch_dtypes_are_format_names(dtype, name):
    assert fb.get_format(dtype) is fb.get_format(name)


@pytest.mark.parametrize("ml_name,name", [(v[0], k) for k, v in SHARED.items()] + [("int4", "int4"), ("uint4", "uint4"),
                                                                                   ("int2", "int2")])
def test_ml_dtypes_types_and_numpy_dtypes_are_format_names(ml_name, name):
    t = np_type(ml_name)
    assert fb.get_format(t) is fb.get_format(name)
    assert fb.get_format(np.dtype(t)) is fb.get_format(name)


@pytest.mark.parametrize("spelling,expected", [
    ("e5m7", FloatFormat(5, 7)),
    ("E5M7", FloatFormat(5, 7)),
    ("e4m3fnuz", FloatFormat(4, 3, specials="fnuz")),
    ("e3m4fn", FloatFormat(3, 4, specials="fn")),
    ("e6m1fnuz", FloatFormat(6, 1, specials="fnuz")),
    ("ue4m3", FloatFormat(4, 3, signed=False)),
    ("ue5m3fn", FloatFormat(5, 3, specials="fn", signed=False)),
    ("e4m3fnu", FloatFormat(4, 3, specials="fn", signed=False)),
    ("e5m2b13", FloatFormat(5, 2, bias=13)),
    ("e4m3fnb11", FloatFormat(4, 3, bias=11, specials="fn")),
    ("e3m2nosub", FloatFormat(3, 2, subnormals=False)),
    ("e3m2_nosub", FloatFormat(3, 2, subnormals=False)),
    ("fp13_e5m7", FloatFormat(5, 7)),
    ("fp8_e6m1", FloatFormat(6, 1)),
    ("int12", IntFormat(12)), ("uint16", IntFormat(16, signed=False)), ("int32", IntFormat(32)),
    ("UINT1", IntFormat(1, signed=False)), ("int_24", IntFormat(24)),
])
def test_parsed_names(spelling, expected):
    fmt = fb.get_format(spelling)
    assert fmt == expected
    assert fb.get_format(fmt.name) == fmt  # the parsed format's own name parses back to it


@pytest.mark.parametrize("fmt", [FloatFormat(4, 3), FloatFormat(3, 2), FloatFormat(2, 1),
                                 FloatFormat(4, 3, specials="none"),
                                 FloatFormat(3, 2, specials="none", subnormals=False)],
                         ids=lambda f: f"{f.specials}-{f.name}")
def test_name_of_any_format_resolves_to_that_format(fmt):
    assert fb.get_format(fmt.name) == fmt


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,close", [
    ("fp8_e4m3x", "fp8_e4m3"), ("nf5", "nf4"), ("bfloat", "bf16"), ("flaot16", "fp16"),
    ("e4m3fnz", "fp8_e4m3fnuz"), ("float8_e5m2fz", "fp8_e5m2fnuz"), ("int", "int8"), ("mxfp4", "fp4_e2m1"),
])
def test_unknown_name_lists_close_names(bad, close):
    with pytest.raises(ValueError) as err:
        fb.get_format(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "did you mean" in msg and close in msg


@pytest.mark.parametrize("bad", ["", "float8", "e4m", "fp8_e5m3", "fp9_e4m3", "int0", "int33", "int1", "e1m2",
                                 "e2m0", "e0m3", "e12m3", "zzzz", "e4m3fnuzfn"])
def test_unparseable_or_impossible_names_are_value_errors(bad):
    with pytest.raises(ValueError):
        fb.get_format(bad)


@pytest.mark.parametrize("bad", [3, 4.5, object(), [1, 2], torch.tensor(1.0)])
def test_non_names_are_type_errors(bad):
    with pytest.raises(TypeError, match="format"):
        fb.get_format(bad)


def test_none_is_not_a_format():
    with pytest.raises(TypeError):
        fb.get_format(None)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: FloatFormat(1, 2), ValueError, "impossible layout"),            # IEEE specials, 1 exponent bit
    (lambda: FloatFormat(1, 0), ValueError, "impossible layout"),
    (lambda: FloatFormat(4, 0), ValueError, "impossible layout"),            # IEEE, no mantissa: NaN == inf
    (lambda: FloatFormat(4, 3, specials="fnuz", signed=False), ValueError, "sign"),
    (lambda: FloatFormat(8, 0, zero=False, specials="fn", signed=False), ValueError, "subnormals"),
    (lambda: FloatFormat(1, 0, specials="fn"), ValueError, "impossible layout"),
    (lambda: FloatFormat(0, 3), ValueError, "exponent"),
    (lambda: FloatFormat(-1, 3, specials="none"), ValueError, "exponent"),
    (lambda: FloatFormat(4, -1), ValueError, "man_bits"),
    (lambda: FloatFormat(4.0, 3), TypeError, "exp_bits"),
    (lambda: FloatFormat(4, 3.0), TypeError, "man_bits"),
    (lambda: FloatFormat(True, 3), TypeError, "exp_bits"),
    (lambda: FloatFormat(4, 3, bias=7.0), TypeError, "bias"),
    (lambda: FloatFormat(4, 3, bias="7"), TypeError, "bias"),
    (lambda: FloatFormat(4, 3, specials="ocp"), ValueError, "specials"),
    (lambda: FloatFormat(12, 3), ValueError, "float64"),                      # range beyond float64
    (lambda: FloatFormat(11, 60), ValueError, "64"),
    (lambda: IntFormat(4.0), TypeError, "bits"),
    (lambda: IntFormat(0), ValueError, "bits"),
    (lambda: IntFormat(33), ValueError, "bits"),
    (lambda: IntFormat(1), ValueError, "uint1"),
    (lambda: LookupFormat("x", [1.0]), ValueError, "at least 2"),
    (lambda: LookupFormat("x", [0.0, math.nan]), ValueError, "finite"),
    (lambda: LookupFormat("x", [0.0, math.inf]), ValueError, "finite"),
    (lambda: LookupFormat("x", [1.0, 0.0]), ValueError, "ascending"),
    (lambda: LookupFormat("x", [0.0, 0.0, 1.0]), ValueError, "ascending"),
    (lambda: LookupFormat("x", [1.0, 1.0 + 2 ** -52]), ValueError, "midpoint"),
])
def test_impossible_layouts_are_refused(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_unsupported_overflow_policies_are_refused():
    e4m3 = fb.get_format("fp8_e4m3")
    with pytest.raises(ValueError, match="no infinity"):
        e4m3.check_overflow("inf")
    with pytest.raises(ValueError, match="no NaN"):
        fb.get_format("fp4_e2m1").check_overflow("nan")
    with pytest.raises(ValueError, match="saturate"):
        e4m3.check_overflow("clamp")
    with pytest.raises(ValueError, match="torch"):
        e4m3.preset_overflow("jax")
    assert e4m3.check_overflow("torch") == "saturate" and e4m3.check_overflow("ml_dtypes") == "nan"
    assert fb.get_format("int8").check_overflow(None) == "saturate"
    with pytest.raises(ValueError):
        fb.get_format("int8").check_overflow("inf")
    with pytest.raises(ValueError):
        fb.get_format("nf4").check_overflow("nan")
