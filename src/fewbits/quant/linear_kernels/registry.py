"""The kernels of a QuantLinear, in the order kernel="auto" tries them: the one place where the
choice is made. A new kernel family is a module of its own (a LinearKernel and the
PreparedWeight it builds) and one line of ORDER.

available_kernels(scheme, shape, device) walks ORDER and keeps each kernel that can run the
scheme and shape there (and whose entry's condition holds); the first is what auto picks.
docs/architecture.md has the table of what each scheme gets (tests/quant/test_kernel_registry.py
checks it against this machine)."""
from __future__ import annotations

import torch

from ..scheme import get_scheme
from .base import LinearKernel
from .bf16 import BF16
from .dequant import DEQUANT, DEQUANT_FP32, introw_first, lut4_first
from .fp8 import W8A8_FP8
from .int4pack import INT4PACK
from .int8pack import INT8PACK
from .w4a8 import W4A8_KERNEL
from .w8a8_gemm import W8A8_INT_MM, W8A8_ONEDNN
from .w8a8_panels import W8A8_AMX, W8A8_VNNI


def _native_lead(s, shape, device) -> bool:
    # fewbits' 4-bit C kernels with the parameters as stored: faster than tinygemm at every batch,
    # exact; and introw.c's one-row kernel for the GGUF types lut4.c cannot read as stored (q4_k:
    # tinygemm would take its activations to bfloat16 and has no one-row call for the decoder)
    return device.type == "cpu" and s.activations is None and (lut4_first(s, shape) or introw_first(s, shape))


def _off_cpu(s, shape, device) -> bool:
    return device.type != "cpu"


# (kernel, a condition on its place here or None). A kernel may appear twice: the first place
# whose condition holds counts.
ORDER: tuple[tuple[LinearKernel, object], ...] = (
    (DEQUANT, _native_lead),
    (W4A8_KERNEL, None),
    (W8A8_AMX, None),
    (W8A8_VNNI, None),
    (W8A8_ONEDNN, None),
    (W8A8_INT_MM, None),
    (W8A8_FP8, _off_cpu),  # FP8 tensor cores: ahead of dequant
    (INT4PACK, None),
    (INT8PACK, None),
    (BF16, None),
    (DEQUANT, None),
    (W8A8_FP8, None),  # on a CPU torch's reference _scaled_mm: exact, slow, only when asked for
    (DEQUANT_FP32, None),
)

def names() -> tuple[str, ...]:
    """Every kernel's name, once each, in ORDER's order."""
    return tuple(dict.fromkeys(k.name for k, _ in ORDER))


def kernel(name: str) -> LinearKernel:
    """The kernel named `name` (one of names())."""
    for k, _ in ORDER:
        if k.name == name:
            return k
    raise KeyError(name)


KERNELS = names()  # the names at import (fewbits.quant.KERNELS)


def available_kernels(scheme, shape, device="cpu") -> list[str]:
    """The kernels that can run a weight of `shape` [out, in] in `scheme` on `device`, fastest
    first (the first one is what kernel="auto" picks). Off the CPU: w8a8_int_mm (CUDA; both
    dimensions multiples of 8, as cuBLASLt's int8 GEMM wants), w8a8_fp8 (CUDA 8.9+), bf16 and
    dequant."""
    s = get_scheme(scheme)
    n, k = (int(d) for d in shape)
    dev = torch.device(device)
    out = []
    for kern, where in ORDER:
        if kern.name not in out and (where is None or where(s, (n, k), dev)) and kern.can_run(s, (n, k), dev):
            out.append(kern.name)
    return out
