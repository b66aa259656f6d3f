"""Quantized inference modules: QuantLinear and QuantEmbedding.

A QuantLinear holds its weight as a QuantizedTensor (`.qweight`, packed codes for real) and runs
the fastest path torch offers on this CPU for the scheme, chosen once at construction
(`.kernel`):

=============  ==================================================================================
kernel         schemes and arithmetic (see fewbits.quant.lowbit_ops for each kernel's contract)
=============  ==================================================================================
int4pack       int4 sym / uint4 asym (integer zero point or float minimum), groups of a multiple
               of 32 (or per channel / tensor): torch's packed int4 matmul; bfloat16
               activations, bfloat16 (scale, zero) pairs. Chosen where dequant's C kernels
               cannot read the parameters as stored (q4_k's two-level scales) or are not built.
int8pack       int8 weight-only, per channel or tensor, in_features % 16 == 0: up to
               LUT4_MAX_BATCH rows fewbits' C kernel (csrc/int8w.c: each output's float32 sum
               of code times x, times the row's float32 scale), or without the native library
               torch's int8 weight matmul (bfloat16 activations and scales);
               larger float32 batches on CPUs with hardware bf16 (bf16_blocks): the int8 codes
               as bfloat16 (exact) times bf16 activations -- on AMX tiles where the build has
               them and tile_batch allows (csrc/tiles.h: 32 rows of codes at a time, float32
               sums times the float32 row scales), else in oneDNN's bf16 GEMM (the sums rounded
               to bf16, then times the scales).
w8a8_amx       int8 weights + dynamic per-token (or per-tensor) int8 activations on CPUs with AMX
               (native.Int8Panels, csrc/int8mm.c): the weight packed once into AMX panels (its
               only copy), batches on the int8 tiles (TDPBSSD), one row with VNNI dot products
               over the same panels; exact int32 sums, y = (float(sum) * sx) * sw (+ bias), the
               same float32 steps for a row and a batch.
w8a8_vnni      the same on CPUs with AVX512-VNNI but without AMX (AMD Zen 4, Intel Ice Lake): the
               same panels and one-row kernel, batches with the same VNNI dot products row by row
               (fb_vnni_gemm_u8), 8 rows per pass over a panel; the same bits as w8a8_amx.
w8a8_onednn    int8 weights + dynamic per-token (or per-tensor) int8 activations: exact int32
w8a8_int_mm    products (oneDNN's prepacked int8 GEMM, or torch._int_mm), one float32 rescale;
               only on CPUs where they are exact (cpu_int8_gemm_exact: not without VNNI).
w8a8_fp8       E4M3 weights per channel + dynamic E4M3 activations per token (w8a8_fp8): the codes
               as quantize() makes them, multiplied by torch._scaled_mm with the two float32
               scale vectors (float32 sums, one rounding): FP8 tensor cores on CUDA compute
               capability 8.9+, where auto picks it; on a CPU only when asked for (torch's
               CPU _scaled_mm is a slow reference loop; auto picks dequant there).
w4a8           int4 weights (or uint4 with a float minimum) in groups of 32 + dynamic int8
               activations in blocks of 32 (w4a8; llama.cpp's q4_0 x q8_0 kind), up to
               W4A8_MAX_BATCH rows: the activations quantized and the products of codes summed
               exactly in int32 in one C call (csrc/w4a8.c: AVX512-VNNI or AVX2), one float32
               rescale per 8 columns; on CPUs where that C kernel is vectorized. Larger batches: the
               activations quantized and dequantized the same way, then dequant's blocks (in
               bfloat16 where bf16_blocks, as for weight-only layers).
bf16           bf16 plain cast: oneDNN's bfloat16 GEMM; bfloat16 activations.
dequant        everything else (nf4, int4, q4_0, q4_1, fp8, mx*, nvfp4, int2/3, fp16, ...): the
               codes are decoded and scaled in float32 (exactly QuantizedTensor.dequantize()) a
               block of output rows at a time, each block multiplied at once, so no whole float
               weight exists. 4-bit schemes with per-group parameters use C kernels where a C
               compiler is there (fewbits.kernels.native, csrc/lut4.c; the same float32
               arithmetic): up to LUT4_MAX_BATCH rows a fused matmul that decodes the codes in
               registers (float32 products and sums; for one row on AVX-512 with groups of 16 to
               64, table values times x summed per 8 columns of a group, then times the scale),
               larger batches blocks decoded by C. Larger
               float32 batches on CPUs with hardware bf16 (bf16_blocks) multiply
               bf16(dequantize()) (round to nearest even) with bf16 activations: on AMX tiles
               where the build has them and tile_batch allows (csrc/tiles.h: 32 rows decoded at
               a time into the caches, float32 sums, float32 result; bf16 subnormals read as
               zero), else blocks in oneDNN's bf16 GEMM, float32 accumulation, the result
               rounded to bf16.
dequant_fp32   dequant with float32 blocks at every batch size (the exact path on every CPU).
=============  ==================================================================================

On CUDA (the module moved with .to("cuda"), or built from a weight there) the kernels are
w8a8_int_mm (cuBLASLt's int8 GEMM; fewer than 17 rows are padded), bf16 (cuBLAS) and dequant;
`available_kernels(scheme, shape, device)` lists them, and moving the module back to the CPU
picks the CPU's kernel again.

Every kernel is checked in tests against the slow reference `reference_forward(x)` =
`F.linear(x, qweight.dequantize(x.dtype), bias)` (for w8a8, with the activations quantized and
dequantized by fewbits.quant.quantize). Where a kernel keeps the codes in its own layout
(int4pack, w8a8_onednn), `.qweight` holds no second copy: its `codes` are derived from that
layout when read, bit-identical to the codes quantize() produced. `.nbytes` counts every byte
the module holds for its weight, kernel-side extras included (e.g. the bfloat16 scale pairs).

State: `module.state_dict()` holds the quantized weight as `qweight.<key>` for each key of its
QuantizedTensor.state_dict() (codes, scales, zero_points, ...), plus `bias`; `load_state_dict()`
restores it exactly (validated first, the kernel layout rebuilt). `QuantLinear.empty(scheme,
shape, dtype, bias=...)` / `QuantEmbedding.empty(...)` build a module with no data on the meta
device, for a model skeleton that load_state_dict() fills.

The modules are for inference: their weights are not parameters. With gradients wanted for
the input (x.requires_grad under grad mode) a QuantLinear runs the reference path, which is
differentiable in x.
"""
from __future__ import annotations

import functools
import itertools
import math
import sys
import types
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import IntFormat, get_format
from ..kernels import int8 as kernels_int8, native
from . import lowbit_ops as ops
from . import scales as sc
from .scheme import QuantScheme, get_scheme
from .tensor import STATE_KEYS, QuantizedTensor, expected_keys, quantize, stored_problem

KERNELS = ("int4pack", "int8pack", "w8a8_amx", "w8a8_vnni", "w8a8_onednn", "w8a8_int_mm", "w8a8_fp8", "w4a8", "bf16", "dequant", "dequant_fp32")
PANEL_KERNELS = ("w8a8_amx", "w8a8_vnni")  # int8mm.c's panels (native.Int8Panels): no torch-op form
QWEIGHT = "qweight"  # state-dict entries of the quantized weight: <module>.qweight.<QuantizedTensor key>
# values decoded per block on the dequant path (8 MiB of float32; bfloat16 blocks twice as many
# values, 8 MiB). Blocks of 2^18 values (1 MiB) left batches of 16-256 rows of 4096-wide layers
# at 2.0-3.0x fp32 and made 4x as many GEMM calls; these reach 2.5-4.8x (benchmarks/bench_linear.py)
_ROW_BLOCK_VALUES = 1 << 21


# ---------------------------------------------------------------------------------------------
# a QuantizedTensor as a kernel holds it
# ---------------------------------------------------------------------------------------------
def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != torch.strided or b.layout != torch.strided:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class KernelQuantizedTensor(QuantizedTensor):
    """A QuantizedTensor held the way a fast kernel wants it.

    It has the scheme, shape, scales and zero points of the tensor it was built from, plus the
    kernel's own tensors (`kernel_tensors`). When the kernel's layout already holds the element
    codes (`codes_from_kernel` given), no second copy is kept: reading `.codes` derives them
    (bit-identical to the original), which costs a pass over the weight. `nbytes` is every byte
    held: the scheme's tensors except derived codes, plus kernel tensors that are not views of
    them (`kernel_nbytes` overrides the size of tensors whose bytes torch cannot see, such as
    oneDNN's opaque prepacked weights).
    """

    def __init__(self, qt: QuantizedTensor, kernel_tensors: dict[str, torch.Tensor],
                 codes_from_kernel: Callable[[dict], torch.Tensor] | None = None,
                 kernel_nbytes: dict[str, int] | None = None):
        # the source tensor was validated when it was built; nothing here changes its meaning
        self.scheme, self.shape, self.dtype = qt.scheme, qt.shape, qt.dtype
        for key in STATE_KEYS:
            if key != "codes":
                setattr(self, key, getattr(qt, key))
        self._stored_codes = None if codes_from_kernel is not None else qt.codes
        self._codes_from_kernel = codes_from_kernel
        self.kernel_tensors = dict(kernel_tensors)
        self._kernel_nbytes = dict(kernel_nbytes or {})

    @property
    def codes(self) -> torch.Tensor:
        if self._stored_codes is not None:
            return self._stored_codes
        return self._codes_from_kernel(self.kernel_tensors)

    @property
    def codes_derived(self) -> bool:
        """True when the codes live only in the kernel's layout."""
        return self._stored_codes is None

    def _held(self) -> list[torch.Tensor]:
        held = [getattr(self, k) for k in STATE_KEYS if k != "codes" and getattr(self, k) is not None]
        if self._stored_codes is not None:
            held.append(self._stored_codes)
        return held

    @property
    def nbytes(self) -> int:
        held = self._held()
        total = sum(t.nbytes for t in held)
        for name, t in self.kernel_tensors.items():
            if name in self._kernel_nbytes:
                total += self._kernel_nbytes[name]
            elif not any(_same_storage(t, h) for h in held):
                total += t.nbytes
        return total

    def plain(self) -> QuantizedTensor:
        """A plain QuantizedTensor with the same state (codes materialized)."""
        return QuantizedTensor.from_state_dict(self.scheme, self.shape, self.dtype, self.state_dict())

    def __reduce__(self):
        # copies and pickles are plain QuantizedTensors: kernel layouts (oneDNN's opaque
        # tensors among them) belong to this process and are rebuilt by the module
        return QuantizedTensor.from_state_dict, (self.scheme, self.shape, self.dtype, self.state_dict())


