"""Bit-exact rounding of float32/float64 values to any FloatFormat or IntFormat.

The value is taken apart as integers (sign, exponent field, significand) in the input's own
floating type (the "domain": float32 for float16/bfloat16/float32 input, float64 for float64, or
float64 where the format needs it), rounded in every mode, and put back together. float64 input
is rounded directly. Which arithmetic does the rounding depends on the format (`kernel_kind`):
integer bit arithmetic, or an exact power-of-two scaling around the CPU's round/floor/ceil; both
are exact (inductor compiles without unsafe float flags; subnormals must not be flushed, torch's
default).

The rounding reads the format from a small integer vector (`float_params`); the overflow and
special-value step (`_finish`) takes its constants at compile time (`finish_spec`), which keeps
that step cheap. `IntFormat` is the special case whose values are all "subnormal" with step 1.

Semantics are those of fewbits.formats.reference (the definition); tests compare bit for bit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import FloatFormat, IntFormat
from .compile import compiled
from .random import ints_on, random_words


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
 I_SIGNED, I_NEGZERO, I_NEGRES, I_MINRES, I_CLAMP, I_SEEDLO, I_SEEDHI, N_PARAMS) = range(20)


def fits(fmt, dom: Domain) -> bool:
    """Whether rounding to fmt can be computed exactly in this domain."""
    if isinstance(fmt, IntFormat):
        return fmt.bits + 1 <= dom.P
    if _one_binade_below(fmt, dom):
        return True
    m_sub = fmt.man_bits if fmt.subnormals else 0
    emin_b = fmt.emin + dom.B
    if fmt.man_bits > dom.P or emin_b < 1:
        return False
    if emin_b > 1 and fmt.emin - m_sub < 1 - dom.B:
        return False
    return fmt.max <= torch.finfo(dom.dtype).max


def _one_binade_below(fmt, dom: Domain) -> bool:
    """Powers-of-two formats reaching one binade below the domain's normal range (E8M0 in
    float32: 2^-127 is a float32 subnormal): the 'pow2' kernel rounds them in the domain."""
    return (isinstance(fmt, FloatFormat) and fmt.man_bits == 0 and not fmt.subnormals and not fmt.zero
            and fmt.emin + dom.B == 0 and fmt.max <= torch.finfo(dom.dtype).max)


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
    emax = _max_exponent(fmt)
    p[I_CLAMP] = dom.bits_of(2.0 ** min(emax + 2, dom.B))
    return tuple(p)


def _max_exponent(fmt) -> int:
    return fmt.bits if isinstance(fmt, IntFormat) else fmt._max_exponent()


def kernel_kind(fmt, dom: Domain) -> str:
    """Which kernel rounds fmt in this domain (all give identical results):
    'fixed'   formats with the domain's own exponent range and subnormals (bf16, tf32 from
              float32): drop a fixed number of mantissa bits in integer arithmetic;
    'scaled'  formats whose smallest step is a normal number of the domain and at most 1 (fp16,
              fp8, fp6, fp4, ints, E8M0 from float64): scale by the step (a power of two, exact),
              round to an integer with the CPU's own rounding instructions, scale back;
    'pow2'    powers of two one binade below the domain's normal range (E8M0 from float32);
    'generic' anything else: integer arithmetic with a per-element shift."""
    if _one_binade_below(fmt, dom):
        return "pow2"
    if isinstance(fmt, FloatFormat):
        m, m_sub = fmt.man_bits, (fmt.man_bits if fmt.subnormals else 0)
        emin_b = fmt.emin + dom.B
        if fmt.subnormals and fmt.zero and emin_b == 1 and m >= 1:
            return "fixed"
    else:
        m = m_sub = fmt.bits + 1
        emin_b = m + dom.B
    emax = _max_exponent(fmt)
    # the smallest step must be a normal number no larger than 1 (so |x| / step is exact even for
    # the tiniest x), and 4x the range must stay finite after scaling
    if (emin_b - m >= 1 and 1 <= emin_b - m_sub <= dom.B and emax + 3 <= dom.B
            and emax + 2 - m <= dom.B - 1):
        return "scaled_m0" if m == 0 else "scaled"
    return "generic"


def float_params(fmt, dom: Domain, overflow: str, seed: tuple[int, int] = (0, 0), device="cpu") -> torch.Tensor:
    """The kernels' parameter vector on `device` (on an accelerator: cached there, the seeds
    filled in per call, so that no call waits for a host-to-device copy)."""
    return ints_on(_static_params(fmt, dom, overflow), device, torch.int64 if dom.W == 64 else torch.int32,
                   fill={I_SEEDLO: int(seed[0]), I_SEEDHI: int(seed[1])})


def _increment(mode: str, lower, kept, neg, k, k_true, p, odd_flip, itype):
    """0/1 per element: whether the kept magnitude `kept` goes up by one step, given the dropped
    bits `lower` (k of them; k_true >= k is the uncapped count, which only stochastic rounding
    needs). Integer arithmetic; shared by the fixed and generic kernels."""
    if mode == "toward_zero":
        return torch.zeros_like(kept)
    if mode in ("up", "down"):
        away = ~neg if mode == "up" else neg
        return ((lower != 0) & away).to(itype)
    if mode == "stochastic":
        r = _random_words_like(lower, p)
        low64 = lower.to(torch.int64)
        k64 = k_true.to(torch.int64)
        thr = torch.where(k64 <= 32, low64 << torch.clamp(32 - k64, min=0),
                          low64 >> torch.clamp(k64 - 32, max=63))
        return (r < thr).to(itype)
    half = (torch.ones_like(lower) << k) >> 1
    if mode == "nearest_away":
        return ((lower >= half) & (lower != 0)).to(itype)
    odd = (kept ^ odd_flip) & 1
    return ((lower > half) | ((lower == half) & (lower != 0) & (odd == 1))).to(itype)


def _random_words_like(t, p):
    idx = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
    return random_words(idx, p[I_SEEDLO].to(torch.int64), p[I_SEEDHI].to(torch.int64))


def _generic_bits(a, neg, p, mode: str, P: int, itype, fdtype):
    """Magnitude bits of the rounded value, any format: integer arithmetic, per-element shift."""
    m, m_sub, emin_b, pflip = p[I_M], p[I_MSUB], p[I_EMINB], p[I_PFLIP]
    E = a >> P
    insub = E < emin_b
    e_eff = torch.clamp(E, min=1)
    shift = torch.clamp(emin_b - e_eff, min=0)
    k_true = (torch.where(insub, P - m_sub, P - m) + shift).to(itype)
    k = torch.clamp(k_true, max=P + 2)
    sig = (a & ((1 << P) - 1)) | ((E > 0).to(itype) << P)
    scaled = shift > 0
    src = torch.where(scaled, sig, a)
    kept = src >> k
    lower = src & ((torch.ones_like(k) << k) - 1)
    inc = _increment(mode, lower, kept, neg, k, k_true, p, torch.where(insub, 0, pflip), itype)
    q = kept + inc
    normal_bits = q << k
    qf = q.to(fdtype).view(itype)
    scaled_bits = torch.where(q == 0, 0, qf + p[I_C] * (1 << P))
    return torch.where(scaled, scaled_bits, normal_bits)


def _fixed_bits(a, neg, p, mode: str, P: int, itype, fdtype):
    """Formats sharing the domain's exponent range: drop P - m mantissa bits of every value."""
    k = (P - p[I_M]).to(itype)
    kept = a >> k
    lower = a & ((torch.ones_like(a) << k) - 1)
    inc = _increment(mode, lower, kept, neg, k, k, p, 0, itype)
    return (kept + inc) << k


