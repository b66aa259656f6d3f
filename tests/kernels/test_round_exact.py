"""The fast rounding kernels equal the exact scalar reference bit for bit.

Inputs are every value of a format, every midpoint between neighbouring values, the float
neighbours (nextafter up and down) of both, both signs, and the special inputs (zeros, inf, NaN,
huge, tiny, float32 subnormals). Every mode, every overflow policy the format admits, float32 and
float64 inputs; float16/bfloat16 inputs for a subset. NaN results compare by NaN-ness, zeros by sign.
"""
import math

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits import FloatFormat, IntFormat, LookupFormat
from helpers import (INPUT_DTYPES, assert_same, boundary_inputs, check_boundaries, check_round, fmt_id, generator,
                     random_wide_floats, reference_round, sampled_boundary_inputs, unique_bits,
                     valid_overflows, with_neighbours)

MODES = list(fb.MODES)

# every registered format of at most 8 bits (floats, e8m0, nf4, int2..8, uint2..8) ...
SMALL_REGISTERED = [f for f in fb.list_formats() if f.bits <= 8]
# ... formats parsed from their names ...
PARSED = [fb.get_format(n) for n in (
    "ue4m3", "e3m2nosub", "e2m1nosub", "e4m3fnu", "e3m4fn", "e5m2b13", "ue8m0fn", "e4m3fnuz_nosub",
    "int12", "uint10", "uint1", "e1m2fn",
)]
# ... and unusual layouts built directly: extreme biases, no zero, no mantissa, unsigned
BUILT = [
    FloatFormat(4, 3, bias=-3), FloatFormat(5, 2, bias=40), FloatFormat(3, 2, bias=-5, specials="fn"),
    FloatFormat(1, 3, specials="none"), FloatFormat(2, 0, specials="none"), FloatFormat(2, 0, specials="fn"),
    FloatFormat(3, 0, specials="none", subnormals=False),
    FloatFormat(3, 1, specials="none", zero=False, subnormals=False),
    FloatFormat(3, 1, specials="fn", zero=False, subnormals=False, signed=False),
    FloatFormat(4, 2, specials="ieee", subnormals=False, signed=False),
    FloatFormat(3, 3, specials="none", signed=False),
    FloatFormat(6, 1), FloatFormat(6, 1, subnormals=False),
    FloatFormat(7, 0, specials="fn", subnormals=False, zero=False, signed=False),
    FloatFormat(8, 0, bias=130, specials="fn", subnormals=False, zero=False, signed=False),
]
# ... and codebooks other than NF4: uneven, all positive, float64-only values, float32 subnormals,
# values beyond float32, no zero
CODEBOOKS = [
    LookupFormat("uneven", [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0]),
    LookupFormat("positive", [0.5, 1.0, 3.0, 10.0]),
    LookupFormat("f64_only", [1 + 2.0 ** -40, 1 + 2.0 ** -30, 1 + 2.0 ** -20, 2.5]),
    LookupFormat("tiny", [-(2.0 ** -133), 0.0, 2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -127]),
    LookupFormat("huge", [-(2.0 ** 1000), 0.0, 2.0 ** 1000]),
    LookupFormat("no_zero", [-2.0, -1.0, 1.0, 2.0]),
]
EXACT_FORMATS = SMALL_REGISTERED + PARSED + BUILT + CODEBOOKS

# wider formats: a deterministic sample of boundary points in the default run, everything under -m slow
# (e8m2 and e11m10 without subnormals take the kernels' generic path from float32 / float64)
WIDE_FORMATS = [fb.get_format(n) for n in ("bf16", "fp16", "tf32", "fp32", "fp64", "e5m7")] + [
    FloatFormat(8, 2), FloatFormat(11, 10, subnormals=False)]



