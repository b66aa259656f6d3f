"""Integer formats: intN (two's complement) and uintN."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from .base import Format


@dataclass(frozen=True, eq=True, repr=False)
class IntFormat(Format):
    """An N-bit integer: signed two's complement [-2^(N-1), 2^(N-1)-1] or unsigned [0, 2^N-1].

    Values are the integers themselves; a quantization scale (see fewbits.quant) maps them to reals.
    Codes are the two's complement bit patterns, e.g. int4 -1 is code 0xF.
    """

    bits_: int
    signed_: bool = True
    name: str = field(default="", compare=False)

    def __init__(self, bits: int, signed: bool = True, name: str = ""):
        if not isinstance(bits, int) or isinstance(bits, bool):
            raise TypeError(f"bits must be an int, got {type(bits).__name__}")
        if not 1 <= bits <= 32:
            raise ValueError(f"integer formats take 1..32 bits, got {bits}")
        if bits == 1 and signed:
            raise ValueError("int1 is not a useful signed format; use uint1")
        object.__setattr__(self, "bits_", bits)
        object.__setattr__(self, "signed_", bool(signed))
        object.__setattr__(self, "name", name or f"{'' if signed else 'u'}int{bits}")

    @property
    def bits(self) -> int:
        return self.bits_

    @property
    def signed(self) -> bool:
        return self.signed_

    @property
    def has_inf(self) -> bool:
        return False

    @property
    def has_nan(self) -> bool:
        return False

    @property
    def max(self) -> float:
        return float(2 ** (self.bits - 1) - 1 if self.signed else 2 ** self.bits - 1)

    @property
    def lowest(self) -> float:
        return float(-(2 ** (self.bits - 1))) if self.signed else 0.0

    @property
    def min_normal(self) -> float:
        return 1.0

    @property
    def min_subnormal(self) -> None:
        return None

    @property
    def eps(self) -> float:
        return 1.0

    @property
    def decimal_digits(self) -> float:
        return math.log10(self.max - self.lowest + 1)

    @property
    def num_values(self) -> int:
        return 2 ** self.bits

    @property
    def layout(self) -> str:
        kind = "two's complement" if self.signed else "unsigned"
        return f"{kind} {self.bits}-bit"

    def decode_code(self, code: int) -> float:
        if not 0 <= code < 2 ** self.bits:
            raise ValueError(f"code {code} out of range for {self.name}")
        if self.signed and code >= 2 ** (self.bits - 1):
            code -= 2 ** self.bits
        return float(code)

    def code_of_int(self, v: int) -> int:
        if not self.lowest <= v <= self.max:
            raise ValueError(f"{v} out of range for {self.name}")
        return v % (2 ** self.bits)

    def _finite_values_exact(self) -> list[Fraction]:
        if self.bits > 20:
            raise ValueError(f"{self.name} has {self.num_values:,} values; enumeration is limited to 20 bits")
        return [Fraction(v) for v in range(int(self.lowest), int(self.max) + 1)]

    def __repr__(self) -> str:
        return f"<IntFormat {self.name}>"