def _scaled_bits(a, neg, p, mode: str, P: int, itype, fdtype, m0: bool = False, ftz: bool = False):
    """Formats whose smallest step is a normal number of the domain: y = |x| / step is exact,
    round y to an integer in the mode, multiply back (exact). Magnitudes beyond 4x the format's
    range are clamped first (they overflow either way), so the scaling never leaves the domain.

    ftz: some of the arithmetic flushes subnormal operands to zero (Triton's float32 code on
    CUDA, seen on an H200: its ceil/floor/round do). Subnormal inputs are then scaled from their
    integer significand through normal numbers only, and a subnormal y (|x| below 2^-126 steps,
    whatever the hardware makes of it) is replaced by 0 before rounding, its being nonzero kept
    apart for the directed modes; the nearest and stochastic modes round such a y to 0 anyway."""
    B = (1 << (itype.itemsize * 8 - 2 - P)) - 1
    m, m_sub, emin_b = p[I_M], p[I_MSUB], p[I_EMINB]
    a_cl = torch.minimum(a, p[I_CLAMP])
    E = a_cl >> P
    eq = torch.where(E >= emin_b, E - m, emin_b - m_sub)
    step = (eq << P).view(fdtype)
    inv_step = ((2 * B - eq) << P).view(fdtype)
    y = a_cl.view(fdtype) * inv_step
    tiny_nonzero = None
    if ftz:  # a subnormal is a_int * 2^(1 - B - P); 2^-64 and 2^(1 - B - P + 64) keep every step normal
        y_sub = (a_cl.to(fdtype) * 2.0 ** -64) * inv_step * 2.0 ** (1 - B - P + 64)
        y = torch.where(E == 0, y_sub, y)
        tiny = y.view(itype) < (1 << P)  # y is zero or subnormal (read from its bits)
        tiny_nonzero = tiny & (a_cl != 0)
        y = torch.where(tiny, torch.zeros_like(y), y)
    if mode == "nearest_even":
        n = torch.round(y)
        if m0:  # one value per binade: a tie goes to the even exponent code, not the even integer
            fl = torch.floor(y)
            lo_even = ((E + p[I_PFLIP]) & 1) == 0
            n = torch.where((y - fl == 0.5) & (E >= emin_b) & lo_even, fl, n)
    elif mode == "toward_zero":
        n = torch.floor(y)
    elif mode == "nearest_away":
        fl = torch.floor(y)
        n = fl + (y - fl >= 0.5).to(fdtype)
    elif mode in ("up", "down"):
        away = ~neg if mode == "up" else neg
        up = torch.ceil(y)
        if ftz:  # a tiny nonzero y still rounds away to one step
            up = up + tiny_nonzero.to(fdtype)
        n = torch.where(away, up, torch.floor(y))
    elif mode == "stochastic":
        fl = torch.floor(y)
        thr = ((y - fl) * 4294967296.0).to(torch.int64)
        n = fl + (_random_words_like(a, p) < thr).to(fdtype)
    else:
        raise ValueError(mode)
    return (n * step).view(itype)


