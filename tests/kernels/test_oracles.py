"""Differential tests against the native casts of ml_dtypes and torch, for every format they share.

fb.round(x, fmt, overflow="ml_dtypes") must equal x.astype(ml_dtype).astype(float32), and
overflow="torch" must equal x.to(torch_dtype).float(), bit for bit (NaN by NaN-ness), on every
float16 bit pattern (as float32), random float32 bit patterns (every exponent, subnormals, inf, NaN)
and the format's own rounding boundaries. The deliberate differences each have a test of their own
that asserts exactly what differs:
  (a) NaN into a format without NaN (e2m1, e3m2, e2m3): ml_dtypes gives a zero; fewbits keeps NaN
      in round() and refuses it in encode();
  (b) e8m0: ties, zero, negatives and float32 subnormals (see the e8m0 tests);
  (c) float64 input: torch (and ml_dtypes before 0.7) round through float32 (double rounding);
      fewbits and ml_dtypes 0.7+ do not.
"""
import functools
import math

import numpy as np
import pytest
import torch

import fewbits as fb
from helpers import (ORACLE_TYPES, assert_same, boundary_inputs, generator, ml_dtypes_rounds_exactly,
                     random_wide_floats, reference_round, same_mask)

ml_dtypes = pytest.importorskip("ml_dtypes")


pytestmark = pytest.mark.usefixtures("eager_kernels")


SHARED = {k: v for k, v in ORACLE_TYPES.items() if k not in ("fp32", "fp64")}
NO_NAN = ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]
ML_PLAIN = [n for n in SHARED if n != "e8m0"]
TORCH_PLAIN = [n for n, (_, t) in SHARED.items() if t and n != "e8m0"]


def ml_type(name):
    t = SHARED[name][0]
    return np.float16 if t == "float16" else getattr(ml_dtypes, t)


def torch_type(name):
    return getattr(torch, SHARED[name][1])


def ml_round(x: torch.Tensor, name) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(x.numpy().astype(ml_type(name)).astype(x.numpy().dtype))


def torch_round(x: torch.Tensor, name) -> torch.Tensor:
    return x.to(torch_type(name)).to(x.dtype)


@functools.lru_cache(maxsize=None)
def common_inputs() -> torch.Tensor:
    """Every float16 bit pattern (as float32), random float32 bit patterns, random wide values."""
    halves = torch.arange(2 ** 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    pattern = torch.randint(-2 ** 31, 2 ** 31, (60000,), generator=generator(0), dtype=torch.int64)
    patterns = pattern.to(torch.int32).view(torch.float32)
    wide = random_wide_floats(30000, seed=1, dtype=torch.float32, lo=-155, hi=130)
    return torch.cat([halves, patterns, wide])


def inputs_for(name) -> torch.Tensor:
    return torch.cat([common_inputs(), boundary_inputs(fb.get_format(name), torch.float32)])


def test_shared_formats_are_what_the_libraries_call_them():
    for name in SHARED:
        assert fb.get_format(ml_type(name)) is fb.get_format(name)
        if SHARED[name][1]:
            assert fb.get_format(torch_type(name)) is fb.get_format(name)


# ---------------------------------------------------------------------------------------------
# bit for bit equal, everywhere but the named differences
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ML_PLAIN)
def test_round_equals_ml_dtypes(name):
    x = inputs_for(name)
    if name in NO_NAN:
        x = x[~torch.isnan(x)]  # difference (a), tested below
    expected = ml_round(x, name)
    assert_same(fb.round(x, name, overflow="ml_dtypes"), expected, x, f"{name} vs ml_dtypes")


@pytest.mark.parametrize("name", TORCH_PLAIN)
def test_round_equals_torch_cast(name):
    x = inputs_for(name)
    expected = torch_round(x, name)
    assert_same(fb.round(x, name, overflow="torch"), expected, x, f"{name} vs torch")


