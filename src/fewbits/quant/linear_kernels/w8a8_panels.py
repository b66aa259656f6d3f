"""w8a8_amx and w8a8_vnni: int8 weights times dynamic per-token (or per-tensor) int8 activations
through int8mm.c's panels (native.Int8Panels): the weight packed once into VNNI panels (its only
copy of the codes), batches on the AMX int8 tiles (TDPBSSD, w8a8_amx) or, on CPUs with
AVX512-VNNI and no AMX (AMD Zen 4, Intel Ice Lake), with the same VNNI dot products row by row
(fb_vnni_gemm_u8, 8 rows per pass over a panel: w8a8_vnni); one row with the VNNI kernel over the
same panels. Exact int32 sums, y = (float(sum) * sx) * sw (+ bias): the same float32 steps for a
row and a batch, the same bits on both."""
from __future__ import annotations

import torch

from ...kernels import native
from .. import lowbit_ops as ops
from .base import (
    KernelQuantizedTensor, LinearKernel, PreparedWeight, int8_activations, int8_weight, w8a8_activations_fast,
    weight_scales, with_bias,
)
from .dequant import DequantWeight


def panels_run(k: int, tiles: bool) -> bool:
    """Whether int8mm.c's panel kernels (native.Int8Panels) run a w8a8 layer of rows of k here:
    with its batches on the AMX tiles (w8a8_amx) or with VNNI dot products (w8a8_vnni)."""
    lib = native.library()
    ready = native.amx_w8a8_ready if tiles else native.vnni_w8a8_ready
    return lib is not None and 0 < k <= native.AMX_GEMV_MAX_K and ready(lib)


class PanelWeight(PreparedWeight):
    def __init__(self, qt, name: str, tiles: bool):
        n, k = (int(d) for d in qt.shape)
        lib = native.library()
        if lib is None:  # native.turned_off() at construction: where the kernel was chosen before
            raise RuntimeError(f"the {name} kernel needs fewbits' native library")
        panels = native.Int8Panels(lib, qt.codes.view(torch.int8).view(n, k), tiles=tiles)
        self.panels = panels
        super().__init__(KernelQuantizedTensor(
            qt, {"panels": panels.panels, "colsum128": panels.colsum128, "weight_scales": weight_scales(qt)},
            codes_from_kernel=lambda kt: native.Int8Panels.codes(kt["panels"], n, k).view(torch.uint8).reshape(-1)))
        # without the native library at a call (native.turned_off()): the exact torch path
        self.fallback = DequantWeight(self.qweight, rows=False)

    def row_call(self):
        # one row's activations quantized as fb_w8a8_amx_row does in C: per token (or per tensor:
        # one row is both) with float32 scales
        a = self.qweight.scheme.activations
        if not (a.scale_format == "fp32" and a.granularity in ("channel", "tensor")):
            return None
        sw = self.qweight.kernel_tensors["weight_scales"]
        return "fb_w8a8_amx_row", self.panels.row_call(sw), native.w8a8_amx_row_rc, self.panels

    def forward(self, x2d, bias, dtype):
        lib = native.library()
        if lib is None or x2d.device.type != "cpu":
            return self.fallback.forward(x2d, bias, dtype)
        a = self.qweight.scheme.activations
        q, sx = int8_activations(a, x2d, offset=self.panels.vnni_rows(x2d.shape[0]))  # uint8 q + 128 for VNNI
        fuse = bias is not None and bias.dtype == torch.float32  # added in float32, before x's dtype
        y = self.panels.matmul(lib, q, sx, self.qweight.kernel_tensors["weight_scales"], bias if fuse else None)
        if dtype == torch.float32 and (fuse or bias is None):
            return y
        with ops.one_thread_if_small(y.numel()):
            return with_bias(y, None if fuse else bias, dtype)


class Panels(LinearKernel):
    def __init__(self, name: str, tiles: bool):
        self.name, self.tiles = name, tiles

    def can_run(self, s, shape, device):
        return (device.type == "cpu" and s.activations is not None and int8_weight(s)
                and w8a8_activations_fast(s.activations) and panels_run(shape[1], self.tiles))

    def prepare(self, qt):
        return PanelWeight(qt, self.name, self.tiles)


W8A8_AMX = Panels("w8a8_amx", tiles=True)
# after the tiles, ahead of oneDNN's GEMM, whose call for one row costs ~80 us of a 576-wide
# layer's decode step
W8A8_VNNI = Panels("w8a8_vnni", tiles=False)
PANEL_KERNELS = (W8A8_AMX.name, W8A8_VNNI.name)  # no torch-op form
