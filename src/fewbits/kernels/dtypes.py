"""Which floating dtypes hold a format's values: decode's default dtype, its `dtype=` argument, and
whether fb.round can give a float32 input's results back in float32.

A dtype *holds* a format when every value of the format (its finite values, signed zeros,
infinities and NaN) is a value of the dtype, so that decoding into it loses nothing; it *spans*
the format when it has the format's range and special values (only precision may be lost).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..formats import FloatFormat, IntFormat, LookupFormat, get_format

_F32_MAX = torch.finfo(torch.float32).max
NUMPY_VALUE_DTYPES = (torch.float16, torch.float32, torch.float64)  # the ones numpy has


def _float_holds(s: FloatFormat, t: FloatFormat) -> bool:
    """Every value of float format s is a value of float format t (exact, from the layouts)."""
    if (s.has_inf and not t.has_inf) or (s.has_nan and not t.has_nan) or (s.signed and not t.signed):
        return False
    if (s.zero and not t.zero) or (s.has_negative_zero and not t.has_negative_zero):
        return False
    if s.man_bits > t.man_bits or s.max > t.max or s.min_positive < t.min_positive:
        return False
    # the finest step among s's values is 2^(emin - man_bits); below t's normal range it must be
    # a multiple of t's subnormal step (above it, man_bits <= t.man_bits suffices)
    return not t.subnormals or s.emin - s.man_bits >= t.emin - t.man_bits


def _int_holds(s: IntFormat, t: FloatFormat) -> bool:
    top = max(s.max, -s.lowest)  # every integer up to 2^(man_bits + 1) is a value of t
    return t.zero and (t.signed or s.lowest >= 0) and top <= t.max and top <= 2 ** (t.man_bits + 1)


@functools.lru_cache(maxsize=256)
def holds(dtype: torch.dtype, fmt) -> bool:
    """Whether every value of fmt is exactly a value of the torch floating dtype `dtype`."""
    target = get_format(dtype)
    if isinstance(fmt, FloatFormat):
        return _float_holds(fmt, target)
    if isinstance(fmt, IntFormat):
        return _int_holds(fmt, target)
    if isinstance(fmt, LookupFormat):
        v = torch.tensor(fmt.table, dtype=torch.float64)
        back = v.to(dtype).to(torch.float64)
        return bool(((back == v) & (torch.signbit(back) == torch.signbit(v))).all())
    raise TypeError(f"unknown kind of format {fmt!r}")


def value_dtype(fmt) -> torch.dtype:
    """decode's default: float32 where it holds every value of fmt, else float64 (fp64, e8m30,
    e11m40 and any format with values beyond float32's range or precision)."""
    return torch.float32 if holds(torch.float32, fmt) else torch.float64


def as_float_dtype(dtype) -> torch.dtype:
    """A torch floating dtype from a torch dtype, its name ("float32", "torch.bfloat16", "half")
    or a numpy dtype (np.float32, ml_dtypes.bfloat16). Integer and bool dtypes raise TypeError."""
    d = dtype
    if isinstance(dtype, str):
        d = getattr(torch, dtype.removeprefix("torch."), None)
    elif not isinstance(dtype, torch.dtype):
        try:
            d = getattr(torch, np.dtype(dtype).name, None)
        except TypeError:
            d = None
    if not isinstance(d, torch.dtype):
        raise TypeError(f"dtype must be a floating dtype such as torch.float32 or 'float32', got {dtype!r}")
    if not d.is_floating_point:
        raise TypeError(f"dtype {d} is not a floating dtype: decode gives the values of the codes "
                        "(float16, bfloat16, float32, float64 or a float8 dtype); cast them yourself if "
                        "you want integers")
    try:
        fmt = get_format(d)
    except ValueError:
        fmt = None
    if not isinstance(fmt, FloatFormat) or fmt.bits != d.itemsize * 8:
        raise TypeError(f"dtype {d} is not supported for values (packed or unknown layout); "
                        "use float16, bfloat16, float32, float64 or a float8 dtype")
    return d


def _spans(dtype: torch.dtype, fmt) -> bool:
    """Whether the dtype spans fmt's range and special values: its largest magnitude, inf, NaN,
    negative values and zero (precision aside)."""
    t = get_format(dtype)
    top, has_neg = max(fmt.max, -fmt.lowest), fmt.lowest < 0
    if isinstance(fmt, FloatFormat):
        has_zero = fmt.zero
    else:
        has_zero = isinstance(fmt, IntFormat) or 0.0 in fmt.table
    has_inf, has_nan = fmt.has_inf, fmt.has_nan
    return (top <= t.max and (t.signed or not has_neg) and (t.zero or not has_zero)
            and (t.has_inf or not has_inf) and (t.has_nan or not has_nan))


def checked_value_dtype(dtype, fmt) -> torch.dtype:
    """decode's dtype= argument: a floating dtype spanning fmt's range and special values. Values
    finer than the dtype's precision are rounded to its nearest, as Tensor.to(dtype) does (a
    float64-only codebook decoded to float32); a dtype whose range or specials fall short of fmt
    (fp64 into float32, bf16 into float16, E5M2's inf into float8_e4m3fn) raises ValueError
    instead of overflowing to inf or NaN in silence. float64 is always accepted."""
    d = as_float_dtype(dtype)
    if d != torch.float64 and not _spans(d, fmt):
        raise ValueError(f"dtype {d} cannot hold the range or special values of {fmt.name} (they would "
                         f"become inf or NaN); decode to {value_dtype(fmt)} (the default) instead")
    return d


def beyond_float32(fmt) -> bool:
    """Whether fmt has finite values beyond float32's range (fp64, FloatFormat(11, 4), e8m3 'fn'):
    rounding a float32 input to fmt can give a value float32 cannot hold."""
    return fmt.max > _F32_MAX


def check_fits_float32(r64: torch.Tensor, fmt):
    """fb.round of float32 input: refuse (ValueError) results beyond float32's finite range that
    would otherwise become inf in silence (values of fmt, finite, but too large for float32)."""
    big = torch.isfinite(r64) & (r64.abs() > _F32_MAX)
    if r64.numel() and bool(big.any()):
        n, v = int(big.sum()), float(r64[big].reshape(-1)[0])
        raise ValueError(f"{n} rounded value(s) of {fmt.name} (e.g. {v:.9g}) lie beyond float32's range "
                         f"(max {_F32_MAX:.9g}) and would become inf in a float32 result; round float64 "
                         "input (x.double()) to get them")