def test_format_lists_are_what_they_claim():
    names = {f.name for f in SMALL_REGISTERED}
    assert {"fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "e8m0", "nf4", "int8", "uint2"} <= names
    assert all(f.bits <= 8 for f in SMALL_REGISTERED)
    assert len(set(EXACT_FORMATS)) == len(EXACT_FORMATS)


# ---------------------------------------------------------------------------------------------
# the full grid, eager
# ---------------------------------------------------------------------------------------------
GRID = [pytest.param(fmt, mode, id=f"{fmt.name}-{mode}") for fmt in EXACT_FORMATS for mode in MODES]


@pytest.mark.parametrize("fmt,mode", GRID)
def test_eager_equals_reference_on_every_boundary(fmt, mode):
    with fb.use_backend("eager"):
        for dtype in INPUT_DTYPES:
            for ovf in valid_overflows(fmt):
                check_boundaries(fmt, dtype, mode, ovf, what=f"eager {fmt.name} {mode} {ovf} {dtype}")


HALF_SUBSET = [fb.get_format(n) for n in ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "e8m0", "nf4", "int4", "ue4m3")]


@pytest.mark.parametrize("fmt,x,mode,expected", [
    (FloatFormat(4, 3, bias=-3), 2.0 ** -149, "up", 2.0),          # smallest step 2
    (FloatFormat(4, 3, bias=-3), -(2.0 ** -149), "down", -2.0),
    (FloatFormat(3, 2, bias=-5, specials="fn"), 2.0 ** -148, "up", 16.0),  # smallest step 16
    (FloatFormat(4, 3, bias=-100), 1e-30, "up", 2.0 ** 98),       # smallest step 2^98
    (FloatFormat(4, 3, bias=-100), -1e-30, "down", -(2.0 ** 98)),
])
def test_directed_rounding_of_tiny_float32_into_coarse_format(fmt, x, mode, expected):
    """Regression: formats whose smallest step is above 1 (large negative bias) once divided tiny
    float32 inputs by the step, which underflowed to 0: 'up'/'down' gave 0, not the smallest value."""
    from fewbits.formats import round_value
    assert round_value(x, fmt, mode) == expected  # the reference: the smallest value of that sign
    with fb.use_backend("eager"):
        for dtype in INPUT_DTYPES:
            assert fb.round(torch.tensor([x], dtype=dtype), fmt, mode).item() == expected, dtype


@pytest.mark.parametrize("fmt", HALF_SUBSET, ids=fmt_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs_round_like_reference_of_upcast(fmt, dtype):
    """float16/bfloat16 input: the reference applied to the exact upcast value, cast back."""
    x = unique_bits(with_neighbours(unique_bits(boundary_inputs(fmt, torch.float64).to(dtype))))
    with fb.use_backend("eager"):
        for mode in MODES:
            for ovf in valid_overflows(fmt):
                check_round(x, fmt, mode, ovf, seed=3)


@pytest.mark.parametrize("fmt", [fb.get_format(n) for n in ("bf16", "fp16")], ids=fmt_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs_to_half_formats(fmt, dtype):
    """bf16 values into fp16 and fp16 values into bf16 (neither holds the other)."""
    x = unique_bits(torch.arange(2 ** 16, dtype=torch.int32).to(torch.int16).view(dtype))
    x = x[torch.randperm(x.numel(), generator=generator(0))[:2000]]
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=dtype)])
    with fb.use_backend("eager"):
        for mode in MODES:
            check_round(x, fmt, mode, None, seed=1)


# ---------------------------------------------------------------------------------------------
# wide formats: sample in the default run, exhaustive under -m slow
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", WIDE_FORMATS, ids=fmt_id)
def test_wide_formats_sampled_boundaries(fmt, mode):
    with fb.use_backend("eager"):
        for dtype in INPUT_DTYPES:
            x = sampled_boundary_inputs(fmt, dtype, n=300, seed=11)
            for ovf in valid_overflows(fmt):
                check_round(x, fmt, mode, ovf, seed=5)