def _pow2_bits(a, neg, p, mode: str, P: int, itype, fdtype):
    """Powers of two from 2^(domain emin - 1) up: normal inputs keep only their exponent (drop P
    bits); subnormal inputs hold the lowest power, 2^(emin-1), in their top mantissa bit (drop
    P - 1 bits). Ties below 2^emin never go up: zero and the lowest power have even codes."""
    sub = ((a >> P) == 0).to(itype)
    k = P - sub
    kept = a >> k
    lower = a & ((torch.ones_like(a) << k) - 1)
    if mode in ("nearest_even", "nearest_away"):  # written out (faster code from inductor)
        half = (torch.ones_like(a) << k) >> 1
        if mode == "nearest_away":
            inc = ((lower >= half) & (lower != 0)).to(itype)
        else:  # ties below 2^emin stay: both candidates have even codes there
            odd = ((kept ^ p[I_PFLIP]) & 1) * (1 - sub)
            inc = ((lower > half) | ((lower == half) & (lower != 0) & (odd == 1))).to(itype)
    else:
        inc = _increment(mode, lower, kept, neg, k, k, p, 0, itype)
    return (kept + inc) << k


_BITS = {"pow2": _pow2_bits, "generic": _generic_bits, "fixed": _fixed_bits, "scaled": _scaled_bits,
         "scaled_m0": functools.partial(_scaled_bits, m0=True)}


def finish_spec(fmt, dom: Domain, overflow: str) -> tuple[int, ...]:
    """The format's range and specials as Python ints, compiled into the kernel as constants
    (dead branches vanish: this step costs more than the rounding when read at run time)."""
    sp = _static_params(fmt, dom, overflow)
    return tuple(sp[i] for i in (I_MAXP, I_MAXN, I_OVFP, I_OVFN, I_INFP, I_INFN, I_SAT, I_SIGNED,
                                 I_NEGZERO, I_NEGRES, I_MINRES))


