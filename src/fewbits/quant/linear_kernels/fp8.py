"""w8a8_fp8: E4M3 weights per channel (or tensor) times dynamic E4M3 activations per token (or
tensor): the codes as quantize() makes them, multiplied by torch._scaled_mm with the two float32
scale vectors (float32 sums, one rounding). FP8 tensor cores on CUDA compute capability 8.9+,
where auto picks it; on a CPU only when asked for (torch's CPU _scaled_mm is a slow reference
loop; auto picks dequant there)."""
from __future__ import annotations

import torch

from ...formats import get_format
from ..tensor import quantize
from .base import KernelQuantizedTensor, LinearKernel, PreparedWeight, per_row_or_tensor, weight_scales, with_bias


def fp8_scheme(s) -> bool:
    """E4M3 weights per channel or tensor and E4M3 activations per token or tensor, absmax
    float32 scales, nearest-even: what torch._scaled_mm multiplies as quantize() made it."""
    e4m3 = get_format("fp8_e4m3")
    a = s.activations
    plain = lambda t: (t.format == e4m3 and t.symmetric and t.scale_format == "fp32"  # noqa: E731
                       and t.scale_method == "absmax" and t.mode == "nearest_even" and not t.double_quant)
    return (a is not None and plain(s) and per_row_or_tensor(s) and plain(a) and a.activations is None
            and (a.granularity == "tensor" or (a.granularity == "channel" and a.axis in (0, -2))))


def fp8_gemm_hardware(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


class Fp8Weight(PreparedWeight):
    def __init__(self, qt):
        n, k = (int(d) for d in qt.shape)
        w = qt.codes.view(torch.float8_e4m3fn).view(n, k)  # OCP E4M3 bits
        super().__init__(KernelQuantizedTensor(qt, {"weight": w, "weight_scales": weight_scales(qt).reshape(1, -1)}))

    def forward(self, x2d, bias, dtype):
        a = self.qweight.scheme.activations
        qx = quantize(x2d, a)  # the E4M3 codes and float32 scales quantize() defines
        m = x2d.shape[0]
        xq = qx.codes.view(torch.float8_e4m3fn).view(m, self.in_features)
        sx = qx.scale_values().reshape(-1, 1).float()
        if sx.shape[0] != m:  # a per-tensor activation scale, one per row for _scaled_mm
            sx = sx.reshape(1, 1).expand(m, 1).contiguous()
        kt = self.qweight.kernel_tensors
        # the result: bfloat16 on CUDA (what cuBLASLt's row-wise FP8 GEMM gives), float32 on a CPU
        out = torch.float32 if x2d.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(xq, kt["weight"].t(), scale_a=sx, scale_b=kt["weight_scales"], out_dtype=out)
        return with_bias(y, bias, dtype)


class Fp8(LinearKernel):
    name = "w8a8_fp8"

    def can_run(self, s, shape, device):
        if not fp8_scheme(s):
            return False
        if device.type == "cpu":  # the CPU's reference _scaled_mm: exact, slow, only when asked for
            return hasattr(torch, "_scaled_mm")
        n, k = shape
        return fp8_gemm_hardware(device) and n % 16 == 0 and k % 16 == 0

    def prepare(self, qt):
        return Fp8Weight(qt)


W8A8_FP8 = Fp8()