def _top_slice(x: torch.Tensor, fmt) -> torch.Tensor:
    """Inputs near or beyond the largest value, and the non-finite ones (where overflow matters)."""
    a = x.abs().double()
    return x[(a >= fmt.max / 4) | ~torch.isfinite(a)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", [fb.get_format(n) for n in ("bf16", "fp16", "e5m7")], ids=fmt_id)
def test_16bit_exhaustive(fmt, mode):
    """Every value, midpoint and neighbour; the default overflow everywhere, every policy near the top."""
    with fb.use_backend("eager"):
        for dtype in INPUT_DTYPES:
            x = boundary_inputs(fmt, dtype)
            check_round(x, fmt, mode, None, seed=2)
            top = _top_slice(x, fmt)
            for ovf in valid_overflows(fmt):
                check_round(top, fmt, mode, ovf, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_tf32_exhaustive(mode):
    """tf32: every positive value and midpoint with their float32 neighbours (the sign is checked
    by the sampled test and by bf16/fp16, which share the code path)."""
    fmt = fb.get_format("tf32")
    x = boundary_inputs(fmt, torch.float32)
    x = x[~torch.signbit(x)]
    with fb.use_backend("eager"):
        check_round(x, fmt, mode, None, seed=2)
        top = _top_slice(x, fmt)
        for ovf in valid_overflows(fmt):
            check_round(top, fmt, mode, ovf, seed=2)


# ---------------------------------------------------------------------------------------------
# the compiled backend: every mode, both input types, and every kernel path. A compiled kernel is
# specialised per (mode, input dtype, kernel, format range and overflow policy), and compiling one
# takes seconds, so each mode checks a few (format, dtype, policy) cases chosen to reach every
# kernel: scaled, fixed, pow2 and generic from float32; scaled, scaled_m0, fixed and generic from
# float64; and the codebook kernels.
# ---------------------------------------------------------------------------------------------
E11M10_NOSUB = FloatFormat(11, 10, subnormals=False)
COMPILED_CASES = {
    "nearest_even": [("fp8_e4m3", torch.float32, "saturate"), ("fp8_e5m2", torch.float64, "inf"),
                     ("nf4", torch.float32, None)],
    "nearest_away": [("e8m0", torch.float32, "nan"), ("int4", torch.float64, "saturate")],
    "toward_zero": [("bf16", torch.float32, None), ("fp8_e4m3fnuz", torch.float64, "nan")],
    "up": [("ue8m0fn", torch.float32, None), ("fp64", torch.float64, "saturate")],
    "down": [("fp4_e2m1", torch.float32, None), (E11M10_NOSUB, torch.float64, None)],
    "stochastic": [("fp8_e4m3", torch.float32, "nan"), ("e8m0", torch.float64, "saturate"),
                   ("nf4", torch.float32, None)],
}


def _compiled_inputs(fmt, dtype):
    if fmt.bits <= 12:
        return boundary_inputs(fmt, dtype)
    return sampled_boundary_inputs(fmt, dtype, n=300, seed=4)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_equals_reference(mode):
    with fb.use_backend("compiled"):
        for name, dtype, ovf in COMPILED_CASES[mode]:
            fmt = fb.get_format(name)
            x = _compiled_inputs(fmt, dtype)
            what = f"compiled {fmt.name} {mode} {ovf} {dtype}"
            if fmt.bits <= 12:
                check_boundaries(fmt, dtype, mode, ovf, what=what)
            else:
                check_round(x, fmt, mode, ovf, seed=9, what=what)


def test_compiled_cases_take_every_kernel_path():
    """An internal detail (skipped if the kernels are no longer split this way): the compiled
    cases reach each float kernel in each domain."""
    from fewbits.kernels import floatround as fr
    from fewbits.kernels.rounding import _domain_for

    kind_of = getattr(fr, "kernel_kind", None)
    if kind_of is None:
        pytest.skip("no kernel_kind in fewbits.kernels.floatround")
    seen = set()
    for cases in COMPILED_CASES.values():
        for name, dtype, _ in cases:
            fmt = fb.get_format(name)
            if fmt.kind != "lookup":
                dom = _domain_for(fmt, dtype)
                seen.add((dom.W, kind_of(fmt, dom)))
    kinds = {k for _, k in seen}
    assert {"fixed", "scaled", "generic"} <= kinds, seen
    assert {(32, "scaled"), (64, "scaled"), (32, "fixed"), (64, "fixed"), (32, "generic"), (64, "generic")} <= seen


def test_compiled_equals_eager_on_large_input():
    """Past the size where 'auto' compiles: identical results, stochastic included."""
    x = random_wide_floats(1 << 15, seed=3, dtype=torch.float32, lo=-20, hi=20)
    for mode, ovf in (("nearest_even", "saturate"), ("stochastic", "nan")):  # variants compiled above
        with fb.use_backend("eager"):
            a = fb.round(x, "fp8_e4m3", mode, ovf, generator=generator(1))
        with fb.use_backend("auto"):
            b = fb.round(x, "fp8_e4m3", mode, ovf, generator=generator(1))
        assert_same(b, a, x, f"auto vs eager {mode}")


def test_compiled_out_variant():
    x = boundary_inputs(fb.get_format("fp8_e5m2"), torch.float32)
    ref = reference_round(x, "fp8_e5m2", "nearest_even").float()
    out = torch.empty_like(x)
    with fb.use_backend("compiled"):
        r = fb.round(x, "fp8_e5m2", out=out)
    assert r is out
    assert_same(out, ref, x, "compiled out=")


def test_backend_name_is_checked():
    with pytest.raises(ValueError, match="eager"):
        with fb.use_backend("fast"):
            pass


# ---------------------------------------------------------------------------------------------
# overflow presets and defaults resolve to the policies they name
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", SMALL_REGISTERED, ids=fmt_id)
def test_overflow_none_and_presets_match_their_policy(fmt):
    x = boundary_inputs(fmt, torch.float32)
    with fb.use_backend("eager"):
        for given, policy in ((None, fmt.default_overflow), ("torch", fmt.preset_overflow("torch")),
                              ("ml_dtypes", fmt.preset_overflow("ml_dtypes"))):
            assert_same(fb.round(x, fmt, overflow=given), fb.round(x, fmt, overflow=policy), x, f"{given}")
    assert fmt.default_overflow == ("inf" if fmt.has_inf else "saturate")


# ---------------------------------------------------------------------------------------------
# float64 input is rounded directly, never through float32
# ---------------------------------------------------------------------------------------------
DOUBLE_ROUNDING_CASES = [
    # (format, float64 input, correct result, what rounding through float32 would give)
    ("fp8_e4m3", 1.0625 + 2 ** -30, 1.125, 1.0),
    ("fp8_e4m3", -(1.0625 + 2 ** -30), -1.125, -1.0),
    ("fp8_e5m2", 1.125 + 2 ** -40, 1.25, 1.0),
    ("fp4_e2m1", 1.25 + 2 ** -35, 1.5, 1.0),
    ("fp6_e3m2", 0.5 * (1.125 + 2 ** -33), 0.625, 0.5),
    ("bf16", 1 + 2 ** -8 + 2 ** -40, 1 + 2 ** -7, 1.0),
    ("fp16", 1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -10, 1.0),
    ("tf32", 1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -10, 1.0),
    ("int8", 2.5 + 2 ** -30, 3.0, 2.0),
    ("int8", 100.5 + 2 ** -30, 101.0, 100.0),
    ("uint8", 0.5 + 2 ** -40, 1.0, 0.0),
    ("e8m0", 3.0 * (1 + 2 ** -30), 4.0, 2.0),  # 3 = 1.5 * 2 is a tie; float32 makes it one
]


@pytest.mark.parametrize("name,x,correct,through_f32", DOUBLE_ROUNDING_CASES)
def test_float64_is_not_rounded_through_float32(name, x, correct, through_f32):
    fmt = fb.get_format(name)
    assert float(np.float32(x)) != x  # the input is not a float32 value
    assert round_via_f32(x, fmt) == through_f32  # so double rounding would be wrong
    # eager here; the compiled float64 kernels are checked in test_compiled_equals_reference
    with fb.use_backend("eager"):
        r = fb.round(torch.tensor([x], dtype=torch.float64), fmt)
    assert r.dtype == torch.float64
    assert r.item() == correct
    with fb.use_backend("eager"):
        rn = fb.round(np.array([x]), fmt)
    assert rn.dtype == np.float64 and rn[0] == correct


def round_via_f32(x, fmt):
    return fb.round(torch.tensor([x], dtype=torch.float64).float(), fmt).item()


def test_fp32_format_equals_numpy_cast_of_float64():
    """Rounding float64 to the fp32 format is numpy's correctly rounded float64 -> float32 cast."""
    rnd = random_wide_floats(20000, seed=5, dtype=torch.float64, lo=-160, hi=130).numpy()
    # boundaries: float32 values, midpoints of neighbouring float32 values and their float64 neighbours
    with np.errstate(over="ignore"):
        f = np.concatenate([rnd.astype(np.float32), np.float32([3.4028235e38, 1.1754944e-38, 1e-45, 2e-45])])
        f = f[np.isfinite(f)]
        nxt = np.nextafter(f, np.float32(np.inf))
    mids = (f.astype(np.float64) + nxt.astype(np.float64)) / 2
    mids = mids[np.isfinite(mids)]
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235677973366e38, 3.4028235677973362e38, 1e39,
                      2.0 ** -150, 2.0 ** -150 * (1 + 2 ** -40), 2.0 ** -151, 1e-300])
    x = np.concatenate([rnd, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), edges, -edges])
    with np.errstate(over="ignore"):
        expected = x.astype(np.float32).astype(np.float64)
    with fb.use_backend("eager"):
        got = fb.round(x, "fp32")
    assert got.dtype == np.float64
    assert_same(got, expected, x, "fp32 vs numpy")


