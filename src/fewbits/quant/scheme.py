"""QuantScheme: how a tensor is quantized, and the named presets.

A scheme is data, like a format: element format x granularity x symmetry x scale format x scale
choice x rounding mode x double quantization. Everything a QuantizedTensor holds follows from
its scheme and the tensor's shape, so the true bits per value (scales and zero points included)
are known before anything is quantized.

Layout rule (shared by every granularity). A tensor is viewed as a matrix [rows, cols]:
- "tensor":  rows = 1, cols = numel, one scale;
- "channel": the `axis` dimension moved first, rows = its length, one scale per row;
- "group" / "mx" / "nvfp4": rows = numel / last-dim, cols = the last dim (for an nn.Linear
  weight [out, in]: groups run along the input dimension), padded with zeros to a multiple of
  the group size; one scale per group per row.
Scales therefore always have shape [rows, groups]. Codes are stored row-major over the padded
matrix and packed into bytes.

Two-level scales (super_block, GGUF's k-quants): the groups of a row are gathered into
super-blocks of `super_block` values (the last one of a row may be short). Each group's scale is
an integer code in `sub_scale_format` times its super-block's scale d, stored in `scale_format`;
with float minimums the same again (codes m, super-block scale dmin, minimum = -(dmin * m)):
    Q4_K / Q5_K: uint4 / uint5 groups of 32, super-blocks of 256, uint6 codes, fp16 d and dmin:
                 w = (d * sc) * q - (dmin * m)
    Q6_K:        int6 groups of 16, super-blocks of 256, int8 codes, fp16 d:  w = (d * sc) * q
The effective group scales and minimums (QuantizedTensor.scale_values() / minimum_values()) are
float32 [rows, groups] like every other scheme's, so dequantization is unchanged.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

from ..formats import (IQ4_NL_VALUES, MODE_PRESETS, FloatFormat, Format, IntFormat, LookupFormat, MODES, check_mode,
                       get_format)
from ..formats import normalize_name

GRANULARITIES = ("tensor", "channel", "group", "mx", "nvfp4")
SCALE_FORMATS = ("fp32", "fp16", "bf16", "e8m0", "e4m3", "none")
SCALE_METHODS = ("absmax", "percentile", "mse", "gguf")
ZERO_POINTS = ("int", "float")
MX_SCALE_MODES = ("floor", "ceil", "even", "rceil")
DOUBLE_QUANT_BLOCK = 256  # QLoRA: the group scales are quantized to int8 in blocks of 256
SUPER_SCALE_METHODS = ("absmax", "mse")  # scale_methods of two-level (super-block) schemes
_LATER_FIELDS = ("super_block", "sub_scale_format")  # QuantScheme fields newer than file format 1

_SCALE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "e8m0": 8, "e4m3": 8, "none": 0}
_SCALE_FORMAT_NAMES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "e8m0": "e8m0", "e4m3": "fp8_e4m3"}


def code_nbytes(count: int, bits: int) -> int:
    """Bytes that `count` element codes take: packed for formats of up to 8 bits, else 2 each."""
    return -(-count * bits // 8) if bits <= 8 else 2 * count


def scale_format_of(name: str) -> Format:
    """The fewbits format a scale is stored in."""
    return get_format(_SCALE_FORMAT_NAMES[name])


@dataclass(frozen=True)
class QuantScheme:
    """How to quantize a tensor. See the module docstring for the layout rule.

    format: element format (any fewbits format or its name).
    granularity: tensor | channel | group | mx (OCP MX, blocks of 32, E8M0 scale) |
        nvfp4 (blocks of 16, E4M3 block scale times a float32 tensor scale).
    axis: the channel axis for "channel" (0: the output channels of an nn.Linear weight).
    group_size: values per scale for group / mx / nvfp4 (default 128 / 32 / 16).
    symmetric: False for an unsigned integer grid with a zero point (integers only).
    scale_format: fp32 | fp16 | bf16 | e8m0 | e4m3 | none (plain cast: no scale at all).
    scale_method: absmax | percentile (clip at that percentile of |x| per group) | mse (search
        the clipping ratio that minimizes the squared error per group) | gguf (llama.cpp's
        reference quantizers, as the gguf package's numpy `gguf.quants.quantize` computes them, bit
        for bit; integer formats in groups): symmetric 8-bit is Q8_0 (d = amax / 127, codes
        roundf(x * (1/d))); symmetric fewer bits is Q4_0 / Q5_0 (d = the value of largest
        magnitude, with its sign, / lowest code (-8, -16), codes trunc(x * (1/d) + 8.5) - 8,
        clamped); zero_point="float" is Q4_1 / Q5_1 (d = (max - min) / (2^b - 1), codes
        trunc((x - min) * (1/d) + 0.5), clamped). In each, 1/d is the float32 reciprocal of the
        unrounded d (0 where d is 0) and the minimum subtracted is the unrounded one; only d and
        the minimum are stored rounded to the scale format. The recipe rounds the elements
        itself, so mode stays nearest_even. Q4_0's d is negative where the largest magnitude is
        positive. With the iq4_nl codebook (IQ4_NL, which gguf only dequantizes): llama.cpp's
        signed-scale search (fewbits.quant.lookup_search), the elements then rounded to nearest
        under d rounded to the scale format.
    mx_scale_mode: floor | ceil | even | rceil, as in torchao's MX casts (E8M0 scales only).
    mode: element rounding mode; stochastic rounding draws from `seed`. "bitsandbytes" (codebooks
        only; the nf4 presets use it) is bitsandbytes' NF4 rounding: float32 bucket bounds, ties
        to the lower code (fewbits.LookupFormat.bitsandbytes_bounds).
    double_quant: QLoRA double quantization: the group scales minus their mean are quantized to
        int8 in blocks of 256, each block with a float32 scale.
    activations: for w8a8-style schemes, the dynamic per-token scheme of the activations.
    zero_point: asymmetric schemes only. "int": an integer zero point on the element grid, the
        range always containing 0: x ~= (q - zp) * scale. "float": a float minimum per group
        stored in the scale format (GGUF Q4_1 style): min = the group minimum (not widened to
        include 0), scale = (max - min) / (2^b - 1), q = round((x - min) * (1 / scale)),
        x ~= q * scale + min. Float minimums take scale_method "absmax" only (and "mse" with
        super-blocks).
    super_block: values per super-block (GGUF k-quants: 256; a multiple of group_size), or None.
        The group scales (and float minimums) of a super-block are stored as integer codes in
        `sub_scale_format` times one super-block scale in `scale_format` (see the module
        docstring). Integer element formats in groups only, symmetric (signed sub-scales) or with
        zero_point="float" (unsigned sub-scales); mode nearest_even; no double quantization.
        scale_method "absmax": each group's plain range (symmetric: amax / max; float minimum:
        min(min, 0) .. max), then d = the super-block's largest scale / the largest sub-scale
        code, codes rounded, elements rounded again under the final d * code (fewbits.quant.scales);
        "mse": each group's (scale, minimum) by a weighted least-squares search over candidate
        scales, as llama.cpp's k-quant reference quantizer does (make_qkx2_quants /
        make_qx_quants), then the same two-level rounding.
    sub_scale_format: the integer format of the group scale codes with super_block ("uint6",
        "int8"), else None.
    """

    format: Format | str
    granularity: str = "channel"
    axis: int = 0
    group_size: int | None = None
    symmetric: bool = True
    scale_format: str = "fp32"
    scale_method: str = "absmax"
    percentile: float = 99.9
    mx_scale_mode: str = "floor"
    mode: str = "nearest_even"
    seed: int = 0
    double_quant: bool = False
    activations: QuantScheme | None = None
    zero_point: str = "int"
    super_block: int | None = None
    sub_scale_format: str | None = None
    name: str | None = None

    def __post_init__(self):
        fmt = get_format(self.format)
        object.__setattr__(self, "format", fmt)
        g = self.granularity
        if g not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {g!r}")
        if g in ("mx", "nvfp4"):
            want = "e8m0" if g == "mx" else "e4m3"
            if self.scale_format not in (want, "fp32"):  # fp32: the default, not a choice
                raise ValueError(f"granularity {g!r} uses {want} scales, got scale_format={self.scale_format!r}")
            object.__setattr__(self, "scale_format", want)
            if self.group_size is None:
                object.__setattr__(self, "group_size", 32 if g == "mx" else 16)
            if not isinstance(fmt, FloatFormat):
                raise ValueError(f"{g} blocks take a float element format (e.g. e2m1, e4m3), got {fmt.name}")
        if g == "group" and self.group_size is None:
            object.__setattr__(self, "group_size", 128)
        if g in ("group", "mx", "nvfp4"):
            gs = self.group_size
            if not isinstance(gs, int) or isinstance(gs, bool) or gs < 1:
                raise ValueError(f"group_size must be a positive int, got {gs!r}")
        elif self.group_size is not None:
            raise ValueError(f"group_size applies to group/mx/nvfp4 granularity, not {g!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"scale_format must be one of {', '.join(SCALE_FORMATS)}, got {self.scale_format!r}")
        if self.scale_format == "none":
            if g != "tensor" or not isinstance(fmt, FloatFormat) or self.double_quant:
                raise ValueError("scale_format='none' (a plain cast) needs granularity='tensor', a float "
                                 "format and no double quantization")
        if self.scale_format == "e8m0" and g != "mx":
            raise ValueError("e8m0 scales are the MX block scale: use granularity='mx'")
        if self.scale_method not in SCALE_METHODS:
            raise ValueError(f"scale_method must be one of {', '.join(SCALE_METHODS)}, got {self.scale_method!r}")
        if self.scale_method == "gguf":
            iq4_nl = isinstance(fmt, LookupFormat) and fmt.table == tuple(float(v) for v in IQ4_NL_VALUES)
            if not (isinstance(fmt, IntFormat) or iq4_nl) or g != "group":
                raise ValueError("scale_method='gguf' (llama.cpp's block quantizers) takes an integer format or "
                                 f"the iq4_nl codebook in groups, got {fmt.name} with granularity {g!r}")
            if self.mode != "nearest_even" or self.double_quant:
                raise ValueError("scale_method='gguf' rounds the elements as llama.cpp does and keeps its scales: "
                                 f"leave mode at nearest_even (got {self.mode!r}) and double_quant off")
            if not self.symmetric and self.zero_point != "float":
                raise ValueError("scale_method='gguf' with symmetric=False is Q4_1 / Q5_1: it needs "
                                 "zero_point='float'")
        if g == "mx" and self.scale_method != "absmax":
            raise ValueError("MX scales are set by mx_scale_mode (floor/ceil/even/rceil), not scale_method")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.mx_scale_mode not in MX_SCALE_MODES:
            raise ValueError(f"mx_scale_mode must be one of {', '.join(MX_SCALE_MODES)}, got {self.mx_scale_mode!r}")
        if self.mode not in MODES + MODE_PRESETS:
            raise ValueError(f"mode must be one of {', '.join(MODES + MODE_PRESETS)}, got {self.mode!r}")
        check_mode(self.mode, fmt)  # a preset (bitsandbytes: codebooks only) the format cannot take
        if not self.symmetric:
            if not isinstance(fmt, IntFormat):
                raise ValueError(f"asymmetric quantization (a zero point) needs an integer format, got {fmt.name}")
            if g in ("mx", "nvfp4"):
                raise ValueError(f"{g} blocks are symmetric")
            if fmt.bits > 8:
                raise ValueError("asymmetric formats of more than 8 bits are not supported")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"zero_point must be one of {', '.join(ZERO_POINTS)}, got {self.zero_point!r}")
        if self.zero_point == "float":
            if self.symmetric:
                raise ValueError("zero_point='float' (a float minimum per group) needs symmetric=False")
            if self.scale_format not in ("fp32", "fp16", "bf16"):
                raise ValueError("zero_point='float' stores the minimums in the scale format: use fp32, fp16 "
                                 f"or bf16 scales, got {self.scale_format!r}")
            if self.scale_method not in ("absmax", "gguf") and self.super_block is None:
                raise ValueError("zero_point='float' takes the group minimum and maximum as they are: "
                                 f"scale_method must be 'absmax' or 'gguf', got {self.scale_method!r}")
        if isinstance(fmt, IntFormat) and self.symmetric and not fmt.signed:
            raise ValueError(f"{fmt.name} is unsigned: use a signed format, or symmetric=False for a zero point")
        if fmt.bits > 16:
            raise ValueError(f"{fmt.name} has {fmt.bits} bits: quantization stores formats of ≤16 bits")
        if self.double_quant and self.scale_format not in ("fp32", "fp16", "bf16"):
            raise ValueError("double quantization applies to float scales (fp32/fp16/bf16)")
        if self.activations is not None and not isinstance(self.activations, QuantScheme):
            raise TypeError("activations must be a QuantScheme or None")
        if self.super_block is not None or self.sub_scale_format is not None:
            self._check_super_blocks(fmt)

    def _check_super_blocks(self, fmt: Format) -> None:
        """The rules of two-level (super-block) scales; see the class docstring."""
        sb, sub = self.super_block, self.sub_scale_format
        if sb is None or sub is None:
            raise ValueError("two-level scales need both super_block (values per super-block, e.g. 256) and "
                             f"sub_scale_format (e.g. 'uint6', 'int8'); got super_block={sb!r}, "
                             f"sub_scale_format={sub!r}")
        if self.granularity != "group":
            raise ValueError(f"super_block applies to granularity='group', not {self.granularity!r}")
        if not isinstance(sb, int) or isinstance(sb, bool) or sb < 1 or sb % self.group_size:
            raise ValueError(f"super_block must be a positive multiple of group_size {self.group_size}, got {sb!r}")
        if not isinstance(sub, str):
            raise ValueError(f"sub_scale_format must be the name of an integer format, got {sub!r}")
        sub_fmt = get_format(sub)
        if not isinstance(sub_fmt, IntFormat) or sub_fmt.bits > 8:
            raise ValueError(f"sub_scale_format must be an integer format of at most 8 bits (uint6, int8, ...), "
                             f"got {sub_fmt.name}")
        object.__setattr__(self, "sub_scale_format", sub_fmt.name)
        if not isinstance(fmt, IntFormat):
            raise ValueError(f"super-blocks take an integer element format (int6, uint4, ...), got {fmt.name}")
        if self.symmetric and not sub_fmt.signed:
            raise ValueError("symmetric super-block scales take a signed sub_scale_format (Q6_K: int8), "
                             f"got {sub_fmt.name}")
        if not self.symmetric and (self.zero_point != "float" or sub_fmt.signed):
            raise ValueError("asymmetric super-blocks take zero_point='float' (minimum = -(dmin * m)) and an "
                             f"unsigned sub_scale_format (Q4_K: uint6); got zero_point={self.zero_point!r}, "
                             f"sub_scale_format={sub_fmt.name}")
        if self.scale_format not in ("fp32", "fp16", "bf16"):
            raise ValueError("the super-block scales are floats: use fp32, fp16 or bf16 scales, got "
                             f"{self.scale_format!r}")
        if self.scale_method not in SUPER_SCALE_METHODS:
            raise ValueError(f"super-block scales take scale_method {' or '.join(map(repr, SUPER_SCALE_METHODS))}, "
                             f"got {self.scale_method!r}")
        if self.double_quant or self.mode != "nearest_even":
            raise ValueError("super-block scales round the elements to nearest even and are not double-"
                             f"quantized: got mode={self.mode!r}, double_quant={self.double_quant}")

    @property
    def sub_scale_format_of(self) -> IntFormat | None:
        """The IntFormat of the sub-scale codes (super-block schemes), else None."""
        return get_format(self.sub_scale_format) if self.sub_scale_format is not None else None

    def super_layout(self, shape) -> tuple[int, int, int]:
        """(rows, super-blocks per row, groups per super-block) of a super-block scheme; the last
        super-block of a row holds the remaining groups."""
        if self.super_block is None:
            raise ValueError(f"{self.label} has no super-blocks")
        rows, _, _, groups = self.layout(shape)
        per = self.super_block // self.group_size
        return rows, -(-groups // per), per

    # --- derived --------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.name or self.describe()

    def describe(self) -> str:
        """A short human description, e.g. 'int4 group 128 asym, fp32 scales'."""
        g = self.granularity
        parts = [self.format.name]
        if g == "group":
            parts.append(f"group {self.group_size}")
        elif g == "channel":
            parts.append(f"per-channel (axis {self.axis})")
        elif g == "mx":
            parts.append(f"MX block {self.group_size}")
        elif g == "nvfp4":
            parts.append(f"NVFP4 block {self.group_size}")
        else:
            parts.append("per-tensor")
        if not self.symmetric:
            parts.append("asym float-min" if self.zero_point == "float" else "asym")
        if self.super_block is not None:
            parts.append(f"super-blocks of {self.super_block} ({self.sub_scale_format} sub-scales)")
        if self.scale_format != "none":
            parts.append(f"{self.scale_format} scales")
        if self.scale_method != "absmax":
            parts.append(self.scale_method)
        if self.double_quant:
            parts.append("double-quant")
        if self.mode != "nearest_even":
            parts.append(self.mode)
        if self.activations is not None:
            a = self.activations
            per = (f"per block of {a.group_size}" if a.granularity == "group"
                   else "per tensor" if a.granularity == "tensor" else "per token")
            parts.append(f"activations {a.format.name} dynamic {per}")
        return ", ".join(parts)

    def layout(self, shape) -> tuple[int, int, int, int]:
        """(rows, cols, padded_cols, groups) of the matrix view of a tensor of this shape."""
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        g = self.granularity
        if g == "tensor":
            return 1, numel, numel, 1
        if len(shape) == 0:
            raise ValueError(f"granularity {g!r} needs a tensor with at least one dimension")
        if g == "channel":
            ax = self._axis(len(shape))
            rows = shape[ax]
            cols = numel // rows if rows else 0
            return rows, cols, cols, 1
        cols = shape[-1]
        rows = numel // cols if cols else 0
        gs = self.group_size
        groups = -(-cols // gs)
        return rows, cols, groups * gs, groups

    def _axis(self, ndim: int) -> int:
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"axis {self.axis} is out of range for a {ndim}-d tensor")
        return self.axis % ndim

    def scales_shape(self, shape) -> tuple[int, int]:
        rows, _, _, groups = self.layout(shape)
        return (rows, groups) if self.scale_format != "none" else (0, 0)

    def nbytes(self, shape) -> int:
        """Bytes a QuantizedTensor of this shape holds (codes, scales, zero points, extras)."""
        rows, _, pcols, groups = self.layout(shape)
        n = rows * pcols
        total = code_nbytes(n, self.format.bits)
        if self.scale_format == "none":
            return total
        n_scales = rows * groups
        if self.super_block is not None:
            _, supers, _ = self.super_layout(shape)
            kinds = 2 if self.zero_point == "float" else 1  # scales, and minimums
            sub_bits = self.sub_scale_format_of.bits
            return total + kinds * (-(-n_scales * sub_bits // 8) + rows * supers * _SCALE_BITS[self.scale_format] // 8)
        if self.double_quant:
            blocks = -(-n_scales // DOUBLE_QUANT_BLOCK)
            total += n_scales + 4 * blocks + 4  # int8 codes, fp32 block scales, fp32 offset
        else:
            total += n_scales * _SCALE_BITS[self.scale_format] // 8
        if self.zero_point == "float":
            total += n_scales * _SCALE_BITS[self.scale_format] // 8  # minimums in the scale format
        elif not self.symmetric:
            total += -(-n_scales * self.format.bits // 8)  # zero points packed at element width
        if self.granularity == "nvfp4":
            total += 4  # the float32 tensor scale
        return total

    def bits_per_value(self, shape=None) -> float:
        """Effective storage bits per value, scales and zero points included.

        shape=None gives the large-tensor limit (per-tensor and per-channel overheads vanish):
        NF4 with double quantization 4.127, MXFP4 4.25, NVFP4 4.5, int4 group 128 4.25.
        """
        if shape is not None:
            numel = math.prod(int(s) for s in shape)
            if numel == 0:
                raise ValueError("bits per value of an empty tensor is undefined")
            return self.nbytes(shape) * 8 / numel
        b = float(self.format.bits if self.format.bits <= 8 else 16)
        if self.granularity in ("tensor", "channel") or self.scale_format == "none":
            return b
        gs = self.group_size
        if self.super_block is not None:
            kinds = 2 if self.zero_point == "float" else 1
            return b + kinds * (self.sub_scale_format_of.bits / gs + _SCALE_BITS[self.scale_format] / self.super_block)
        if self.double_quant:
            b += (8 + 32 / DOUBLE_QUANT_BLOCK) / gs
        else:
            b += _SCALE_BITS[self.scale_format] / gs
        if self.zero_point == "float":
            b += _SCALE_BITS[self.scale_format] / gs
        elif not self.symmetric:
            b += self.format.bits / gs
        return b

    def with_(self, **changes) -> QuantScheme:
        """A copy with some fields changed (the name is dropped unless given)."""
        changes.setdefault("name", None)
        return dataclasses.replace(self, **changes)

    # --- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["format"] = _format_spec(self.format)
        d["activations"] = self.activations.to_dict() if self.activations is not None else None
        # fields added after files of format version 1 were first written appear only when used,
        # so a file of a scheme without them stays readable by the fewbits that wrote those files
        for key in _LATER_FIELDS:
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> QuantScheme:
        if not isinstance(d, dict):
            raise TypeError(f"a scheme description must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown scheme fields: {', '.join(sorted(unknown))}")
        d = dict(d)
        d["format"] = _format_from_spec(d.get("format"))
        if d.get("activations") is not None:
            d["activations"] = cls.from_dict(d["activations"])
        return cls(**d)


def _format_spec(fmt: Format):
    """A JSON description of a format: its registered name, or its fields for a custom one."""
    try:
        if get_format(fmt.name) == fmt:
            return fmt.name
    except (ValueError, KeyError):
        pass
    if isinstance(fmt, FloatFormat):
        return {"kind": "float", "exp_bits": fmt.exp_bits, "man_bits": fmt.man_bits, "bias": fmt.bias,
                "specials": fmt.specials, "subnormals": fmt.subnormals, "signed": fmt.signed}
    if isinstance(fmt, IntFormat):
        return {"kind": "int", "bits": fmt.bits, "signed": fmt.signed}
    if isinstance(fmt, LookupFormat):
        return {"kind": "lookup", "name": fmt.name, "values": list(fmt.table)}
    raise TypeError(f"cannot describe format {fmt!r}")


def _format_from_spec(spec) -> Format:
    if isinstance(spec, str):
        return get_format(spec)
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"bad format description {spec!r}")
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "float":
        return FloatFormat(**spec)
    if kind == "int":
        return IntFormat(**spec)
    if kind == "lookup":
        return LookupFormat(spec["name"], values=spec["values"])
    raise ValueError(f"unknown format kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------
def _presets() -> dict[str, QuantScheme]:
    S = QuantScheme
    per_token_int8 = S("int8", "channel", axis=0, name="int8_per_token")
    per_token_fp8 = S("fp8_e4m3", "channel", axis=0, name="fp8_per_token")
    # each token's activations in blocks of 32 columns, as llama.cpp's q8_0 activations
    per_block_int8 = S("int8", "group", group_size=32, name="int8_per_block")
    p = [
        S("int8", "channel", name="int8"),
        S("int8", "tensor", name="int8_tensor"),
        S("uint8", "channel", symmetric=False, name="int8_asym"),
        S("int4", "group", group_size=128, name="int4"),
        S("uint4", "group", group_size=128, symmetric=False, name="int4_asym"),
        S("int4", "group", group_size=32, name="int4_g32"),
        S("uint4", "group", group_size=32, symmetric=False, name="int4_asym_g32"),
        # the weights of the serving engines' W4A16 / W8A16 checkpoints (GPTQ, compressed-tensors):
        # symmetric integers under fp16 scales, which GPTQ stores (int4 / int4_g32 / int8 keep fp32)
        S("int4", "group", group_size=128, scale_format="fp16", name="w4a16"),
        S("int4", "group", group_size=32, scale_format="fp16", name="w4a16_g32"),
        S("int8", "channel", scale_format="fp16", name="w8a16"),
        # GGUF's legacy blocks of 32, quantized bit for bit as gguf.quants.quantize does (scale_method
        # "gguf"): Q8_0 and Q4_0 (an fp16 scale d, w = d * q), Q4_1 and Q5_1 (fp16 d and minimum m,
        # w = d * q + m), Q5_0; fewbits.files.gguf_blocks writes them as GGUF block bytes
        S("int8", "group", group_size=32, scale_format="fp16", scale_method="gguf", name="q8_0"),
        S("int4", "group", group_size=32, scale_format="fp16", scale_method="gguf", name="q4_0"),
        S("uint4", "group", group_size=32, symmetric=False, scale_format="fp16", zero_point="float",
          scale_method="gguf", name="q4_1"),
        S("int5", "group", group_size=32, scale_format="fp16", scale_method="gguf", name="q5_0"),
        S("uint5", "group", group_size=32, symmetric=False, scale_format="fp16", zero_point="float",
          scale_method="gguf", name="q5_1"),
        # GGUF's IQ4_NL: blocks of 32 of llama.cpp's non-linear 4-bit codebook under a signed fp16 scale
        S("iq4_nl", "group", group_size=32, scale_format="fp16", scale_method="gguf", name="iq4_nl"),
        # GGUF's k-quants: super-blocks of 256 values with 4-bit (Q2_K: scales and minimums of groups
        # of 16), 6-bit (Q3_K: signed scales of groups of 16; Q4_K, Q5_K: scales and minimums of
        # groups of 32) or 8-bit (Q6_K: scales of groups of 16) sub-scales under fp16 super-block
        # scales; fewbits chooses the codes (a weighted least-squares scale search, or GPTQ) and
        # fewbits.files.gguf_blocks writes the blocks
        S("uint2", "group", group_size=16, symmetric=False, zero_point="float", scale_format="fp16",
          scale_method="mse", super_block=256, sub_scale_format="uint4", name="q2_k"),
        S("int3", "group", group_size=16, scale_format="fp16", scale_method="mse", super_block=256,
          sub_scale_format="int6", name="q3_k"),
        S("uint4", "group", group_size=32, symmetric=False, zero_point="float", scale_format="fp16",
          scale_method="mse", super_block=256, sub_scale_format="uint6", name="q4_k"),
        S("uint5", "group", group_size=32, symmetric=False, zero_point="float", scale_format="fp16",
          scale_method="mse", super_block=256, sub_scale_format="uint6", name="q5_k"),
        S("int6", "group", group_size=16, scale_format="fp16", scale_method="mse", super_block=256,
          sub_scale_format="int8", name="q6_k"),
        S("int4", "channel", name="int4_channel"),
        S("int3", "group", group_size=64, name="int3"),
        S("int2", "group", group_size=64, name="int2"),
        # bitsandbytes' NF4 (quantize_4bit, blocks of 64): its rounding too, bit for bit
        S("nf4", "group", group_size=64, mode="bitsandbytes", name="nf4"),
        S("nf4", "group", group_size=64, double_quant=True, mode="bitsandbytes", name="nf4_dq"),
        S("fp8_e4m3", "tensor", name="fp8"),
        S("fp8_e4m3", "channel", name="fp8_channel"),
        S("fp8_e5m2", "tensor", name="fp8_e5m2"),
        S("fp8_e4m3", "mx", name="mxfp8"),
        S("fp8_e5m2", "mx", name="mxfp8_e5m2"),
        S("fp6_e3m2", "mx", name="mxfp6"),
        S("fp6_e2m3", "mx", name="mxfp6_e2m3"),
        S("fp4_e2m1", "mx", name="mxfp4"),
        S("fp4_e2m1", "nvfp4", name="nvfp4"),
        S("fp4_e2m1", "group", group_size=32, name="fp4"),
        S("int8", "channel", activations=per_token_int8, name="w8a8"),
        # GGUF Q4_0's weights (the q4_0 preset: 4.5 bits a weight) and dynamic int8 activations in
        # blocks of 32: the integer dot products of llama.cpp's q4_0 x q8_0 (AVX512-VNNI or AVX2,
        # csrc/w4a8.c)
        S("int4", "group", group_size=32, scale_format="fp16", scale_method="gguf", activations=per_block_int8,
          name="w4a8"),
        # FP8 weights per channel and FP8 activations per token, dynamic: FP8 tensor cores
        # (torch._scaled_mm) on GPUs that have them
        S("fp8_e4m3", "channel", activations=per_token_fp8, name="w8a8_fp8"),
        S("bf16", "tensor", scale_format="none", name="bf16"),
        S("fp16", "tensor", scale_format="none", name="fp16"),
    ]
    return {s.name: s for s in p}


_PRESETS = _presets()
_PRESET_ALIASES = {"fp8_tensor": "fp8", "fp8_e4m3": "fp8", "int4_sym": "int4", "nf4_double_quant": "nf4_dq",
                   "nf4dq": "nf4_dq", "int8_channel": "int8", "mxfp6_e3m2": "mxfp6", "mxfp8_e4m3": "mxfp8",
                   "bfloat16": "bf16", "float16": "fp16"}


def _preset_keys() -> tuple[dict[str, str], dict]:
    """Lookup tables of get_scheme(): {normalized preset name or alias: preset} and {format: the
    preset named after it} (int8, nf4, fp8 -> fp8_e4m3, fp4 -> fp4_e2m1, bf16, ...), so that a
    scheme named by any spelling of its format ("e4m3", "float8_e4m3fn") is that preset."""
    keys = {normalize_name(n): n for n in _PRESETS}
    keys.update((normalize_name(a), n) for a, n in _PRESET_ALIASES.items())
    by_format = {}
    for name in _PRESETS:
        try:
            fmt = get_format(name)
        except ValueError:  # mxfp4, int4_g32, ...: not a format's name
            continue
        by_format.setdefault(fmt, name)
    return keys, by_format


_PRESET_KEYS, _FORMAT_PRESETS = _preset_keys()


def list_schemes() -> list[str]:
    """Names of the preset schemes."""
    return list(_PRESETS)


def get_scheme(spec) -> QuantScheme:
    """A preset by name, or a QuantScheme passed through.

    Names follow the format names' spelling rule (fewbits.formats.normalize_name: case,
    spaces, '_', '-' and '.' do not matter), and a format's name or alias names the preset called
    after that format: "e4m3", "FP8 E4M3" and "float8_e4m3fn" are the preset fp8, "e2m1" is fp4.
    A format without a preset of its own (e3m2, fp32) is an error naming the presets that use it.
    """
    if isinstance(spec, QuantScheme):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a scheme is a QuantScheme or a preset name, got {type(spec).__name__}")
    key = normalize_name(spec)
    if key in _PRESET_KEYS:
        return _PRESETS[_PRESET_KEYS[key]]
    try:
        fmt = get_format(spec)
    except ValueError:
        fmt = None
    if fmt is not None and fmt in _FORMAT_PRESETS:
        return _PRESETS[_FORMAT_PRESETS[fmt]]
    if fmt is not None:
        users = [n for n, s in _PRESETS.items() if s.format == fmt]
        hint = (f" Presets with {fmt.name} elements: {', '.join(users)}." if users else
                f" Give a QuantScheme({fmt.name!r}, ...) to quantize to it.")
        raise ValueError(f"unknown quantization scheme {spec!r}: it names the format {fmt.name}, which has no "
                         f"preset of its own.{hint}")
    close = difflib.get_close_matches(key, list(_PRESET_KEYS), n=8, cutoff=0.5)
    names = list(dict.fromkeys(_PRESET_KEYS[c] for c in close))[:4]
    hint = f" Did you mean: {', '.join(names)}?" if names else ""
    raise ValueError(f"unknown quantization scheme {spec!r}.{hint} Presets: {', '.join(_PRESETS)}")
