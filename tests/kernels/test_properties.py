"""Properties of rounding that hold for every format: monotone, idempotent, results are format
values, nearest modes pick a nearest value, directed modes bracket the input, and stochastic
rounding is reproducible, picks one of the two neighbours and is unbiased."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits.formats import round_value
from fewbits.kernels.random import draw_seed, random_word_reference, random_words
from helpers import assert_same, fmt_id, generator

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


pytestmark = pytest.mark.usefixtures("eager_kernels")


DETERMINISTIC = ["nearest_even", "nearest_away", "toward_zero", "up", "down"]
FORMATS = [fb.get_format(n) for n in (
    "fp8_e4m3", "fp8_e4m3_ieee", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e3m4", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1",
    "e8m0", "nf4", "int4", "uint8", "int8", "bf16", "fp16", "ue4m3", "e3m2nosub",
)]
PROPS = settings(max_examples=25, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


def floats_for(fmt, width=64):
    """Finite floats mostly in the format's range (some beyond it)."""
    top = min(fmt.max * 4, 1e300 if width == 64 else 3e38)
    if width == 32:
        top = float(np.float32(top))
    return st.one_of(
        st.floats(-top, top, width=width, allow_nan=False),
        st.floats(-4.0, 4.0, width=width, allow_nan=False),
        st.sampled_from([0.0, -0.0, fmt.max, -fmt.max, fmt.lowest, fmt.min_normal or 1.0]),
    )


@st.composite
def format_and_inputs(draw, width=64):
    fmt = draw(st.sampled_from(FORMATS))
    xs = draw(st.lists(floats_for(fmt, width), min_size=1, max_size=64))
    dtype = torch.float64 if width == 64 else torch.float32
    return fmt, torch.tensor(xs, dtype=dtype)


def in_range(fmt, x):
    return (x >= fmt.lowest) & (x <= fmt.max)


def neighbours(fmt, x: torch.Tensor):
    """(lo, hi): the largest format value <= x and the smallest >= x, for x in range."""
    vals = fmt.values()
    xd = x.double()
    i = torch.searchsorted(vals, xd, right=True) - 1
    lo = vals[i.clamp(0, vals.numel() - 1)]
    j = torch.searchsorted(vals, xd, right=False)
    hi = vals[j.clamp(0, vals.numel() - 1)]
    return lo, hi


def non_nan_policy(fmt):
    return "inf" if fmt.has_inf else "saturate"


# ---------------------------------------------------------------------------------------------
# deterministic modes
# ---------------------------------------------------------------------------------------------
@PROPS
@given(format_and_inputs(), st.sampled_from(DETERMINISTIC))
def test_monotone(fi, mode):
    fmt, x = fi
    xs, _ = torch.sort(x)
    r = fb.round(xs, fmt, mode, non_nan_policy(fmt))
    assert not torch.isnan(r).any()
    assert bool((r[1:] >= r[:-1]).all()), (xs.tolist(), r.tolist())


@PROPS
@given(format_and_inputs(width=32), st.sampled_from(fb.MODES), st.integers(0, 2 ** 20))
def test_idempotent(fi, mode, seed):
    fmt, x = fi
    for ovf in ("saturate", None):
        r = fb.round(x, fmt, mode, ovf, generator=generator(seed))
        again = fb.round(r, fmt, mode, ovf, generator=generator(seed + 1))
        assert_same(again, r, x, f"{fmt.name} {mode}")


@PROPS
@given(format_and_inputs(), st.sampled_from(fb.MODES))
def test_results_are_format_values(fi, mode):
    fmt, x = fi
    r = fb.round(x, fmt, mode, "saturate", generator=generator(0))
    vals = fmt.values()
    assert bool(torch.isin(r.double(), vals).all()), (x.tolist(), r.tolist())
    negative_zero = (r == 0) & torch.signbit(r)
    if not getattr(fmt, "has_negative_zero", False):
        assert not negative_zero.any()


