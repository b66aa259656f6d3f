"""QuantLinear's kernels: one module per kernel family (each a LinearKernel that says whether it
runs a scheme and shape on a device, and the PreparedWeight it holds a layer's weight as), the
batch rules and output steps they share (base), row decoding (rows), and the order auto tries
them in (registry)."""
from .base import (
    DOT_MAX_VALUES, LUT4_MAX_BATCH, TILE_MAX_VALUES, W4A8_MAX_BATCH, KernelQuantizedTensor, LinearKernel,
    PreparedWeight, bf16_blocks, tile_batch, tile_limit,
)
from .registry import KERNELS, ORDER, available_kernels, kernel
from .rows import RowDecoder
from .w8a8_gemm import cpu_int8_gemm_exact
from .w8a8_panels import PANEL_KERNELS

__all__ = [
    "LinearKernel", "PreparedWeight", "KernelQuantizedTensor", "RowDecoder", "KERNELS", "ORDER", "PANEL_KERNELS",
    "available_kernels", "kernel", "bf16_blocks", "tile_batch", "tile_limit", "cpu_int8_gemm_exact",
    "LUT4_MAX_BATCH", "W4A8_MAX_BATCH", "TILE_MAX_VALUES", "DOT_MAX_VALUES",
]
