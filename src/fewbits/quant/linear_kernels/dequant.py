"""The dequant kernels: every scheme, the codes decoded and scaled with dequantize()'s float32
arithmetic a block of output rows at a time (no whole float weight exists), 4-bit codes through
fewbits' C kernels (csrc/lut4.c, native.Lut4Weight) where a C compiler is there.

dequant: up to LUT4_MAX_BATCH rows lut4.c's fused matmul (the codes decoded in registers, float32
products and sums); larger float32 batches on CPUs with hardware bf16 (bf16_blocks) in bfloat16:
on tiles.h's fused multiply where tile_batch allows, else blocks in oneDNN's bf16 GEMM.
dequant_fp32: the same with float32 blocks at every batch size (the exact path on every CPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...formats import IntFormat
from ...kernels import native
from .. import lowbit_ops as ops
from ..scheme import QuantScheme
from ..tensor import QuantizedTensor, quantize
from .base import (
    LUT4_MAX_BATCH, LinearKernel, PreparedWeight, bf16_blocks, block_matmul, finished, rows_per_block, tile_batch,
    with_bias,
)
from .rows import RowDecoder


def introw_shape(s: QuantScheme, shape) -> bool:
    """Whether introw.c reads this 2-d weight as stored: integer codes of 2-8 bits in groups of a
    multiple of 16 that divide the rows, scales in float32 / float16 / bfloat16 or two-level
    (GGUF's k-quants), symmetric or with a float minimum (GGUF's Q8_0, Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K), weight-only."""
    fmt = s.format
    if (not isinstance(fmt, IntFormat) or not 2 <= fmt.bits <= 8 or len(shape) != 2 or s.granularity != "group"
            or s.activations is not None or s.double_quant or s.scale_format not in ("fp32", "fp16", "bf16")):
        return False
    if not (s.symmetric or s.zero_point == "float"):
        return False
    if s.super_block is not None and not (isinstance(s.sub_scale_format_of, IntFormat)
                                          and s.sub_scale_format_of.bits <= 8):
        return False
    row_len, _ = RowDecoder.row_layout(s, shape)
    return native.introw_supported(fmt.bits, row_len, s.group_size)


def introw_first(s: QuantScheme, shape) -> bool:
    """Whether the dequant kernel runs this weight's small batches through introw.c (where
    lut4.c cannot read its parameters as stored)."""
    return (introw_shape(s, shape) and not (RowDecoder.lut4_shape(s, shape) and RowDecoder.lut4_params_held(s))
            and native.library() is not None)


def lut4_first(s: QuantScheme, shape) -> bool:
    """Whether the dequant kernel runs this 4-bit weight through fewbits' C kernels with its
    parameters as stored: then it beats torch's int4 kernel (tinygemm) at one row and, with
    blocks decoded to bfloat16, at large batches (benchmarks/bench_linear.py), and computes the
    weights exactly."""
    return (RowDecoder.lut4_shape(s, shape) and RowDecoder.lut4_params_held(s)
            and native.library() is not None)


class DequantWeight(PreparedWeight):
    """A weight held for the dequant kernels: its row decoder (2-d weights whose codes lie row by
    row) and, for 4-bit codes whose parameters the C kernels read as stored, the Lut4Weight built
    once (what it derives is counted in extra_nbytes). `rows=False`: neither (dequantize() and one
    GEMM), the fallback of kernels that cannot run without the native library."""

    def __init__(self, qt: QuantizedTensor, bf16_batches: bool = True, rows: bool = True):
        super().__init__(qt)
        self.bf16_batches = bf16_batches
        self.decoder = None
        self.lut4w = None
        self.introw = None
        if rows and RowDecoder.supports(qt):
            self.decoder = RowDecoder(qt)
            lib = native.library() if self.decoder.lut4 and qt.device.type == "cpu" else None
            if lib is not None and RowDecoder.lut4_params_held(qt.scheme):
                # built once here; what it derives (float32 zero points, a per-tensor scale
                # repeated per row) is held, and counted in nbytes
                self.lut4w, self.extra_nbytes = self.new_lut4_weight()
            elif qt.device.type == "cpu" and introw_first(qt.scheme, qt.shape):
                self.introw = self.new_introw_weight()

    def new_lut4_weight(self, huge_pages: bool = True):
        """(the weight prepared for fewbits' 4-bit C kernels, the bytes it holds of its own: the
        parameters it derived rather than reads as the QuantizedTensor stores them)."""
        qt, dec = self.qweight, self.decoder
        s = qt.scheme
        held = RowDecoder.lut4_params_held(s)
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

    def new_introw_weight(self):
        """The weight prepared for introw.c: codes, scales and minimums as the QuantizedTensor
        stores them (two-level ones as their packed sub-codes and super-block values)."""
        qt, dec = self.qweight, self.decoder
        s = qt.scheme
        if s.super_block is not None:
            sub = s.sub_scale_format_of
            per = s.super_block // s.group_size

            def two_level(codes, supers, negate):
                return native.TwoLevel(codes, sub.bits, sub.signed, supers, per, negate)

            scales = two_level(qt.sub_scales, qt.super_scales, False)
            mins = two_level(qt.sub_minimums, qt.super_minimums, True) if qt.sub_minimums is not None else None
        else:
            scales = qt.scales
            mins = qt.minimums if s.zero_point == "float" else None
        return native.IntRowWeight(qt.codes, dec.fmt.bits, dec.fmt.signed, self.out_features, dec.row_len,
                                   dec.group_len, scales, mins)

    def lut4_weight(self, lib):
        """The weight prepared for fewbits' 4-bit C kernels (built with the weight where its
        parameters are read as stored; otherwise built for each call), or None where the codes
        cannot go through them."""
        if lib is None:
            return None
        if self.lut4w is not None:
            return self.lut4w
        # built without huge pages: a weight rebuilt at every call (double-quantized or super-block
        # scales) would otherwise madvise its codes at every call, and retry a refused collapse
        w, own = self.new_lut4_weight(huge_pages=False)
        if own == 0:  # holds nothing of its own: keep it (and its codes on huge pages, once)
            self.lut4w = w
            w.huge_pages()
        return w

    def row_call(self):
        if self.introw is not None:
            return "fb_introw_row", self.introw.row_call(self.in_features), native.introw_rc, self.introw
        if self.lut4w is None or self.qweight.scheme.activations is not None:
            return None
        return "fb_lut4_row", self.lut4w.row_call(self.in_features), native.lut4_rc, self.lut4w

    def tile_call(self):
        return "fb_lut4_tiles" if self.bf16_batches and self.lut4w is not None and self.row_call() is not None else None

    def forward(self, x2d, bias, dtype):
        return self.matmul(x2d, bias, dtype, self.bf16_batches and self.qweight.scheme.activations is None)

    def matmul(self, x2d, bias, dtype, bf16_batches: bool, x_quantized: bool = False):
        """x2d @ W.T + bias in `dtype`; w8a8 schemes' activations quantized and dequantized first
        unless `x_quantized`; float32 batches in bfloat16 blocks where `bf16_batches` and
        bf16_blocks say so."""
        if self.qweight.scheme.activations is not None and not x_quantized:
            x2d = quantize(x2d, self.qweight.scheme.activations).dequantize(x2d.dtype)
        dec = self.decoder
        if dec is None:
            return with_bias(F.linear(x2d, self.qweight.dequantize(x2d.dtype)), bias, dtype)
        n, rows = self.out_features, x2d.shape[0]
        if (self.introw is not None and rows <= LUT4_MAX_BATCH and x2d.device.type == "cpu"
                and x2d.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            lib = native.library()
            if lib is not None:  # introw.c: the codes read as stored, once per 8 rows of x
                return finished(self.introw.matmul(lib, x2d.to(torch.float32)), bias, dtype)
        lib = native.library() if dec.lut4 and x2d.device.type == "cpu" else None
        w = self.lut4_weight(lib)
        if w is not None and rows <= LUT4_MAX_BATCH and x2d.dtype in (torch.float32, torch.bfloat16, torch.float16):
            # the codes read once per 8 rows of x, never decoded to memory (x in float32: exact)
            return finished(w.matmul(lib, x2d if x2d.dtype == torch.float32 else x2d.to(torch.float32)), bias, dtype)
        # blocks of rows decoded, each multiplied at once: in bfloat16 where asked (bf16_blocks),
        # else in x's dtype
        mm_dtype = torch.bfloat16 if bf16_batches and bf16_blocks(x2d) else x2d.dtype
        if w is not None and mm_dtype == torch.bfloat16 and tile_batch(rows, x2d.shape[1]):
            # AMX: blocks of 32 rows decoded to bf16 in the caches, float32 sums, float32 x rounded
            # to bf16 in the same call (None without AMX)
            y = w.tile_matmul(lib, x2d)
            if y is not None:
                return finished(y, bias, dtype)
        with ops.one_thread_if_small(x2d.numel()):
            xm = x2d.to(mm_dtype)
        step = rows_per_block(dec.row_len, dec.fmt.bits, mm_dtype)
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
            return with_bias(F.linear(xm, block(0, n)), bias, dtype)
        return block_matmul(xm, n, step, block, bias, dtype)


class Dequant(LinearKernel):
    """dequant (bf16_batches: float32 batches in bfloat16 blocks where the CPU has hardware bf16)
    and dequant_fp32 (float32 blocks at every batch size; weight-only schemes on a CPU)."""

    def __init__(self, name: str, bf16_batches: bool):
        self.name, self.bf16_batches = name, bf16_batches

    def can_run(self, s, shape, device):
        return self.bf16_batches or (device.type == "cpu" and s.activations is None)

    def prepare(self, qt):
        return DequantWeight(qt, self.bf16_batches)


DEQUANT = Dequant("dequant", bf16_batches=True)
DEQUANT_FP32 = Dequant("dequant_fp32", bf16_batches=False)
