"""w8a8_onednn and w8a8_int_mm: int8 weights times dynamic per-token (or per-tensor) int8
activations with exact int32 products in torch's int8 GEMMs (oneDNN's prepacked qlinear, or
torch._int_mm; cuBLASLt's on CUDA), then one float32 rescale. On a CPU only where they are exact
(cpu_int8_gemm_exact: not without VNNI)."""
from __future__ import annotations

import functools

import torch

from ...kernels import int8 as kernels_int8
from .. import lowbit_ops as ops
from .base import (
    KernelQuantizedTensor, LinearKernel, PreparedWeight, int8_activations, int8_weight, rescaled,
    w8a8_activations_fast, weight_scales,
)


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


def _codes_from_onednn(kernel_tensors: dict) -> torch.Tensor:
    return ops.onednn_unpack_int8(kernel_tensors["weight"]).view(torch.uint8).reshape(-1)


class OneDnnWeight(PreparedWeight):
    def __init__(self, qt):
        n, k = (int(d) for d in qt.shape)
        prepacked = ops.onednn_prepack_int8(qt.codes.view(torch.int8).view(n, k))
        super().__init__(KernelQuantizedTensor(qt, {"weight": prepacked, "weight_scales": weight_scales(qt)},
                                               codes_from_kernel=_codes_from_onednn,
                                               kernel_nbytes={"weight": ops.onednn_prepacked_nbytes(n, k)}))

    def forward(self, x2d, bias, dtype):
        q_u8, sx = int8_activations(self.qweight.scheme.activations, x2d, offset=True)
        kt = self.qweight.kernel_tensors
        y = ops.int8_int8_matmul_onednn(q_u8, kt["weight"], kt["weight_scales"])  # acc * s_w
        with ops.one_thread_if_small(y.numel()):
            return rescaled(y, sx.unsqueeze(1), bias, dtype)


class IntMmWeight(PreparedWeight):
    def __init__(self, qt):
        n, k = (int(d) for d in qt.shape)
        w = qt.codes.view(torch.int8).view(n, k)
        super().__init__(KernelQuantizedTensor(qt, {"weight": w, "weight_scales": weight_scales(qt)}))

    def forward(self, x2d, bias, dtype):
        q, sx = int8_activations(self.qweight.scheme.activations, x2d, offset=False)
        kt = self.qweight.kernel_tensors
        acc = ops.int8_int8_matmul(q, kt["weight"])
        with ops.one_thread_if_small(acc.numel()):
            return rescaled(acc.to(torch.float32).mul_(kt["weight_scales"]), sx.unsqueeze(1), bias, dtype)


def _int8_gemm_scheme(s) -> bool:
    return s.activations is not None and int8_weight(s) and w8a8_activations_fast(s.activations)


class OneDnn(LinearKernel):
    name = "w8a8_onednn"

    def can_run(self, s, shape, device):
        return (device.type == "cpu" and _int8_gemm_scheme(s) and ops.onednn_int8_available()
                and cpu_int8_gemm_exact(self.name))

    def prepare(self, qt):
        return OneDnnWeight(qt)


class IntMm(LinearKernel):
    name = "w8a8_int_mm"

    def can_run(self, s, shape, device):
        if not _int8_gemm_scheme(s):
            return False
        if device.type == "cpu":
            return cpu_int8_gemm_exact(self.name)
        n, k = shape  # cuBLASLt's int8 GEMM wants both dimensions multiples of 8
        return device.type == "cuda" and n % 8 == 0 and k % 8 == 0

    def prepare(self, qt):
        return IntMmWeight(qt)


W8A8_ONEDNN = OneDnn()
W8A8_INT_MM = IntMm()
