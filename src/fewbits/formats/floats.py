"""Binary floating-point formats ExMy: IEEE-style, OCP 'fn' and 'fnuz', and plain finite ones."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from .base import Format
from .names import is_taken

SPECIALS = ("ieee", "fn", "fnuz", "none")
_SPECIALS_HELP = (
    "ieee: all-ones exponent holds inf and NaN; fn: finite, the all-ones code is NaN (OCP E4M3); "
    "fnuz: finite, no negative zero, NaN is the negative-zero code; none: every code is a finite number"
)
_MAX_ENUMERATED_BITS = 20


@dataclass(frozen=True, eq=True, repr=False)
class FloatFormat(Format):
    """A binary floating-point format with `exp_bits` exponent and `man_bits` mantissa bits.

    bias: exponent bias; default 2**(exp_bits-1) - 1, or 2**(exp_bits-1) for 'fnuz' (as torch and
        ml_dtypes define the fnuz FP8 types).
    specials: 'ieee' | 'fn' | 'fnuz' | 'none' (see SPECIALS).
    subnormals: whether exponent field 0 holds subnormals (False: it holds only zero).
    signed: whether a sign bit is present.
    zero: False for formats such as E8M0 whose exponent field 0 is an ordinary binade (no zero).
    """

    exp_bits: int
    man_bits: int
    bias: int | None = None
    specials: str = "ieee"
    subnormals: bool = True
    signed: bool = True
    zero: bool = True
    name: str = field(default="", compare=False)

    def __post_init__(self):
        for attr in ("exp_bits", "man_bits"):
            v = getattr(self, attr)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{attr} must be an int, got {type(v).__name__}")
        e, m = self.exp_bits, self.man_bits
        if e < 1:
            raise ValueError(f"a float format needs at least 1 exponent bit (got exp_bits={e}); "
                             "use IntFormat for integers")
        if m < 0:
            raise ValueError(f"man_bits must be >= 0, got {m}")
        if self.specials not in SPECIALS:
            raise ValueError(f"unknown specials {self.specials!r}; choose one of {SPECIALS} ({_SPECIALS_HELP})")
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (e - 1) - (0 if self.specials == "fnuz" else 1))
        if not isinstance(self.bias, int) or isinstance(self.bias, bool):
            raise TypeError(f"bias must be an int, got {type(self.bias).__name__}")
        if self.specials == "ieee":
            if e < 2:
                raise ValueError("impossible layout: IEEE specials take the all-ones exponent, which with "
                                 f"{e} exponent bit(s) leaves no normal numbers; use specials='fn' or 'none'")
            if m < 1:
                raise ValueError("impossible layout: IEEE specials need at least 1 mantissa bit to tell NaN "
                                 "from inf; use specials='fn' or 'none'")
        if self.specials == "fnuz" and not self.signed:
            raise ValueError("impossible layout: 'fnuz' puts NaN in the negative-zero code, which needs a sign bit")
        if not self.zero and self.subnormals:
            raise ValueError("zero=False (exponent field 0 is an ordinary binade) requires subnormals=False")
        if self.specials == "fn" and m == 0 and e < 2:
            raise ValueError("impossible layout: with 1 exponent bit and no mantissa, 'fn' leaves no finite value")
        if self.bits > 64:
            raise ValueError(f"{self.bits} bits is more than 64")
        top = self._max_exponent()
        if top > 1023 or self.emin - self.man_bits < -1074:
            raise ValueError(f"format range 2^{self.emin - (self.man_bits if self.subnormals else 0)} .. 2^{top} "
                             "exceeds float64, the widest type fewbits computes in")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    # --- layout ----------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials in ("ieee", "fn", "fnuz")

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.zero and self.specials != "fnuz"

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return (1 if self.zero else 0) - self.bias

    @property
    def max_field(self) -> int:
        return 2 ** self.exp_bits - 1

    def _max_code_fields(self) -> tuple[int, int]:
        """(exponent field, mantissa field) of the largest finite value."""
        e_top, m_all = self.max_field, 2 ** self.man_bits - 1
        if self.specials == "ieee":
            return e_top - 1, m_all
        if self.specials == "fn":
            return (e_top, m_all - 1) if self.man_bits >= 1 else (e_top - 1, 0)
        return e_top, m_all

    def _max_exponent(self) -> int:
        return self._max_code_fields()[0] - self.bias

    def default_name(self) -> str:
        """A name that get_format() maps back to this format (eXmY[fn|fnuz|_finite][_bN]...)."""
        suffix = {"ieee": "", "fn": "fn", "fnuz": "fnuz", "none": "_finite"}[self.specials]
        name = f"e{self.exp_bits}m{self.man_bits}{suffix}"
        std_bias = 2 ** (self.exp_bits - 1) - (0 if self.specials == "fnuz" else 1)
        if self.bias != std_bias:
            name += f"_b{self.bias}"
        if not self.signed:
            name = "u" + name
        if not self.subnormals:
            name += "_nosub"
        if not self.zero:
            name += "_nozero"
        if self.specials == "ieee" and is_taken(name, self):
            name = name.replace(f"m{self.man_bits}", f"m{self.man_bits}_ieee", 1)
        return name

    # --- values -----------------------------------------------------------------------------
    def _field_value(self, e_field: int, m_field: int) -> Fraction:
        m = self.man_bits
        if e_field == 0 and self.zero:
            if not self.subnormals:
                return Fraction(0)
            return Fraction(m_field, 2 ** m) * Fraction(2) ** self.emin
        return Fraction(2 ** m + m_field, 2 ** m) * Fraction(2) ** (e_field - self.bias)

    def split_code(self, code: int) -> tuple[int, int, int]:
        """(sign, exponent field, mantissa field) of a code."""
        m, e = self.man_bits, self.exp_bits
        if not 0 <= code < 2 ** self.bits:
            raise ValueError(f"code {code} out of range for {self.bits}-bit format {self.name}")
        sign = (code >> (e + m)) & 1 if self.signed else 0
        return sign, (code >> m) & (2 ** e - 1), code & (2 ** m - 1)

    def code_kind(self, code: int) -> str:
        """'nan' | 'inf' | 'finite' for a code."""
        s, ef, mf = self.split_code(code)
        if self.specials == "ieee" and ef == self.max_field:
            return "inf" if mf == 0 else "nan"
        if self.specials == "fn" and ef == self.max_field and mf == 2 ** self.man_bits - 1:
            return "nan"
        if self.specials == "fnuz" and s == 1 and ef == 0 and mf == 0:
            return "nan"
        return "finite"

    def decode_code(self, code: int) -> float:
        kind = self.code_kind(code)
        s, ef, mf = self.split_code(code)
        sign = -1.0 if s else 1.0
        if kind == "nan":
            return math.copysign(math.nan, sign)
        if kind == "inf":
            return sign * math.inf
        return math.copysign(float(self._field_value(ef, mf)), sign)

    def _finite_values_exact(self) -> list[Fraction]:
        if self.bits > _MAX_ENUMERATED_BITS:
            raise ValueError(f"{self.name} has {self.num_values:,} values; enumeration is limited to formats "
                             f"of at most {_MAX_ENUMERATED_BITS} bits")
        vals = set()
        for code in range(2 ** self.bits):
            if self.code_kind(code) == "finite":
                s, ef, mf = self.split_code(code)
                v = self._field_value(ef, mf)
                vals.add(-v if s else v)
        return sorted(vals)

    @property
    def num_values(self) -> int:
        m = self.man_bits
        normal_fields = self.max_field if self.zero else self.max_field + 1
        specials_per_sign = {"ieee": 2 ** m, "fn": 1, "fnuz": 0, "none": 0}[self.specials]
        positive = normal_fields * 2 ** m - specials_per_sign + (2 ** m - 1 if self.subnormals else 0)
        return (2 * positive if self.signed else positive) + (1 if self.zero else 0)

    @property
    def max(self) -> float:
        ef, mf = self._max_code_fields()
        return float(self._field_value(ef, mf))

    @property
    def lowest(self) -> float:
        if self.signed:
            return -self.max
        return 0.0 if self.zero else self.min_normal

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float | None:
        return math.ldexp(1.0, self.emin - self.man_bits) if self.subnormals else None

    @property
    def min_positive(self) -> float:
        return self.min_subnormal if self.subnormals else self.min_normal

    @property
    def eps(self) -> float:
        return math.ldexp(1.0, -self.man_bits)

    @property
    def decimal_digits(self) -> float:
        return (self.man_bits + 1) * math.log10(2)

    @property
    def specials_description(self) -> str:
        base = {"ieee": "inf+NaN", "fn": "NaN", "fnuz": "NaN (no -0)", "none": "none"}[self.specials]
        extra = []
        if not self.subnormals:
            extra.append("no subnormals")
        if not self.zero:
            extra.append("no zero")
        if not self.signed:
            extra.append("unsigned")
        return base + (f" ({', '.join(extra)})" if extra else "")

    @property
    def layout(self) -> str:
        return f"{int(self.signed)}-{self.exp_bits}-{self.man_bits}"

    def nan_code(self, negative: bool = False) -> int:
        """The code this format uses for NaN (quiet NaN for IEEE)."""
        m, e = self.man_bits, self.exp_bits
        sign = (1 << (e + m)) if (negative and self.signed) else 0
        if self.specials == "ieee":
            return sign | (self.max_field << m) | (1 << (m - 1))
        if self.specials == "fn":
            return sign | (self.max_field << m) | (2 ** m - 1)
        if self.specials == "fnuz":
            return 1 << (e + m)
        raise ValueError(f"format {self.name} has no NaN")

    def inf_code(self, negative: bool = False) -> int:
        if not self.has_inf:
            raise ValueError(f"format {self.name} has no infinity")
        sign = (1 << (self.exp_bits + self.man_bits)) if negative else 0
        return sign | (self.max_field << self.man_bits)

    def code_of_finite(self, value: Fraction, negative: bool) -> int:
        """The code of a representable finite value (exact); raises if not representable."""
        m, e = self.man_bits, self.exp_bits
        mag = abs(Fraction(value))
        if mag == 0:
            if not self.zero:
                raise ValueError(f"{self.name} has no zero")
            return (1 << (e + m)) if negative and self.has_negative_zero else 0
        if negative and not self.signed:
            raise ValueError(f"{self.name} is unsigned")
        sign_bit = (1 << (e + m)) if negative else 0
        ex = _floor_log2(mag)
        if ex < self.emin:
            if not self.subnormals:
                raise ValueError(f"{value} is not representable in {self.name}")
            mf = mag / Fraction(2) ** (self.emin - m)
            if mf.denominator != 1:
                raise ValueError(f"{value} is not representable in {self.name}")
            return sign_bit | int(mf)
        ef = ex + self.bias
        mf = (mag / Fraction(2) ** ex - 1) * 2 ** m
        if mf.denominator != 1 or mag > Fraction(self.max):
            raise ValueError(f"{value} is not representable in {self.name}")
        return sign_bit | (ef << m) | int(mf)


def _floor_log2(q: Fraction) -> int:
    """floor(log2(q)) for a positive Fraction, exactly."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    elif Fraction(2) ** (e + 1) <= q:
        e += 1
    return e
