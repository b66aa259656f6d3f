"""bf16: a plain bfloat16 cast of the weight through oneDNN's (cuBLAS's on CUDA) bfloat16 GEMM,
bfloat16 activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...formats import get_format
from .. import lowbit_ops as ops
from .base import KernelQuantizedTensor, LinearKernel, PreparedWeight, with_bias


class Bf16Weight(PreparedWeight):
    def __init__(self, qt):
        n, k = (int(d) for d in qt.shape)
        super().__init__(KernelQuantizedTensor(qt, {"weight": qt.codes.view(torch.bfloat16).view(n, k)}))

    def forward(self, x2d, bias, dtype):
        with ops.one_thread_if_small(x2d.numel()):
            xb = x2d.to(torch.bfloat16)
        y = F.linear(xb, self.qweight.kernel_tensors["weight"])
        with ops.one_thread_if_small(y.numel()):
            return with_bias(y, bias, dtype)


class Bf16(LinearKernel):
    name = "bf16"

    def can_run(self, s, shape, device):
        return s.activations is None and s.scale_format == "none" and s.format == get_format("bf16")

    def prepare(self, qt):
        return Bf16Weight(qt)


BF16 = Bf16()
