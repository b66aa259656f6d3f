"""w4a8: int4 weights (or uint4 with a float minimum) in groups of 32 times dynamic int8
activations in blocks of 32 (llama.cpp's q4_0 x q8_0 kind), up to W4A8_MAX_BATCH rows in one C
call (csrc/w4a8.c, native.W4A8Weight: the activations quantized as quantize() does, the products
of codes summed exactly in int32, AVX512-VNNI or AVX2), on CPUs where that C kernel is vectorized.
Larger batches: the activations quantized and dequantized the same way in C, then dequant's
blocks (in bfloat16 where bf16_blocks, as for weight-only layers)."""
from __future__ import annotations

import torch

from ...kernels import native
from .base import W4A8_MAX_BATCH, LinearKernel, PreparedWeight, bf16_blocks, finished, is_int
from .dequant import DequantWeight


def w4a8_scheme(s, shape) -> bool:
    """Whether csrc/w4a8.c runs this scheme, vectorized, with its exact arithmetic: 4-bit integer
    weight codes (int4 symmetric, or uint4 with a float minimum) in row groups of 32 with float
    scales as stored, and int8 absmax activations in blocks of 32 with float32 scales (quantized
    in the C call as quantize() does)."""
    a = s.activations
    n, k = shape
    weights = (s.granularity == "group" and s.group_size == 32 and k > 0 and k % 32 == 0 and not s.double_quant
               and s.super_block is None and s.scale_format in ("fp32", "fp16", "bf16")
               and ((s.symmetric and is_int(s.format, 4, True))
                    or (not s.symmetric and is_int(s.format, 4, False) and s.zero_point == "float")))
    acts = (is_int(a.format, 8, True) and a.symmetric and a.scale_method == "absmax" and a.mode == "nearest_even"
            and a.scale_format == "fp32" and not a.double_quant and a.activations is None
            and a.granularity == "group" and a.group_size == 32)
    if not (weights and acts):
        return False
    lib = native.library()
    return lib is not None and bool(lib.fb_w4a8_vectorized())


class W4A8Prepared(PreparedWeight):
    def __init__(self, qt):
        super().__init__(qt)
        s = qt.scheme
        self.w = native.W4A8Weight(qt.codes, qt.scales, self.out_features, self.in_features, s.symmetric,
                                   qt.minimums if not s.symmetric else None)
        self.batches = DequantWeight(qt)  # batches beyond W4A8_MAX_BATCH rows
        self.extra_nbytes = self.batches.extra_nbytes + self.w.own_nbytes(list(qt.state_dict().values()))

    def row_call(self):
        return "fb_w4a8_row", self.w.row_call(), native.w4a8_row_rc, self.w

    def forward(self, x2d, bias, dtype):
        lib = native.library()
        small = x2d.shape[0] <= W4A8_MAX_BATCH
        # the C kernel takes float32 (float16 / bfloat16 inputs are exact in it); batches of other
        # dtypes keep them (bf16_blocks is a rule for float32 batches), as the dequant kernel does
        if (lib is None or x2d.device.type != "cpu"
                or x2d.dtype not in ((torch.float32, torch.bfloat16, torch.float16) if small else (torch.float32,))):
            return self.batches.forward(x2d, bias, dtype)
        x = x2d if x2d.dtype == torch.float32 else x2d.to(torch.float32)
        if small:
            return finished(self.w.linear(lib, x), bias, dtype)
        # batches: the activations quantized per block by the C quantizer (quantize()'s codes and
        # scales) and dequantized (one float32 product each, in the same C call), then dequant's
        # blocks -- in bfloat16 where bf16_blocks says so, as for weight-only layers (bf16 of the
        # dequantized activations and of the dequantized weight, float32 sums)
        mm_dtype = torch.bfloat16 if bf16_blocks(x) else torch.float32  # rounded in the same C pass
        return self.batches.matmul(native.w4a8_dequantized_x(lib, x, mm_dtype), bias, dtype, True, x_quantized=True)


class W4A8(LinearKernel):
    name = "w4a8"

    def can_run(self, s, shape, device):
        return device.type == "cpu" and s.activations is not None and w4a8_scheme(s, shape)

    def prepare(self, qt):
        return W4A8Prepared(qt)


W4A8_KERNEL = W4A8()