@pytest.mark.parametrize("name", [n for n in ML_PLAIN if fb.get_format(n).bits <= 8])
def test_encode_equals_ml_dtypes_bytes(name):
    x = inputs_for(name)
    if name in NO_NAN:
        x = x[~torch.isnan(x)]
    with np.errstate(all="ignore"):
        expected = x.numpy().astype(ml_type(name)).view(np.uint8)
    got = fb.encode(x.numpy(), name, overflow="ml_dtypes")
    assert got.dtype == np.uint8
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (f"{name}: {bad.size} codes differ, e.g. x={x[bad[:5]].tolist()} "
                           f"got={got[bad[:5]].tolist()} ml_dtypes={expected[bad[:5]].tolist()}")


def test_presets_name_the_library_policies():
    policy = {n: (fb.get_format(n).preset_overflow("torch"), fb.get_format(n).preset_overflow("ml_dtypes"))
              for n in SHARED}
    assert policy["fp8_e4m3"] == ("saturate", "nan")  # torch saturates OCP E4M3, ml_dtypes gives NaN
    assert policy["fp8_e5m2"] == ("inf", "inf") == policy["bf16"] == policy["fp16"] == policy["fp8_e3m4"]
    assert policy["fp8_e4m3fnuz"] == ("nan", "nan") == policy["fp8_e5m2fnuz"]
    assert policy["fp4_e2m1"] == ("saturate", "saturate")


# ---------------------------------------------------------------------------------------------
# (a) NaN into a format without NaN
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NO_NAN)
def test_difference_nan_into_format_without_nan(name):
    nans = np.array([np.nan, -np.nan, np.float32(np.nan) * 0], dtype=np.float32)
    with np.errstate(all="ignore"):
        theirs = nans.astype(ml_type(name)).astype(np.float32)
    assert (theirs == 0).all()  # ml_dtypes: a zero (a silently wrong number)
    assert math.copysign(1, theirs[0]) == -1  # np.nan becomes -0.0
    ours = fb.round(nans, name)
    assert np.isnan(ours).all()  # fewbits: NaN stays NaN
    for policy in ("saturate", "ml_dtypes", "torch", None):
        assert np.isnan(fb.round(nans, name, overflow=policy)).all()
    with pytest.raises(ValueError, match="NaN"):
        fb.encode(nans, name)
    with pytest.raises(ValueError, match="NaN"):
        fb.encode(torch.tensor([1.0, math.nan]), name)


# ---------------------------------------------------------------------------------------------
# (b) e8m0
# ---------------------------------------------------------------------------------------------
def e8m0_positive_normal_inputs() -> torch.Tensor:
    x = common_inputs()
    x = torch.cat([x, boundary_inputs(fb.get_format("e8m0"), torch.float32)])
    return x[(x >= 2.0 ** -126) | (x == math.inf)]


def test_e8m0_difference_ties():
    """Ties (x = 1.5 * 2^k): ml_dtypes and torch round half away from zero; fewbits' nearest_even
    picks the even exponent field and nearest_away reproduces the libraries exactly."""
    x = e8m0_positive_normal_inputs()
    away = fb.round(x, "e8m0", "nearest_away", overflow="nan")
    assert_same(away, ml_round(x, "e8m0"), x, "nearest_away vs ml_dtypes")
    assert_same(away, torch_round(x, "e8m0"), x, "nearest_away vs torch")

    even = fb.round(x, "e8m0", "nearest_even", overflow="nan")
    differ = ~same_mask(even, away)
    xs = x[differ].double()
    assert xs.numel() > 100
    k = torch.floor(torch.log2(xs))
    assert bool((xs == 1.5 * torch.exp2(k)).all()), "only exact ties differ"
    lower_field = (k + 127).long()
    got = even[differ].double()
    # the result is the neighbour with the even exponent field (at the top, 2^128 is overflow)
    expected = torch.where(lower_field % 2 == 0, torch.exp2(k), torch.exp2(k + 1))
    expected = torch.where(expected > 2.0 ** 127, math.nan, expected)
    assert_same(got, expected, xs, "nearest_even at ties")
    ties = torch.tensor([1.5, 3.0, 6.0, 0.75], dtype=torch.float32)
    assert fb.round(ties, "e8m0").tolist() == [2.0, 2.0, 8.0, 0.5]
    assert ml_round(ties, "e8m0").tolist() == [2.0, 4.0, 8.0, 1.0] == torch_round(ties, "e8m0").tolist()