# ---------------------------------------------------------------------------------------------
# decoding rows of a weight (the dequantize-on-the-fly path and embedding lookups)
# ---------------------------------------------------------------------------------------------
class _RowDecoder:
    """Decodes output rows r of a 2-d QuantizedTensor [R, C] whose codes lie row by row
    (granularity tensor, channel on axis 0, group, mx, nvfp4), with the arithmetic of
    QuantizedTensor.dequantize(): float32 decode, minus zero point, times scale, plus float
    minimum."""

    def __init__(self, qt: QuantizedTensor):
        s = qt.scheme
        rows, cols = qt.shape
        self.qt, self.fmt, self.rows, self.cols = qt, s.format, rows, cols
        self.row_len, self.groups = self.row_layout(s, qt.shape)
        self.group_len = self.row_len // self.groups if self.groups else 0
        bits = self.fmt.bits
        self.row_bytes = (self.row_len * bits // 8) if bits <= 8 and (self.row_len * bits) % 8 == 0 else None
        self.lut4 = self.lut4_shape(s, qt.shape)

    @staticmethod
    def row_layout(s: QuantScheme, shape) -> tuple[int, int]:
        """(codes per row, groups per row) of a 2-d weight's codes."""
        _, _, pcols, groups = s.layout(tuple(shape))
        return (int(shape[1]), 1) if s.granularity in ("tensor", "channel") else (pcols, groups)

    @staticmethod
    def lut4_shape(s: QuantScheme, shape) -> bool:
        """Whether fewbits' 4-bit C kernels can read this weight's codes (4-bit codes, rows of a
        multiple of 32 in groups of a multiple of 16, any zero point or minimum per group)."""
        if s.format.bits != 4 or len(shape) != 2 or s.scale_format == "none":
            return False
        row_len, groups = _RowDecoder.row_layout(s, shape)
        return bool(groups) and native.lut4_supported(row_len, row_len // groups)

    @staticmethod
    def lut4_params_held(s: QuantScheme) -> bool:
        """Whether the C kernels read this scheme's scales (and minimums) as the QuantizedTensor
        stores them (float32 / float16 / bfloat16 values, or MX / NVFP4 byte codes): nothing is
        derived that would cost memory or time per call (zero points, small, excepted)."""
        plain = s.scale_format in ("fp32", "fp16", "bf16") and s.granularity in ("group", "channel", "tensor")
        coded = s.granularity in ("mx", "nvfp4")
        return not s.double_quant and s.super_block is None and (plain or coded)

    def coded_scales(self):
        """(byte codes [rows, groups], float32 table [256], multiplier) for MX and NVFP4 scales,
        whose values are table[code] * multiplier with dequantize()'s arithmetic; else None."""
        s = self.qt.scheme
        if s.double_quant or s.granularity not in ("mx", "nvfp4"):
            return None
        if getattr(self, "_scale_table", None) is None:
            every = torch.arange(256, dtype=torch.uint8)
            self._scale_table = (sc.mx_scale_values(every, s) if s.granularity == "mx"
                                 else sc.nvfp4_scale_values(every, torch.ones((), dtype=torch.float32)))
        mul = 1.0 if s.granularity == "mx" else float(self.qt.tensor_scale)
        return self.qt.scales, self._scale_table, mul

    @staticmethod
    def supports(qt: QuantizedTensor) -> bool:
        s = qt.scheme
        if len(qt.shape) != 2:
            return False
        return s.granularity != "channel" or s._axis(2) == 0

    def params(self):
        """(scales [rows or 1, groups] float32 or None, offsets), computed once per call (they
        are small next to the codes). offsets = (integer zero points [rows, groups] float32 or
        None, float minimums [rows, groups] float32 or None)."""
        scales = self.qt.scale_values()
        zps = self.qt.zero_point_values()
        return scales, (zps.to(torch.float32) if zps is not None else None, self.qt.minimum_values())

    def _finish(self, v: torch.Tensor, scales, offsets, rows_index) -> torch.Tensor:
        zps, mins = offsets
        n = v.numel() // self.row_len if self.row_len else 0
        v = v.view(n, self.groups, self.group_len)
        if zps is not None:  # per-tensor parameters have one row, shared by all
            v.sub_((zps if zps.shape[0] == 1 else zps[rows_index]).unsqueeze(-1))
        if scales is not None:
            v.mul_((scales if scales.shape[0] == 1 else scales[rows_index]).unsqueeze(-1))
        if mins is not None:
            v.add_((mins if mins.shape[0] == 1 else mins[rows_index]).unsqueeze(-1))
        return v.view(n, self.row_len)[:, : self.cols]

    def block(self, r0: int, r1: int, scales, zps) -> torch.Tensor:
        """float32 rows r0..r1 [r1 - r0, cols] (a view into a fresh buffer)."""
        v = ops.decode_codes(self.qt.codes, self.fmt, (r1 - r0) * self.row_len, r0 * self.row_len)
        return self._finish(v, scales, zps, slice(r0, r1))

    def gather(self, index: torch.Tensor, scales, zps) -> torch.Tensor:
        """float32 rows at `index` (int64 [n]) -> [n, cols]."""
        if self.fmt.bits > 8:
            c = self.qt.codes.view(self.rows, self.row_len)[index].reshape(-1)
            v = ops.decode_codes(c, self.fmt, c.numel())
        elif self.row_bytes is not None:
            c = self.qt.codes.view(self.rows, self.row_bytes)[index].reshape(-1)
            v = ops.decode_codes(c, self.fmt, index.numel() * self.row_len)
        else:  # rows do not start on whole bytes: decode each distinct row once
            uniq, inverse = torch.unique(index, return_inverse=True)
            decoded = [ops.decode_codes(self.qt.codes, self.fmt, self.row_len, int(r) * self.row_len) for r in uniq]
            table = torch.stack(decoded) if decoded else torch.empty(0, self.row_len, device=index.device)
            v = table[inverse].reshape(-1)
        return self._finish(v, scales, zps, index)


# up to this many rows of x the w4a8 kernel (4 rows per pass over the codes); larger batches:
# dequant's blocks, faster from about 12-16 rows (1536 x 576 and 4096 x 4096 layers, 1 and 2 threads)
W4A8_MAX_BATCH = 12
LUT4_MAX_BATCH = 8  # up to this many rows of x the fused 4-bit matmul (one pass over the codes)
# bf16 batches on AMX tiles over blocks decoded in the caches (lut4.c's fb_lut4_tile_matmul,
# int8w.c's) up to this many rows x in_features: x's bf16 pairs, which every block of weight rows
# reads, within 1 MiB of the core's 2 MiB L2. Beyond, oneDNN's bf16 GEMM on decoded blocks wins:
# 4 x 4096^2 layers at 128 rows (2^19 values) 5.2-5.9x fp32 on tiles against 4.2-4.5x on blocks,
# at 256 rows 3.5-3.9x against 4.0-5.9x; SmolLM2's layers at 256 rows (<= 2^18.6) 2.4-2.8x
# against 1.6-2.5x (Xeon with AMX, 1 and 2 threads).
TILE_MAX_VALUES = 1 << 19
# the same multiply with AVX512-BF16 dot products (CPUs without AMX, tiles.h's dp_block) keeps
# ahead of oneDNN's blocks further: 4096^2 at 256 rows (2^20 values) 40.8 ms against 47.2 at one
# thread, 20.5 against 22.1 at two; at 512 rows 82.9 against 83.3 (AMD Zen 4, from the caches)
DOT_MAX_VALUES = 1 << 21


@functools.lru_cache(maxsize=None)
def _tile_limit(lib) -> int:
    return DOT_MAX_VALUES if native.tiles_kind(lib) == 1 else TILE_MAX_VALUES


def tile_limit() -> int:
    """The most rows x in_features of a batch that goes to tiles.h's fused multiply here: on AMX
    tiles TILE_MAX_VALUES, with AVX512-BF16 dot products DOT_MAX_VALUES."""
    lib = native.library()
    return TILE_MAX_VALUES if lib is None else _tile_limit(lib)


def tile_batch(rows: int, in_features: int) -> bool:
    """Whether a batch bf16_blocks sends to bf16 goes to tiles.h's fused multiply (where the build
    has it) rather than to oneDNN's GEMM on decoded blocks: one rule for every weight-only kernel."""
    return rows * in_features <= tile_limit()


def _rows_per_block(row_len: int, bits: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per decoded block: about _ROW_BLOCK_VALUES values (twice as many in bfloat16, whose
    GEMM wants wider blocks), starting on whole bytes."""
    values = _ROW_BLOCK_VALUES * (2 if dtype == torch.bfloat16 else 1)
    rows = max(1, values // max(row_len, 1))
    if bits <= 8:
        step = 8 // math.gcd(row_len * bits, 8)
        rows = max(step, rows // step * step)
    return rows


# ---------------------------------------------------------------------------------------------
# scheme checks: which kernel can run a scheme exactly
# ---------------------------------------------------------------------------------------------
def _is_int(fmt, bits: int, signed: bool) -> bool:
    return isinstance(fmt, IntFormat) and fmt.bits == bits and fmt.signed == signed


def _per_row_or_tensor(s: QuantScheme) -> bool:
    return s.granularity == "tensor" or (s.granularity == "channel" and s._axis(2) == 0)


def _int4_op_group(s: QuantScheme, in_features: int) -> tuple[int, int] | None:
    """(tinygemm group size, padded K) for an int4 scheme, or None when it cannot run there."""
    fmt = s.format
    if not (s.symmetric and _is_int(fmt, 4, True)) and not (not s.symmetric and _is_int(fmt, 4, False)):
        return None
    if s.granularity == "group":
        g = ops.int4_op_group_size(s.group_size)
        return (g, s.layout((1, in_features))[2]) if g else None
    if _per_row_or_tensor(s):
        k_op = -(-in_features // ops.INT4_GROUP_SIZES[-1]) * ops.INT4_GROUP_SIZES[-1]
        return ops.int4_op_group_size(k_op), k_op
    return None


def _w8a8_activations_fast(a: QuantScheme) -> bool:
    """Dynamic activation schemes the fused path computes with quantize()'s exact arithmetic."""
    return (_is_int(a.format, 8, True) and a.symmetric and a.scale_method == "absmax"
            and a.mode == "nearest_even" and a.scale_format in ("fp32", "fp16", "bf16")
            and not a.double_quant and a.activations is None
            and (a.granularity == "tensor" or (a.granularity == "channel" and a.axis in (0, -2))))


def _w4a8_kernel(s: QuantScheme, shape) -> bool:
    """Whether csrc/w4a8.c runs this scheme, vectorized, with its exact arithmetic: 4-bit integer
    weight codes (int4 symmetric, or uint4 with a float minimum) in row groups of 32 with float
    scales as stored, and int8 absmax activations in blocks of 32 with float32 scales (quantized
    in the C call as quantize() does)."""
    a = s.activations
    n, k = shape
    weights = (s.granularity == "group" and s.group_size == 32 and k > 0 and k % 32 == 0 and not s.double_quant
               and s.super_block is None and s.scale_format in ("fp32", "fp16", "bf16")
               and ((s.symmetric and _is_int(s.format, 4, True))
                    or (not s.symmetric and _is_int(s.format, 4, False) and s.zero_point == "float")))
    acts = (_is_int(a.format, 8, True) and a.symmetric and a.scale_method == "absmax" and a.mode == "nearest_even"
            and a.scale_format == "fp32" and not a.double_quant and a.activations is None
            and a.granularity == "group" and a.group_size == 32)
    if not (weights and acts):
        return False
    lib = native.library()
    return lib is not None and bool(lib.fb_w4a8_vectorized())


def _fp8_w8a8(s: QuantScheme) -> bool:
    """E4M3 weights per channel or tensor and E4M3 activations per token or tensor, absmax
    float32 scales, nearest-even: what torch._scaled_mm multiplies as quantize() made it."""
    e4m3 = get_format("fp8_e4m3")
    a = s.activations
    plain = lambda t: (t.format == e4m3 and t.symmetric and t.scale_format == "fp32"  # noqa: E731
                       and t.scale_method == "absmax" and t.mode == "nearest_even" and not t.double_quant)
    return (a is not None and plain(s) and _per_row_or_tensor(s) and plain(a) and a.activations is None
            and (a.granularity == "tensor" or (a.granularity == "channel" and a.axis in (0, -2))))


def _fp8_gemm_hardware(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _int8_weight(s: QuantScheme) -> bool:
    return _is_int(s.format, 8, True) and s.symmetric and _per_row_or_tensor(s)


def _is_bf16_cast(s: QuantScheme) -> bool:
    return s.scale_format == "none" and s.format == get_format("bf16")


@functools.lru_cache(maxsize=None)
def cpu_int8_gemm_exact(kernel: str) -> bool:
    """Whether the CPU int8 GEMM behind `kernel` ("w8a8_onednn": oneDNN's qlinear on a prepacked
    weight; "w8a8_int_mm": torch._int_mm, also oneDNN's) sums exactly on this CPU, tried once per
    process on worst-case values against an int64 matmul.

    oneDNN without VNNI (AVX2-only CPUs such as AMD EPYC Rome and Milan, AVX-512 without VNNI;
    ONEDNN_MAX_CPU_ISA=AVX2 imitates them) multiplies uint8 x int8 pairs with vpmaddubsw, whose
    int16 sum of two products saturates (2 x 255 x 127 > 32767): the int32 results come out wrong
    by up to 4e4, silently. There neither kernel is offered and w8a8 runs the dequant kernel.

    oneDNN picks its kernel by shape (gemv for one row, other blockings and brgemm/AMX for many
    rows, tail code for K off its 64-wide blocks and N off its 16-wide ones), so the probe runs
    1, 32 and 256 rows, each with K a multiple of 64 and K not (200), N = 24, and puts the worst
    case (activations 127, weight rows 127 and -127) in the first and last rows, where blocks and
    tails start and end (kernels.int8.sums_exactly). Six small GEMMs, once per process."""
    if kernel == "w8a8_int_mm":
        return kernels_int8.sums_exactly(lambda q, w, _: ops.int8_int8_matmul(q, w))
    return kernels_int8.sums_exactly(
        lambda q, w, packed: ops.int8_int8_matmul_onednn((q.to(torch.int16) + 128).to(torch.uint8), packed,
                                                         torch.ones(w.shape[0])),
        prepare=ops.onednn_prepack_int8)


def _w8a8_panels_run(k: int, tiles: bool) -> bool:
    """Whether int8mm.c's panel kernels (native.Int8Panels) run a w8a8 layer of rows of k here:
    with its batches on the AMX tiles (w8a8_amx) or with VNNI dot products (w8a8_vnni)."""
    lib = native.library()
    ready = native.amx_w8a8_ready if tiles else native.vnni_w8a8_ready
    return lib is not None and 0 < k <= native.AMX_GEMV_MAX_K and ready(lib)


def available_kernels(scheme, shape, device="cpu") -> list[str]:
    """The kernels that can run a weight of `shape` [out, in] in `scheme` on `device`, fastest
    first (the first one is what kernel="auto" picks). Off the CPU: w8a8_int_mm (CUDA; both
    dimensions multiples of 8, as cuBLASLt's int8 GEMM wants), bf16 and dequant."""
    s = get_scheme(scheme)
    n, k = (int(d) for d in shape)
    dev = torch.device(device)
    if dev.type != "cpu":
        out = []
        if s.activations is not None:
            if (dev.type == "cuda" and _int8_weight(s) and _w8a8_activations_fast(s.activations)
                    and n % 8 == 0 and k % 8 == 0):
                out.append("w8a8_int_mm")
            if _fp8_w8a8(s) and _fp8_gemm_hardware(dev) and n % 16 == 0 and k % 16 == 0:
                out.append("w8a8_fp8")
        elif _is_bf16_cast(s):
            out.append("bf16")
        return out + ["dequant"]
    out = []
    if s.activations is not None:
        if _w4a8_kernel(s, (n, k)):
            out.append("w4a8")
        if _int8_weight(s) and _w8a8_activations_fast(s.activations):
            if _w8a8_panels_run(k, tiles=True):
                out.append("w8a8_amx")
            # after the tiles, ahead of oneDNN's GEMM, whose call for one row costs ~80 us of a
            # 576-wide layer's decode step
            if _w8a8_panels_run(k, tiles=False):
                out.append("w8a8_vnni")
            if ops.onednn_int8_available() and cpu_int8_gemm_exact("w8a8_onednn"):
                out.append("w8a8_onednn")
            if cpu_int8_gemm_exact("w8a8_int_mm"):
                out.append("w8a8_int_mm")
        out.append("dequant")
        if _fp8_w8a8(s) and hasattr(torch, "_scaled_mm"):
            out.append("w8a8_fp8")  # the CPU's reference _scaled_mm: exact, slow, only when asked for
        return out
    if _lut4_first(s, (n, k)):
        out.append("dequant")  # fewbits' 4-bit C kernels: faster than tinygemm at every batch, exact
    if _int4_op_group(s, k) is not None and n % ops.INT4_N_MULTIPLE == 0 and ops.int4pack_layout() is not None:
        out.append("int4pack")
    if _int8_weight(s) and k % ops.INT8PACK_K_MULTIPLE == 0 and ops.int8pack_available():
        out.append("int8pack")
    if _is_bf16_cast(s):
        out.append("bf16")
    return list(dict.fromkeys(out + ["dequant", "dequant_fp32"]))


def _lut4_first(s: QuantScheme, shape) -> bool:
    """Whether the dequant kernel runs this 4-bit weight through fewbits' C kernels with its
    parameters as stored: then it beats torch's int4 kernel (tinygemm) at one row and, with
    blocks decoded to bfloat16, at large batches (benchmarks/bench_linear.py), and computes the
    weights exactly."""
    return (_RowDecoder.lut4_shape(s, shape) and _RowDecoder.lut4_params_held(s)
            and native.library() is not None)


def _codes_from_int4pack(n: int, k_op: int, code_cols: int, symmetric: bool, kernel_tensors: dict) -> torch.Tensor:
    """The QuantizedTensor codes (low-first packed nibbles over [n, code_cols]) that tinygemm's
    packed weight [n, k_op] holds; a signed code c was stored as u = c ^ 8."""
    u = ops.unpack_int4(kernel_tensors["weight"], n, k_op)[:, :code_cols]
    return ops.pack_low_first(u ^ 8 if symmetric else u, 4)


def _codes_from_onednn(kernel_tensors: dict) -> torch.Tensor:
    return ops.onednn_unpack_int8(kernel_tensors["weight"]).view(torch.uint8).reshape(-1)


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y (a fresh kernel result) in `dtype` plus the bias, in one pass where the types allow."""
    if bias is None:
        return y.to(dtype)
    if y.dtype == dtype:
        return y.add_(bias)
    if torch.promote_types(y.dtype, bias.dtype) == dtype:
        return torch.add(y, bias)
    return y.to(dtype).add_(bias)


def _rescaled(y: torch.Tensor, act_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """float32 y * act_scales (+ bias) in `dtype` (one pass when there is a float32 bias): the
    product and the bias added with one rounding (an FMA, as torch.addcmul does on this CPU)."""
    if act_scales.numel() == 1 and y.shape[0] != 1:  # a per-tensor activation scale: one per row
        act_scales = act_scales.reshape(1, 1).expand(y.shape[0], 1)
    lib = native.library() if y.device.type == "cpu" and y.stride(-1) == 1 else None
    if lib is not None and (bias is None or bias.dtype == torch.float32):
        return native.scale_rows_(lib, y, act_scales, bias).to(dtype)
    if bias is not None and bias.dtype == torch.float32:  # in place: no second output buffer
        return torch.addcmul(bias, y, act_scales, out=y).to(dtype)
    return _with_bias(y.mul_(act_scales), bias, dtype)


# ---------------------------------------------------------------------------------------------
# QuantLinear
# ---------------------------------------------------------------------------------------------
class _QuantizedWeightViews:
    """What both quantized modules expose of the QuantizedTensor they hold in `_qweight`."""

    @property
    def qweight(self) -> QuantizedTensor:
        return self._qweight

    @property
    def scheme(self) -> QuantScheme:
        return self._qweight.scheme

    @property
    def dtype(self) -> torch.dtype:
        return self._qweight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held for the weight (codes, scales, zero points, kernel-side tensors, parameters
        a kernel keeps derived); a float bias is not included."""
        return self._qweight.nbytes + getattr(self, "_kernel_extra_nbytes", 0)

    # --- state_dict / load_state_dict ---------------------------------------------------------
    # The quantized weight is no Parameter, so torch would leave it out of model.state_dict(). It
    # goes in as `<prefix>qweight.<key>` for each key of its QuantizedTensor.state_dict() (the
    # names fb.save uses), the codes as the QuantizedTensor holds them whatever the kernel's layout.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, t in self._qweight.state_dict().items():
            destination[f"{prefix}{QWEIGHT}.{key}"] = t if keep_vars else t.detach()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Restores the quantized weight from `<prefix>qweight.<key>` entries: a new QuantizedTensor
        of this module's scheme, shape and dtype, validated (tensor shapes and dtypes, element
        codes in their format) before anything changes; then the bias as torch loads it, then the
        kernel layout is rebuilt for the loaded weight. Missing entries and (strict) unexpected
        ones are reported as torch reports them. With assign=False the tensors are copied to the
        module's device, as torch copies into parameters; with assign=True, or into a module on
        the meta device (a skeleton, see empty()), the module takes the given tensors."""
        qprefix = f"{prefix}{QWEIGHT}."
        given = {k[len(qprefix):]: v for k, v in state_dict.items() if k.startswith(qprefix)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(qprefix)}
        want = expected_keys(self.scheme)
        missing = [k for k in want if k not in given]
        missing_keys.extend(qprefix + k for k in missing)
        if strict:
            unexpected_keys.extend(qprefix + k for k in given if k not in want)
        current = self._qweight
        meta = current.device.type == "meta"
        assign = bool(local_metadata.get("assign_to_params_buffers", False)) or meta
        loaded = None
        if not missing:
            loaded = _loaded_qweight(current, {k: given[k] for k in want}, assign, qprefix[:-1], error_msgs)
            if loaded is None:
                return
        errors_before = len(error_msgs)
        bias = getattr(self, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.is_meta:  # a skeleton's bias takes the given tensor
            local_metadata = {**local_metadata, "assign_to_params_buffers": True}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if loaded is not None and len(error_msgs) == errors_before:
            self._set_qweight(loaded)


def _loaded_qweight(current: QuantizedTensor, tensors: dict, assign: bool, where: str,
                    error_msgs: list) -> QuantizedTensor | None:
    """The QuantizedTensor that `tensors` make in `current`'s scheme, shape and dtype, or None
    with the reason appended to error_msgs (as torch reports a bad entry)."""
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        error_msgs.append(f"While loading {where}: {', '.join(bad)} must be tensors")
        return None
    if not assign:
        device = current.device
        tensors = {k: v.detach().to(device, copy=True) for k, v in tensors.items()}
    else:
        tensors = {k: v.detach() for k, v in tensors.items()}
    try:
        qt = QuantizedTensor.from_state_dict(current.scheme, current.shape, current.dtype, tensors)
    except (TypeError, ValueError) as e:
        error_msgs.append(f"While loading {where} ({current.scheme.label}, shape {tuple(current.shape)}): {e}")
        return None
    if qt.device.type != "meta":
        problem = stored_problem(qt)
        if problem:
            error_msgs.append(f"While loading {where}: {problem}")
            return None
    return qt


class QuantLinear(_QuantizedWeightViews, nn.Module):
    """nn.Linear with a quantized weight (see the module docstring for the kernels).

    QuantLinear.from_linear(linear, scheme) quantizes a float layer; QuantLinear(qweight, bias)
    or .from_quantized(qweight, bias) wraps an existing QuantizedTensor [out, in]. The bias
    stays in float. kernel="auto" picks the fastest exact-enough path; naming one forces it
    (ValueError if it cannot run this scheme and shape).
    """

    def __init__(self, qweight: QuantizedTensor, bias: torch.Tensor | None = None, kernel: str = "auto"):
        super().__init__()
        if not isinstance(qweight, QuantizedTensor):
            raise TypeError(f"qweight must be a QuantizedTensor, got {type(qweight).__name__}")
        if len(qweight.shape) != 2:
            raise ValueError(f"a linear weight is 2-d [out_features, in_features], got shape {tuple(qweight.shape)}")
        if isinstance(qweight, KernelQuantizedTensor):
            qweight = qweight.plain()
        self.out_features, self.in_features = (int(d) for d in qweight.shape)
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError("bias must be a float tensor or None")
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.bias = bias
        s = qweight.scheme
        self._requested_kernel = kernel
        possible = available_kernels(s, qweight.shape, qweight.device)
        if kernel == "auto":
            kernel = possible[0]
        elif kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto' or one of {', '.join(KERNELS)}, got {kernel!r}")
        elif kernel not in possible:
            raise ValueError(f"kernel {kernel!r} cannot run {s.label} with shape {tuple(qweight.shape)} here; "
                             f"possible: {', '.join(possible)}")
        self._install(qweight, kernel)

    def _install(self, qweight: QuantizedTensor, kernel: str) -> None:
        self._handle = _register(self)
        # the handle as a tensor: torch.compile passes it as an input instead of guarding on its
        # value, so identical layers share one compiled graph (a plain attribute, not a buffer: it
        # is no part of the model's state or size, and stays on the CPU)
        self._handle_tensor = torch.tensor(self._handle, dtype=torch.int64)
        self._kernel_extra_nbytes = 0
        self.kernel = kernel
        self._decoder = None
        self._lut4w = None
        self._w4a8w = None
        self._int8w = None
        self._panels = None
        self._qweight = getattr(self, f"_build_{kernel}")(qweight)
        self._row = self._row_path(kernel)
        self._tiles = self._tile_path(kernel, self._row)

    def _row_path(self, kernel: str):
        """Where one float32 row on the CPU runs one C call of a weight held prepared -- the
        dequant kernel's fused 4-bit matmul (lut4.c), w4a8's (w4a8.c), int8pack's (int8w.c) --
        (the C function's name, its argument address, its return-code check, the output shapes
        by input rank, the prepared weight: held with the address, so that a call in flight
        keeps the tensors it reads alive while another thread replaces the weight); else None.
        forward() then makes that call itself (the general path costs ~10 us of Python per call,
        more than a small layer's row): the same call with the same arguments, the same bits."""
        if self.out_features == 0:
            return None
        if kernel == "w4a8":
            w, call = self._w4a8w, ("fb_w4a8_row", self._w4a8w.row_call(), native.w4a8_row_rc)
        elif kernel == "int8pack" and self._int8w is not None:
            w, call = self._int8w, ("fb_int8w_row", self._int8w.row_call(), native.int8w_rc)
        elif kernel in PANEL_KERNELS and self._row_quantized_in_c():
            sw = self._qweight.kernel_tensors["weight_scales"]
            w, call = self._panels, ("fb_w8a8_amx_row", self._panels.row_call(sw), native.w8a8_amx_row_rc)
        elif (kernel in ("dequant", "dequant_fp32") and self._lut4w is not None
              and self._qweight.scheme.activations is None):
            w, call = self._lut4w, ("fb_lut4_row", self._lut4w.row_call(self.in_features), native.lut4_rc)
        else:
            return None
        return call + (tuple((1,) * (d - 1) + (self.out_features,) for d in range(1, 5)), w)

    def _row_quantized_in_c(self) -> bool:
        """Whether one row's activations are quantized as fb_w8a8_amx_row does in C: per token (or
        per tensor: one row is both) with float32 scales."""
        a = self.scheme.activations
        return a is not None and a.scale_format == "fp32" and a.granularity in ("channel", "tensor")

    def _row_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """forward(x) through _row_path's C call, or None where it does not apply."""
        row = self._row
        if (row is not None and type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu
                and 1 <= x.dim() <= 4 and x.numel() == self.in_features and x.shape[-1] == self.in_features
                and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())):
            lib = native.library()  # None inside native.turned_off()
            if lib is not None:
                y = torch.empty(row[3][x.dim() - 1], dtype=torch.float32)  # not the default dtype
                row[2](getattr(lib, row[0])(row[1], x.data_ptr(), y.data_ptr()))
                return y if self.bias is None else _with_bias(y, self.bias, torch.float32)
        return None

    def row_kernel(self) -> native.RowKernel | None:
        """The C call that forward() makes for one float32 row on the CPU (_row_path's), as a
        native.RowKernel for C code that calls it itself (models.decoder's decode step): the same
        function and arguments, so the same bits, with the float32 bias added after it as
        forward() adds it. None where there is no such call: no native library, a kernel or
        scheme without a one-row C path, or a bias that is not float32."""
        row = self._row
        bias = self.bias
        if row is None or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu")):
            return None
        lib = native.library()
        if lib is None:
            return None
        return native.RowKernel(native.function_address(lib, row[0]), row[1], row[2], None if bias is None else bias.detach(),
                                self.in_features, self.out_features, row[4])

    def _tile_path(self, kernel: str, row):
        """Where float32 batches of more than LUT4_MAX_BATCH rows that tile_batch sends to the AMX
        tiles run in one C call (a weight-only lut4 or int8 layer): (the C function's name, its
        argument address -- _row's, the same weight's fixed arguments --, its return-code check, the
        prepared weight); else None. forward() makes that call itself where the tiles are there:
        the general path's call (tile_matmul with float32 x) with the same arguments, the same bits."""
        batch_call = {("dequant", "fb_lut4_row"): "fb_lut4_tiles", ("int8pack", "fb_int8w_row"): "fb_int8w_tiles"}
        name = batch_call.get((kernel, row[0])) if row is not None else None
        return None if name is None else (name, row[1], row[2], row[4])

    def _tile_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """forward(x) through _tile_path's C call, or None where it does not apply."""
        t = self._tiles
        if (t is not None and type(x) is torch.Tensor and x.dim() >= 2 and x.shape[-1] == self.in_features > 0
                and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())):
            x2d = x.view(-1, self.in_features)
            rows = x2d.shape[0]
            if bf16_blocks(x2d) and tile_batch(rows, self.in_features):  # the general path's rules
                lib = native.library()  # None inside native.turned_off()
                if lib is not None and native.tiles(lib):
                    y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
                    rc = getattr(lib, t[0])(t[1], x.data_ptr(), rows, y.data_ptr())
                    if rc == -3:  # the tiles refused after all: the general path
                        return None
                    t[2](rc)
                    return y if self.bias is None else _with_bias(y, self.bias, torch.float32)
        return None

    def __getstate__(self):
        # a copy or pickle holds the plain QuantizedTensor; the kernel layout is rebuilt
        state = dict(super().__getstate__())
        qweight = state.pop("_qweight")
        state["_qweight"] = qweight.plain() if isinstance(qweight, KernelQuantizedTensor) else qweight
        state.pop("_decoder", None)
        state.pop("_lut4w", None)
        state.pop("_w4a8w", None)
        state.pop("_int8w", None)
        state.pop("_panels", None)
        state.pop("_row", None)
        state.pop("_tiles", None)
        return state

    def __setstate__(self, state):
        state = dict(state)
        qweight = state.pop("_qweight")
        super().__setstate__(state)
        possible = available_kernels(qweight.scheme, qweight.shape, qweight.device)
        self._install(qweight, self.kernel if self.kernel in possible else possible[0])

    def _set_qweight(self, qweight: QuantizedTensor) -> None:
        """Hold `qweight` (same scheme and shape) with the kernel for its device: the one named at
        construction where it can run there, else the fastest."""
        if isinstance(qweight, KernelQuantizedTensor):
            qweight = qweight.plain()
        possible = available_kernels(qweight.scheme, qweight.shape, qweight.device)
        wanted = getattr(self, "_requested_kernel", "auto")
        self._install(qweight, wanted if wanted in possible else possible[0])

    def _apply(self, fn, *args, **kwargs):
        # .to(device) / .cuda() / .cpu(): the bias moves as a parameter; the quantized weight
        # moves with it and its kernel is chosen again for the new device (a kernel named at
        # construction is kept where it can run there). Dtype conversions (.half()) leave the
        # codes and scales alone: outputs follow the input's dtype.
        super()._apply(fn, *args, **kwargs)
        device = fn(torch.empty(0, device=self._qweight.device)).device
        if device != self._qweight.device:
            qweight = self._qweight
            if isinstance(qweight, KernelQuantizedTensor):
                qweight = qweight.plain()
            self._set_qweight(qweight.to(device))
        return self

    @classmethod
    def empty(cls, scheme, shape, dtype: torch.dtype = torch.float32, bias: bool = False,
              bias_dtype: torch.dtype | None = None, device="meta", kernel: str = "auto") -> QuantLinear:
        """A QuantLinear of this scheme, weight shape [out, in] and dtype whose tensors hold no data
        (on the meta device by default: for a model skeleton); its load_state_dict() fills it and
        picks the kernel for the loaded tensors' device."""
        qweight = QuantizedTensor.empty(scheme, shape, dtype, device=device)
        b = torch.empty(int(shape[0]), dtype=bias_dtype or dtype, device=device) if bias else None
        return cls(qweight, b, kernel=kernel)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme, kernel: str = "auto") -> QuantLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear() takes an nn.Linear, got {type(linear).__name__}")
        with torch.no_grad():
            qweight = quantize(linear.weight.detach(), get_scheme(scheme))
        return cls(qweight, linear.bias, kernel=kernel)

    @classmethod
    def from_quantized(cls, qweight: QuantizedTensor, bias: torch.Tensor | None = None,
                       kernel: str = "auto") -> QuantLinear:
        return cls(qweight, bias, kernel=kernel)

    def _build_dequant(self, qt: QuantizedTensor) -> QuantizedTensor:
        if _RowDecoder.supports(qt):
            self._decoder = _RowDecoder(qt)
            lib = native.library() if self._decoder.lut4 and qt.device.type == "cpu" else None
            if lib is not None and _RowDecoder.lut4_params_held(qt.scheme):
                # built once here; what it derives (float32 zero points, a per-tensor scale
                # repeated per row) is held, and counted in nbytes
                self._lut4w, self._kernel_extra_nbytes = self._new_lut4_weight(qt, self._decoder)
        return qt

    _build_dequant_fp32 = _build_dequant

    def _build_w4a8(self, qt: QuantizedTensor) -> QuantizedTensor:
        s = qt.scheme
        self._w4a8w = native.W4A8Weight(qt.codes, qt.scales, self.out_features, self.in_features, s.symmetric,
                                        qt.minimums if not s.symmetric else None)
        self._build_dequant(qt)  # batches beyond W4A8_MAX_BATCH rows
        self._kernel_extra_nbytes += self._w4a8w.own_nbytes(list(qt.state_dict().values()))
        return qt

    def _build_bf16(self, qt: QuantizedTensor) -> QuantizedTensor:
        w = qt.codes.view(torch.bfloat16).view(self.out_features, self.in_features)
        return KernelQuantizedTensor(qt, {"weight": w})

    def _weight_scales(self, qt: QuantizedTensor) -> torch.Tensor:
        """float32 per-output-channel scales [N] of a per-channel or per-tensor weight."""
        return qt.scale_values().reshape(-1).expand(self.out_features).contiguous()

    def _build_int8pack(self, qt: QuantizedTensor) -> QuantizedTensor:
        # the kernel crashes on unaligned weights (see lowbit_ops): align the codes once here, so
        # that the weight stays a view of the codes and no call copies it
        codes = ops.aligned(qt.codes)
        if codes is not qt.codes:
            qt = QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype, {**qt.state_dict(), "codes": codes})
        w = codes.view(torch.int8).view(self.out_features, self.in_features)
        s = ops.aligned(self._weight_scales(qt).to(torch.bfloat16))
        # float32 scales for the bf16 block path (a view of the stored ones for per-channel fp32)
        self._int8_scales_f32 = self._weight_scales(qt)
        if qt.scales is None or not _same_storage(self._int8_scales_f32, qt.scales):
            self._kernel_extra_nbytes = self._int8_scales_f32.nbytes
        # a few rows: fewbits' C kernel (float32 activations) on the same codes and scales
        self._int8w = native.Int8Weight(w, self._int8_scales_f32)
        return KernelQuantizedTensor(qt, {"weight": w, "scales_bf16": s})

    def _build_w8a8_int_mm(self, qt: QuantizedTensor) -> QuantizedTensor:
        w = qt.codes.view(torch.int8).view(self.out_features, self.in_features)
        return KernelQuantizedTensor(qt, {"weight": w, "weight_scales": self._weight_scales(qt)})

    def _build_w8a8_fp8(self, qt: QuantizedTensor) -> QuantizedTensor:
        w = qt.codes.view(torch.float8_e4m3fn).view(self.out_features, self.in_features)  # OCP E4M3 bits
        return KernelQuantizedTensor(qt, {"weight": w, "weight_scales": self._weight_scales(qt).reshape(1, -1)})

    def _build_w8a8_amx(self, qt: QuantizedTensor, tiles: bool = True) -> QuantizedTensor:
        n, k = self.out_features, self.in_features
        lib = native.library()
        if lib is None:  # native.turned_off() at construction: where the kernel was chosen before
            raise RuntimeError(f"the {self.kernel} kernel needs fewbits' native library")
        panels = native.Int8Panels(lib, qt.codes.view(torch.int8).view(n, k), tiles=tiles)
        self._panels = panels
        return KernelQuantizedTensor(
            qt, {"panels": panels.panels, "colsum128": panels.colsum128, "weight_scales": self._weight_scales(qt)},
            codes_from_kernel=lambda kt: native.Int8Panels.codes(kt["panels"], n, k).view(torch.uint8).reshape(-1))

    def _build_w8a8_vnni(self, qt: QuantizedTensor) -> QuantizedTensor:
        return self._build_w8a8_amx(qt, tiles=False)

    def _build_w8a8_onednn(self, qt: QuantizedTensor) -> QuantizedTensor:
        n, k = self.out_features, self.in_features
        prepacked = ops.onednn_prepack_int8(qt.codes.view(torch.int8).view(n, k))
        return KernelQuantizedTensor(qt, {"weight": prepacked, "weight_scales": self._weight_scales(qt)},
                                     codes_from_kernel=_codes_from_onednn,
                                     kernel_nbytes={"weight": ops.onednn_prepacked_nbytes(n, k)})

    def _build_int4pack(self, qt: QuantizedTensor) -> QuantizedTensor:
        s = qt.scheme
        n, k = self.out_features, self.in_features
        group, k_op = _int4_op_group(s, k)
        _, _, pcols, groups = s.layout(qt.shape)
        symmetric = s.symmetric
        # tinygemm reads nibble u as u - 8: a signed int4 code (two's complement) maps to u = c ^ 8
        c = qt.element_codes().reshape(n, -1)  # [n, pcols] (per-tensor: the same row-major order)
        u = c ^ 8 if symmetric else c
        if k_op > u.shape[1]:
            u = F.pad(u, (0, k_op - u.shape[1]), value=8)
        packed = ops.pack_int4(u)
        del u, c
        sv = qt.scale_values()
        sv = sv.expand(n, sv.shape[1]) if sv.shape[0] == 1 else sv
        if symmetric:
            zeros = torch.zeros_like(sv)
        elif s.zero_point == "float":  # q * s + min = (q - 8) * s + (8 * s + min)
            mins = qt.minimum_values()
            zeros = 8.0 * sv + (mins.expand(n, mins.shape[1]) if mins.shape[0] == 1 else mins)
        else:
            zeros = (8.0 - qt.zero_point_values().to(torch.float32)) * sv
        per_group = (s.group_size if s.granularity == "group" else k_op) // group
        sz = ops.int4_scales_and_zeros(sv.repeat_interleave(per_group, dim=1)[:, : k_op // group],
                                       zeros.repeat_interleave(per_group, dim=1)[:, : k_op // group])
        self._int4_group, self._int4_k = group, k_op
        code_cols = pcols if s.granularity == "group" else k
        return KernelQuantizedTensor(qt, {"weight": packed, "scales_and_zeros": sz},
                                     codes_from_kernel=functools.partial(_codes_from_int4pack, n, k_op, code_cols,
                                                                         symmetric))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.label!r}, kernel={self.kernel!r}, nbytes={self.nbytes}")

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _compiling():
            if _exporting():
                raise NotImplementedError(
                    "torch.export of a QuantLinear is not supported: its kernel is a handle to this process's "
                    "module, which an exported program could not carry; export the float model, or use "
                    "torch.compile")
            if not (torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))):
                # under torch.compile the layer is one opaque op: no graph break around it
                return quant_linear_op(x, self._handle_tensor, self.out_features)
            return self._forward_eager(x)
        y = self._row_forward(x)
        if y is None:
            y = self._tile_forward(x)
        if y is not None:
            return y
        return self._forward_eager(x)

    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"QuantLinear takes a float tensor, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"input's last dimension must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            return self.reference_forward(x)
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] == 0 or self.out_features == 0:
            y = _with_bias(x2d.new_zeros(x2d.shape[0], self.out_features), self.bias, x.dtype)
        else:
            y = _FORWARDS[self.kernel](self, x2d, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The slow, obviously-correct result: F.linear with the dequantized weight (and, for
        w8a8, the activations quantized and dequantized by quantize())."""
        act = self.scheme.activations
        if act is not None:
            x = quantize(x.reshape(-1, self.in_features), act).dequantize(x.dtype).reshape(x.shape)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self._qweight.dequantize(x.dtype), bias)

    # Each kernel returns the finished output: in `dtype`, bias added. The steps around the
    # kernel call are few and, for small inputs, single-threaded (see ops.one_thread_if_small).
    def _forward_bf16(self, x2d, bias, dtype):
        with ops.one_thread_if_small(x2d.numel()):
            xb = x2d.to(torch.bfloat16)
        y = F.linear(xb, self._qweight.kernel_tensors["weight"])
        with ops.one_thread_if_small(y.numel()):
            return _with_bias(y, bias, dtype)

    def _forward_int8pack(self, x2d, bias, dtype):
        kt = self._qweight.kernel_tensors
        lib = native.library()
        if (lib is not None and self._int8w is not None and x2d.shape[0] <= LUT4_MAX_BATCH
                and x2d.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            # a few rows: each output q @ x in float32 times its row's scale (kernels/csrc/int8w.c)
            y = self._int8w.matmul(lib, x2d if x2d.dtype == torch.float32 else x2d.to(torch.float32))
            if bias is None and dtype == torch.float32:
                return y
            with ops.one_thread_if_small(y.numel()):
                return _with_bias(y, bias, dtype)
        lib = lib if bf16_blocks(x2d) else None
        if lib is not None and self._int8w is not None and tile_batch(x2d.shape[0], self.in_features):
            # AMX: the codes as bf16 (exact) 32 rows at a time, float32 sums times the row scales
            y = self._int8w.tile_matmul(lib, x2d)
            if y is not None:
                if bias is None and dtype == torch.float32:
                    return y
                with ops.one_thread_if_small(y.numel()):
                    return _with_bias(y, bias, dtype)
        if lib is not None:
            # torch's int8 kernel is a GEMV: batches go to the bf16 GEMM, the int8 codes as they
            # are (exact in bf16), the rows' scales applied to the sums in float32 after it
            w = kt["weight"]
            step = _rows_per_block(self.in_features, 8, torch.bfloat16)
            buf = torch.empty(min(step, self.out_features) * self.in_features, dtype=torch.bfloat16)
            with ops.one_thread_if_small(x2d.numel()):
                xm = x2d.to(torch.bfloat16)
            y = _block_matmul(xm, self.out_features, step,
                              lambda r0, r1: native.int8_rows_bf16(lib, w, r0, r1, out=buf), None, torch.bfloat16)
            with ops.one_thread_if_small(y.numel()):
                return _with_bias(y.to(torch.float32).mul_(self._int8_scales_f32), bias, dtype)
        with ops.one_thread_if_small(x2d.numel()):
            xb = x2d.to(torch.bfloat16).contiguous()
        y = ops.int8_weight_matmul(xb, kt["weight"], kt["scales_bf16"])
        with ops.one_thread_if_small(y.numel()):
            return _with_bias(y, bias, dtype)

    def _forward_int4pack(self, x2d, bias, dtype):
        kt = self._qweight.kernel_tensors
        with ops.one_thread_if_small(x2d.numel()):
            xb = x2d.to(torch.bfloat16)
            if self._int4_k != self.in_features:
                xb = F.pad(xb, (0, self._int4_k - self.in_features))
            xb = xb.contiguous()
        y = ops.int4_matmul(xb, kt["weight"], self._int4_group, kt["scales_and_zeros"])
        with ops.one_thread_if_small(y.numel()):
            return _with_bias(y, bias, dtype)

    def _activations(self, x2d, offset: bool):
        a = self.scheme.activations
        with ops.one_thread_if_small(x2d.numel()):
            fp32 = a.scale_format == "fp32"
            return ops.quantize_rows_int8(x2d, a.granularity == "channel",
                                          None if fp32 else lambda v: sc.round_scales(v, a.scale_format),
                                          saturate=not fp32, offset=offset)

    def _forward_w8a8_amx(self, x2d, bias, dtype):
        lib = native.library()
        if lib is None or x2d.device.type != "cpu":  # native.turned_off(): the exact torch path
            return self._forward_dequant(x2d, bias, dtype)
        q, sx = self._activations(x2d, offset=self._panels.vnni_rows(x2d.shape[0]))  # uint8 q + 128 for VNNI
        fuse = bias is not None and bias.dtype == torch.float32  # added in float32, before x's dtype
        y = self._panels.matmul(lib, q, sx, self._qweight.kernel_tensors["weight_scales"], bias if fuse else None)
        if dtype == torch.float32 and (fuse or bias is None):
            return y
        with ops.one_thread_if_small(y.numel()):
            return _with_bias(y, None if fuse else bias, dtype)

    _forward_w8a8_vnni = _forward_w8a8_amx  # the same panels; Int8Panels.matmul picks the batches' kernel

    def _forward_w8a8_onednn(self, x2d, bias, dtype):
        q_u8, sx = self._activations(x2d, offset=True)
        kt = self._qweight.kernel_tensors
        y = ops.int8_int8_matmul_onednn(q_u8, kt["weight"], kt["weight_scales"])  # acc * s_w
        with ops.one_thread_if_small(y.numel()):
            return _rescaled(y, sx.unsqueeze(1), bias, dtype)

    def _forward_w8a8_int_mm(self, x2d, bias, dtype):
        q, sx = self._activations(x2d, offset=False)
        kt = self._qweight.kernel_tensors
        acc = ops.int8_int8_matmul(q, kt["weight"])
        with ops.one_thread_if_small(acc.numel()):
            return _rescaled(acc.to(torch.float32).mul_(kt["weight_scales"]), sx.unsqueeze(1), bias, dtype)

    def _forward_w8a8_fp8(self, x2d, bias, dtype):
        a = self.scheme.activations
        qx = quantize(x2d, a)  # the E4M3 codes and float32 scales quantize() defines
        m = x2d.shape[0]
        xq = qx.codes.view(torch.float8_e4m3fn).view(m, self.in_features)
        sx = qx.scale_values().reshape(-1, 1).float()
        if sx.shape[0] != m:  # a per-tensor activation scale, one per row for _scaled_mm
            sx = sx.reshape(1, 1).expand(m, 1).contiguous()
        kt = self._qweight.kernel_tensors
        # the result: bfloat16 on CUDA (what cuBLASLt's row-wise FP8 GEMM gives), float32 on a CPU
        out = torch.float32 if x2d.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(xq, kt["weight"].t(), scale_a=sx, scale_b=kt["weight_scales"], out_dtype=out)
        return _with_bias(y, bias, dtype)

    def _new_lut4_weight(self, qt: QuantizedTensor, dec: _RowDecoder, huge_pages: bool = True):
        """(the weight prepared for fewbits' 4-bit C kernels, the bytes it holds of its own: the
        parameters it derived rather than reads as the QuantizedTensor stores them)."""
        s = qt.scheme
        held = _RowDecoder.lut4_params_held(s)
        with ops.one_thread():  # small next to the codes: a parallel region costs more
            coded = dec.coded_scales()
            if coded is not None:  # MX / NVFP4 scales: decoded inside the kernels, a row at a time
                scales = coded
            else:
                scales = qt.scales if held else qt.scale_values()
            zps = qt.zero_point_values()
            zps = zps.to(torch.float32) if zps is not None else None
            mins = qt.minimums if held and s.zero_point == "float" else qt.minimum_values()
        w = native.Lut4Weight(qt.codes, scales, ops.value_table(dec.fmt), self.out_features, dec.row_len,
                              dec.group_len, zero_points=zps, minimums=mins, huge_pages=huge_pages)
        return w, w.own_nbytes(list(qt.state_dict().values()))

    def _lut4_weight(self, lib):
        """The weight prepared for fewbits' 4-bit C kernels (built with the module where its
        parameters are read as stored, see _build_dequant; otherwise built for each call), or
        None where the codes cannot go through them."""
        if lib is None:
            return None
        if self._lut4w is not None:
            return self._lut4w
        # built without huge pages: a weight rebuilt at every call (double-quantized or super-block
        # scales) would otherwise madvise its codes at every call, and retry a refused collapse
        w, own = self._new_lut4_weight(self._qweight, self._decoder, huge_pages=False)
        if own == 0:  # holds nothing of its own: keep it (and its codes on huge pages, once)
            self._lut4w = w
            w.huge_pages()
        return w

    def _forward_w4a8(self, x2d, bias, dtype):
        lib = native.library()
        small = x2d.shape[0] <= W4A8_MAX_BATCH
        # the C kernel takes float32 (float16 / bfloat16 inputs are exact in it); batches of other
        # dtypes keep them (bf16_blocks is a rule for float32 batches), as the dequant kernel does
        if (lib is None or x2d.device.type != "cpu"
                or x2d.dtype not in ((torch.float32, torch.bfloat16, torch.float16) if small else (torch.float32,))):
            return self._forward_dequant(x2d, bias, dtype)
        x = x2d if x2d.dtype == torch.float32 else x2d.to(torch.float32)
        if small:
            y = self._w4a8w.linear(lib, x)
            if bias is None and dtype == torch.float32:
                return y
            with ops.one_thread_if_small(y.numel()):
                return _with_bias(y, bias, dtype)
        # batches: the activations quantized per block by the C quantizer (quantize()'s codes and
        # scales) and dequantized (one float32 product each, in the same C call), then dequant's
        # blocks -- in bfloat16 where bf16_blocks says so, as for weight-only layers (bf16 of the
        # dequantized activations and of the dequantized weight, float32 sums)
        mm_dtype = torch.bfloat16 if bf16_blocks(x) else torch.float32  # rounded in the same C pass
        return self._dequant_matmul(native.w4a8_dequantized_x(lib, x, mm_dtype), bias, dtype, True, x_quantized=True)

    def _forward_dequant(self, x2d, bias, dtype):
        return self._dequant_matmul(x2d, bias, dtype, self.scheme.activations is None)

    def _forward_dequant_fp32(self, x2d, bias, dtype):
        return self._dequant_matmul(x2d, bias, dtype, False)

    def _dequant_matmul(self, x2d, bias, dtype, bf16_batches: bool, x_quantized: bool = False):
        if self.scheme.activations is not None and not x_quantized:
            x2d = quantize(x2d, self.scheme.activations).dequantize(x2d.dtype)
        dec = self._decoder
        if dec is None:
            return _with_bias(F.linear(x2d, self._qweight.dequantize(x2d.dtype)), bias, dtype)
        n, rows = self.out_features, x2d.shape[0]
        lib = native.library() if dec.lut4 and x2d.device.type == "cpu" else None
        w = self._lut4_weight(lib)
        if w is not None and rows <= LUT4_MAX_BATCH and x2d.dtype in (torch.float32, torch.bfloat16, torch.float16):
            # the codes read once per 8 rows of x, never decoded to memory (x in float32: exact)
            y = w.matmul(lib, x2d if x2d.dtype == torch.float32 else x2d.to(torch.float32))
            if bias is None and dtype == torch.float32:
                return y
            with ops.one_thread_if_small(y.numel()):
                return _with_bias(y, bias, dtype)
        # blocks of rows decoded, each multiplied at once: in bfloat16 where asked (bf16_blocks),
        # else in x's dtype
        mm_dtype = torch.bfloat16 if bf16_batches and bf16_blocks(x2d) else x2d.dtype
        if w is not None and mm_dtype == torch.bfloat16 and tile_batch(rows, x2d.shape[1]):
            # AMX: blocks of 32 rows decoded to bf16 in the caches, float32 sums, float32 x rounded
            # to bf16 in the same call (None without AMX)
            y = w.tile_matmul(lib, x2d)
            if y is not None:
                if bias is None and dtype == torch.float32:
                    return y
                with ops.one_thread_if_small(y.numel()):
                    return _with_bias(y, bias, dtype)
        with ops.one_thread_if_small(x2d.numel()):
            xm = x2d.to(mm_dtype)
        step = _rows_per_block(dec.row_len, dec.fmt.bits, mm_dtype)
        if w is not None and mm_dtype in (torch.float32, torch.bfloat16):
            buf = torch.empty(min(step, n) * dec.row_len, dtype=mm_dtype)  # one buffer for every block

            def block(r0, r1):
                return w.decode(lib, r0, r1, mm_dtype, out=buf)[:, : dec.cols]
        else:
            scales, zps = dec.params()

            def block(r0, r1):
                with ops.one_thread_if_small(0):  # a block is small: decoding it gains little from threads
                    return dec.block(r0, r1, scales, zps).to(mm_dtype)
        if step >= n:
            return _with_bias(F.linear(xm, block(0, n)), bias, dtype)
        return _block_matmul(xm, n, step, block, bias, dtype)


def _block_matmul(xm: torch.Tensor, n: int, step: int, block: Callable, bias, dtype) -> torch.Tensor:
    """x @ W.T [rows, n] from W's rows decoded `step` at a time by block(r0, r1) (in xm's dtype;
    each block is used before the next is asked for, so it may reuse one buffer), with the bias."""
    x_t = xm.t()
    y_t = torch.empty(n, xm.shape[0], dtype=xm.dtype, device=xm.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        torch.mm(block(r0, r1), x_t, out=y_t[r0:r1])
    with ops.one_thread_if_small(y_t.numel()):
        return _with_bias(y_t.t(), bias, dtype)


def bf16_blocks(x2d: torch.Tensor) -> bool:
    """Whether a weight-only layer multiplies this input in bfloat16 blocks of decoded weight:
    float32 batches of more than LUT4_MAX_BATCH rows on a CPU with hardware bf16 products (where
    oneDNN's bf16 GEMM runs 4-5x as fast as float32's). One rule for every weight-only kernel."""
    return (x2d.dtype == torch.float32 and x2d.shape[0] > LUT4_MAX_BATCH and x2d.device.type == "cpu"
            and ops.fast_bf16_matmul())


# ---------------------------------------------------------------------------------------------
# torch.compile: a QuantLinear is one custom op (torch.library), opaque to the compiler
# ---------------------------------------------------------------------------------------------
# The kernels are C calls, oneDNN's opaque tensors and per-call Python dispatch: dynamo would
# break the graph at each of them. Instead a compiled model calls fewbits::quant_linear(x, handle)
# for each layer, which runs the layer's eager forward; its fake implementation gives the output's
# shape and dtype, so the graph around the layers (attention, norms, the KV cache) compiles whole.
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def _register(module) -> int:
    handle = next(_next_handle)
    _LAYERS[handle] = module
    return handle


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _compiling() -> bool:
    return bool(_is_compiling is not None and _is_compiling())


def _layer(handle: int):
    module = _LAYERS.get(handle)
    if module is None:
        raise RuntimeError(f"fewbits::quant_linear: the QuantLinear of handle {handle} no longer exists")
    return module


def _exporting() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_exporting") and compiler.is_exporting())


# kernel name -> QuantLinear's forward for it (looked up per call; no string built per call)
_FORWARDS = {k: getattr(QuantLinear, f"_forward_{k}") for k in KERNELS}


# The op is defined with torch.library.Library rather than the custom_op decorator: that one's
# Python wrapper cost ~7 us per call (211 calls per SmolLM2 token), a plain kernel registration
# ~2.5 us. One implementation for every device (CompositeExplicitAutograd: the op is never
# differentiated, see QuantLinear.forward), a fake one for shapes. A namespace is defined once
# per process, so the registration lives in a module of its own in sys.modules and calls this
# module's implementation through it: a second execution of this file (importlib.reload, IPython
# autoreload) hands it its own implementation, with its own layer registry.
def _quant_linear_impl(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """The forward of x by the QuantLinear whose handle `handle` holds (its out_features given
    for the output's shape), as one op: what compiled models call."""
    m = _layer(int(handle))
    if m.out_features != out_features:
        raise RuntimeError(f"fewbits::quant_linear: handle {int(handle)} has {m.out_features} outputs, not {out_features}")
    y = m._row_forward(x)
    if y is None:
        y = m._tile_forward(x)
    if y is None:
        y = m._forward_eager(x).contiguous()  # the layout the fake promises
    return y.clone() if y.data_ptr() == x.data_ptr() else y  # an op's output never aliases its input


def _op_registration():
    name = "_fewbits_torch_ops"
    reg = sys.modules.get(name)
    if reg is None:
        reg = types.ModuleType(name, "fewbits' torch.library registrations (once per process)")
        reg.impl = None
        reg.lib = torch.library.Library("fewbits", "DEF")
        reg.lib.define("quant_linear(Tensor x, Tensor handle, int out_features) -> Tensor")
        reg.lib.impl("quant_linear", lambda x, handle, out_features: reg.impl(x, handle, out_features),
                     "CompositeExplicitAutograd")

        @torch.library.register_fake("fewbits::quant_linear", lib=reg.lib)
        def _(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], out_features)

        sys.modules[name] = reg
    return reg


