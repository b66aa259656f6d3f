"""int8pack: int8 weight-only layers, per channel or tensor, in_features % 16 == 0. Up to
LUT4_MAX_BATCH rows fewbits' C kernel (csrc/int8w.c, native.Int8Weight: each output's float32 sum
of code times x, times the row's float32 scale), or without the native library torch's int8
weight matmul (bfloat16 activations and scales); larger float32 batches on CPUs with hardware bf16
(bf16_blocks): the int8 codes as bfloat16 (exact) times bf16 activations -- on AMX tiles where the
build has them and tile_batch allows (csrc/tiles.h: 32 rows of codes at a time, float32 sums times
the float32 row scales), else in oneDNN's bf16 GEMM (the sums rounded to bf16, then times the
scales)."""
from __future__ import annotations

import torch

from ...kernels import native
from .. import lowbit_ops as ops
from ..tensor import QuantizedTensor
from .base import (
    LUT4_MAX_BATCH, KernelQuantizedTensor, LinearKernel, PreparedWeight, bf16_blocks, block_matmul, finished,
    int8_weight, rows_per_block, same_storage, tile_batch, weight_scales, with_bias,
)


class Int8Packed(PreparedWeight):
    def __init__(self, qt):
        n, k = (int(d) for d in qt.shape)
        # the kernel crashes on unaligned weights (see lowbit_ops): align the codes once here, so
        # that the weight stays a view of the codes and no call copies it
        codes = ops.aligned(qt.codes)
        if codes is not qt.codes:
            qt = QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype, {**qt.state_dict(), "codes": codes})
        w = codes.view(torch.int8).view(n, k)
        s = ops.aligned(weight_scales(qt).to(torch.bfloat16))
        # float32 scales for the bf16 block path (a view of the stored ones for per-channel fp32)
        self.scales_f32 = weight_scales(qt)
        if qt.scales is None or not same_storage(self.scales_f32, qt.scales):
            self.extra_nbytes = self.scales_f32.nbytes
        # a few rows: fewbits' C kernel (float32 activations) on the same codes and scales
        self.int8w = native.Int8Weight(w, self.scales_f32)
        super().__init__(KernelQuantizedTensor(qt, {"weight": w, "scales_bf16": s}))

    def row_call(self):
        return "fb_int8w_row", self.int8w.row_call(), native.int8w_rc, self.int8w

    def tile_call(self):
        return "fb_int8w_tiles"

    def forward(self, x2d, bias, dtype):
        kt = self.qweight.kernel_tensors
        lib = native.library()
        if lib is not None and x2d.shape[0] <= LUT4_MAX_BATCH and x2d.dtype in (torch.float32, torch.bfloat16,
                                                                                 torch.float16):
            # a few rows: each output q @ x in float32 times its row's scale (kernels/csrc/int8w.c)
            return finished(self.int8w.matmul(lib, x2d if x2d.dtype == torch.float32 else x2d.to(torch.float32)),
                            bias, dtype)
        lib = lib if bf16_blocks(x2d) else None
        if lib is not None and tile_batch(x2d.shape[0], self.in_features):
            # AMX: the codes as bf16 (exact) 32 rows at a time, float32 sums times the row scales
            y = self.int8w.tile_matmul(lib, x2d)
            if y is not None:
                return finished(y, bias, dtype)
        if lib is not None:
            # torch's int8 kernel is a GEMV: batches go to the bf16 GEMM, the int8 codes as they
            # are (exact in bf16), the rows' scales applied to the sums in float32 after it
            w = kt["weight"]
            step = rows_per_block(self.in_features, 8, torch.bfloat16)
            buf = torch.empty(min(step, self.out_features) * self.in_features, dtype=torch.bfloat16)
            with ops.one_thread_if_small(x2d.numel()):
                xm = x2d.to(torch.bfloat16)
            y = block_matmul(xm, self.out_features, step,
                             lambda r0, r1: native.int8_rows_bf16(lib, w, r0, r1, out=buf), None, torch.bfloat16)
            with ops.one_thread_if_small(y.numel()):
                return with_bias(y.to(torch.float32).mul_(self.scales_f32), bias, dtype)
        with ops.one_thread_if_small(x2d.numel()):
            xb = x2d.to(torch.bfloat16).contiguous()
        y = ops.int8_weight_matmul(xb, kt["weight"], kt["scales_bf16"])
        with ops.one_thread_if_small(y.numel()):
            return with_bias(y, bias, dtype)


class Int8Pack(LinearKernel):
    name = "int8pack"

    def can_run(self, s, shape, device):
        return (device.type == "cpu" and s.activations is None and int8_weight(s)
                and shape[1] % ops.INT8PACK_K_MULTIPLE == 0 and ops.int8pack_available())

    def prepare(self, qt):
        return Int8Packed(qt)


INT8PACK = Int8Pack()
