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

import torch

from ..formats import IntFormat, get_format
from ..kernels import decode, encode, round as fb_round
from ..kernels.int8 import divide, reciprocal  # noqa: F401 - the scales' arithmetic, shared with int8 GEMMs
from .kquant_search import (_float_min_params, _sqrt, _symmetric_params, group_params,  # noqa: F401 - names kept
                            group_params_reference, group_sum, refine_codes)
from .kquant_search import refine_codes as _refine_codes  # noqa: F401 - the name kernels.native's notes use
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
# two-level scales in super-blocks: GGUF's k-quants (Q4_K, Q5_K, Q6_K); the searches of each
# group's scale live in fewbits.quant.kquant_search
# ---------------------------------------------------------------------------------------------
def super_block_scaling(g: torch.Tensor, valid, scheme: QuantScheme) -> Scaling:
    """The Scaling of a super-block scheme (see QuantScheme): each group's scale (and float
    minimum) by scale_method ("absmax": the group's plain range; "mse": the weighted least-squares
    search of group_params), then per super-block the scale d = the largest group scale / the
    largest sub-scale code (symmetric: the group scale of largest magnitude / the lowest code,
    so that it gets code -128 as in Q6_K), rounded to the scale format (fp16), each group's code
    round(scale / d) clamped to the sub-scale format, and the effective scale d * code (float32,
    exact). The minimums likewise (codes of -minimum, unsigned). With "mse" each group's codes
    are then chosen among the neighbours of scale / d (and -minimum / dmin), floor or ceil, by the
    weighted error of its elements rounded under them (kquant_search.refine_codes). Both searches run in C
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
        codes, mcodes = refine_codes(g, valid, scheme, scale, neg_min, d, dmin)
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