_op_registration().impl = _quant_linear_impl
quant_linear_op = torch.ops.fewbits.quant_linear


# ---------------------------------------------------------------------------------------------
# QuantEmbedding
# ---------------------------------------------------------------------------------------------
class QuantEmbedding(_QuantizedWeightViews, nn.Module):
    """nn.Embedding with a quantized table: a lookup decodes only the rows it reads.

    QuantEmbedding.from_embedding(embedding, scheme) quantizes a float table;
    .from_quantized(qweight, embedding=None) wraps a QuantizedTensor [num_embeddings, dim]
    (padding_idx is taken from `embedding`). Rows come out in the table's original dtype,
    equal to F.embedding(ids, qweight.dequantize()).
    """

    def __init__(self, qweight: QuantizedTensor, padding_idx: int | None = None):
        super().__init__()
        if not isinstance(qweight, QuantizedTensor):
            raise TypeError(f"qweight must be a QuantizedTensor, got {type(qweight).__name__}")
        if len(qweight.shape) != 2:
            raise ValueError(f"an embedding table is 2-d [num_embeddings, embedding_dim], got {tuple(qweight.shape)}")
        if isinstance(qweight, KernelQuantizedTensor):
            qweight = qweight.plain()
        self.num_embeddings, self.embedding_dim = (int(d) for d in qweight.shape)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} is out of range for {self.num_embeddings} embeddings")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self._set_qweight(qweight)

    def _set_qweight(self, qweight: QuantizedTensor) -> None:
        self._qweight = qweight
        self._decoder = _RowDecoder(qweight) if _RowDecoder.supports(qweight) else None

    def _apply(self, fn, *args, **kwargs):
        # .to(device) / .cuda() / .cpu() move the quantized table (see QuantLinear._apply)
        super()._apply(fn, *args, **kwargs)
        device = fn(torch.empty(0, device=self._qweight.device)).device
        if device != self._qweight.device:
            self._set_qweight(self._qweight.to(device))
        return self

    @classmethod
    def empty(cls, scheme, shape, dtype: torch.dtype = torch.float32, padding_idx: int | None = None,
              device="meta") -> QuantEmbedding:
        """A QuantEmbedding of this scheme, table shape [num_embeddings, dim] and dtype whose
        tensors hold no data (meta by default), for load_state_dict() to fill."""
        return cls(QuantizedTensor.empty(scheme, shape, dtype, device=device), padding_idx)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, scheme) -> QuantEmbedding:
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"from_embedding() takes an nn.Embedding, got {type(embedding).__name__}")
        with torch.no_grad():
            qweight = quantize(embedding.weight.detach(), get_scheme(scheme))
        return cls.from_quantized(qweight, embedding)

    @classmethod
    def from_quantized(cls, qweight: QuantizedTensor, embedding: nn.Embedding | None = None) -> QuantEmbedding:
        padding_idx = None
        if embedding is not None:
            if getattr(embedding, "max_norm", None) is not None:
                raise ValueError("an embedding with max_norm renormalizes its rows in place; a quantized table cannot")
            padding_idx = embedding.padding_idx
        return cls(qweight, padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, scheme={self.scheme.label!r}, nbytes={self.nbytes}"

    def _check(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                     torch.int8, torch.uint8):
            raise TypeError(f"QuantEmbedding takes an integer tensor of indices, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"index out of range: indices must lie in 0..{self.num_embeddings - 1}, "
                             f"got {int(flat.min())}..{int(flat.max())}")
        return flat

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = self._check(ids)
        if self._decoder is None:
            rows = self._qweight.dequantize(torch.float32)[flat]
        else:
            scales, zps = self._decoder.params()
            rows = self._decoder.gather(flat, scales, zps)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def reference_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The slow, obviously-correct result: F.embedding on the whole dequantized table."""
        self._check(ids)
        return F.embedding(ids.to(torch.int64), self._qweight.dequantize())


__all__ = ["QuantLinear", "QuantEmbedding", "KernelQuantizedTensor", "available_kernels", "KERNELS"]