def test_fp32_and_fp64_formats_keep_their_own_values():
    x32 = random_wide_floats(5000, seed=1, dtype=torch.float32)
    x32 = torch.cat([x32, torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-45])])
    assert_same(fb.round(x32, "fp32"), x32, x32, "fp32 identity")
    x64 = random_wide_floats(5000, seed=1, dtype=torch.float64, lo=-1000, hi=1000)
    assert_same(fb.round(x64, "fp64"), x64, x64, "fp64 identity")
    assert_same(fb.round(x32, "fp64"), x32, x32, "fp64 on float32")


# ---------------------------------------------------------------------------------------------
# integer formats against torch.round (half to even) and a clamp
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", fb.list_formats("int") + [IntFormat(12), IntFormat(16, False), IntFormat(24)],
                         ids=fmt_id)
def test_int_nearest_even_saturate_is_torch_round_and_clamp(fmt):
    g = generator(fmt.bits)
    span = fmt.max - fmt.lowest
    x = (torch.rand(8000, generator=g, dtype=torch.float64) * 1.5 - 0.25) * span + fmt.lowest
    halves = torch.arange(max(int(fmt.lowest), -2000) - 3, min(int(fmt.max), 2000) + 3, dtype=torch.float64) + 0.5
    x = torch.cat([x, halves, torch.floor(x), torch.tensor([0.0, -0.0, 1e30, -1e30])])
    for dtype in INPUT_DTYPES:
        xd = x.to(dtype)
        expected = torch.round(xd.double()).clamp(fmt.lowest, fmt.max)
        got = fb.round(xd, fmt, "nearest_even", "saturate")
        # torch.round keeps -0.0; integer formats have no negative zero
        expected = torch.where(expected == 0, 0.0, expected).to(dtype)
        assert_same(got, expected, xd, f"{fmt.name} {dtype}")
