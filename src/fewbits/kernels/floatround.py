"""Bit-exact rounding of float32/float64 values to any FloatFormat or IntFormat.

The value is taken apart as integers (sign, exponent field, significand), the dropped bits are
rounded in integer arithmetic in every mode, and the result is put back together as a value of
the input's own floating type (the "domain"). No floating-point arithmetic touches the value, so
the result is exact whatever the compiler's float flags, and float64 input is rounded directly.

The format enters only through a small integer parameter vector (see `float_params`), so one
compiled kernel per (domain, mode) serves every format. `IntFormat` is the special case whose
values are all "subnormal" with quantum 1.

Semantics are those of fewbits.formats.reference (the definition); tests compare bit for bit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import FloatFormat, IntFormat
from .compile import compiled
from .random import random_words


@dataclass(frozen=True)
class Domain:
    dtype: torch.dtype
    itype: torch.dtype
    P: int  # stored mantissa bits
    B: int  # exponent bias
    W: int  # total bits

    @property
    def inf_bits(self) -> int:
        return ((1 << (self.W - 1 - self.P)) - 1) << self.P

    @property
    def nan_bits(self) -> int:
        return self.inf_bits | (1 << (self.P - 1))

    def bits_of(self, v: float) -> int:
        return int(torch.tensor(v, dtype=self.dtype).view(self.itype).item())


F32 = Domain(torch.float32, torch.int32, 23, 127, 32)
F64 = Domain(torch.float64, torch.int64, 52, 1023, 64)

# parameter vector layout
(I_M, I_MSUB, I_EMINB, I_PFLIP, I_C, I_MAXP, I_MAXN, I_OVFP, I_OVFN, I_SAT, I_INFP, I_INFN,
 I_SIGNED, I_NEGZERO, I_NEGRES, I_MINRES, I_SEEDLO, I_SEEDHI, N_PARAMS) = range(19)


def fits(fmt, dom: Domain) -> bool:
    """Whether rounding to fmt can be computed exactly in this domain."""
    if isinstance(fmt, IntFormat):
        return fmt.bits + 1 <= dom.P
    m_sub = fmt.man_bits if fmt.subnormals else 0
    emin_b = fmt.emin + dom.B
    if fmt.man_bits > dom.P or emin_b < 1:
        return False
    if emin_b > 1 and fmt.emin - m_sub < 1 - dom.B:
        return False
    return fmt.max <= torch.finfo(dom.dtype).max


def covers(fmt, dom: Domain) -> bool:
    """Whether every value of the domain is a value of fmt (rounding is the identity)."""
    return (isinstance(fmt, FloatFormat) and fmt.specials == "ieee" and fmt.signed and fmt.subnormals
            and fmt.man_bits >= dom.P and fmt.emin - fmt.man_bits <= 1 - dom.B - dom.P
            and fmt.max >= torch.finfo(dom.dtype).max)


@functools.lru_cache(maxsize=512)
def _static_params(fmt, dom: Domain, overflow: str) -> tuple[int, ...]:
    p = [0] * N_PARAMS
    if isinstance(fmt, IntFormat):
        m = fmt.bits + 1
        p[I_M] = p[I_MSUB] = m
        p[I_EMINB] = m + dom.B
        p[I_C] = 0
        maxp, maxn = fmt.max, -fmt.lowest
        p[I_NEGZERO] = 0
        p[I_MINRES] = 0
        lowest_mag = 0
    else:
        m, m_sub = fmt.man_bits, (fmt.man_bits if fmt.subnormals else 0)
        p[I_M], p[I_MSUB] = m, m_sub
        p[I_EMINB] = fmt.emin + dom.B
        p[I_PFLIP] = (dom.B - fmt.bias) & 1 if m == 0 else 0
        p[I_C] = fmt.emin - m_sub
        maxp = maxn = fmt.max
        p[I_NEGZERO] = int(fmt.has_negative_zero)
        p[I_MINRES] = 0 if fmt.zero else dom.bits_of(fmt.min_normal)
        lowest_mag = 0 if fmt.zero else p[I_MINRES]
    p[I_MAXP], p[I_MAXN] = dom.bits_of(maxp), dom.bits_of(maxn)
    p[I_SAT] = int(overflow == "saturate")
    for i_ovf, i_inf, i_max in ((I_OVFP, I_INFP, I_MAXP), (I_OVFN, I_INFN, I_MAXN)):
        special = {"inf": dom.inf_bits, "nan": dom.nan_bits, "saturate": p[i_max]}[overflow]
        p[i_ovf] = special
        p[i_inf] = special
    p[I_SIGNED] = int(fmt.signed)
    p[I_NEGRES] = dom.nan_bits if overflow == "nan" else lowest_mag
    return tuple(p)


def float_params(fmt, dom: Domain, overflow: str, seed: tuple[int, int] = (0, 0), device="cpu") -> torch.Tensor:
    p = list(_static_params(fmt, dom, overflow))
    p[I_SEEDLO], p[I_SEEDHI] = seed
    return torch.tensor(p, dtype=torch.int64 if dom.W == 64 else torch.int32, device=device)


def _round_bits(x: torch.Tensor, p: torch.Tensor, mode: str, P: int, W: int) -> torch.Tensor:
    """The kernel: x (1-D, float32 or float64) -> rounded values, same dtype. Pure torch ops."""
    itype = torch.int32 if W == 32 else torch.int64
    u = x.view(itype)
    neg = u < 0
    a = u & ((1 << (W - 1)) - 1)
    inf_bits = ((1 << (W - 1 - P)) - 1) << P
    m, m_sub, emin_b, pflip = p[I_M], p[I_MSUB], p[I_EMINB], p[I_PFLIP]

    E = a >> P
    insub = E < emin_b
    e_eff = torch.clamp(E, min=1)
    shift = torch.clamp(emin_b - e_eff, min=0)
    k_true = torch.where(insub, P - m_sub, P - m) + shift
    k = torch.clamp(k_true, max=P + 2)
    sig = (a & ((1 << P) - 1)) | ((E > 0).to(itype) << P)
    scaled = shift > 0
    src = torch.where(scaled, sig, a)
    kept = src >> k
    lower = src & ((torch.ones_like(k) << k) - 1)

    if mode == "toward_zero":
        inc = torch.zeros_like(kept)
    elif mode in ("nearest_even", "nearest_away"):
        half = (torch.ones_like(k) << k) >> 1
        if mode == "nearest_away":
            inc = ((lower >= half) & (lower != 0)).to(itype)
        else:
            odd = (kept ^ torch.where(insub, 0, pflip)) & 1
            inc = ((lower > half) | ((lower == half) & (lower != 0) & (odd == 1))).to(itype)
    elif mode in ("up", "down"):
        away = ~neg if mode == "up" else neg
        inc = ((lower != 0) & away).to(itype)
    elif mode == "stochastic":
        idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64)
        r = random_words(idx, p[I_SEEDLO].to(torch.int64), p[I_SEEDHI].to(torch.int64))
        low64 = lower.to(torch.int64)
        k64 = k_true.to(torch.int64)
        thr = torch.where(k64 <= 32, low64 << torch.clamp(32 - k64, min=0),
                          low64 >> torch.clamp(k64 - 32, max=63))
        inc = (r < thr).to(itype)
    else:
        raise ValueError(mode)

    q = kept + inc
    normal_bits = q << k
    qf = q.to(x.dtype).view(itype)
    scaled_bits = torch.where(q == 0, 0, qf + p[I_C] * (1 << P))
    r_bits = torch.where(scaled, scaled_bits, normal_bits)

    # overflow: towards-zero rounding of the magnitude gives the largest finite value
    if mode == "toward_zero":
        rz = torch.ones_like(neg)
    elif mode == "up":
        rz = neg
    elif mode == "down":
        rz = ~neg
    else:
        rz = torch.zeros_like(neg)
    top = torch.where(neg, p[I_MAXN], p[I_MAXP])
    ovf = torch.where(neg, p[I_OVFN], p[I_OVFP])
    r_bits = torch.where(r_bits > top, torch.where(rz | (p[I_SAT] == 1), top, ovf), r_bits)
    r_bits = torch.where(a == inf_bits, torch.where(neg, p[I_INFN], p[I_INFP]), r_bits)
    is_nan_in = a > inf_bits
    is_zero = r_bits == 0
    # unsigned formats: a negative value that did not round to zero is out of range
    neg_out = neg & (p[I_SIGNED] == 0) & ~is_zero & ~is_nan_in
    r_bits = torch.where(neg_out, p[I_NEGRES], r_bits)
    r_bits = torch.where(is_nan_in, inf_bits | (1 << (P - 1)), r_bits)
    r_bits = torch.where(r_bits == 0, p[I_MINRES], r_bits)
    keep_sign = neg & ((p[I_SIGNED] == 1) | (r_bits > inf_bits)) & (~is_zero | (p[I_NEGZERO] == 1))
    return (r_bits | (keep_sign.to(itype) * -(1 << (W - 1)))).view(x.dtype)


def _kernel(x, p, mode: str, P: int, W: int):
    return _round_bits(x, p, mode, P, W)


def _kernel_out(x, p, out, mode: str, P: int, W: int):
    out.copy_(_round_bits(x, p, mode, P, W))


_compiled = compiled(_kernel)
_compiled_out = compiled(_kernel_out)


def round_flat(x: torch.Tensor, params: torch.Tensor, mode: str, dom: Domain, out: torch.Tensor | None = None):
    """Round a contiguous 1-D tensor of the domain dtype; write into `out` (1-D, same dtype) if given."""
    if out is None:
        return _compiled(x.numel(), x, params, mode=mode, P=dom.P, W=dom.W)
    _compiled_out(x.numel(), x, params, out, mode=mode, P=dom.P, W=dom.W)
    return out