@PROPS
@given(format_and_inputs(), st.sampled_from(["nearest_even", "nearest_away"]))
def test_nearest_modes_pick_a_nearest_value(fi, mode):
    fmt, x = fi
    x = x[in_range(fmt, x)]
    r = fb.round(x, fmt, mode)
    lo, hi = neighbours(fmt, x)
    for xi, ri, a, b in zip(x.tolist(), r.tolist(), lo.tolist(), hi.tolist()):
        d = abs(Fraction(xi) - Fraction(ri))
        assert ri in (a, b)
        assert d <= abs(Fraction(xi) - Fraction(a)) and d <= abs(Fraction(xi) - Fraction(b)), (xi, ri, a, b)
        if Fraction(xi) - Fraction(a) == Fraction(b) - Fraction(xi) and a != b and mode == "nearest_away":
            assert abs(ri) == max(abs(a), abs(b))


@PROPS
@given(format_and_inputs())
def test_directed_modes_bracket(fi):
    fmt, x = fi
    x = x[in_range(fmt, x)]
    down = fb.round(x, fmt, "down")
    up = fb.round(x, fmt, "up")
    tz = fb.round(x, fmt, "toward_zero")
    assert bool((down <= x).all()) and bool((x <= up).all())
    lo, hi = neighbours(fmt, x)
    assert bool((down == lo).all()) and bool((up == hi).all())
    assert bool((tz.abs() <= x.abs()).all())
    assert bool(((tz == 0) | (torch.sign(tz) == torch.sign(x))).all())
    # toward_zero is down for positives and up for negatives
    assert bool(torch.where(x >= 0, tz == down, tz == up).all())


@PROPS
@given(format_and_inputs())
def test_out_of_range_inputs_follow_the_overflow_policy(fi):
    fmt, x = fi
    beyond = x[x >= fmt.max * 2]  # past the overflow threshold of every format
    if beyond.numel() == 0:
        return
    assert bool((fb.round(beyond, fmt, "nearest_even", "saturate") == fmt.max).all())
    if fmt.has_inf:
        assert bool((fb.round(beyond, fmt, "nearest_even", "inf") == math.inf).all())
    if fmt.has_nan:
        assert bool(torch.isnan(fb.round(beyond, fmt, "nearest_even", "nan")).all())


# ---------------------------------------------------------------------------------------------
# stochastic rounding
# ---------------------------------------------------------------------------------------------
@PROPS
@given(format_and_inputs(), st.integers(0, 2 ** 31))
def test_stochastic_reproducible_and_one_of_the_two_neighbours(fi, seed):
    fmt, x = fi
    x = x[in_range(fmt, x)]
    a = fb.round(x, fmt, "stochastic", generator=generator(seed))
    b = fb.round(x, fmt, "stochastic", generator=generator(seed))
    assert_same(a, b, x, "same seed")
    lo, hi = neighbours(fmt, x)
    assert bool(((a == lo) | (a == hi)).all()), (x.tolist(), a.tolist())


def test_stochastic_differs_with_another_seed():
    x = torch.linspace(-3, 3, 4001)
    x = x[fb.round(x, "fp8_e4m3") != x]
    a = fb.round(x, "fp8_e4m3", "stochastic", generator=generator(1))
    b = fb.round(x, "fp8_e4m3", "stochastic", generator=generator(2))
    frac_differ = (a != b).float().mean().item()
    assert 0.2 < frac_differ < 0.8


def test_stochastic_uses_the_global_rng_when_no_generator_is_given():
    x = torch.linspace(-3, 3, 4001)
    torch.manual_seed(123)
    a = fb.round(x, "fp8_e5m2", "stochastic")
    torch.manual_seed(123)
    b = fb.round(x, "fp8_e5m2", "stochastic")
    c = fb.round(x, "fp8_e5m2", "stochastic")  # the global RNG moved on
    assert torch.equal(a, b) and not torch.equal(b, c)
    # the seed pair is the one draw_seed() takes from the global RNG
    torch.manual_seed(123)
    lo, hi = draw_seed()
    small = x[::97]
    expected = [round_value(v, fb.get_format("fp8_e5m2"), "stochastic", None, random_word_reference(lo, hi, i))
                for i, v in enumerate(small.tolist())]
    torch.manual_seed(123)
    assert fb.round(small, "fp8_e5m2", "stochastic").tolist() == expected


