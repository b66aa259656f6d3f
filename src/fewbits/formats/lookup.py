"""Codebook (lookup) formats such as NF4: a code indexes a table of values."""
from __future__ import annotations

import math
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

    def decode_code(self, code: int) -> float:
        if not 0 <= code < len(self._values):
            raise ValueError(f"code {code} out of range for {self.name} ({len(self._values)} values)")
        return self._values[code]

    def _finite_values_exact(self) -> list[Fraction]:
        return [Fraction(v) for v in self._values]

    def __repr__(self) -> str:
        return f"<LookupFormat {self.name}>"
