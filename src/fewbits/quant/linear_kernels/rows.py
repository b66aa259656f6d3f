"""Decoding rows of a 2-d weight with QuantizedTensor.dequantize()'s arithmetic: the dequant
kernel's blocks of output rows, and the rows an embedding lookup reads."""
from __future__ import annotations

import torch

from ...kernels import native
from .. import lowbit_ops as ops
from .. import scales as sc
from ..scheme import QuantScheme
from ..tensor import QuantizedTensor


class RowDecoder:
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
        row_len, groups = RowDecoder.row_layout(s, shape)
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