def test_stochastic_result_is_independent_of_shape_and_strides():
    x = torch.randn(64, 48, generator=generator(0))
    flat = fb.round(x.reshape(-1), "fp4_e2m1", "stochastic", generator=generator(4))
    shaped = fb.round(x, "fp4_e2m1", "stochastic", generator=generator(4))
    assert torch.equal(shaped.reshape(-1), flat)
    xt = x.t()
    assert torch.equal(fb.round(xt, "fp4_e2m1", "stochastic", generator=generator(4)),
                       fb.round(xt.contiguous(), "fp4_e2m1", "stochastic", generator=generator(4)))


UNBIASED_CASES = [
    ("fp8_e4m3", [1.0 + 0.125 * f for f in (0.01, 0.3, 0.5, 0.77, 0.999)] + [-2.9, 300.0, 2.0 ** -8 * 1.3]),
    ("fp8_e5m2", [1.1, -3.3, 2.0 ** -15 * 1.7, 50000.0]),
    ("fp4_e2m1", [0.2, 1.1, 2.5, -5.0, 4.9]),
    ("fp6_e3m2", [0.3, -13.0]),
    ("e8m0", [1.1, 1.5, 3.7, 2.0 ** -100 * 1.9]),
    ("int4", [0.3, -2.5, 6.9, -7.99]),
    ("uint8", [0.5, 200.2]),
    ("nf4", [0.01, -0.6, 0.9, -0.95]),
    ("bf16", [1.0 + 2.0 ** -9, math.pi, -1e-3]),
    ("fp16", [1.0 + 2.0 ** -12, 1e-6, 60000.5]),
]


@pytest.mark.parametrize("name,points", UNBIASED_CASES, ids=[c[0] for c in UNBIASED_CASES])
def test_stochastic_is_unbiased(name, points):
    """Mean over 2^16 draws is within 5 standard errors of x (each element draws its own word)."""
    fmt = fb.get_format(name)
    n = 1 << 16
    for k, p in enumerate(points):
        x = torch.full((n,), p, dtype=torch.float64)
        r = fb.round(x, fmt, "stochastic", generator=generator(1000 + k))
        lo, hi = neighbours(fmt, x[:1])
        lo, hi = lo.item(), hi.item()
        assert bool(((r == lo) | (r == hi)).all())
        q = (p - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(max(q * (1 - q), 1e-12) / n)
        mean = r.mean().item()
        assert abs(mean - p) <= 5 * se + 1e-12 * abs(p), (name, p, mean, se)


def test_random_words_equal_their_reference():
    big = torch.tensor([2 ** 31 - 1, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 7, 2 ** 40 + 3])  # the high word counts too
    idx = torch.cat([torch.arange(0, 2000), big])
    for lo, hi in [(0, 0), (1, 2), (2 ** 31 - 2, 12345), draw_seed(generator(5))]:
        got = random_words(idx, lo, hi).tolist()
        assert got == [random_word_reference(lo, hi, i) for i in idx.tolist()]
        assert all(0 <= w < 2 ** 32 for w in got)


def test_random_words_look_uniform():
    n = 1 << 18
    idx = torch.arange(n)
    for lo, hi in [(0, 0), draw_seed(generator(0)), draw_seed(generator(1))]:
        w = random_words(idx, lo, hi)
        u = w.double() / 2.0 ** 32
        assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
        for shift in (0, 8, 16, 24):  # every byte of the word
            counts = torch.bincount((w >> shift) & 255, minlength=256).double()
            chi2 = (((counts - n / 256) ** 2) / (n / 256)).sum().item()
            assert chi2 < 400, (lo, hi, shift, chi2)  # 255 degrees of freedom: mean 255, sd 22.6
        # neighbouring indices are not correlated
        corr = np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]
        assert abs(corr) < 5 / math.sqrt(n)
        assert w.unique().numel() > n * 0.99


def test_draw_seed_is_reproducible():
    assert draw_seed(generator(9)) == draw_seed(generator(9))
    assert draw_seed(generator(9)) != draw_seed(generator(10))
    lo, hi = draw_seed(generator(9))
    assert 0 <= lo < 2 ** 31 and 0 <= hi < 2 ** 31


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_round_of_a_value_is_the_value_in_every_mode(fmt):
    vals = fmt.values()
    if vals.numel() > 4096:
        vals = vals[torch.randperm(vals.numel(), generator=generator(0))[:4096]]
    for mode in fb.MODES:
        r = fb.round(vals, fmt, mode, generator=generator(1))
        assert_same(r, vals, vals, mode)
