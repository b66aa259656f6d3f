"""QuantizedTensor and quantize(): element codes packed into bytes for real, with their scales.

Dequantization rule (what a QuantizedTensor means):
- symmetric:   x ~= decode(code) * scale
- asymmetric:  x ~= (q - zero_point) * scale, q on the unsigned grid 0..2^b-1
- float-min:   x ~= q * scale + minimum, q on the unsigned grid (zero_point="float", GGUF Q4_1);
               computed in float32 as two roundings (product, then sum), as gguf-py does
- MX:          x ~= decode(code) * 2^(e8m0 code - 127)
- NVFP4:       x ~= decode(code) * (decode_e4m3(block code) * tensor_scale)
- super-blocks (GGUF k-quants): scale = super_scale * sub-scale code and minimum =
               -(super_minimum * sub-minimum code), each a float32 product, then as above
- plain cast (scale_format "none"): x ~= decode(code)
Elements are computed as round(x * (1 / scale)) in float32 (see fewbits.quant.scales).

quantize() reads top-down: the tensor's group view (to_groups), then one visit to the scales
(scales.scale_groups: the scheme's scale kind chooses the scales, or takes given ones, scales the
elements by them and stores them), then the scaled elements encoded and packed into the codes.
Everything a kind's scales are (chosen, stored, their shapes, read back) lives in its class in
fewbits.quant.scales.
"""
from __future__ import annotations

import math

import torch

from ..formats import FLOAT_DTYPES, IntFormat, LookupFormat
from ..kernels import decode, encode, pack, unpack
from . import scales as sc
from .kquant_search import importance_weights
from .scheme import QuantScheme, get_scheme

_SCALE_DTYPES = sc.SCALE_DTYPES  # scales as stored (the float formats' dtypes; E8M0 / E4M3 codes: uint8)
_PACK_ORDER = sc.PACK_ORDER
STATE_KEYS = ("codes", "scales", "zero_points", "tensor_scale", "dq_codes", "dq_scales", "dq_offset", "minimums",
              "sub_scales", "super_scales", "sub_minimums", "super_minimums")


# ---------------------------------------------------------------------------------------------
# the matrix view of QuantScheme's layout rule
# ---------------------------------------------------------------------------------------------
_MAX_PADDING = 16  # how many times x's size a zero-padded group view may be (beyond 2^20 values)


def check_padding(scheme: QuantScheme, shape, layout=None):
    """Refuse, before anything is allocated, a group longer than a row when padding the rows to
    it would make the group view many times larger than the tensor (group_size=10**9 on an 8x64
    tensor: 8e9 values). A group somewhat longer than a short row (128 on 64) stays allowed.
    layout: scheme.layout(shape), where the caller has it."""
    rows, cols, pcols, _ = layout or scheme.layout(shape)
    if pcols > cols and rows * pcols > max(_MAX_PADDING * rows * cols, 1 << 20):
        raise ValueError(f"group_size {scheme.group_size} is longer than the rows of this {tuple(shape)} tensor "
                         f"({cols} values each): padding each row to one group would make {rows * pcols} values, "
                         f"more than {_MAX_PADDING}x the tensor; use group_size <= {cols}, or "
                         "granularity='channel' for one scale per row")


