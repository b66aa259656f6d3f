"""Scales, one kind at a time: how each group's scale (and zero point, float minimum, super-block
scale, tensor scale) is chosen, stored and read back.

The walk of quantize() (fewbits.quant.tensor) is top-down: scheme -> scale kind -> scales -> codes.
kind_of(scheme) is the one dispatch on the scheme's scale rule; each ScaleKind below holds the
whole life of one kind of scales in one class:
    choose(g, valid, scheme)  the scales of a group view, by the scheme's scale_method (a Scaling)
    given(scheme, shape, ...) scales handed to quantize() (GPTQ's), rounded to the scale format
    store(scaling, scheme)    the tensors a QuantizedTensor keeps of them (besides its codes)
    stored_shapes(...)        their shapes and dtypes, known before anything is quantized
    scale_values / minimum_values   the float32 scales (and minimums) dequantize() applies

The kinds (KINDS): "symmetric" (absmax, percentile, MSE and GGUF Q8_0 / Q4_0 / Q5_0 scales, per
tensor, channel or group), "zero_point" (asymmetric: an integer zero point on the unsigned grid),
"float_minimum" (GGUF Q4_1 style: a float minimum per group), "super_block" (GGUF k-quants:
sub-scale codes times super-block scales, searched by fewbits.quant.kquant_search), "mx" (OCP MX
E8M0 exponents) and "nvfp4" (E4M3 block scales times a float32 tensor scale). The float kinds
(symmetric, zero point, float minimum) store their scales double-quantized where the scheme asks
(QLoRA's int8 blocks). quantize(), fake_quantize() and GPTQ all take their scales from choose() (a
Scaling), and scale the elements with Scaling.scaled().

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

from ..formats import IntFormat, LookupFormat, get_format, torch_dtype
from ..kernels import decode, encode, pack, round as fb_round, unpack
from ..kernels.int8 import divide, reciprocal  # noqa: F401 - the scales' arithmetic, shared with int8 GEMMs
from .kquant_search import (_float_min_params, _sqrt, _symmetric_params, group_params,  # noqa: F401 - names kept
                            group_params_reference, group_sum, refine_codes)
from .kquant_search import refine_codes as _refine_codes  # noqa: F401 - the name kernels.native's notes use
from .lookup_search import signed_lookup_scales
from .scheme import DOUBLE_QUANT_BLOCK, QuantScheme, scale_format_of

PACK_ORDER = "low_first"  # of every packed code: elements, zero points, sub-scale codes
# scales as stored: the float formats in their own torch dtype, E8M0 / E4M3 as their uint8 codes
SCALE_DTYPES = {**{f: torch_dtype(f) for f in ("fp32", "fp16", "bf16")}, "e8m0": torch.uint8, "e4m3": torch.uint8}
_E8M0_BIAS = 127
_F32_MIN_NORMAL = 2.0 ** -126
_MSE_RATIOS = torch.linspace(1.0, 0.5, 21).tolist()
_E4M3 = get_format("fp8_e4m3")
_E4M3_TINY = 2.0 ** -6  # torchao clamps block scales to torch.finfo(float8_e4m3fn).tiny
_LONE_ZERO_POINTS = "zero_points go with given scales of an asymmetric scheme"


# ---------------------------------------------------------------------------------------------
# the chosen scales, and the one dispatch on the scheme
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


def choose(g: torch.Tensor, valid, scheme: QuantScheme, tensor_scale: torch.Tensor | None = None,
           weights: torch.Tensor | None = None) -> Scaling:
    """The scales of the group view g [rows, groups, n] (valid: its mask of real entries, or None)
    by the scheme's rule: its scale kind's choose(). Not for plain casts (scale_format "none").

    tensor_scale: NVFP4's tensor scale, held fixed (GPTQ chooses each group's block scales under
    the whole tensor's); by default it comes from g.
    weights: None, or the weight of every value's error (float64 of g's shape, 0 on padding; see
    kquant_search.importance_weights): importance-weighted rounding, each kind's scales searched
    on the weighted squared error (the kinds whose `weighted` is true).
    """
    kind = kind_of(scheme)
    if weights is None:
        return kind.choose(g, valid, scheme, tensor_scale)
    if not kind.weighted:
        raise ValueError(f"{scheme.label}: {kind.name} scales are fixed by their recipe; importance-weighted "
                         "rounding searches the scales of the integer block formats (symmetric, zero-point, "
                         "float-minimum and super-block scales)")
    return kind.choose(g, valid, scheme, tensor_scale, weights=weights)


def kind_of(scheme: QuantScheme) -> ScaleKind:
    """The scale kind of a scaled scheme (one of KINDS): MX and NVFP4 blocks by their granularity,
    super-blocks, float minimums, then symmetric or zero-point scales."""
    if scheme.scale_format == "none":
        raise ValueError(f"{scheme.label} is a plain cast (scale_format 'none'): it has no scales")
    if scheme.granularity in ("mx", "nvfp4"):
        return KINDS[scheme.granularity]
    if scheme.super_block is not None:
        return KINDS["super_block"]
    if scheme.zero_point == "float":
        return KINDS["float_minimum"]
    return KINDS["symmetric" if scheme.symmetric else "zero_point"]


def scale_groups(g: torch.Tensor, valid, scheme: QuantScheme, shape, scales=None, zero_points=None,
                 scaling: Scaling | None = None, weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """quantize()'s one pass over the scales of the group view g of a tensor of `shape`: the
    scheme's kind chooses them (under `weights`, as choose()) or takes the given scales and zero
    points, or a whole `scaling`; the elements are scaled by them, and the kind stores them.
    Returns (the elements to round [rows, groups, n], the stored scale tensors by their STATE_KEYS)."""
    kind = kind_of(scheme)
    if weights is not None and (scaling is not None or scales is not None):
        raise ValueError("importance weights choose the scales: they do not go with given scales")
    if scaling is None and scales is not None:
        scaling = kind.given(scheme, shape, scales, zero_points)
    elif scaling is None:
        if zero_points is not None:
            raise ValueError(_LONE_ZERO_POINTS)
        scaling = choose(g, valid, scheme, weights=weights)
    return scaling.scaled(g), kind.store(scaling, scheme)


def stored_shapes(scheme: QuantScheme, shape, rows: int, groups: int) -> dict:
    """{key: (shape, dtype)} of the scale tensors a QuantizedTensor of `shape` holds ([rows, groups]
    scales): its kind's stored_shapes()."""
    return kind_of(scheme).stored_shapes(scheme, shape, rows, groups)


