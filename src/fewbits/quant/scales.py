"""Scale choice: absmax, percentile and MSE-optimal scales, MX E8M0 exponents, NVFP4 two-level
scales, integer zero points and float minimums, GGUF k-quant super-block scales, and QLoRA double
quantization of the scales.

choose() is the one place that dispatches on the scheme's scale rule: quantize(), fake_quantize()
and GPTQ all take their scales from it (a Scaling), and scale the elements with Scaling.scaled().

Every function here works on a group view: a float32 tensor [rows, groups, group_size] (see
QuantScheme's layout rule), with a boolean mask of the real (non-padding) entries where padding
matters. The arithmetic is spelled out because two oracles fix it bit for bit:
- elements are scaled as x * (1 / scale) in float32, then rounded (bitsandbytes' NF4 and
  torchao's NVFP4 do the same; for MX's power-of-two scales it is exact);
- MX exponents follow torchao's `to_mx` in each ScaleCalculationMode (floor, ceil, even, rceil).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..formats import IntFormat, get_format
from ..kernels import decode, encode, native, round as fb_round
from ..kernels.int8 import divide, reciprocal  # noqa: F401 - the scales' arithmetic, shared with int8 GEMMs
from .scheme import DOUBLE_QUANT_BLOCK, QuantScheme, scale_format_of

_E8M0_BIAS = 127
_F32_MIN_NORMAL = 2.0 ** -126
_MSE_RATIOS = torch.linspace(1.0, 0.5, 21).tolist()


def element_max(scheme: QuantScheme) -> float:
    """The largest magnitude the element grid reaches on the positive side (int4: 7; nf4: 1)."""
    return float(scheme.format.max)


def group_amax(g: torch.Tensor) -> torch.Tensor:
    """max |x| per group -> [rows, groups]. NaN propagates (a NaN group gets a NaN scale)."""
    return g.abs().amax(dim=-1) if g.shape[-1] else g.new_zeros(g.shape[:-1])


def group_percentile(g: torch.Tensor, valid: torch.Tensor | None, q: float) -> torch.Tensor:
    """The q-th percentile of |x| over the real entries of each group (nearest rank) -> [rows, groups]."""
    a = g.abs()
    if valid is not None:
        a = torch.where(valid, a, torch.tensor(float("nan")))
    s, _ = torch.sort(a, dim=-1)  # NaN (padding) sorts last
    if valid is None:
        n = torch.full(a.shape[:-1], a.shape[-1], device=a.device)
    else:  # valid is [1, groups, n], the same padding on every row: its counts hold for every row
        n = valid.sum(-1).expand(a.shape[:-1])
    k = (torch.ceil(n.to(torch.float64) * (q / 100.0)).to(torch.int64) - 1).clamp(min=0)
    k = torch.minimum(k, (n - 1).clamp(min=0))
    return s.gather(-1, k.unsqueeze(-1)).squeeze(-1).nan_to_num(0.0)


def round_scales(scale: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Scales rounded to their storage format (nearest even, saturating), as float32 values."""
    if scale_format == "fp32":
        return scale
    fmt = scale_format_of(scale_format)
    return fb_round(scale, fmt, overflow="saturate")


