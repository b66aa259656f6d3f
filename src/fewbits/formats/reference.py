"""The exact scalar reference: round, encode and decode one number at a time with Python integers
and fractions. It is slow and obviously correct, and it *defines* fewbits' semantics; the fast
kernels in fewbits.kernels are tested bit for bit against it.

Semantics (every format):
- Rounding happens with an unbounded exponent range; a result above the largest finite value
  (below the lowest, for signed formats) has overflowed and the overflow policy decides:
  'saturate' -> the largest finite value of that sign; 'inf' -> infinity; 'nan' -> NaN.
  As in IEEE 754, rounding toward zero (and 'up' for negatives, 'down' for positives) never
  overflows to inf/NaN: it gives the largest finite value.
- Infinite inputs: 'inf' keeps them, 'saturate' gives the largest finite value, 'nan' gives NaN.
- NaN inputs stay NaN (as a float NaN, even for formats with no NaN code; encode() refuses them).
- Signed zeros are kept where the format has -0; 'fnuz' formats and unsigned formats give +0.
- Unsigned formats: a negative input that does not round to zero is out of range: 'saturate'
  gives the lowest value (0, or the smallest value of a format without zero), 'nan' gives NaN.
- Formats without zero (E8M0): results below the smallest value become the smallest value
  (with the input's sign, in a signed format).
- Ties: 'nearest_even' picks the neighbour whose code is even; 'nearest_away' the larger magnitude.
- 'bitsandbytes' (a mode preset, codebooks only) reproduces bitsandbytes' NF4 bucketing bit for
  bit: float32 bounds, ties to the lower code, the input cast to float32 first (see
  LookupFormat.bitsandbytes_bounds).
- 'stochastic' takes a 32-bit random word r per value: with frac the position of |x| between its
  two neighbours (0 <= frac < 1), it rounds away from zero iff r < floor(frac * 2**32). So the
  probability is exact to 2**-32 and the rounding is unbiased to within 2**-32 of a step.
  (Codebooks compute frac in float64; binary formats compute it exactly.)
"""
from __future__ import annotations

import math
from fractions import Fraction

from .base import Format
from .floats import FloatFormat, _floor_log2
from .integers import IntFormat
from .lookup import LookupFormat, float32

MODES = ("nearest_even", "nearest_away", "toward_zero", "up", "down", "stochastic")
# a library's own rounding rule, accepted wherever a mode is (as OVERFLOW_PRESETS are for
# overflow): "bitsandbytes" is its codebook rule, see LookupFormat.bitsandbytes_bounds
MODE_PRESETS = ("bitsandbytes",)


def check_mode(mode: str, fmt: Format | None = None) -> str:
    """Validate a rounding mode or mode preset (for fmt, where given: a preset it can take)."""
    if mode in MODE_PRESETS:
        if fmt is not None:
            if not isinstance(fmt, LookupFormat):
                raise ValueError(f"mode {mode!r} is bitsandbytes' rule for codebooks (nf4); {fmt.name} is not a "
                                 f"codebook: use one of {', '.join(MODES)}")
            fmt.bitsandbytes_bounds()  # raises for a codebook bitsandbytes could not hold
        return mode
    if mode not in MODES:
        raise ValueError(f"unknown rounding mode {mode!r}; choose one of {', '.join(MODES + MODE_PRESETS)}")
    return mode


def _magnitude_mode(mode: str, negative: bool) -> str:
    """Rounding mode acting on |x|: nearest_even, nearest_away, toward_zero, away or stochastic."""
    if mode == "up":
        return "toward_zero" if negative else "away"
    if mode == "down":
        return "away" if negative else "toward_zero"
    return mode


def _pick(mag: Fraction, lo: Fraction, hi: Fraction, lo_even: bool, mmode: str, rand32: int | None) -> Fraction:
    """Choose lo or hi (lo <= mag < hi, both neighbours in the format with unbounded exponent)."""
    if mag == lo:
        return lo
    if mmode == "toward_zero":
        return lo
    if mmode == "away":
        return hi
    if mmode == "stochastic":
        if rand32 is None:
            raise ValueError("stochastic rounding needs a 32-bit random word")
        frac = (mag - lo) / (hi - lo)
        return hi if rand32 < math.floor(frac * 2 ** 32) else lo
    d_lo, d_hi = mag - lo, hi - mag
    if d_lo != d_hi:
        return lo if d_lo < d_hi else hi
    if mmode == "nearest_away":
        return hi
    return lo if lo_even else hi


def _float_neighbours(fmt: FloatFormat, mag: Fraction) -> tuple[Fraction, Fraction, bool]:
    """(lo, hi, lo's code is even) around mag > 0, with an unbounded exponent range."""
    ex = _floor_log2(mag)
    if ex >= fmt.emin:
        quantum = Fraction(2) ** (ex - fmt.man_bits)
    elif fmt.subnormals:
        quantum = Fraction(2) ** (fmt.emin - fmt.man_bits)
    else:  # only zero and the smallest normal lie below it
        quantum = Fraction(2) ** fmt.emin
    n = math.floor(mag / quantum)
    lo = n * quantum
    if fmt.man_bits == 0 and ex >= fmt.emin:
        lo_even = (ex + fmt.bias) % 2 == 0  # the code is the exponent field
    else:
        lo_even = n % 2 == 0
    return lo, lo + quantum, lo_even


