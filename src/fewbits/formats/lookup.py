"""Codebook (lookup) formats such as NF4: a code indexes a table of values."""
from __future__ import annotations

import math
import struct
from fractions import Fraction

from .base import Format

# The NF4 codebook of QLoRA (Dettmers et al., 2023) exactly as bitsandbytes stores it (float32),
# ascending, so code i is the i-th value: code 7 is 0.0, code 15 is 1.0.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# llama.cpp's IQ4_NL / IQ4_XS codebook (kvalues_iq4nl, ggml-common.h): 16 integers, not symmetric,
# denser near zero; a block scale multiplies them
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def float32(x: float) -> float:
    """x rounded to float32 (nearest, ties to even; beyond float32's range: +-inf, as torch's
    .float() casts), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


class LookupFormat(Format):
    """A format whose codes index a table of values (a codebook).

    values: the finite values, strictly ascending; code i stands for values[i]. The codebook has
    no inf or NaN. Every midpoint between neighbours must be exact in float64 (true for float32
    values), so that rounding decisions are exact.
    """

    def __init__(self, name: str, values):
        vals = [float(v) for v in values]
        if len(vals) < 2:
            raise ValueError("a codebook needs at least 2 values")
        if any(not math.isfinite(v) for v in vals):
            raise ValueError("codebook values must be finite")
        if any(b <= a for a, b in zip(vals, vals[1:])):
            raise ValueError("codebook values must be strictly ascending")
        for a, b in zip(vals, vals[1:]):
            if Fraction((a + b) / 2) != (Fraction(a) + Fraction(b)) / 2:
                raise ValueError(f"midpoint of {a} and {b} is not exact in float64; use float32-representable values")
        self.name = name
        self._values = tuple(vals)
        self._bits = max(1, (len(vals) - 1).bit_length())
        self._bnb_bounds = None  # bitsandbytes_bounds(), computed once (it runs at every call in that mode)

    def __eq__(self, other):
        return isinstance(other, LookupFormat) and self._values == other._values

    def __hash__(self):
        return hash(("lookup", self._values))

    @property
    def table(self) -> tuple[float, ...]:
        return self._values

    @property
    def bits(self) -> int:
        return self._bits

    @property
    def signed(self) -> bool:
        return self._values[0] < 0

    @property
    def has_inf(self) -> bool:
        return False

    @property
    def has_nan(self) -> bool:
        return False

    @property
    def max(self) -> float:
        return self._values[-1]

    @property
    def lowest(self) -> float:
        return self._values[0]

    @property
    def min_normal(self) -> float | None:
        pos = [v for v in self._values if v > 0]
        return min(pos) if pos else None

    @property
    def min_subnormal(self) -> None:
        return None

    @property
    def eps(self) -> None:
        return None

    @property
    def num_values(self) -> int:
        return len(self._values)

    @property
    def layout(self) -> str:
        return f"{self.bits}-bit index into {len(self._values)} values"

    def bitsandbytes_bounds(self) -> tuple[float, ...]:
        """The bucket bounds of bitsandbytes' codebook rounding (mode="bitsandbytes").

        bitsandbytes (quantize_4bit, 0.45 to 0.50 at least: its default/CPU kernel) computes the
        bounds in float32, b[i] = (v[i] + v[i+1]) / 2 on a float32 table, and takes
        code = torch.bucketize(float32(x), b) = #{i: float32(x) > b[i]}. This differs from exact
        rounding (mode="nearest_even") in three ways: a bound is the float32 nearest the
        midpoint, not the midpoint itself; a value equal to a bound goes to the lower code, not
        to the even one; and the input is cast to float32 first (float64 too). For float32
        inputs the two rules differ only on the bounds themselves: for NF4, on 10 of its 15
        (the 5 others are exact midpoints where the even code is the lower one, or float32
        roundings below the midpoint).

        Raises ValueError for a codebook whose values float32 cannot hold (bitsandbytes' tables
        are float32)."""
        if self._bnb_bounds is None:
            self._bnb_bounds = self._compute_bitsandbytes_bounds()
        return self._bnb_bounds

    def _compute_bitsandbytes_bounds(self) -> tuple[float, ...]:
        v = self._values
        if any(float32(t) != t for t in v):
            raise ValueError(f"mode 'bitsandbytes' takes codebooks of float32 values; {self.name} has values "
                             "float32 cannot hold")
        # a + b is exact in float64 (the constructor checked the midpoints), so each step below
        # is one float32 rounding, as bitsandbytes' float32 add and divide
        return tuple(float32(float32(a + b) / 2) for a, b in zip(v, v[1:]))

    def decode_code(self, code: int) -> float:
        if not 0 <= code < len(self._values):
            raise ValueError(f"code {code} out of range for {self.name} ({len(self._values)} values)")
        return self._values[code]

    def _finite_values_exact(self) -> list[Fraction]:
        return [Fraction(v) for v in self._values]

    def __repr__(self) -> str:
        return f"<LookupFormat {self.name}>"