def _finish(a, neg, r_bits, mode: str, spec: tuple, P: int, W: int, itype):
    """Overflow policy, infinities, NaN, unsigned range, missing zero and the sign."""
    maxp, maxn, ovfp, ovfn, infp, infn, sat, signed, negzero, negres, minres = spec
    inf_bits = ((1 << (W - 1 - P)) - 1) << P

    def sel(c, x, y):
        return torch.where(c, x, y).to(itype)

    r_bits = r_bits.to(itype)
    rz = {"toward_zero": True, "up": neg, "down": ~neg}.get(mode, False)
    top = maxp if maxp == maxn else sel(neg, maxn, maxp)
    ovf = ovfp if ovfp == ovfn else sel(neg, ovfn, ovfp)
    if sat or rz is True:  # overflow gives the largest finite value
        r = torch.clamp(r_bits, max=top) if isinstance(top, int) else sel(r_bits > top, top, r_bits)
    elif rz is False:
        r = sel(r_bits > top, ovf, r_bits)
    else:
        r = sel(r_bits > top, sel(rz, top, ovf), r_bits)
    inf_out = infp if infp == infn else sel(neg, infn, infp)
    if not (sat and isinstance(inf_out, int) and inf_out == top):  # saturation already clamped inf
        r = sel(a == inf_bits, inf_out, r)
    is_nan_in = a > inf_bits
    if not signed:  # a negative value that did not round to zero is out of range
        r = sel(neg & (r != 0) & ~is_nan_in, negres, r)
    r = sel(is_nan_in, inf_bits | (1 << (P - 1)), r)
    if minres:  # no zero in the format: the smallest value instead
        r = sel(r == 0, minres, r)
    if signed and negzero:
        sign = neg
    elif signed:
        sign = neg & (r != 0)
    else:
        sign = neg & (r > inf_bits)  # only NaN keeps its sign
    return r | (sign.to(itype) * -(1 << (W - 1)))


def _flushes_subnormals(x: torch.Tensor) -> bool:
    """Whether the code compiled for x flushes float32 subnormals to zero: Triton's on CUDA does
    (seen on an H200, torch 2.11); eager CUDA kernels and the CPU keep them."""
    return x.device.type != "cpu" and torch.compiler.is_compiling()


def _round(x: torch.Tensor, p: torch.Tensor, mode: str, P: int, W: int, kind: str, spec: tuple) -> torch.Tensor:
    """x (1-D, any float dtype) rounded in the domain (P, W) by kernel `kind`; same dtype as x."""
    fdtype, itype = (torch.float32, torch.int32) if W == 32 else (torch.float64, torch.int64)
    u = x.to(fdtype).view(itype)
    neg = u < 0
    a = u & ((1 << (W - 1)) - 1)
    if kind.startswith("scaled") and W == 32 and _flushes_subnormals(x):
        r_bits = _BITS[kind](a, neg, p, mode, P, itype, fdtype, ftz=True)
    else:
        r_bits = _BITS[kind](a, neg, p, mode, P, itype, fdtype)
    return _finish(a, neg, r_bits, mode, spec, P, W, itype).view(fdtype).to(x.dtype)


def _kernel(x, p, mode: str, P: int, W: int, kind: str, spec: tuple):
    return _round(x, p, mode, P, W, kind, spec)


def _kernel_out(x, p, out, mode: str, P: int, W: int, kind: str, spec: tuple):
    out.copy_(_round(x, p, mode, P, W, kind, spec))


_compiled = compiled(_kernel)
_compiled_out = compiled(_kernel_out)


def round_flat(x: torch.Tensor, params: torch.Tensor, mode: str, dom: Domain, kind: str, spec: tuple,
               out: torch.Tensor | None = None):
    """Round a contiguous 1-D float tensor in domain `dom` with kernel `kind` (spec: finish_spec);
    the result has x's dtype, written into `out` (1-D, x's dtype) if given."""
    static = dict(mode=mode, P=dom.P, W=dom.W, kind=kind, spec=spec)
    if out is None:
        return _compiled(x.numel(), x, params, **static)
    _compiled_out(x.numel(), x, params, out, **static)
    return out
