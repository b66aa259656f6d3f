"""The common interface of every number format.

A format is pure data: a finite set of values (plus optional infinities and NaN) and a bit code
for each. Everything else in fewbits — rounding, packing, quantization, memory — is derived from
these descriptors. Subclasses: FloatFormat, IntFormat, LookupFormat.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from fractions import Fraction

OVERFLOW_POLICIES = ("saturate", "inf", "nan")
OVERFLOW_PRESETS = ("torch", "ml_dtypes")


class Format(ABC):
    """A number format. Immutable and hashable; equal formats compare equal."""

    name: str

    # --- layout -----------------------------------------------------------------------------
    @property
    @abstractmethod
    def bits(self) -> int:
        """Storage bits of one value (without any shared scale)."""

    @property
    @abstractmethod
    def signed(self) -> bool: ...

    @property
    @abstractmethod
    def has_inf(self) -> bool: ...

    @property
    @abstractmethod
    def has_nan(self) -> bool: ...

    # --- the value set ---------------------------------------------------------------------
    @abstractmethod
    def decode_code(self, code: int) -> float:
        """Exact value of one bit pattern (a Python float: every supported value fits float64)."""

    @abstractmethod
    def _finite_values_exact(self) -> list[Fraction]:
        """All distinct finite values, ascending, as exact fractions (-0 and +0 count once)."""

    @property
    @abstractmethod
    def max(self) -> float:
        """Largest finite value."""

    @property
    @abstractmethod
    def min_normal(self) -> float | None:
        """Smallest positive normal value (for integers and codebooks: smallest positive value)."""

    @property
    @abstractmethod
    def min_subnormal(self) -> float | None:
        """Smallest positive subnormal value, or None if the format has no subnormals."""

    @property
    @abstractmethod
    def eps(self) -> float | None:
        """Gap between 1 and the next larger value (machine epsilon), None where 1 is absent."""

    @property
    def lowest(self) -> float:
        """Most negative finite value (0 or the smallest value for unsigned formats)."""
        return float(self._finite_values_exact()[0])

    @property
    def num_values(self) -> int:
        """Number of distinct finite values (+0 and -0 count once)."""
        return len(self._finite_values_exact())

    def values(self):
        """All finite values, ascending, as a float64 torch tensor (-0 and +0 appear once, as +0)."""
        import torch  # formats needs torch only for this convenience

        return torch.tensor([float(v) for v in self._finite_values_exact()], dtype=torch.float64)

    @property
    def decimal_digits(self) -> float | None:
        """Decimal digits of precision: log10(2**(mantissa bits + 1)) for floats."""
        return None

    @property
    def default_overflow(self) -> str:
        """What an out-of-range value becomes by default: inf where the format has infinities,
        otherwise the largest finite value (saturate). NaN on overflow is available on request."""
        return "inf" if self.has_inf else "saturate"

    def preset_overflow(self, library: str, device: str = "cpu") -> str:
        """The overflow policy that reproduces a library's casts to this format:
        'torch' saturates OCP E4M3 (inf too) on a CPU and gives inf for IEEE-style formats;
        'ml_dtypes' gives NaN wherever the format has NaN but no inf; both give NaN for fnuz
        formats. torch's CUDA casts differ from its CPU casts for OCP E4M3: they give NaN
        (seen with torch 2.11 on an H200), so device="cuda" (the device type of the tensor
        being rounded) selects that."""
        if library not in OVERFLOW_PRESETS:
            raise ValueError(f"unknown preset {library!r}; choose one of {', '.join(OVERFLOW_PRESETS)}")
        if self.has_inf:
            return "inf"
        torch_saturates = (library == "torch" and device == "cpu" and getattr(self, "specials", None) == "fn"
                           and self.signed)
        if self.has_nan and not torch_saturates:  # torch saturates float8_e4m3fn, not e8m0fnu
            return "nan"
        return "saturate"

    def check_overflow(self, overflow: str | None, device: str = "cpu") -> str:
        """Resolve and validate an overflow policy (or a preset name, for values on a device of
        type `device`) for this format."""
        if overflow is None:
            return self.default_overflow
        if overflow in OVERFLOW_PRESETS:
            return self.preset_overflow(overflow, device)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(
                f"unknown overflow policy {overflow!r}; choose one of "
                f"{', '.join(OVERFLOW_POLICIES + OVERFLOW_PRESETS)}"
            )
        if overflow == "inf" and not self.has_inf:
            raise ValueError(f"format {self.name} has no infinity: overflow='inf' is impossible; "
                             f"use 'saturate'{' or nan' if self.has_nan else ''}")
        if overflow == "nan" and not self.has_nan:
            raise ValueError(f"format {self.name} has no NaN: overflow='nan' is impossible; "
                             f"use 'saturate'{' or inf' if self.has_inf else ''}")
        return overflow

    # --- descriptive helpers ---------------------------------------------------------------
    @property
    def kind(self) -> str:
        return type(self).__name__.replace("Format", "").lower()

    @property
    def specials_description(self) -> str:
        parts = []
        if self.has_inf:
            parts.append("inf")
        if self.has_nan:
            parts.append("NaN")
        return "+".join(parts) if parts else "none"

    def bytes_per_billion(self) -> float:
        """Bytes needed to store 1e9 values (no scales)."""
        return self.bits * 1e9 / 8

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