def to_groups(x: torch.Tensor, scheme: QuantScheme):
    """float32 group view [rows, groups, group_size] (zero-padded) and the mask of real entries
    (None when nothing is padded)."""
    layout = scheme.layout(x.shape)
    check_padding(scheme, x.shape, layout)
    rows, cols, pcols, groups = layout
    g = scheme.granularity
    if g == "tensor":
        m = x.reshape(1, -1)
    elif g == "channel":
        m = x.movedim(scheme._axis(x.dim()), 0).reshape(rows, cols)
    else:
        m = x.reshape(rows, cols)
    m = m.to(torch.float32)
    valid = None
    if pcols != cols:
        m = torch.nn.functional.pad(m, (0, pcols - cols))
        valid = (torch.arange(pcols, device=x.device) < cols).reshape(1, groups, pcols // groups)
    return m.reshape(rows, groups, pcols // groups if groups else 0), valid


def from_groups(g: torch.Tensor, scheme: QuantScheme, shape) -> torch.Tensor:
    """Inverse of to_groups: crop the padding and restore the tensor's shape."""
    rows, cols, pcols, _ = scheme.layout(shape)
    m = g.reshape(rows, pcols)[:, :cols]
    if scheme.granularity == "channel":
        ax = scheme._axis(len(shape))
        moved = (shape[ax],) + tuple(s for i, s in enumerate(shape) if i != ax)
        return m.reshape(moved).movedim(0, ax)
    return m.reshape(shape)


# ---------------------------------------------------------------------------------------------
# QuantizedTensor
# ---------------------------------------------------------------------------------------------
def expected_keys(scheme: QuantScheme) -> tuple[str, ...]:
    """The STATE_KEYS a QuantizedTensor of this scheme holds (those of state_shapes)."""
    return tuple(state_shapes(scheme, (1, 1)))


def state_shapes(scheme: QuantScheme, shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of each tensor a QuantizedTensor of `shape` in this scheme holds (the
    keys of expected_keys(scheme), in that order)."""
    s = scheme
    rows, _, pcols, groups = s.layout(shape)
    n = rows * pcols
    bits = s.format.bits
    out = {"codes": ((-(-n * bits // 8),), torch.uint8) if bits <= 8 else ((n,), torch.int16)}
    if s.scale_format != "none":
        out.update(sc.stored_shapes(s, shape, rows, groups))
    return out


class QuantizedTensor:
    """A tensor stored in a QuantScheme: packed codes, scales, zero points. See the module doc.

    codes: uint8 bytes of the packed element codes (formats of up to 8 bits; low-first order),
        or int16 bit patterns (16-bit formats), over the padded [rows, padded_cols] matrix.
    scales: [rows, groups] in the scheme's scale format (float tensors for fp32/fp16/bf16,
        uint8 codes for e8m0/e4m3); None for a plain cast.
    zero_points: packed uint8 zero points at the element width (asymmetric schemes with
        integer zero points).
    minimums: [rows, groups] float minimums in the scale format's dtype (zero_point="float").
    tensor_scale: float32 scalar (NVFP4).
    dq_codes, dq_scales, dq_offset: the double-quantized scales (scales is None then).
    sub_scales, super_scales (super-block schemes, GGUF k-quants; scales is None then): the group
        scales' codes in the sub-scale format, packed (low-first) over [rows, groups], and the
        super-block scales [rows, super-blocks] in the scale format's dtype.
    sub_minimums, super_minimums: the same for the float minimums (zero_point="float"; minimums
        is None then): minimum = -(super_minimum * code).
    """

    def __init__(self, scheme: QuantScheme, shape, dtype: torch.dtype, codes: torch.Tensor,
                 scales=None, zero_points=None, tensor_scale=None, dq_codes=None, dq_scales=None,
                 dq_offset=None, minimums=None, sub_scales=None, super_scales=None, sub_minimums=None,
                 super_minimums=None):
        self.scheme = get_scheme(scheme)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.codes = codes
        self.scales = scales
        self.zero_points = zero_points
        self.tensor_scale = tensor_scale
        self.dq_codes, self.dq_scales, self.dq_offset = dq_codes, dq_scales, dq_offset
        self.minimums = minimums
        self.sub_scales, self.super_scales = sub_scales, super_scales
        self.sub_minimums, self.super_minimums = sub_minimums, super_minimums
        self._validate()

    # --- construction checks (also guard loading from files) --------------------------------
    def _validate(self):
        s = self.scheme
        shapes = state_shapes(s, self.shape)
        extra = [k for k in STATE_KEYS if k not in shapes and getattr(self, k) is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} not used by scheme {s.label}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be a float dtype, got {self.dtype}")
        for name, (shape, dtype) in shapes.items():
            t = getattr(self, name)
            if t is None:
                raise ValueError(f"{name} is missing for scheme {s.label}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)} for shape {tuple(self.shape)} "
                                 f"in {s.label}; got {t.dtype} of shape {tuple(t.shape)}")

    @classmethod
    def empty(cls, scheme, shape, dtype: torch.dtype = torch.float32, device="meta") -> QuantizedTensor:
        """A QuantizedTensor of this scheme, shape and dtype whose tensors are uninitialized (on the
        meta device by default: a skeleton's placeholder, filled by a quantized module's
        load_state_dict)."""
        scheme = get_scheme(scheme)
        tensors = {k: torch.empty(sh, dtype=dt, device=device) for k, (sh, dt) in state_shapes(scheme, shape).items()}
        return cls(scheme, shape, dtype, **tensors)

    @classmethod
    def from_int_codes(cls, scheme, shape, dtype: torch.dtype, values: torch.Tensor, scales: torch.Tensor,
                       zero_points: torch.Tensor | None = None) -> QuantizedTensor:
        """The QuantizedTensor of an integer scheme (granularity "channel" along axis 0, or
        "group" whose groups divide the width) holding these integer values [rows, cols] (int4:
        -8..7; asymmetric uint4: 0..15), float scales [rows, groups] and, asymmetric, integer zero
        points [rows, groups]: another format's codes taken as they are (the inverse of int_codes,
        scale_values and zero_point_values). A ValueError for values or zero points outside the
        format, or scales the scheme's scale format does not hold exactly."""
        s = get_scheme(scheme)
        fmt = s.format
        if not isinstance(fmt, IntFormat) or s.super_block is not None or s.zero_point == "float" \
                or s.double_quant or s.granularity not in ("channel", "group") or \
                (s.granularity == "channel" and s.axis != 0):
            raise ValueError(f"from_int_codes() takes integer codes with per-row or per-group scales, not {s.label}")
        rows, cols, pcols, groups = s.layout(shape)
        if pcols != cols or len(shape) != 2:
            raise ValueError(f"from_int_codes() takes a matrix whose width is whole groups; {list(shape)} in {s.label}")
        values = torch.as_tensor(values)
        if tuple(values.shape) != (rows, cols) or values.dtype.is_floating_point:
            raise ValueError(f"values must be integers of shape {(rows, cols)}, got {values.dtype} {tuple(values.shape)}")
        lo, hi = int(fmt.lowest), int(fmt.max)
        if values.numel() and (int(values.min()) < lo or int(values.max()) > hi):
            raise ValueError(f"values outside {fmt.name} ({lo}..{hi}): {int(values.min())}..{int(values.max())}")
        scales = torch.as_tensor(scales)
        if tuple(scales.shape) != (rows, groups) or not scales.dtype.is_floating_point:
            raise ValueError(f"scales must be floats of shape {(rows, groups)}, got {scales.dtype} "
                             f"{tuple(scales.shape)}")
        if not bool(torch.isfinite(scales).all()):
            raise ValueError("scales that are not finite (inf or NaN)")
        stored = scales.to(sc.SCALE_DTYPES[s.scale_format])
        if not torch.equal(stored.to(torch.float64), scales.to(torch.float64)):
            raise ValueError(f"scales that {s.scale_format} does not hold exactly")
        # an integer's code is its two's-complement bit pattern (what encode gives), made here
        # with integer operations: a byte a value, not float64 (a large layer's read stays small)
        codes = (values.reshape(-1) & ((1 << fmt.bits) - 1)).to(torch.uint8)
        parts = {"scales": stored.contiguous()}
        if not s.symmetric:
            if zero_points is None:
                raise ValueError(f"{s.label} is asymmetric: zero points are needed")
            zero_points = torch.as_tensor(zero_points)
            if tuple(zero_points.shape) != (rows, groups) or zero_points.dtype.is_floating_point:
                raise ValueError(f"zero points must be integers of shape {(rows, groups)}")
            if zero_points.numel() and (int(zero_points.min()) < lo or int(zero_points.max()) > hi):
                raise ValueError(f"zero points outside {fmt.name} ({lo}..{hi})")
            parts["zero_points"] = pack(zero_points.reshape(-1).to(torch.uint8), fmt.bits, order=_PACK_ORDER)
        elif zero_points is not None:
            raise ValueError(f"{s.label} is symmetric: no zero points")
        return cls(s, shape, dtype, pack(codes, fmt.bits, order=_PACK_ORDER), **parts)

    # --- views ------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _layout(self):
        return self.scheme.layout(self.shape)

    def element_codes(self) -> torch.Tensor:
        """Unpacked element codes (the format's bit patterns, int64) [rows, groups, group_size]."""
        rows, _, pcols, groups = self._layout()
        n = rows * pcols
        bits = self.scheme.format.bits
        if bits <= 8:
            c = unpack(self.codes, bits, n, order=_PACK_ORDER).to(torch.int64)
        else:
            c = self.codes.to(torch.int64) & 0xFFFF
        return c.reshape(rows, max(groups, 1), pcols // max(groups, 1) if n else 0)

    def int_codes(self) -> torch.Tensor:
        """Element values as integers [rows, padded_cols] (integer formats: int4 gives -8..7,
        asymmetric uint4 0..15)."""
        if not isinstance(self.scheme.format, IntFormat):
            raise TypeError(f"int_codes() is for integer formats; {self.scheme.format.name} has codes, "
                            "use element_codes()")
        rows, _, pcols, _ = self._layout()
        return decode(self.element_codes(), self.scheme.format).to(torch.int64).reshape(rows, pcols)

    def zero_point_values(self) -> torch.Tensor | None:
        """Integer zero points [rows, groups] (asymmetric schemes), else None."""
        if self.zero_points is None:
            return None
        rows, _, _, groups = self._layout()
        bits = self.scheme.format.bits
        return unpack(self.zero_points, bits, rows * groups, order=_PACK_ORDER).to(torch.int64).reshape(rows, groups)

    def minimum_values(self) -> torch.Tensor | None:
        """Float32 minimums [rows, groups] (zero_point="float" schemes), else None. Super-block
        schemes: -(super_minimum * code), the float32 product GGUF's dequantization subtracts."""
        if self.scheme.scale_format == "none":
            return None
        rows, _, _, groups = self._layout()
        return sc.minimum_values(self, rows, groups)

    def sub_scale_codes(self, minimums: bool = False) -> torch.Tensor:
        """The integer sub-scale codes [rows, groups] (int64, in the sub-scale format: int8 gives
        -128..127) of a super-block scheme; minimums=True: those of the minimums."""
        s = self.scheme
        if s.super_block is None:
            raise TypeError(f"sub_scale_codes() is for super-block schemes, not {s.label}")
        rows, _, _, groups = self._layout()
        packed = self.sub_minimums if minimums else self.sub_scales
        if packed is None:
            raise ValueError(f"{s.label} has no float minimums")
        return sc.SuperBlockScales.sub_codes(s, packed, rows, groups)

    def scale_values(self) -> torch.Tensor | None:
        """Float32 scales [rows, groups] that multiply the element values (after double-quant)."""
        if self.scheme.scale_format == "none":
            return None
        rows, _, _, groups = self._layout()
        return sc.scale_values(self, rows, groups)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values this tensor stands for, in `dtype` (default: the original dtype)."""
        dtype = dtype or self.dtype
        s = self.scheme
        if s.scale_format == "none":
            v = decode(self.element_codes().reshape(-1), s.format, dtype=torch.float32)
            return v.reshape(self.shape).to(dtype)
        v = decode(self.element_codes(), s.format, dtype=torch.float32)
        zp = self.zero_point_values()
        if zp is not None:
            v = v - zp.unsqueeze(-1).to(torch.float32)
        v = v * self.scale_values().unsqueeze(-1)
        mins = self.minimum_values()
        if mins is not None:
            v = v + mins.unsqueeze(-1)
        return from_groups(v, s, self.shape).to(dtype)

    # --- sizes ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by name (the keys of STATE_KEYS that are present)."""
        return {k: getattr(self, k) for k in STATE_KEYS if getattr(self, k) is not None}

    @classmethod
    def from_state_dict(cls, scheme, shape, dtype, tensors: dict) -> QuantizedTensor:
        unknown = set(tensors) - set(STATE_KEYS)
        if unknown:
            raise ValueError(f"unknown quantized-tensor entries: {', '.join(sorted(unknown))}")
        return cls(scheme, shape, dtype, **{k: tensors.get(k) for k in STATE_KEYS})

    @property
    def nbytes(self) -> int:
        """Bytes actually held (codes, scales, zero points, tensor scale, double-quant pieces)."""
        return sum(t.nbytes for t in self.state_dict().values())

    @property
    def bits_per_value(self) -> float:
        return self.nbytes * 8 / self.numel if self.numel else float("nan")

    def to(self, device) -> QuantizedTensor:
        return QuantizedTensor(self.scheme, self.shape, self.dtype,
                               **{k: (v.to(device) if v is not None else None)
                                  for k, v in ((k, getattr(self, k)) for k in STATE_KEYS)})

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def __repr__(self) -> str:
        return (f"QuantizedTensor(shape={tuple(self.shape)}, scheme={self.scheme.label!r}, "
                f"nbytes={self.nbytes}, bits_per_value={self.bits_per_value:.3f})")


_CODE_CHUNK = 1 << 20  # element codes unpacked at a time by the range check


def stored_problem(qt: QuantizedTensor) -> str | None:
    """Why a QuantizedTensor read from a file cannot stand for a tensor, or None: element codes
    outside their format (codes_outside_format), or a scale, minimum or tensor scale that is NaN
    or infinite (quantize() never stores one: a crafted file's NaN scale would load, then turn
    every output it touches into NaN)."""
    problem = codes_outside_format(qt)
    if problem:
        return problem
    for key, t in qt.state_dict().items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return f"its {key} hold NaN or infinite values"
    return None


def codes_outside_format(qt: QuantizedTensor) -> str | None:
    """Why the element codes do not all name values of the scheme's format, or None. Only a
    codebook with fewer than 2^bits values, or a format of 9 to 15 bits stored in 16-bit
    words, leaves bit patterns that are no code; a file that held them would load, then give
    NaN in some kernels and raise in dequantize()."""
    fmt = qt.scheme.format
    bits = fmt.bits
    limit = fmt.num_values if isinstance(fmt, LookupFormat) else 2 ** bits
    if bits > 8:
        limit = min(limit, 2 ** 16)
        if limit == 2 ** 16:
            return None
        for start in range(0, qt.codes.numel(), _CODE_CHUNK):
            top = int((qt.codes[start:start + _CODE_CHUNK].to(torch.int32) & 0xFFFF).max())
            if top >= limit:
                return f"code {top} is outside the format {fmt.name} (codes 0..{limit - 1})"
        return None
    if limit >= 2 ** bits:
        return None
    rows, _, pcols, _ = qt.scheme.layout(qt.shape)
    n = rows * pcols
    per = math.lcm(bits, 8) // bits  # codes per run of whole bytes
    step = max(per, _CODE_CHUNK // per * per)
    for start in range(0, n, step):
        count = min(step, n - start)
        first = start * bits // 8
        top = int(unpack(qt.codes[first:first + -(-count * bits // 8)], bits, count, order=_PACK_ORDER).max())
        if top >= limit:
            return f"code {top} is outside the codebook {fmt.name} of {limit} values"
    return None


# ---------------------------------------------------------------------------------------------
# quantize: scheme -> scale kind -> scales -> codes
# ---------------------------------------------------------------------------------------------
def quantize(x: torch.Tensor, scheme, scales: torch.Tensor | None = None,
             zero_points: torch.Tensor | None = None, importance: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize a float tensor to a QuantizedTensor under `scheme` (a QuantScheme or preset name).

    scales / zero_points: use these float32 scales (and integer zero points; for
    zero_point="float" schemes, float minimums) of shape scheme.scales_shape(x.shape) instead
    of choosing them (as GPTQ does, group by group); scales and minimums are rounded to the
    scheme's scale format. Not for MX/NVFP4, whose scales are fixed by their recipes.
    importance: importance-weighted rounding: a non-negative float tensor [x.shape[-1]], how much
    an error in each input column costs (a linear layer's mean square input on calibration data,
    fewbits.quant.importance); each group's scales are then searched on the error weighted by
    it (scales.choose, kquant_search.importance_weights). For the integer block formats (not
    MX/NVFP4 or plain casts), with granularity "group", or "channel" along axis 0 of a matrix.
    """
    scheme = get_scheme(scheme)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize() takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize() takes a float tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    x = x.detach()
    if importance is not None and not takes_importance(scheme, x.shape):
        importance_view(importance, scheme, x.shape)  # the error that says why
    gen = rounding_generator(scheme, x.device)
    if scheme.scale_format == "none":  # a plain cast: the codes are the values' own bit patterns
        fmt = scheme.format
        codes = encode(x.reshape(-1), fmt, mode=scheme.mode, generator=gen)
        stored = codes.to(torch.int16) if fmt.bits > 8 else pack(codes.to(torch.uint8), fmt.bits, order=_PACK_ORDER)
        return QuantizedTensor(scheme, x.shape, x.dtype, stored)
    _check_finite(x)
    g, valid = to_groups(x, scheme)
    weights = None
    if importance is not None:
        weights = importance_weights(g, valid, importance_view(importance, scheme, x.shape))
    y, stored = sc.scale_groups(g, valid, scheme, x.shape, scales, zero_points, weights=weights)
    return _encoded(x, scheme, y, stored, gen)


def takes_importance(scheme, shape) -> bool:
    """Whether quantize(x, scheme, importance=...) weighs a tensor of `shape` (see quantize)."""
    scheme = get_scheme(scheme)
    if scheme.scale_format == "none" or not sc.kind_of(scheme).weighted:
        return False
    return scheme.granularity == "group" or (
        scheme.granularity == "channel" and len(tuple(shape)) == 2 and scheme._axis(2) == 0)


def importance_view(importance: torch.Tensor, scheme: QuantScheme, shape) -> torch.Tensor:
    """The importance of x's columns (a tensor [shape[-1]]) as the group view of a tensor of
    `shape` lays them out: float64 [1, groups, group_size], padding 0. Checked: finite and
    non-negative, not all zero, one per column; granularity "group", or "channel" along axis 0
    of a matrix (where the view's columns are x's last dimension)."""
    if not isinstance(importance, torch.Tensor):
        raise TypeError(f"importance must be a torch.Tensor, got {type(importance).__name__}")
    shape = tuple(shape)
    if scheme.scale_format == "none" or not sc.kind_of(scheme).weighted:
        raise ValueError(f"{scheme.label}: its scales are fixed by its recipe (or it has none); importance-"
                         "weighted rounding searches the scales of the integer block formats")
    if not takes_importance(scheme, shape):
        raise ValueError(f"{scheme.label}: importance weights the input columns of a matrix; they go with "
                         "granularity 'group', or 'channel' along axis 0 of a 2-d tensor, not "
                         f"{scheme.granularity!r} on a {len(shape)}-d tensor")
    if importance.dim() != 1 or importance.numel() != shape[-1]:
        raise ValueError(f"importance must hold one value per input column: shape ({shape[-1]},), "
                         f"got {tuple(importance.shape)}")
    imp = importance.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError("importance must be finite and non-negative")
    if imp.numel() and not bool((imp > 0).any()):
        raise ValueError("importance is zero in every column: there is nothing to weigh the error by")
    rows, cols, pcols, groups = scheme.layout(shape)
    imp = torch.nn.functional.pad(imp, (0, pcols - cols))
    return imp.reshape(1, groups, pcols // groups if groups else 0)


def quantize_scaled(x: torch.Tensor, scheme, scaling: sc.Scaling) -> QuantizedTensor:
    """quantize(x, scheme) under a given Scaling of x's group view (as scales.choose returns it):
    GPTQ assembles one for super-block schemes from the scalings it chose super-block by
    super-block. The Scaling is trusted to fit the scheme and shape; the result is validated."""
    scheme = get_scheme(scheme)
    _check_finite(x)
    x = x.detach()
    g, _ = to_groups(x, scheme)
    y, stored = sc.scale_groups(g, None, scheme, x.shape, scaling=scaling)
    return _encoded(x, scheme, y, stored, rounding_generator(scheme, x.device))


def _encoded(x, scheme: QuantScheme, y: torch.Tensor, scale_parts: dict, gen) -> QuantizedTensor:
    """The QuantizedTensor of x whose scaled elements are y (its group view, scaled): y rounded to
    the element codes and packed, beside the scale tensors its scale kind stores."""
    fmt = scheme.format
    bits = fmt.bits
    codes = encode(y, fmt, mode=scheme.mode, overflow="saturate", generator=gen).reshape(-1)
    stored = pack(codes, bits, order=_PACK_ORDER) if bits <= 8 else codes.to(torch.int16)
    return QuantizedTensor(scheme, x.shape, x.dtype, stored, **scale_parts)


def _check_finite(x: torch.Tensor) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or inf, which a scaled quantization cannot represent")


def rounding_generator(scheme: QuantScheme, device) -> torch.Generator | None:
    """The generator quantize() draws stochastic rounding from: a fresh one seeded with
    scheme.seed (None unless the scheme rounds stochastically)."""
    if scheme.mode != "stochastic":
        return None
    return torch.Generator(device=device).manual_seed(scheme.seed)