def scale_values(qt, rows: int, groups: int) -> torch.Tensor:
    """The float32 scales [rows, groups] of a QuantizedTensor: its kind's scale_values()."""
    return kind_of(qt.scheme).scale_values(qt, rows, groups)


def minimum_values(qt, rows: int, groups: int) -> torch.Tensor | None:
    """The float32 minimums [rows, groups] of a QuantizedTensor, or None: its kind's minimum_values()."""
    return kind_of(qt.scheme).minimum_values(qt, rows, groups)


# ---------------------------------------------------------------------------------------------
# the kinds
# ---------------------------------------------------------------------------------------------
class ScaleKind:
    """A kind of scales (see the module docstring). This base is the float scales [rows, groups]
    in the scheme's scale format (fp32 / fp16 / bf16), stored as they are or double-quantized,
    with no zero point; its subclasses add theirs."""

    name = ""
    weighted = True  # whether choose() takes importance weights

    def choose(self, g: torch.Tensor, valid, scheme: QuantScheme, tensor_scale=None, weights=None) -> Scaling:
        raise NotImplementedError

    def given(self, scheme: QuantScheme, shape, scales, zero_points) -> Scaling:
        """The Scaling of `scales` (float32 [rows, groups]) given to quantize(), rounded to the
        scale format; zero_points only for the kinds that have them."""
        if zero_points is not None:
            raise ValueError(_LONE_ZERO_POINTS)
        return self._given_scales(scheme, shape, scales)

    def store(self, scaling: Scaling, scheme: QuantScheme) -> dict[str, torch.Tensor]:
        """The tensors a QuantizedTensor holds of `scaling`, by their STATE_KEYS."""
        scale = scaling.scale.to(SCALE_DTYPES[scheme.scale_format])
        if not scheme.double_quant:
            return {"scales": scale}
        q, bs, off = double_quantize(scale.to(torch.float32))
        return {"dq_codes": q, "dq_scales": bs, "dq_offset": off}

    def stored_shapes(self, scheme: QuantScheme, shape, rows: int, groups: int) -> dict:
        """{key: (shape, dtype)} of what store() gives for a tensor of `shape` ([rows, groups] scales)."""
        n = rows * groups
        if scheme.double_quant:
            return {"dq_codes": ((n,), torch.int8), "dq_scales": ((-(-n // DOUBLE_QUANT_BLOCK),), torch.float32),
                    "dq_offset": ((), torch.float32)}
        return {"scales": ((rows, groups), SCALE_DTYPES[scheme.scale_format])}

    def scale_values(self, qt, rows: int, groups: int) -> torch.Tensor:
        """The float32 scales [rows, groups] that multiply a QuantizedTensor's element values."""
        if qt.scheme.double_quant:
            return double_dequantize(qt.dq_codes, qt.dq_scales, qt.dq_offset).reshape(rows, groups)
        return qt.scales.to(torch.float32)

    def minimum_values(self, qt, rows: int, groups: int) -> torch.Tensor | None:
        """The float32 minimums [rows, groups] added after scaling, or None."""
        return None

    @staticmethod
    def _given_scales(scheme, shape, scales) -> Scaling:
        scale = round_scales(_given(scales, "scales", scheme, shape, torch.float32), scheme.scale_format)
        return Scaling(scale, reciprocal(scale))


class SymmetricScales(ScaleKind):
    """One scale per group (tensor, channel or group), x ~= code * scale, by scale_method:
    "absmax": amax / the element format's max; "percentile": that percentile of |x| instead of
    amax; "mse": of the clipping ratios r in [0.5, 1], the one whose quantization has the least
    squared error (each candidate quantized and dequantized with quantize()'s arithmetic); each
    rounded to the scale format. "gguf": llama.cpp's Q8_0 (d = amax / 127) or Q4_0 / Q5_0 (d = the
    value of largest magnitude, with its sign, / the lowest code), the elements then rounded by
    the recipe (gguf_elements) under 1 / the unrounded d; with a codebook (IQ4_NL), llama.cpp's
    signed-scale search (lookup_search.signed_lookup_scales, weights x^2), the elements then
    rounded to the nearest table entry under 1 / d rounded to the scale format.
    Under importance weights: GGUF's integer blocks (scale_method "gguf") search their signed
    scale as make_qx_quants does (kquant_search.group_params: the value of largest magnitude may
    take the lowest code), IQ4_NL its signed scale by the same lookup search under those weights,
    the other schemes their clipping ratio, each on the weighted squared error;
    the elements are then rounded to nearest under 1 / the scale rounded to its format."""

    name = "symmetric"

    def choose(self, g, valid, scheme, tensor_scale=None, weights=None):
        if scheme.scale_method == "gguf" and isinstance(scheme.format, LookupFormat):
            d = signed_lookup_scales(g, valid, scheme.format, weights)
            scale = round_scales(d.to(torch.float32), scheme.scale_format)
            return Scaling(scale, reciprocal(scale))
        if weights is not None and scheme.scale_method == "gguf":
            scale = round_scales(group_params(g, valid, scheme, weights)[0].to(torch.float32), scheme.scale_format)
            return Scaling(scale, reciprocal(scale))
        if scheme.scale_method == "gguf":
            return self._gguf(g, scheme)
        if scheme.scale_method == "percentile":
            amax = group_percentile(g, valid, scheme.percentile)
        else:
            amax = group_amax(g)
        base = divide(amax, element_max(scheme))
        if scheme.scale_method != "mse" and weights is None:
            scale = round_scales(base, scheme.scale_format)
            return Scaling(scale, reciprocal(scale))

        def quantize_dequantize(gg, scale):
            return round_elements(times_reciprocal(gg, scale), scheme.format) * scale.unsqueeze(-1)

        scale = _mse_search(g, valid, scheme, lambda r: round_scales(base * r, scheme.scale_format),
                            quantize_dequantize, weights)
        return Scaling(scale, reciprocal(scale))

    @staticmethod
    def _gguf(g, scheme) -> Scaling:
        fmt = scheme.format
        recipe = "q8_0" if fmt.bits == 8 else "q4_0"
        if not g.shape[-1]:
            zero = g.new_zeros(g.shape[:-1])
            return Scaling(zero, zero.clone(), gguf=recipe, gguf_levels=2 ** fmt.bits)
        if recipe == "q8_0":
            d = divide(group_amax(g), float(fmt.max))
        else:  # the value of largest magnitude (the first such, as numpy's argmax) maps to the lowest code
            signed_max = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
            d = divide(signed_max, float(fmt.lowest))
        return Scaling(round_scales(d, scheme.scale_format), _gguf_reciprocal(d), gguf=recipe,
                       gguf_levels=2 ** fmt.bits)


class ZeroPointScales(ScaleKind):
    """Asymmetric scales with an integer zero point on the unsigned grid 0..2^b-1: the range always
    contains 0, so zero is exact: lo = min(min, 0), hi = max(max, 0) ("percentile": each clipped to
    that percentile); scale = (hi - lo) / (2^b - 1) rounded to the scale format, zero_point =
    round(-lo / scale); "mse" (and under importance weights): the clipping ratio of least
    (weighted) squared error, as SymmetricScales. The zero points are stored packed at the
    element width."""

    name = "zero_point"

    def choose(self, g, valid, scheme, tensor_scale=None, weights=None):
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

        if scheme.scale_method != "mse" and weights is None:
            scale, zero_point = params(1.0)
        else:
            def quantize_dequantize(gg, scale_zero):
                scale, zero = scale_zero
                q = round_elements(times_reciprocal(gg, scale) + zero.unsqueeze(-1), scheme.format)
                return (q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)

            scale, zero_point = _mse_search(g, valid, scheme, params, quantize_dequantize, weights)
        return Scaling(scale, reciprocal(scale), zero_point=zero_point.to(torch.int64))

    def given(self, scheme, shape, scales, zero_points):
        scaling = self._given_scales(scheme, shape, scales)
        zp = _given(zero_points, "zero_points", scheme, shape, torch.int64)
        if int(zp.min()) < 0 or int(zp.max()) > 2 ** scheme.format.bits - 1:
            raise ValueError(f"zero points must lie in 0..{2 ** scheme.format.bits - 1}")
        scaling.zero_point = zp
        return scaling

    def store(self, scaling, scheme):
        zero_points = pack(scaling.zero_point.reshape(-1).to(torch.uint8), scheme.format.bits, order=PACK_ORDER)
        return {**super().store(scaling, scheme), "zero_points": zero_points}

    def stored_shapes(self, scheme, shape, rows, groups):
        packed = -(-rows * groups * scheme.format.bits // 8)
        return {**super().stored_shapes(scheme, shape, rows, groups), "zero_points": ((packed,), torch.uint8)}


class FloatMinimumScales(ScaleKind):
    """A float minimum per group (zero_point="float", GGUF Q4_1 style) on the unsigned grid
    0..2^b-1: minimum = the group minimum (not widened to include 0; padding ignored), scale =
    (max - min) / (2^b - 1) computed in float32 from the unrounded minimum as llama.cpp does, both
    stored rounded to the scale format. "absmax": the elements are round((x - minimum) * (1 /
    scale)); "gguf" (Q4_1 / Q5_1): the recipe's trunc((x - min) * (1 / d) + 0.5) with the
    unrounded d and minimum (gguf_elements).
    Under importance weights: the scale and minimum (min(minimum, 0)) of least weighted squared
    error, as make_qkx2_quants searches them (kquant_search.group_params), each rounded to the
    scale format; the elements then round((x - minimum) * (1 / scale))."""

    name = "float_minimum"

    def choose(self, g, valid, scheme, tensor_scale=None, weights=None):
        levels = 2 ** scheme.format.bits
        if weights is not None and g.shape[-1]:
            scale, neg_min = group_params(g, valid, scheme, weights)
            scale = round_scales(scale.to(torch.float32), scheme.scale_format)
            return Scaling(scale, reciprocal(scale), minimum=round_scales((-neg_min).to(torch.float32),
                                                                          scheme.scale_format))
        gguf = scheme.scale_method == "gguf"
        if not g.shape[-1]:
            zero = g.new_zeros(g.shape[:-1])
            if gguf:
                return Scaling(zero, zero.clone(), minimum=zero.clone(), gguf="q4_1", gguf_minimum=zero.clone(),
                               gguf_levels=levels)
            return Scaling(zero, reciprocal(zero), minimum=zero.clone())
        big = torch.tensor(float("inf"))
        lo = (torch.where(valid, g, big) if valid is not None else g).amin(-1)
        hi = (torch.where(valid, g, -big) if valid is not None else g).amax(-1)
        d = divide(hi - lo, float(levels - 1))
        scale, minimum = round_scales(d, scheme.scale_format), round_scales(lo, scheme.scale_format)
        if gguf:
            return Scaling(scale, _gguf_reciprocal(d), minimum=minimum, gguf="q4_1", gguf_minimum=lo,
                           gguf_levels=levels)
        return Scaling(scale, reciprocal(scale), minimum=minimum)

    def given(self, scheme, shape, scales, zero_points):
        scaling = self._given_scales(scheme, shape, scales)
        mins = _given(zero_points, "zero_points (float minimums)", scheme, shape, torch.float32)
        if not bool(torch.isfinite(mins).all()):
            raise ValueError("the float minimums (zero_points) must be finite")
        scaling.minimum = round_scales(mins, scheme.scale_format)
        return scaling

    def store(self, scaling, scheme):
        return {**super().store(scaling, scheme), "minimums": scaling.minimum.to(SCALE_DTYPES[scheme.scale_format])}

    def stored_shapes(self, scheme, shape, rows, groups):
        return {**super().stored_shapes(scheme, shape, rows, groups),
                "minimums": ((rows, groups), SCALE_DTYPES[scheme.scale_format])}

    def minimum_values(self, qt, rows, groups):
        return qt.minimums.to(torch.float32)


class SuperBlockScales(ScaleKind):
    """Two-level scales in super-blocks (GGUF's k-quants Q2_K ... Q6_K; see QuantScheme): each
    group's scale (and float minimum) by scale_method ("absmax": the group's plain range; "mse":
    the weighted least-squares search of kquant_search.group_params), then per super-block the
    scale d = the largest group scale / the largest sub-scale code (symmetric: the group scale of
    largest magnitude / the lowest code, so that it gets code -128 as in Q6_K), rounded to the
    scale format (fp16), each group's code round(scale / d) clamped to the sub-scale format, and
    the effective scale d * code (float32, exact). The minimums likewise (codes of -minimum,
    unsigned). With "mse" each group's codes are then chosen among the neighbours of scale / d
    (and -minimum / dmin), floor or ceil, by the weighted error of its elements rounded under them
    (kquant_search.refine_codes). Both searches run in C (kernels/csrc/kquant.c) where the native
    library serves, else in torch, with equal results. scaled() then rounds the elements under
    these final scales and minimums, as quantize() rounds every float-minimum or symmetric scheme:
    round((x - minimum) * (1 / scale)). Stored: the sub-scale codes packed (low-first) and the
    super-block scales in the scale format's dtype (minimum = -(super_minimum * code)).

    Deliberate differences from llama.cpp's quantize_row_q4_K_ref / q6_K_ref: the codes are
    chosen against the fp16-rounded d (llama.cpp rounds scale * 63 / max against the unrounded
    one), floor or ceil by the resulting error (llama.cpp: nearest), the elements are multiplied
    by 1 / scale rather than divided and rounded half to even (as every fewbits scheme), the search
    works in float64 and sums each group in group_sum's order (llama.cpp: float32, sequentially),
    and a group whose scale code is 0 keeps codes that dequantize to its minimum (llama.cpp leaves
    the search's codes there: they dequantize to the same value).
    Under importance weights both searches weigh each value's error by its weight instead."""

    name = "super_block"

    def choose(self, g, valid, scheme, tensor_scale=None, weights=None):
        sub = scheme.sub_scale_format_of
        groups = g.shape[1]
        scale, neg_min = group_params(g, valid, scheme, weights)
        d, codes = _super_scales(scale, scheme, sub)
        dmin = mcodes = None
        if scheme.zero_point == "float":
            dmin, mcodes = _super_scales(neg_min, scheme, sub)
        if scheme.scale_method == "mse" or weights is not None:
            codes, mcodes = refine_codes(g, valid, scheme, sub, scale, neg_min, d, dmin, weights)
        eff = expand_super(d, scheme, groups) * codes.to(torch.float32)
        if scheme.zero_point != "float":
            return Scaling(eff, reciprocal(eff), sub_codes=codes, super_scale=d)
        minimum = -(expand_super(dmin, scheme, groups) * mcodes.to(torch.float32))
        return Scaling(eff, reciprocal(eff), minimum=minimum, sub_codes=codes, super_scale=d,
                       sub_min_codes=mcodes, super_minimum=dmin)

    def given(self, scheme, shape, scales, zero_points):
        raise ValueError("super-block scales are codes times super-block scales, not float scales: they cannot be "
                         "given to quantize() (quantize_scaled takes a whole Scaling)")

    def store(self, scaling, scheme):
        sub = scheme.sub_scale_format_of
        stored_as = SCALE_DTYPES[scheme.scale_format]
        bits, mask = sub.bits, (1 << sub.bits) - 1

        def packed(codes):  # integers of the sub-scale format: their bit patterns are their low bits
            return pack((codes.reshape(-1).to(torch.int64) & mask).to(torch.uint8), bits, order=PACK_ORDER)

        parts = {"sub_scales": packed(scaling.sub_codes), "super_scales": scaling.super_scale.to(stored_as)}
        if scaling.sub_min_codes is not None:
            parts.update(sub_minimums=packed(scaling.sub_min_codes), super_minimums=scaling.super_minimum.to(stored_as))
        return parts

    def stored_shapes(self, scheme, shape, rows, groups):
        _, supers, _ = scheme.super_layout(shape)
        sub_bytes = ((-(-rows * groups * scheme.sub_scale_format_of.bits // 8),), torch.uint8)
        supers_as = ((rows, supers), SCALE_DTYPES[scheme.scale_format])
        out = {"sub_scales": sub_bytes, "super_scales": supers_as}
        if scheme.zero_point == "float":
            out.update(sub_minimums=sub_bytes, super_minimums=supers_as)
        return out

    def scale_values(self, qt, rows, groups):
        return self._two_level(qt.scheme, qt.sub_scales, qt.super_scales, rows, groups)

    def minimum_values(self, qt, rows, groups):
        if qt.sub_minimums is None:
            return None
        return -self._two_level(qt.scheme, qt.sub_minimums, qt.super_minimums, rows, groups)

    @staticmethod
    def sub_codes(scheme: QuantScheme, packed: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
        """The integer sub-scale codes [rows, groups] (int64, in the sub-scale format) of `packed`."""
        sub = scheme.sub_scale_format_of
        raw = unpack(packed, sub.bits, rows * groups, order=PACK_ORDER).reshape(rows, groups)
        return decode(raw, sub).to(torch.int64)

    def _two_level(self, scheme, packed, supers, rows, groups) -> torch.Tensor:
        """float32 super-block value times the float32 sub-scale code, per group [rows, groups]."""
        codes = self.sub_codes(scheme, packed, rows, groups)
        return expand_super(supers.to(torch.float32), scheme, groups) * codes.to(torch.float32)


class MXScales(ScaleKind):
    """OCP MX: one E8M0 shared exponent per block (of 32), from the block's amax by torchao's
    `to_mx` rule in the scheme's mx_scale_mode (floor, ceil, even, rceil); the elements are
    multiplied by 1 / 2^e (exact). Stored: the E8M0 codes (uint8); they cannot be given."""

    name = "mx"
    weighted = False

    def choose(self, g, valid, scheme, tensor_scale=None):
        codes = self.codes(group_amax(g), scheme)
        scale = mx_scale_values(codes, scheme)
        return Scaling(scale, 1.0 / scale, codes=codes)

    @staticmethod
    def codes(amax: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
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
        emax_pow2 = math.floor(math.log2(fmt.max))  # the element format's largest power of two (e2m1 6 -> 2)
        e = (pow2 - emax_pow2).clamp(-_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS
        return torch.where(nan, 255, e).to(torch.uint8)

    def given(self, scheme, shape, scales, zero_points):
        raise ValueError(f"{scheme.granularity} scales follow their recipe; they cannot be given")

    def store(self, scaling, scheme):
        return {"scales": scaling.codes}

    def scale_values(self, qt, rows, groups):
        return mx_scale_values(qt.scales, qt.scheme)


class NVFP4Scales(ScaleKind):
    """NVFP4: E4M3 block scales (blocks of 16) times a float32 tensor scale, as NVIDIA's recipe and
    torchao's nvfp4_quantize compute them: tensor_scale = amax / (448 * 6) of the whole tensor (1
    if all zero), block = e4m3(clamp(block_amax / 6 / tensor_scale)), and the elements multiplied
    by (1 / tensor_scale) / block. Stored: the E4M3 codes (uint8) and the tensor scale."""

    name = "nvfp4"
    weighted = False
    given = MXScales.given

    def choose(self, g, valid, scheme, tensor_scale=None):
        ts = nvfp4_tensor_scale(g, scheme) if tensor_scale is None else tensor_scale
        block = divide(group_amax(g), element_max(scheme)) / ts
        block = fb_round(block.clamp(min=_E4M3_TINY, max=_E4M3.max), _E4M3, overflow="saturate")
        codes = encode(block, _E4M3)
        return Scaling(nvfp4_scale_values(codes, ts), (1.0 / ts) / block, codes=codes, tensor_scale=ts)

    def store(self, scaling, scheme):
        return {"scales": scaling.codes, "tensor_scale": scaling.tensor_scale}

    def stored_shapes(self, scheme, shape, rows, groups):
        return {**super().stored_shapes(scheme, shape, rows, groups), "tensor_scale": ((), torch.float32)}

    def scale_values(self, qt, rows, groups):
        return nvfp4_scale_values(qt.scales, qt.tensor_scale)


KINDS: dict[str, ScaleKind] = {k.name: k for k in (SymmetricScales(), ZeroPointScales(), FloatMinimumScales(),
                                                    SuperBlockScales(), MXScales(), NVFP4Scales())}


# ---------------------------------------------------------------------------------------------
# helpers of the kinds: statistics, rounding, the arithmetic of the elements
# ---------------------------------------------------------------------------------------------
def _given(t, what, scheme: QuantScheme, shape, dtype) -> torch.Tensor:
    """`t` (scales, zero points or minimums given to quantize()) as a `dtype` tensor, checked to
    have the shape [rows, groups] of this scheme's scales for a tensor of `shape`."""
    want = scheme.scales_shape(shape)
    if t is None:
        raise ValueError(f"{what} are needed (shape {want})")
    t = torch.as_tensor(t)
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{what} must have shape {want} for a tensor of shape {tuple(shape)} in {scheme.label}, "
                         f"got {tuple(t.shape)}")
    return t.to(dtype)


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


def element_max(scheme: QuantScheme) -> float:
    """The largest magnitude the element grid reaches on the positive side (int4: 7; nf4: 1)."""
    return float(scheme.format.max)


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


def _mse_search(g, valid, scheme, candidate, quantize_dequantize, weights=None):
    """Per group, the clipping ratio r in [0.5, 1] (21 steps) whose quantization has the least
    squared error (weighted by `weights`, float64 of g's shape, where given).
    candidate(r) -> scale (or (scale, zero_point))."""
    best_err = best = None
    w = weights.to(torch.float32) if weights is not None else None
    for r in _MSE_RATIOS:
        c = candidate(r)
        err = (quantize_dequantize(g, c) - g).square()
        if w is not None:
            err = err * w
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
# GGUF legacy blocks: llama.cpp's reference quantizers (gguf.quants.quantize), bit for bit
# ---------------------------------------------------------------------------------------------
def _gguf_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """id = 1/d in float32, 0 where d is 0 (llama.cpp: `d ? 1.0f/d : 0.0f`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


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
# super-blocks: the two-level rounding of the searched group scales
# ---------------------------------------------------------------------------------------------
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
    lowest, top_code = sub.lowest, sub.max
    if sub.signed:
        top = v.gather(-1, v.abs().argmax(-1, keepdim=True)).squeeze(-1) / float(lowest)
    else:
        top = v.amax(-1).clamp(min=0.0) / float(top_code)
    d = round_scales(top.to(torch.float32), scheme.scale_format)
    d_exp = expand_super(d, scheme, groups).to(torch.float64)
    safe = torch.where(d_exp == 0, torch.ones_like(d_exp), d_exp)
    codes = torch.round(values / safe).clamp(lowest, top_code)
    codes = torch.where(d_exp == 0, torch.zeros_like(codes), codes)
    return d, codes.to(torch.int64)


# ---------------------------------------------------------------------------------------------
# MX and NVFP4 scale values (the quantized modules read them too)
# ---------------------------------------------------------------------------------------------
def mx_scale_values(codes: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The float32 scale the elements are divided by: 2^(code-127), in torchao's convention
    (floor/ceil/even: clamped to the smallest normal float32; rceil: code 0 means 1)."""
    c = codes.to(torch.int32)
    if scheme.mx_scale_mode == "rceil":
        v = torch.exp2(c.to(torch.float32) - _E8M0_BIAS)
        return torch.where(c == 0, torch.ones_like(v), v)
    v = (c << 23).view(torch.float32)
    return v.clamp(min=_F32_MIN_NORMAL)


def nvfp4_tensor_scale(g: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The float32 scalar tensor scale amax / (448 * 6) of the whole group view (1 if all zero)."""
    amax = g.abs().amax() if g.numel() else torch.tensor(0.0, device=g.device)
    ts = divide(amax.to(torch.float32), _E4M3.max * element_max(scheme)).reshape(())
    return torch.where(ts == 0, torch.ones_like(ts), ts)  # an all-zero tensor: any scale works


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
