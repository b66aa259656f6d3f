"""int4pack: int4 symmetric / uint4 asymmetric weights (integer zero point or float minimum) in
groups of a multiple of 32 (or per channel / tensor) through torch's packed int4 matmul
(tinygemm): bfloat16 activations, bfloat16 (scale, zero) pairs. auto picks it where dequant's C
kernels cannot read the parameters as stored (q4_k's two-level scales) or are not built. The
packed weight is the only copy of the codes."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import lowbit_ops as ops
from ..scheme import QuantScheme
from .base import KernelQuantizedTensor, LinearKernel, PreparedWeight, is_int, per_row_or_tensor, with_bias


def int4_op_group(s: QuantScheme, in_features: int) -> tuple[int, int] | None:
    """(tinygemm group size, padded K) for an int4 scheme, or None when it cannot run there."""
    fmt = s.format
    if not (s.symmetric and is_int(fmt, 4, True)) and not (not s.symmetric and is_int(fmt, 4, False)):
        return None
    if s.granularity == "group":
        g = ops.int4_op_group_size(s.group_size)
        return (g, s.layout((1, in_features))[2]) if g else None
    if per_row_or_tensor(s):
        k_op = -(-in_features // ops.INT4_GROUP_SIZES[-1]) * ops.INT4_GROUP_SIZES[-1]
        return ops.int4_op_group_size(k_op), k_op
    return None


def _codes_from_int4pack(n: int, k_op: int, code_cols: int, symmetric: bool, kernel_tensors: dict) -> torch.Tensor:
    """The QuantizedTensor codes (low-first packed nibbles over [n, code_cols]) that tinygemm's
    packed weight [n, k_op] holds; a signed code c was stored as u = c ^ 8."""
    u = ops.unpack_int4(kernel_tensors["weight"], n, k_op)[:, :code_cols]
    return ops.pack_low_first(u ^ 8 if symmetric else u, 4)


class Int4Packed(PreparedWeight):
    def __init__(self, qt):
        s = qt.scheme
        n, k = (int(d) for d in qt.shape)
        group, k_op = int4_op_group(s, k)
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
        self.group, self.k_op = group, k_op
        code_cols = pcols if s.granularity == "group" else k
        super().__init__(KernelQuantizedTensor(qt, {"weight": packed, "scales_and_zeros": sz},
                                               codes_from_kernel=functools.partial(_codes_from_int4pack, n, k_op,
                                                                                   code_cols, symmetric)))

    def forward(self, x2d, bias, dtype):
        kt = self.qweight.kernel_tensors
        with ops.one_thread_if_small(x2d.numel()):
            xb = x2d.to(torch.bfloat16)
            if self.k_op != self.in_features:
                xb = F.pad(xb, (0, self.k_op - self.in_features))
            xb = xb.contiguous()
        y = ops.int4_matmul(xb, kt["weight"], self.group, kt["scales_and_zeros"])
        with ops.one_thread_if_small(y.numel()):
            return with_bias(y, bias, dtype)


class Int4Pack(LinearKernel):
    name = "int4pack"

    def can_run(self, s, shape, device):
        n, k = shape
        return (device.type == "cpu" and s.activations is None and int4_op_group(s, k) is not None
                and n % ops.INT4_N_MULTIPLE == 0 and ops.int4pack_layout() is not None)

    def prepare(self, qt):
        return Int4Packed(qt)


INT4PACK = Int4Pack()
