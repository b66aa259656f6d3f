"""fb.round, fb.encode and fb.decode: the public entry points of the rounding kernels."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..formats import FLOAT_DTYPES, FloatFormat, IntFormat, LookupFormat, check_mode, get_format
from . import dtypes
from . import floatround as fr
from . import native_round
from .arguments import check_dense, check_generator, check_out
from .lookupround import lookup_indices, round_lookup
from .random import draw_seed

_FP32, _FP64 = get_format("fp32"), get_format("fp64")


# ---------------------------------------------------------------------------------------------
# input handling
# ---------------------------------------------------------------------------------------------
class _Wrapped:
    """A caller's array as a torch tensor: `tensor`; `restore(t)` gives a float result back in the
    caller's type (numpy in, numpy out); `shares` says whether writes to `tensor` reach the
    caller's memory (False when wrapping needed a copy: bfloat16 or foreign-byte-order numpy
    arrays, negative strides)."""

    def __init__(self, tensor, restore, shares, is_numpy):
        self.tensor, self.restore, self.shares, self.is_numpy = tensor, restore, shares, is_numpy


def _to_torch(x, what="x") -> _Wrapped:
    if isinstance(x, torch.Tensor):
        check_dense(x, what)
        return _Wrapped(x, lambda t: t, True, False)
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":  # ml_dtypes
            bf = x.dtype
            t = torch.from_numpy(np.ascontiguousarray(x).view(np.uint16)).view(torch.bfloat16).reshape(x.shape)
            shares = x.flags.c_contiguous
            return _Wrapped(t, lambda r: r.contiguous().view(torch.int16).numpy().view(bf), shares, True)
        if x.dtype.kind == "f" and x.dtype.itemsize in (2, 4, 8):
            arr, shares = x, True
            if not x.dtype.isnative:
                arr, shares = x.astype(x.dtype.newbyteorder("=")), False
            if any(st < 0 for st in arr.strides):
                arr, shares = np.ascontiguousarray(arr), False
            return _Wrapped(torch.from_numpy(arr), lambda r: r.numpy(), shares, True)
        _reject_dtype(x.dtype, what)
    raise TypeError(f"{what} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _reject_dtype(dtype, what):
    raise TypeError(f"{what} has dtype {dtype}; fewbits rounds float16, bfloat16, float32 and float64 "
                    "values (convert integers with .float(); complex values are not supported)")


def _check_float(t: torch.Tensor, what="x"):
    if t.dtype not in FLOAT_DTYPES:
        _reject_dtype(t.dtype, what)


def _domain_for(fmt, dtype) -> fr.Domain | None:
    """The float domain (float32 or float64) whose integer bits fmt is rounded in."""
    dom = fr.F64 if dtype == torch.float64 else fr.F32
    if dom is fr.F32 and not fr.fits(fmt, fr.F32):
        dom = fr.F64
    if not fr.fits(fmt, dom):
        raise NotImplementedError(f"{fmt.name}: its range or precision exceeds what float64 can compute")
    return dom


def _mode_seed(mode, fmt, generator):
    check_generator(generator)
    check_mode(mode, fmt)
    return draw_seed(generator) if mode == "stochastic" else (0, 0)


# ---------------------------------------------------------------------------------------------
# round
# ---------------------------------------------------------------------------------------------
def round(x, fmt, mode: str = "nearest_even", overflow: str | None = None,
          generator: torch.Generator | None = None, out=None):
    """Round every element of x to the nearest value of `fmt` (see fewbits.formats.reference).

    x: torch.Tensor or numpy.ndarray of float16/bfloat16/float32/float64, any shape or strides
    (dense: sparse tensors raise TypeError).
    Returns the same type, shape and dtype (float16/bfloat16 are rounded exactly via float32, and
    the result is cast back: a value the input dtype cannot hold is rounded again by that cast).
    float32 input to a format with values beyond float32's range (fp64, FloatFormat(11, 4)) is
    rounded exactly and stays float32 while every result fits; a result float32 cannot hold
    (3.4e38 rounding up to 2^128, or inf saturating to the format's max) raises ValueError
    instead of becoming inf: round float64 input to get such values.
    mode: nearest_even | nearest_away | toward_zero | up | down | stochastic, or for codebooks
    the preset "bitsandbytes" (its NF4 rule: float32 bounds, ties to the lower code).
    overflow: saturate | inf | nan | None (the format's default: inf if it has inf, else saturate).
    generator: torch.Generator for stochastic rounding (default: torch's global RNG); anything
    else (an int seed, a numpy Generator) raises TypeError.
    out: a tensor or array of x's shape and dtype to write the result into: x itself (in place),
    or memory x does not use. ValueError, before anything is written, for an out that partly
    overlaps x (or views x's memory with other strides), one whose elements share memory
    (expand()ed), and a read-only numpy array (bytes-backed, read-only mmap, non-writeable).

    E8M0 against torch's and ml_dtypes' float8_e8m0fnu casts: they round ties away (fewbits'
    nearest_away). torch (and ml_dtypes before 0.7) give 2^-126 for every float32 subnormal
    strictly between 2^-127 and 2^-126, where fewbits (and ml_dtypes 0.7) give the nearest power
    of two: 2^-127 below 1.5 * 2^-127 (and at that tie except under nearest_away). Elsewhere
    nearest_away with overflow="torch" equals both bit for bit, except that ml_dtypes maps 0 to
    NaN (torch and fewbits: 2^-127). No fewbits mode reproduces torch's subnormal rule;
    x.to(torch.float8_e8m0fnu) does.
    """
    fmt = get_format(fmt)
    wx = _to_torch(x)
    t = wx.tensor
    _check_float(t)
    check_mode(mode, fmt)
    overflow = fmt.check_overflow(overflow, t.device.type)
    if out is None:
        return wx.restore(_round_checked(t, fmt, mode, overflow, _mode_seed(mode, fmt, generator)))
    check_out(x, out)  # before wrapping: a read-only numpy out must never reach torch.from_numpy
    wo = _to_torch(out, "out")
    out_t = wo.tensor
    if out_t.shape != t.shape or out_t.dtype != t.dtype or out_t.device != t.device:
        raise ValueError(f"out has shape {tuple(out_t.shape)}, dtype {out_t.dtype}, device {out_t.device}; "
                         f"expected {tuple(t.shape)}, {t.dtype}, {t.device}")
    _round_checked(t, fmt, mode, overflow, _mode_seed(mode, fmt, generator), out_t)
    if not wo.shares:  # the array could only be wrapped by copying it: write the result back
        np.copyto(out, wo.restore(out_t))
    return out


def _round_checked(t, fmt, mode, overflow, seed, out=None):
    """_round_tensor, except for float32 input to a format with values beyond float32's range
    (fp64, FloatFormat(11, 4)): rounded in float64 (as it is anyway), and a result float32 cannot
    hold raises ValueError instead of becoming inf in the cast back."""
    if t.dtype != torch.float32 or not dtypes.beyond_float32(fmt):
        return _round_tensor(t, fmt, mode, overflow, seed, out)
    r64 = _round_tensor(t.to(torch.float64), fmt, mode, overflow, seed)
    dtypes.check_fits_float32(r64, fmt)
    return r64.to(torch.float32) if out is None else out.copy_(r64)


def _round_tensor(t, fmt, mode, overflow, seed, out=None, kind=None):
    """Round tensor t (any float dtype, any layout); into `out` (t's shape and dtype) if given.
    `kind` forces one of the float kernels (tests use it to check each against the reference)."""
    if t.numel() == 0:
        return out if out is not None else t.clone()
    if kind is None:  # C kernels where they beat the compiled ones (float32 on a CPU)
        r = native_round.try_round(t, fmt, mode, overflow, seed, out)
        if r is not None:
            return r
    if isinstance(fmt, LookupFormat):
        return round_lookup(t, fmt, mode, seed, out)
    work_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    if kind is None and fr.covers(fmt, fr.F64 if work_dtype == torch.float64 else fr.F32) and overflow == "inf":
        return out.copy_(t) if out is not None else t.clone()
    dom = _domain_for(fmt, work_dtype)
    params = fr.float_params(fmt, dom, overflow, seed, device=t.device)
    kind = kind or fr.kernel_kind(fmt, dom)
    spec = fr.finish_spec(fmt, dom, overflow)
    flat = t.reshape(-1)  # a view when t is contiguous, else one copy
    if out is not None and out.is_contiguous():
        fr.round_flat(flat, params, mode, dom, kind, spec, out.view(-1))
        return out
    r = fr.round_flat(flat, params, mode, dom, kind, spec).view(t.shape)
    return out.copy_(r) if out is not None else r


# ---------------------------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------------------------
def code_dtype(bits: int) -> torch.dtype:
    """uint8 for codes of up to 8 bits, int32 up to 16, int64 beyond (64-bit codes as bit patterns)."""
    return torch.uint8 if bits <= 8 else torch.int32 if bits <= 16 else torch.int64


def encode(x, fmt, mode: str = "nearest_even", overflow: str | None = None,
           generator: torch.Generator | None = None):
    """Round x to fmt and return the bit patterns (codes) of the results.

    Codes are non-negative integers of dtype code_dtype(fmt.bits), same shape as x (numpy in,
    numpy out). NaN into a format without NaN raises ValueError.
    """
    fmt = get_format(fmt)
    wx = _to_torch(x)
    t = wx.tensor

    def restore(codes):
        return codes.numpy() if wx.is_numpy else codes

    _check_float(t)
    overflow = fmt.check_overflow(overflow, t.device.type)
    seed = _mode_seed(mode, fmt, generator)
    if not fmt.has_nan and t.numel() and bool(torch.isnan(t).any()):
        raise ValueError(f"x contains NaN, which has no code in {fmt.name} (a format without NaN)")
    cd = code_dtype(fmt.bits)
    if t.numel() == 0:
        return restore(torch.empty(t.shape, dtype=cd, device=t.device))
    if isinstance(fmt, LookupFormat):
        return restore(lookup_indices(t, fmt, mode, seed).to(cd))
    work_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    dom = _domain_for(fmt, work_dtype)
    r = _round_tensor(t.to(dom.dtype), fmt, mode, overflow, seed)
    if dom.dtype != r.dtype:
        r = r.to(dom.dtype)
    if isinstance(fmt, IntFormat):
        codes = r.to(torch.int64) & ((1 << fmt.bits) - 1)
        return restore(codes.to(cd))
    if fmt.bits == dom.W:  # the domain's own format: the codes are the bits
        bits = r.view(dom.itype).to(torch.int64)
        return restore((bits & 0xFFFFFFFF if dom.W == 32 else bits).to(cd))
    return restore(_float_codes(r, fmt, dom).to(cd))


def _float_codes(r: torch.Tensor, fmt: FloatFormat, dom: fr.Domain) -> torch.Tensor:
    """Codes of values already representable in fmt (domain float tensor) -> int64."""
    P, B = dom.P, dom.B
    u = r.view(dom.itype).to(torch.int64)
    neg = u < 0
    a = u & ((1 << (dom.W - 1)) - 1)
    E = a >> P
    m = fmt.man_bits
    emin_b = fmt.emin + B
    sig = (a & ((1 << P) - 1)) | ((E > 0).to(torch.int64) << P)
    e_eff = E.clamp(min=1)
    normal = E >= emin_b
    ef = torch.where(normal, E - (B - fmt.bias), 0)
    shift_sub = (P - m + (emin_b - e_eff)).clamp(0, 63)
    mf = torch.where(normal, (a & ((1 << P) - 1)) >> (P - m), sig >> shift_sub)
    body = (ef << m) | mf
    sbit = 1 << (fmt.exp_bits + m)
    code = torch.where(neg & torch.tensor(fmt.signed), body | sbit, body)
    inf_bits = dom.inf_bits
    if fmt.has_inf:
        code = torch.where(a == inf_bits, torch.where(neg, fmt.inf_code(True), fmt.inf_code(False)), code)
    if fmt.has_nan:
        nan_code = torch.where(neg, fmt.nan_code(True), fmt.nan_code(False))
        code = torch.where(a > inf_bits, nan_code, code)
    return code


@functools.lru_cache(maxsize=128)
def _decode_table(fmt, device: str) -> torch.Tensor:
    if isinstance(fmt, LookupFormat):
        return torch.tensor(fmt.table, dtype=torch.float64, device=device)
    codes = torch.arange(2 ** fmt.bits, dtype=torch.int64, device=device)
    return _decode_formula(codes, fmt)


def _decode_formula(c: torch.Tensor, fmt) -> torch.Tensor:
    """float64 values of int64 codes, computed field by field (exact)."""
    if isinstance(fmt, LookupFormat):
        return torch.tensor(fmt.table, dtype=torch.float64, device=c.device)[c]
    if isinstance(fmt, IntFormat):
        v = c.to(torch.float64)
        if fmt.signed:
            v = torch.where(c >= 2 ** (fmt.bits - 1), v - 2.0 ** fmt.bits, v)
        return v
    m, e = fmt.man_bits, fmt.exp_bits
    s = ((c >> (e + m)) & 1) == 1 if fmt.signed else torch.zeros_like(c, dtype=torch.bool)
    ef = (c >> m) & (2 ** e - 1)
    mf = (c & (2 ** m - 1)).to(torch.float64)
    if fmt.zero:
        sub = mf * 2.0 ** (fmt.emin - m) if fmt.subnormals else torch.zeros_like(mf)
        mag = torch.where(ef == 0, sub, torch.ldexp(mf + 2.0 ** m, ef - fmt.bias - m))
    else:
        mag = torch.ldexp(mf + 2.0 ** m, ef - fmt.bias - m)
    top = ef == fmt.max_field
    if fmt.specials == "ieee":
        mag = torch.where(top, torch.where(mf == 0, math.inf, math.nan), mag)
    elif fmt.specials == "fn":
        mag = torch.where(top & (mf == 2 ** m - 1), math.nan, mag)
    elif fmt.specials == "fnuz":
        mag = torch.where(s & (ef == 0) & (mf == 0), math.nan, mag)
    return torch.where(s, -mag, mag)


def decode(codes, fmt, dtype=None):
    """Values of bit patterns `codes` (any integer dtype, any shape) in fmt; numpy in, numpy out.

    dtype: the values' floating dtype: a torch dtype, its name ("float32", "bfloat16") or a numpy
    float dtype. Default: float32 where it holds every value of fmt exactly, else float64 (fp64,
    e8m30, e11m40, any format with values beyond float32's range or precision). A given dtype
    must span fmt's range and special values, else ValueError (fp64 into float32, bf16 into
    float16: values would become inf or NaN); values finer than its precision are rounded to
    nearest, as Tensor.to(dtype) does; float64 is always accepted. Integer and bool dtypes raise
    TypeError. numpy codes decode to float16, float32 or float64 (numpy has no other float dtype).
    Codes out of range raise ValueError; codes of 64-bit formats are bit patterns (int64, uint64).
    """
    fmt = get_format(fmt)
    want = dtypes.value_dtype(fmt) if dtype is None else dtypes.checked_value_dtype(dtype, fmt)
    if isinstance(codes, torch.Tensor):
        check_dense(codes, "codes")
        t, restore = codes, (lambda r: r)
    else:
        if isinstance(codes, np.ndarray) and want not in dtypes.NUMPY_VALUE_DTYPES:
            raise TypeError(f"numpy codes decode to float16, float32 or float64, not {want}; pass torch codes")
        t, restore = _codes_numpy(codes)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"codes must be integers, got dtype {t.dtype}")
    unsigned64 = t.dtype == torch.uint64 or (isinstance(codes, np.ndarray) and codes.dtype == np.uint64)
    c = t.view(torch.int64) if t.dtype == torch.uint64 else t.to(torch.int64)  # uint64: the bit patterns
    if fmt.bits == 64 and fmt == _FP64:
        return restore(c.view(torch.float64).to(want))
    n_codes = fmt.num_values if isinstance(fmt, LookupFormat) else 2 ** fmt.bits
    if fmt.bits < 64 and c.numel() and (int(c.min()) < 0 or int(c.max()) >= n_codes):
        lo, hi = _code_range(c, unsigned64)
        raise ValueError(f"codes range {lo}..{hi} is outside 0..{n_codes - 1} of {fmt.name}")
    if fmt.bits == 32 and isinstance(fmt, FloatFormat) and fmt == _FP32:
        return restore(c.to(torch.int32).view(torch.float32).to(want))
    if fmt.bits <= 16:
        table = _decode_table(fmt, str(c.device)).to(want)
        return restore(table[c])
    return restore(_decode_formula(c, fmt).to(want))


def _code_range(c: torch.Tensor, unsigned64: bool) -> tuple[int, int]:
    """(min, max) of int64 codes; of uint64 codes read as their bit patterns (>= 2^63: negative)."""
    neg = c < 0
    if not unsigned64 or not bool(neg.any()):
        return int(c.min()), int(c.max())
    lo = int(c[~neg].min()) if bool((~neg).any()) else int(c[neg].min()) + 2 ** 64
    return lo, int(c[neg].max()) + 2 ** 64


def _codes_numpy(codes):
    if isinstance(codes, np.ndarray):
        if codes.dtype.kind not in "iu":
            raise TypeError(f"codes must be integers, got dtype {codes.dtype}")
        if codes.dtype == np.uint64:
            arr = codes.view(np.int64)  # the bit patterns; decode reads them back as unsigned
        else:
            arr = codes.astype(np.int64) if codes.dtype in (np.uint32, np.uint16) else codes
        return torch.from_numpy(np.ascontiguousarray(arr)), lambda r: r.numpy()
    raise TypeError(f"codes must be a torch.Tensor or numpy.ndarray, got {type(codes).__name__}")