def round_value(x: float, fmt: Format, mode: str = "nearest_even", overflow: str | None = None,
                rand32: int | None = None) -> float:
    """x rounded to the nearest value of fmt under `mode` and `overflow` (see module docstring)."""
    check_mode(mode, fmt)
    overflow = fmt.check_overflow(overflow)
    x = float(x)
    if math.isnan(x):
        return x
    negative = math.copysign(1.0, x) < 0
    mmode = _magnitude_mode(mode, negative)
    top = _top(fmt, negative)

    if math.isinf(x):
        mag_result = {"inf": math.inf, "nan": math.nan, "saturate": top}[overflow]
        return _finish(fmt, mag_result, negative, overflow)

    mag = Fraction(abs(x))
    if isinstance(fmt, LookupFormat):
        return _round_lookup(fmt, Fraction(x), mode, rand32)
    if mag == 0:
        result = Fraction(0)
    elif isinstance(fmt, IntFormat):
        n = math.floor(mag)
        result = _pick(mag, Fraction(n), Fraction(n + 1), n % 2 == 0, mmode, rand32)
    else:
        lo, hi, lo_even = _float_neighbours(fmt, mag)
        result = _pick(mag, lo, hi, lo_even, mmode, rand32)

    if result > top:
        if mmode == "toward_zero" or overflow == "saturate":
            return _finish(fmt, top, negative, overflow)
        return _finish(fmt, math.inf if overflow == "inf" else math.nan, negative, overflow)
    return _finish(fmt, result, negative, overflow)


def _top(fmt: Format, negative: bool) -> Fraction:
    """Largest finite magnitude on this side of zero (unsigned formats: see _finish)."""
    if negative and fmt.signed:
        return Fraction(-fmt.lowest) if not isinstance(fmt, FloatFormat) else Fraction(fmt.max)
    return Fraction(fmt.max)


def _finish(fmt: Format, mag, negative: bool, overflow: str) -> float:
    """Apply sign, unsigned range, missing zero and signed-zero rules to a magnitude."""
    if isinstance(mag, float) and math.isnan(mag):
        return math.copysign(math.nan, -1.0 if negative else 1.0)
    is_zero = mag == 0
    if not fmt.signed and negative and not is_zero:
        if overflow == "nan":
            return math.copysign(math.nan, -1.0)
        return float(fmt.lowest)
    if is_zero:
        if isinstance(fmt, FloatFormat) and not fmt.zero:  # the smallest magnitude, signed if it can be
            return -fmt.min_normal if negative and fmt.signed else fmt.min_normal
        keep_sign = negative and isinstance(fmt, FloatFormat) and fmt.has_negative_zero
        return -0.0 if keep_sign else 0.0
    if isinstance(fmt, FloatFormat) and not fmt.zero and mag < Fraction(fmt.min_normal):
        mag = Fraction(fmt.min_normal)
    value = float(mag)
    return -value if negative else value


def _round_lookup(fmt: LookupFormat, x: Fraction, mode: str, rand32: int | None) -> float:
    if mode == "bitsandbytes":  # code = #{i: float32(x) > b[i]}
        x32 = float32(float(x))
        return fmt.table[sum(x32 > b for b in fmt.bitsandbytes_bounds())]
    table = [Fraction(v) for v in fmt.table]
    if x <= table[0]:
        return float(table[0])
    if x >= table[-1]:
        return float(table[-1])
    i = max(j for j in range(len(table)) if table[j] <= x)
    lo, hi = table[i], table[i + 1]
    if x == lo:
        return float(lo)
    if mode == "up":
        return float(hi)
    if mode == "down":
        return float(lo)
    if mode == "toward_zero":
        if lo < 0 < hi:
            return float(min(lo, hi, key=abs))
        return float(lo if lo >= 0 else hi)
    if mode == "stochastic":
        if rand32 is None:
            raise ValueError("stochastic rounding needs a 32-bit random word")
        # the probability is computed in float64, as the codebook kernel does
        frac = (float(x) - float(lo)) / (float(hi) - float(lo))
        return float(hi if rand32 < math.floor(frac * 2.0 ** 32) else lo)
    d_lo, d_hi = x - lo, hi - x
    if d_lo != d_hi:
        return float(lo if d_lo < d_hi else hi)
    if mode == "nearest_away":
        return float(hi if abs(hi) > abs(lo) else lo)
    return float(lo if i % 2 == 0 else hi)


def encode_value(x: float, fmt: Format, mode: str = "nearest_even", overflow: str | None = None,
                 rand32: int | None = None) -> int:
    """The code of round_value(x, ...). NaN into a format without NaN raises ValueError."""
    x = float(x)
    if math.isnan(x):
        if not fmt.has_nan:
            raise ValueError(f"NaN has no code in {fmt.name}, which has no NaN")
        return fmt.nan_code(negative=math.copysign(1.0, x) < 0)
    v = round_value(x, fmt, mode, overflow, rand32)
    if math.isnan(v):
        return fmt.nan_code(negative=math.copysign(1.0, v) < 0)
    if isinstance(fmt, IntFormat):
        return fmt.code_of_int(int(v))
    if isinstance(fmt, LookupFormat):
        return fmt.table.index(v)
    if math.isinf(v):
        return fmt.inf_code(negative=v < 0)
    return fmt.code_of_finite(Fraction(v), negative=math.copysign(1.0, v) < 0)


def decode_value(code: int, fmt: Format) -> float:
    return fmt.decode_code(code)