def test_e8m0_difference_float32_subnormal_inputs():
    """float32 subnormals in (2^-127, 1.5 * 2^-127): torch (and ml_dtypes before 0.7) give
    2^-126, the farther neighbour; fewbits (and ml_dtypes 0.7+) give the nearest value 2^-127.
    Everywhere else they agree."""
    bits = torch.cat([torch.arange(1, 1 << 23, 97, dtype=torch.int32),
                      torch.tensor([(1 << 22) - 1, 1 << 22, (1 << 22) + 1, 3 << 21, (3 << 21) - 1, (3 << 21) + 1],
                                   dtype=torch.int32)])
    x = bits.view(torch.float32)
    ours = fb.round(x, "e8m0", "nearest_away", overflow="nan")
    window = (x > 2.0 ** -127) & (x < 1.5 * 2.0 ** -127)
    assert bool((ours[window] == 2.0 ** -127).all())
    for theirs, nearest in ((ml_round(x, "e8m0"), ml_dtypes_rounds_exactly()), (torch_round(x, "e8m0"), False)):
        assert bool((theirs[window] == (2.0 ** -127 if nearest else 2.0 ** -126)).all())
        assert_same(ours[~window], theirs[~window], x[~window], "outside the window")
    # the reference agrees with fewbits: |x - 2^-127| < |x - 2^-126| inside the window
    probe = torch.tensor([2.0 ** -127 * 1.25], dtype=torch.float32)
    assert reference_round(probe, "e8m0", "nearest_away", "nan").item() == 2.0 ** -127


def test_e8m0_difference_zero_and_negatives():
    """ml_dtypes: NaN for +-0 and every negative input. torch 2.13: +-0 (and tiny values) give the
    smallest value 2^-127 (code 0), negative finite x gives the cast of |x| (the sign is dropped),
    -inf gives NaN. fewbits: +-0 gives 2^-127; a negative input that does not round to zero is out of
    range: the smallest value 2^-127 under 'saturate', NaN under 'nan'."""
    e8 = fb.get_format("e8m0")
    mags = torch.cat([torch.tensor([2.0 ** -126, 1.0, 1.5, 3.0, 1e10, 2.0 ** 127]),
                      random_wide_floats(500, seed=2, dtype=torch.float32, lo=-120, hi=120).abs()])
    neg = -mags
    zeros = torch.tensor([0.0, -0.0])
    # ml_dtypes
    assert torch.isnan(ml_round(neg, "e8m0")).all() and torch.isnan(ml_round(zeros, "e8m0")).all()
    assert torch.isnan(ml_round(torch.tensor([-math.inf]), "e8m0")).all()
    # torch
    assert torch_round(zeros, "e8m0").tolist() == [2.0 ** -127] * 2
    assert_same(torch_round(neg, "e8m0"), torch_round(mags, "e8m0"), neg, "torch drops the sign")
    assert torch.isnan(torch_round(torch.tensor([-math.inf]), "e8m0")).all()
    # fewbits
    for policy in ("saturate", "nan", "ml_dtypes", "torch"):
        assert fb.round(zeros, e8, overflow=policy).tolist() == [2.0 ** -127] * 2
    assert bool((fb.round(neg, e8, overflow="saturate") == 2.0 ** -127).all())
    assert bool(torch.isnan(fb.round(neg, e8, overflow="nan")).all())
    assert fb.round(torch.tensor([-math.inf]), e8, overflow="saturate").item() == 2.0 ** -127
    assert math.isnan(fb.round(torch.tensor([-math.inf]), e8, overflow="nan").item())
    # a negative input too small to reach 2^-127 rounds to (the missing) zero: the smallest value
    assert fb.round(torch.tensor([-1e-45]), e8, overflow="nan").item() == 2.0 ** -127
    codes = fb.encode(torch.cat([zeros, neg[:3]]), e8, overflow="nan")
    assert codes.tolist() == [0, 0, 255, 255, 255]