def times_reciprocal(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """g [..., n] * reciprocal(scale)[..., None]: the arithmetic every quantizer here uses."""
    return _times(g, reciprocal(scale))


def _times(g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """g [..., n] * r[..., None]. A scale below 2^-128 has an infinite reciprocal r; 0 times it is
    read as 0 (0 / scale), not NaN."""
    y = g * r.unsqueeze(-1)
    if bool(torch.isinf(r).any()):
        y = torch.where(g == 0, torch.zeros_like(y), y)
    return y


def round_elements(y: torch.Tensor, fmt, mode: str = "nearest_even", generator=None) -> torch.Tensor:
    """Elements rounded to the format's grid, saturating, as quantize() encodes them (its MSE
    scale search and fake_quantize round with this)."""
    if isinstance(fmt, IntFormat) and mode == "nearest_even":
        # torch.round is round-half-to-even; clamping is saturation. `+ 0.0` turns the -0.0 of
        # small negatives into the +0.0 that decoding the integer code 0 gives.
        return torch.round(y).clamp_(fmt.lowest, fmt.max).add_(0.0)
    return fb_round(y, fmt, mode=mode, overflow="saturate", generator=generator)


# ---------------------------------------------------------------------------------------------
# the scale recipe: one dispatch on the scheme
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Scaling:
    """The scales choose() picked for a group view [rows, groups, n].

    scale: float32 [rows, groups], what the rounded elements are multiplied by (the scale
        dequantize() uses: MX 2^e, NVFP4 E4M3 block scale times the tensor scale, else the
        scale rounded to its format; before double quantization).
    multiplier: float32 [rows, groups], what the elements are multiplied by before rounding:
        reciprocal(scale), or NVFP4's (1 / tensor_scale) / block.
    codes: the stored scale codes, uint8 [rows, groups]: E8M0 (MX) or E4M3 (NVFP4); else None.
    zero_point: int64 [rows, groups] on the unsigned grid (asymmetric schemes), else None.
    minimum: float32 [rows, groups], rounded to the scale format (zero_point="float"), else None.
    tensor_scale: float32 scalar (NVFP4), else None.
    gguf: "q8_0" | "q4_0" | "q4_1" for scale_method "gguf" (llama.cpp's element arithmetic, which
        scaled() then applies: it returns the elements already rounded), else None.
    gguf_minimum: float32 [rows, groups], the unrounded group minimum the "q4_1" elements are
        measured from (minimum holds it rounded to the scale format), else None.
    gguf_levels: 2^bits of the element format (GGUF recipes: the unsigned grid is 0..levels-1).
    sub_codes: int64 [rows, groups], the group scales' integer codes in the scheme's
        sub_scale_format (super-block schemes: scale = super_scale * sub_code), else None.
    super_scale: float32 [rows, super-blocks], the super-block scales d rounded to the scale
        format (super-block schemes), else None.
    sub_min_codes, super_minimum: the same for the float minimums (minimum = -(super_minimum *
        sub_min_code)), else None.
    """

    scale: torch.Tensor
    multiplier: torch.Tensor
    codes: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None
    gguf: str | None = None
    gguf_minimum: torch.Tensor | None = None
    gguf_levels: int = 0
    sub_codes: torch.Tensor | None = None
    super_scale: torch.Tensor | None = None
    sub_min_codes: torch.Tensor | None = None
    super_minimum: torch.Tensor | None = None

    def scaled(self, g: torch.Tensor) -> torch.Tensor:
        """The elements to round: (g - minimum) * multiplier (+ zero_point), as quantize() computes
        them. MX and NVFP4 multiply as their recipes (torchao) do; the others read 0 / a scale
        below 2^-128 as 0. GGUF recipes return the elements rounded as llama.cpp rounds them
        (integers on the signed or unsigned grid: rounding them again changes nothing)."""
        if self.gguf is not None:
            return gguf_elements(g, self)
        if self.minimum is not None:
            g = g - self.minimum.unsqueeze(-1)
        if self.codes is not None:
            y = g * self.multiplier.unsqueeze(-1)
        else:
            y = _times(g, self.multiplier)
        if self.zero_point is not None:
            y = y + self.zero_point.unsqueeze(-1).to(torch.float32)
        return y


def choose(g: torch.Tensor, valid, scheme: QuantScheme, tensor_scale: torch.Tensor | None = None) -> Scaling:
    """The scales of the group view g [rows, groups, n] (valid: its mask of real entries, or None)
    by the scheme's rule: MX exponents, NVFP4 block scales, float minimums, symmetric scales, or
    asymmetric scales with zero points. Not for plain casts (scale_format "none": no scale).

    tensor_scale: NVFP4's tensor scale, held fixed (GPTQ chooses each group's block scales under
    the whole tensor's); by default it comes from g.
    """
    if scheme.granularity == "mx":
        codes = mx_scale_codes(group_amax(g), scheme)
        scale = mx_scale_values(codes, scheme)
        return Scaling(scale, 1.0 / scale, codes=codes)
    if scheme.granularity == "nvfp4":
        ts = nvfp4_tensor_scale(g, scheme) if tensor_scale is None else tensor_scale
        codes, block = nvfp4_block_scales(g, ts, scheme)
        return Scaling(nvfp4_scale_values(codes, ts), (1.0 / ts) / block, codes=codes, tensor_scale=ts)
    if scheme.scale_method == "gguf":
        return gguf_scaling(g, valid, scheme)
    if scheme.super_block is not None:
        return super_block_scaling(g, valid, scheme)
    if scheme.zero_point == "float":
        scale, minimum = float_min_params(g, valid, scheme)
        return Scaling(scale, reciprocal(scale), minimum=minimum)
    if scheme.symmetric:
        scale = symmetric_scales(g, valid, scheme)
        return Scaling(scale, reciprocal(scale))
    scale, zero_point = asymmetric_params(g, valid, scheme)
    return Scaling(scale, reciprocal(scale), zero_point=zero_point)


# ---------------------------------------------------------------------------------------------
# symmetric and asymmetric scales
# ---------------------------------------------------------------------------------------------
def symmetric_scales(g: torch.Tensor, valid, scheme: QuantScheme) -> torch.Tensor:
    """Float32 scales [rows, groups] by the scheme's scale_method, rounded to its scale format
    (the MSE search quantizes and dequantizes each candidate with quantize()'s arithmetic).
    """
    emax = element_max(scheme)
    if scheme.scale_method == "percentile":
        amax = group_percentile(g, valid, scheme.percentile)
    else:
        amax = group_amax(g)
    base = divide(amax, emax)
    if scheme.scale_method != "mse":
        return round_scales(base, scheme.scale_format)
    def quantize_dequantize(gg, scale):
        return round_elements(times_reciprocal(gg, scale), scheme.format) * scale.unsqueeze(-1)

    return _mse_search(g, valid, scheme, lambda r: round_scales(base * r, scheme.scale_format),
                       quantize_dequantize)


def asymmetric_params(g: torch.Tensor, valid, scheme: QuantScheme):
    """(scale float32, zero_point int64) [rows, groups] for an unsigned grid 0..2^b-1.

    The range always contains 0, so zero is exact: lo = min(min, 0), hi = max(max, 0);
    scale = (hi - lo) / (2^b - 1); zero_point = round(-lo / scale).
    """
    qmax = float(2 ** scheme.format.bits - 1)
    big = torch.tensor(float("inf"))
    lo_src = torch.where(valid, g, big) if valid is not None else g
    hi_src = torch.where(valid, g, -big) if valid is not None else g
    lo = lo_src.amin(-1).clamp(max=0.0) if g.shape[-1] else g.new_zeros(g.shape[:-1])
    hi = hi_src.amax(-1).clamp(min=0.0) if g.shape[-1] else g.new_zeros(g.shape[:-1])
    if scheme.scale_method == "percentile":
        p = scheme.percentile
        hi = torch.minimum(hi, group_percentile(g.clamp(min=0), valid, p))
        lo = torch.maximum(lo, -group_percentile(g.clamp(max=0), valid, p))

    def params(r):
        scale = round_scales(divide((hi - lo) * r, qmax), scheme.scale_format)
        zp = torch.round(-lo * r * reciprocal(scale)).clamp(0, qmax)
        return scale, zp

    if scheme.scale_method != "mse":
        s, z = params(1.0)
        return s, z.to(torch.int64)
    def quantize_dequantize(gg, scale_zero):
        scale, zero = scale_zero
        q = round_elements(times_reciprocal(gg, scale) + zero.unsqueeze(-1), scheme.format)
        return (q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)

    s, z = _mse_search(g, valid, scheme, params, quantize_dequantize)
    return s, z.to(torch.int64)


def float_min_params(g: torch.Tensor, valid, scheme: QuantScheme):
    """(scale, minimum) float32 [rows, groups], both rounded to the scheme's scale format, for
    an unsigned grid 0..2^b-1 with a float minimum (zero_point="float", GGUF Q4_1 style).

    minimum = the group minimum (not widened to include 0); scale = (max - min) / (2^b - 1),
    computed in float32 from the unrounded minimum as llama.cpp does. Padding is ignored.
    """
    qmax = float(2 ** scheme.format.bits - 1)
    if not g.shape[-1]:
        zero = g.new_zeros(g.shape[:-1])
        return zero, zero.clone()
    big = torch.tensor(float("inf"))
    lo = (torch.where(valid, g, big) if valid is not None else g).amin(-1)
    hi = (torch.where(valid, g, -big) if valid is not None else g).amax(-1)
    scale = round_scales(divide(hi - lo, qmax), scheme.scale_format)
    return scale, round_scales(lo, scheme.scale_format)


# ---------------------------------------------------------------------------------------------
# GGUF legacy blocks: llama.cpp's reference quantizers (gguf.quants.quantize), bit for bit
# ---------------------------------------------------------------------------------------------
def _gguf_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """id = 1/d in float32, 0 where d is 0 (llama.cpp: `d ? 1.0f/d : 0.0f`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def gguf_scaling(g: torch.Tensor, valid, scheme: QuantScheme) -> Scaling:
    """The Scaling of scale_method "gguf" (see QuantScheme): d from the group's float32 statistics,
    the multiplier 1/d of the unrounded d, d and the minimum stored rounded to the scale format.
    Padding (a row length that is not a multiple of the group) is ignored: GGUF has none."""
    fmt = scheme.format
    if not g.shape[-1]:
        zero = g.new_zeros(g.shape[:-1])
        return Scaling(zero, zero.clone(), gguf="q8_0" if fmt.bits == 8 else "q4_0", gguf_levels=2 ** fmt.bits)
    if scheme.zero_point == "float":  # Q4_1 / Q5_1
        big = torch.tensor(float("inf"))
        lo = (torch.where(valid, g, big) if valid is not None else g).amin(-1)
        hi = (torch.where(valid, g, -big) if valid is not None else g).amax(-1)
        d = divide(hi - lo, float(2 ** fmt.bits - 1))
        return Scaling(round_scales(d, scheme.scale_format), _gguf_reciprocal(d),
                       minimum=round_scales(lo, scheme.scale_format), gguf="q4_1", gguf_minimum=lo, gguf_levels=2 ** fmt.bits)
    if fmt.bits == 8:  # Q8_0
        d = divide(group_amax(g), float(fmt.max))
        return Scaling(round_scales(d, scheme.scale_format), _gguf_reciprocal(d), gguf="q8_0", gguf_levels=2 ** fmt.bits)
    # Q4_0 / Q5_0: the value of largest magnitude (the first such, as numpy's argmax) maps to the lowest code
    signed_max = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = divide(signed_max, float(fmt.lowest))
    return Scaling(round_scales(d, scheme.scale_format), _gguf_reciprocal(d), gguf="q4_0", gguf_levels=2 ** fmt.bits)


def gguf_elements(g: torch.Tensor, s: Scaling) -> torch.Tensor:
    """Elements rounded as llama.cpp's reference quantizers round them, in float32 as it computes:
    q8_0: roundf(x * id) (half away from zero); q4_0: trunc(x * id + (offset + 0.5)) - offset,
    offset = 8 (int4) or 16 (int5), the sum clamped to 0..2^b-1 (the float32 addition itself may
    round up: x * id just below a half can go up); q4_1: trunc((x - min) * id + 0.5), clamped."""
    top = float(s.gguf_levels - 1)
    if s.gguf == "q8_0":
        y = _times(g, s.multiplier)
        a = y.abs()
        f = torch.floor(a)
        q = f + (a - f >= 0.5).to(a.dtype)  # exact: a - floor(a) needs no rounding
        half = float(s.gguf_levels // 2 - 1)  # 127: Q8_0 never reaches -128
        return torch.copysign(q, y).clamp_(-half, half).add_(0.0)
    if s.gguf == "q4_1":
        y = _times(g - s.gguf_minimum.unsqueeze(-1), s.multiplier)
        return torch.trunc(y + 0.5).clamp_(0.0, top).add_(0.0)
    offset = float(s.gguf_levels // 2)
    y = _times(g, s.multiplier)
    return (torch.trunc(y + (offset + 0.5)).clamp_(0.0, top) - offset).add_(0.0)


# ---------------------------------------------------------------------------------------------
# two-level scales in super-blocks: GGUF's k-quants (Q4_K, Q5_K, Q6_K)
# ---------------------------------------------------------------------------------------------
# the candidate scales of the searches, as llama.cpp's reference k-quant quantizers try them:
# float minimums (make_qkx2_quants): iscale = (nmax + rmin + rdelta * i) / (max - min), i = 0..nstep,
# (rmin, rdelta, nstep) by element width (Q4_K, Q5_K); symmetric (make_qx_quants):
# iscale = -(nmax + 0.1 * i) / max, i = -9..9
_FLOAT_MIN_SEARCH = {4: (-1.0, 0.1, 20), 5: (-0.5, 0.1, 15)}
_FLOAT_MIN_SEARCH_OTHER = (-1.0, 0.1, 20)
_SYMMETRIC_STEPS = (0,) + tuple(i for i in range(-9, 10) if i)
_SEARCH_VALUES = 1 << 20  # values searched at a time (the search works in float64)


def group_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in one fixed order, the order of every sum of the k-quant
    searches, which their C kernel (kernels/csrc/kquant.c) follows too: halving, with m values
    left and h = m // 2, a[i] = a[i] + a[i + m - h] for i < h, then m = m - h, until one is left
    (32 values: a[i] + a[i + 16], then + 8, + 4, + 2, + 1; of an odd m the middle value is
    carried on). torch's own .sum() order depends on the CPU's vector width and the tensor's
    shape, so the searches spell theirs out: they give the same results on every CPU, device
    and path. float64 in, float64 out; an empty last dimension sums to 0."""
    m = t.shape[-1]
    if m == 0:
        return t.sum(-1)
    while m > 1:
        h = m // 2
        head = t[..., :h] + t[..., m - h:m]
        t = head if m == 2 * h else torch.cat([head, t[..., h:m - h]], dim=-1)
        m -= h
    return t[..., 0]


def super_block_scaling(g: torch.Tensor, valid, scheme: QuantScheme) -> Scaling:
    """The Scaling of a super-block scheme (see QuantScheme): each group's scale (and float
    minimum) by scale_method ("absmax": the group's plain range; "mse": the weighted least-squares
    search of group_params), then per super-block the scale d = the largest group scale / the
    largest sub-scale code (symmetric: the group scale of largest magnitude / the lowest code,
    so that it gets code -128 as in Q6_K), rounded to the scale format (fp16), each group's code
    round(scale / d) clamped to the sub-scale format, and the effective scale d * code (float32,
    exact). The minimums likewise (codes of -minimum, unsigned). With "mse" each group's codes
    are then chosen among the neighbours of scale / d (and -minimum / dmin), floor or ceil, by the
    weighted error of its elements rounded under them (_refine_codes). Both searches run in C
    (kernels/csrc/kquant.c) where the native library serves, else in torch, with equal results.
    scaled() then rounds the elements
    under these final scales and minimums, as quantize() rounds every float-minimum or symmetric
    scheme: round((x - minimum) * (1 / scale)).

    Deliberate differences from llama.cpp's quantize_row_q4_K_ref / q6_K_ref: the codes are
    chosen against the fp16-rounded d (llama.cpp rounds scale * 63 / max against the unrounded
    one), floor or ceil by the resulting error (llama.cpp: nearest), the elements are multiplied
    by 1 / scale rather than divided and rounded half to even (as every fewbits scheme), the search
    works in float64 and sums each group in group_sum's order (llama.cpp: float32, sequentially), and a group whose scale code is 0 keeps codes that dequantize to its minimum
    (llama.cpp leaves the search's codes there: they dequantize to the same value)."""
    sub = scheme.sub_scale_format_of
    rows, groups, _ = g.shape
    scale, neg_min = group_params(g, valid, scheme)
    d, codes = _super_scales(scale, scheme, sub)
    dmin = mcodes = None
    if scheme.zero_point == "float":
        dmin, mcodes = _super_scales(neg_min, scheme, sub)
    if scheme.scale_method == "mse":
        codes, mcodes = _refine_codes(g, valid, scheme, scale, neg_min, d, dmin)
    eff = expand_super(d, scheme, groups) * codes.to(torch.float32)
    if scheme.zero_point != "float":
        return Scaling(eff, reciprocal(eff), sub_codes=codes, super_scale=d)
    minimum = -(expand_super(dmin, scheme, groups) * mcodes.to(torch.float32))
    return Scaling(eff, reciprocal(eff), minimum=minimum, sub_codes=codes, super_scale=d,
                   sub_min_codes=mcodes, super_minimum=dmin)


def expand_super(d: torch.Tensor, scheme: QuantScheme, groups: int) -> torch.Tensor:
    """[rows, super-blocks] -> [rows, groups]: each super-block's value for its groups."""
    per = scheme.super_block // scheme.group_size
    return d.repeat_interleave(per, dim=1)[:, :groups]


def _super_scales(values: torch.Tensor, scheme: QuantScheme, sub) -> tuple[torch.Tensor, torch.Tensor]:
    """(d float32 [rows, supers] rounded to the scale format, codes int64 [rows, groups]) with
    values ~= d * code per super-block. Unsigned codes: d = max / sub.max; signed: d = the value
    of largest magnitude (the first such) / sub.lowest. values: float64 [rows, groups]."""
    rows, groups = values.shape
    per = scheme.super_block // scheme.group_size
    supers = -(-groups // per)
    v = torch.nn.functional.pad(values, (0, supers * per - groups)).reshape(rows, supers, per)
    if sub.signed:
        top = v.gather(-1, v.abs().argmax(-1, keepdim=True)).squeeze(-1) / float(sub.lowest)
    else:
        top = v.amax(-1).clamp(min=0.0) / float(sub.max)
    d = round_scales(top.to(torch.float32), scheme.scale_format)
    d_exp = expand_super(d, scheme, groups).to(torch.float64)
    safe = torch.where(d_exp == 0, torch.ones_like(d_exp), d_exp)
    codes = torch.round(values / safe).clamp(sub.lowest, sub.max)
    codes = torch.where(d_exp == 0, torch.zeros_like(codes), codes)
    return d, codes.to(torch.int64)


def _refine_codes(g, valid, scheme, scale, neg_min, d, dmin):
    """Each group's sub-scale codes (and sub-minimum codes) under the super-block scales d (dmin):
    of the codes just below and just above scale / d (-minimum / dmin), the pair whose elements,
    rounded under it, have the least weighted squared error (the weights of group_params); the
    first of equal ones, in the order (floor, floor), (floor, ceil), (ceil, floor), (ceil, ceil).
    By kquant.c where the native library serves (see group_params), else by
    _refine_codes_reference; the two agree bit for bit."""
    sub = scheme.sub_scale_format_of
    groups = g.shape[1]

    def neighbours(values, dd):
        de = expand_super(dd, scheme, groups).to(torch.float64)
        zero = de == 0
        c = torch.floor(values / torch.where(zero, torch.ones_like(de), de))
        pair = [c.clamp(sub.lowest, sub.max), (c + 1).clamp(sub.lowest, sub.max)]
        return [torch.where(zero, torch.zeros_like(p), p) for p in pair], de

    sc_pairs, de = neighbours(scale, d)
    m_pairs = dme = None
    if neg_min is not None:
        m_pairs, dme = neighbours(neg_min, dmin)
    lo_q, hi_q = _element_range(scheme)
    lib = _kquant_library(g, valid)
    if lib is not None:
        codes, mcodes = native.kquant_refine(lib, g, valid, lo_q, hi_q, de, sc_pairs, dme, m_pairs)
    else:
        codes, mcodes = _refine_codes_reference(g, valid, scheme, de, sc_pairs, dme, m_pairs)
    return codes.to(torch.int64), (mcodes.to(torch.int64) if mcodes is not None else None)


def _element_range(scheme: QuantScheme) -> tuple[float, float]:
    """The element grid of a super-block scheme: 0..2^b-1 (float minimums), else lowest..max."""
    fmt = scheme.format
    if scheme.zero_point == "float":
        return 0.0, float(2 ** fmt.bits - 1)
    return float(fmt.lowest), float(fmt.max)


def _refine_codes_reference(g, valid, scheme, de, sc_pairs, dme, m_pairs):
    """_refine_codes' choice in torch (the reference kquant.c is tested against): float64
    codes [rows, groups] (and sub-minimum codes, or None)."""
    rows, groups, n = g.shape
    lo_q, hi_q = _element_range(scheme)
    step = max(1, _SEARCH_VALUES // max(groups * n, 1))
    out_s, out_m = [], []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = g[r0:r1].to(torch.float64)
        w = _weights(x, valid, scheme)
        best = best_s = best_m = None
        for cs in sc_pairs:
            for cm in (m_pairs if m_pairs is not None else [None]):
                s_ = (de[r0:r1] * cs[r0:r1]).unsqueeze(-1)
                m_ = -(dme[r0:r1] * cm[r0:r1]).unsqueeze(-1) if cm is not None else 0.0
                q = torch.round((x - m_) / torch.where(s_ == 0, torch.ones_like(s_), s_)).clamp_(lo_q, hi_q)
                err = group_sum(w * (q * s_ + m_ - x) ** 2)
                if best is None:
                    best, best_s, best_m = err, cs[r0:r1], (cm[r0:r1] if cm is not None else None)
                    continue
                better = err < best
                best = torch.where(better, err, best)
                best_s = torch.where(better, cs[r0:r1], best_s)
                if cm is not None:
                    best_m = torch.where(better, cm[r0:r1], best_m)
        out_s.append(best_s)
        out_m.append(best_m)
    if not out_s:
        empty = g.new_zeros((rows, groups), dtype=torch.float64)
        return empty, (empty.clone() if m_pairs is not None else None)
    return torch.cat(out_s), (torch.cat(out_m) if m_pairs is not None else None)


def _kquant_library(g: torch.Tensor, valid):
    """The native library where kquant.c takes this group view (CPU float32, groups of at most
    256 values, not empty), else None (FEWBITS_NATIVE=0, no compiler, another device: torch)."""
    if not g.numel() or not native.kquant_supported(g, valid):
        return None
    return native.library()


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """The square root rounded to nearest, as IEEE 754 and C's sqrt() define it: torch's own
    float64 sqrt on the CPU is not always (MKL's: about 1 value in 100 comes out one ulp off),
    so the CPU reference takes numpy's; CUDA's double sqrt is correctly rounded."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.sqrt(t.detach().contiguous().numpy()))
    return torch.sqrt(t)


def _weights(x: torch.Tensor, valid, scheme: QuantScheme) -> torch.Tensor:
    """The weights of the k-quant searches, as llama.cpp's reference quantizers weigh the error:
    float minimums sqrt(mean x^2) + |x| (per group), symmetric x^2; 0 on padding. x: float64."""
    if scheme.zero_point == "float":
        count = x.shape[-1] if valid is None else valid.sum(-1).clamp(min=1)
        w = x.abs() + _sqrt(group_sum(x * x) / count).unsqueeze(-1)
    else:
        w = x * x
    if valid is not None:
        w = torch.where(valid, w, torch.zeros_like(w))
    return w


def group_params(g: torch.Tensor, valid, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's (scale, -minimum) of a super-block scheme before the two-level rounding,
    float64 [rows, groups] (symmetric: (signed scale, None)); in row chunks of bounded size.

    Float minimums, unsigned grid 0..nmax (make_qkx2_quants' rule): min = min(group min, 0);
    "absmax": scale = (max - min) / nmax; "mse": weights w = sqrt(mean x^2) + |x|, and for each
    candidate iscale the codes L = clamp(round(iscale * (x - min)), 0, nmax) and the weighted
    least-squares (scale, min) of x ~ scale * L + min (min held at 0 when the fit is positive);
    the pair of least weighted squared error wins (the plain range is the first candidate).
    Symmetric, grid lowest..max (make_qx_quants' rule, weights x^2): "absmax": amax / max;
    "mse": for each candidate iscale = -(nmax + 0.1 i) / (the value of largest magnitude), with
    nmax = -lowest, codes L = clamp(round(iscale * x), lowest, max) and scale = sum(w x L) /
    sum(w L^2); the largest sum(w x L)^2 / sum(w L^2) (least weighted error) wins.
    Padding entries have weight 0 and are left out of the minimum and maximum.

    Every sum is a group_sum (its order fixed). "mse" runs in kquant.c where the native library
    serves (CPU float32; fewbits.kernels.native), else as group_params_reference; the two agree
    bit for bit (tests/quant/test_kquant_fast.py)."""
    if scheme.scale_method == "mse":
        lib = _kquant_library(g, valid)
        if lib is not None:
            if scheme.zero_point == "float":
                return native.kquant_float_min(lib, g, valid, _element_range(scheme)[1],
                                               _float_min_candidates(scheme))
            lowest, top = _element_range(scheme)
            return native.kquant_symmetric(lib, g, valid, lowest, top, _symmetric_candidates(scheme)), None
    return group_params_reference(g, valid, scheme)


def _float_min_candidates(scheme: QuantScheme) -> list[float]:
    """The constants c of the float-minimum search's candidate scales c / (max - min)."""
    nmax = float(2 ** scheme.format.bits - 1)
    rmin, rdelta, nstep = _FLOAT_MIN_SEARCH.get(scheme.format.bits, _FLOAT_MIN_SEARCH_OTHER)
    return [rmin + rdelta * i + nmax for i in range(nstep + 1)]


def _symmetric_candidates(scheme: QuantScheme) -> list[float]:
    """The constants c of the symmetric search's candidate scales c / (the value of largest
    magnitude); the first is the plain range."""
    nmax = -float(scheme.format.lowest)
    return [-(nmax + 0.1 * i) for i in _SYMMETRIC_STEPS]


def group_params_reference(g: torch.Tensor, valid, scheme: QuantScheme):
    """group_params in torch, in row chunks of bounded size (the reference of kquant.c)."""
    rows, groups, n = g.shape
    step = max(1, _SEARCH_VALUES // max(groups * n, 1))
    scales, mins = [], []
    for r0 in range(0, rows, step):
        x = g[r0:r0 + step].to(torch.float64)
        if scheme.zero_point == "float":
            s, m = _float_min_params(x, valid, scheme)
            mins.append(m)
        else:
            s = _symmetric_params(x, valid, scheme)
        scales.append(s)
    if not scales:
        empty = g.new_zeros((rows, groups), dtype=torch.float64)
        return empty, (empty.clone() if scheme.zero_point == "float" else None)
    return torch.cat(scales), (torch.cat(mins) if mins else None)


def _float_min_params(x: torch.Tensor, valid, scheme: QuantScheme):
    nmax = float(2 ** scheme.format.bits - 1)
    inf = torch.tensor(float("inf"), dtype=x.dtype)
    lo = (torch.where(valid, x, inf) if valid is not None else x).amin(-1)
    lo = torch.where(lo < 0, lo, torch.zeros_like(lo))  # min(lo, 0), and +0.0 for either zero
    hi = (torch.where(valid, x, -inf) if valid is not None else x).amax(-1)
    span = hi - lo
    flat = span <= 0  # constant (or all-zero) groups: scale 0, the minimum holds the value
    safe_span = torch.where(flat, torch.ones_like(span), span)
    scale = torch.where(flat, torch.zeros_like(span), span / nmax)
    minimum = lo
    if scheme.scale_method == "mse":
        w = _weights(x, valid, scheme)
        sw, sx, sx2 = group_sum(w), group_sum(w * x), group_sum(w * x * x)
        xs = x - lo.unsqueeze(-1)

        def weighted_error(s, m, sl, sl2, sxl):  # sum w (s L + m - x)^2, from the sums
            return (s * s * sl2 + 2 * s * m * sl - 2 * s * sxl + m * m * sw - 2 * m * sx + sx2)

        def sums(iscale):
            L = torch.round(xs * iscale.unsqueeze(-1)).clamp_(0.0, nmax)
            wl = w * L
            return group_sum(wl), group_sum(wl * L), group_sum(wl * x)

        best = weighted_error(scale, minimum, *sums(1.0 / torch.where(flat, torch.ones_like(scale), scale)))
        for c in _float_min_candidates(scheme):
            sl, sl2, sxl = sums(c / safe_span)  # torch: safe_span.reciprocal() * c
            D = sw * sl2 - sl * sl
            ok = (D > 0) & ~flat
            safe_D = torch.where(ok, D, torch.ones_like(D))
            s = (sw * sxl - sx * sl) / safe_D
            m = (sl2 * sx - sl * sxl) / safe_D
            positive = m > 0
            s = torch.where(positive, sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), s)
            m = torch.where(positive, torch.zeros_like(m), m)
            err = weighted_error(s, m, sl, sl2, sxl)
            better = ok & (s > 0) & (err < best)
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            minimum = torch.where(better, m, minimum)
    return scale, -minimum


def _symmetric_params(x: torch.Tensor, valid, scheme: QuantScheme):
    fmt = scheme.format
    if scheme.scale_method != "mse":
        return x.abs().amax(-1) / float(fmt.max)
    lowest, top = float(fmt.lowest), float(fmt.max)
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)  # the value of largest magnitude
    zero = peak == 0
    safe_peak = torch.where(zero, torch.ones_like(peak), peak)
    w = _weights(x, valid, scheme)
    scale = best = None
    for c in _symmetric_candidates(scheme):
        iscale = c / safe_peak  # torch: safe_peak.reciprocal() * c
        L = torch.round(x * iscale.unsqueeze(-1)).clamp_(lowest, top)
        wl = w * L
        sumlx, suml2 = group_sum(wl * x), group_sum(wl * L)
        ok = suml2 > 0
        safe_l2 = torch.where(ok, suml2, torch.ones_like(suml2))
        s = sumlx / safe_l2
        merit = sumlx * s  # sum(w x L)^2 / sum(w L^2): the larger, the smaller the weighted error
        if scale is None:
            scale, best = torch.where(ok, s, torch.zeros_like(s)), torch.where(ok, merit, torch.zeros_like(s))
            continue
        better = ok & (merit > best)
        best = torch.where(better, merit, best)
        scale = torch.where(better, s, scale)
    return torch.where(zero, torch.zeros_like(scale), scale)


def _mse_search(g, valid, scheme, candidate, quantize_dequantize):
    """Per group, the clipping ratio r in [0.5, 1] (21 steps) whose quantization has the least
    squared error. candidate(r) -> scale (or (scale, zero_point))."""
    best_err = best = None
    for r in _MSE_RATIOS:
        c = candidate(r)
        err = (quantize_dequantize(g, c) - g).square()
        if valid is not None:
            err = torch.where(valid, err, 0.0)
        err = err.sum(-1)
        if best is None:
            best_err, best = err, c
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        if isinstance(c, tuple):
            best = tuple(torch.where(better, ci, bi) for ci, bi in zip(c, best))
        else:
            best = torch.where(better, c, best)
    return best


# ---------------------------------------------------------------------------------------------
# MX: E8M0 shared exponents (torchao to_mx semantics, per scaling mode)
# ---------------------------------------------------------------------------------------------
def _emax_pow2(fmt) -> int:
    """Exponent of the element format's largest power of two (e4m3 448 -> 8, e2m1 6 -> 2)."""
    return math.floor(math.log2(fmt.max))


def mx_scale_codes(amax: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """E8M0 codes (biased exponents, uint8) of the MX block scales, from float32 block amax."""
    fmt = scheme.format
    mode = scheme.mx_scale_mode
    amax = amax.to(torch.float32)
    nan = torch.isnan(amax)
    if mode == "rceil":
        descale = divide(amax, fmt.max)
        e = torch.ceil(torch.log2(descale)).clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
        e = torch.where(torch.isinf(descale), 254.0, e)
        return torch.where(nan, 255.0, e).to(torch.uint8)
    bits = amax.view(torch.int32)
    if mode == "even":  # round amax to the element's mantissa width first
        m = fmt.man_bits
        bits = (bits + (1 << (23 - m - 1))) & -(1 << 23)  # keep sign and exponent
    pow2 = ((bits >> 23) & 0xFF) - 127
    if mode == "ceil":
        pow2 = pow2 + ((bits & 0x7FFFFF) > 0).to(pow2.dtype)
    e = (pow2 - _emax_pow2(fmt)).clamp(-_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS
    return torch.where(nan, 255, e).to(torch.uint8)


def mx_scale_values(codes: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The float32 scale the elements are divided by: 2^(code-127), in torchao's convention
    (floor/ceil/even: clamped to the smallest normal float32; rceil: code 0 means 1)."""
    c = codes.to(torch.int32)
    if scheme.mx_scale_mode == "rceil":
        v = torch.exp2(c.to(torch.float32) - _E8M0_BIAS)
        return torch.where(c == 0, torch.ones_like(v), v)
    v = (c << 23).view(torch.float32)
    return v.clamp(min=_F32_MIN_NORMAL)


# ---------------------------------------------------------------------------------------------
# NVFP4: E4M3 block scales times a float32 tensor scale (torchao nvfp4_quantize semantics)
# ---------------------------------------------------------------------------------------------
_E4M3 = get_format("fp8_e4m3")
_E4M3_TINY = 2.0 ** -6  # torchao clamps block scales to torch.finfo(float8_e4m3fn).tiny


def nvfp4_tensor_scale(g: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The float32 scalar tensor scale amax / (448 * 6) of the whole group view (1 if all zero)."""
    amax = g.abs().amax() if g.numel() else torch.tensor(0.0, device=g.device)
    ts = divide(amax.to(torch.float32), _E4M3.max * element_max(scheme)).reshape(())
    return torch.where(ts == 0, torch.ones_like(ts), ts)  # an all-zero tensor: any scale works


def nvfp4_block_scales(g: torch.Tensor, tensor_scale: torch.Tensor, scheme: QuantScheme):
    """(E4M3 codes uint8, their float32 values) of the block scales under `tensor_scale`:
    block = e4m3(clamp(block_amax / 6 / tensor_scale)). The elements are then multiplied by
    (1 / tensor_scale) / block, as NVIDIA's recipe and torchao compute it (see choose())."""
    block = divide(group_amax(g), element_max(scheme)) / tensor_scale
    block = fb_round(block.clamp(min=_E4M3_TINY, max=_E4M3.max), _E4M3, overflow="saturate")
    return encode(block, _E4M3), block


def nvfp4_scale_values(codes: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    return decode(codes, _E4M3) * tensor_scale


# ---------------------------------------------------------------------------------------------
# double quantization of the scales (QLoRA)
# ---------------------------------------------------------------------------------------------
def double_quantize(scales: torch.Tensor):
    """float32 scales (any shape) -> (int8 codes [n], float32 block scales [blocks], float32 offset).

    The scales minus their mean are quantized to int8 (symmetric absmax, nearest even) in blocks
    of 256 values, as QLoRA does for NF4's block absmax (bitsandbytes uses its own 8-bit
    dynamic code; fewbits uses plain int8, which costs the same bits).
    """
    flat = scales.reshape(-1).to(torch.float32)
    offset = flat.mean() if flat.numel() else torch.tensor(0.0, device=flat.device)
    d = flat - offset
    n = d.numel()
    blocks = -(-n // DOUBLE_QUANT_BLOCK)
    pad = blocks * DOUBLE_QUANT_BLOCK - n
    dp = torch.nn.functional.pad(d, (0, pad)).reshape(blocks, DOUBLE_QUANT_BLOCK)
    bscale = divide(dp.abs().amax(-1), 127.0)
    q = torch.round(dp * reciprocal(bscale)[:, None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n].clone(), bscale, offset.reshape(())


def double_dequantize(codes: torch.Tensor, bscale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    blocks = bscale.numel()
    pad = blocks * DOUBLE_QUANT_BLOCK - n
    q = torch.nn.functional.pad(codes.to(torch.float32), (0, pad)).reshape(blocks, DOUBLE_QUANT_BLOCK)
    return (q * bscale[:, None]).reshape(-1)[:n] + offset