def test_e8m0_overflow_and_inf_give_nan_in_both_libraries():
    x = torch.tensor([math.inf, 2.0 ** 127 * 1.5, 3e38, 2.0 ** 127], dtype=torch.float32)
    expected = [math.nan, math.nan, math.nan, 2.0 ** 127]
    for theirs in (ml_round(x, "e8m0"), torch_round(x, "e8m0")):
        assert_same(theirs, torch.tensor(expected), x, "library")
    assert_same(fb.round(x, "e8m0", "nearest_away", "nan"), torch.tensor(expected), x, "fewbits 'nan'")
    assert_same(fb.round(x, "e8m0", "nearest_away", "ml_dtypes"), torch.tensor(expected), x, "ml_dtypes preset")


def test_e8m0_torch_preset_reproduces_torch_overflow():
    x = torch.tensor([math.inf, 2.0 ** 127 * 1.5, 3e38], dtype=torch.float32)
    assert_same(fb.round(x, "e8m0", "nearest_away", overflow="torch"), torch_round(x, "e8m0"), x, "torch preset")


# ---------------------------------------------------------------------------------------------
# (c) float64 input: the libraries round through float32
# ---------------------------------------------------------------------------------------------
def double_rounding_inputs(name) -> torch.Tensor:
    """float64 values a hair (far below float32's precision) beside the midpoints of neighbouring
    values: float32 rounds them onto the midpoint, where the tie rule then decides."""
    vals = fb.get_format(name).values()
    lo, hi = vals[:-1], vals[1:]
    mid = (lo + hi) / 2
    tiny = (hi - lo) * 2.0 ** -35
    x = torch.cat([mid + tiny, mid - tiny])
    keep = (x.float().double() == torch.cat([mid, mid])) & (x.abs() >= 2.0 ** -120) & torch.isfinite(x)
    return x[keep]


@pytest.mark.parametrize("name", [n for n in SHARED if n not in ("e8m0", "bf16", "fp16")]
                         + ["bf16-sample", "fp16-sample"])
def test_difference_float64_double_rounding(name):
    if name.endswith("-sample"):
        name = name[:-len("-sample")]
        x = double_rounding_inputs_wide(name)
    else:
        x = double_rounding_inputs(name)
    ours = fb.round(x, name, overflow="ml_dtypes")
    assert ours.dtype == torch.float64
    assert_same(ours, reference_round(x, name, "nearest_even", "ml_dtypes"), x, "fewbits is exact")
    through_f32 = fb.round(x.float(), name, overflow="ml_dtypes").double()
    differ = ~same_mask(ours, through_f32)
    assert differ.float().mean() > 0.4  # about half of these inputs are decided differently
    with np.errstate(all="ignore"):
        theirs = torch.from_numpy(x.numpy().astype(ml_type(name)).astype(np.float64))
    if name == "fp16":
        # numpy's own float64 -> float16 cast is correctly rounded: it agrees with fewbits
        assert_same(theirs, ours, x, "numpy float16")
    elif ml_dtypes_rounds_exactly():
        assert_same(theirs, ours, x, "ml_dtypes 0.7+ rounds float64 directly")
    else:
        assert_same(theirs, through_f32, x, "ml_dtypes before 0.7 rounds float64 through float32")
    if SHARED[name][1]:
        theirs_t = x.to(torch_type(name)).double()
        assert_same(theirs_t, fb.round(x.float(), name, overflow="torch").double(), x,
                    "torch rounds float64 through float32")
        assert not bool(same_mask(theirs_t, fb.round(x, name, overflow="torch")).all())


def double_rounding_inputs_wide(name) -> torch.Tensor:
    g = generator(3)
    fmt = fb.get_format(name)
    codes = torch.randint(1, 2 ** (fmt.bits - 1) - 2 ** fmt.man_bits - 1, (4000,), generator=g)
    codes = torch.cat([codes, codes | (1 << (fmt.bits - 1))])
    storage = codes.to(torch.int32).to(torch.int16).view(getattr(torch, SHARED[name][1]))
    lo = storage.double()
    nxt = (codes + 1).to(torch.int32).to(torch.int16).view(storage.dtype).double()
    mid = (lo + nxt) / 2
    tiny = (nxt - lo).abs() * 2.0 ** -35
    x = torch.cat([mid + tiny, mid - tiny])
    keep = (x.float().double() == torch.cat([mid, mid])) & torch.isfinite(x) & (x.abs() >= 2.0 ** -120)
    return x[keep]
