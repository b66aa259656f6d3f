"""What the binding modules share: the one reading of the C kernels' return codes, the dtype
codes of their parameter tensors, and the tensors their one-row kernels stream at every call."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .. import hugepages

NONFINITE_ACTIVATIONS = "the activations contain NaN or inf, which dynamic int8 quantization cannot represent"
PARAM_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # lut4.c's / w4a8.c's P_F32, P_F16, P_BF16


def check_rc(rc: int, refused: str, no_memory: str | None = None, nonfinite: bool = False) -> None:
    """Raise for a non-zero return code of a C kernel, as every kernel of csrc/ returns them: -3
    the activations hold NaN or inf (ValueError(NONFINITE_ACTIVATIONS), for kernels that
    quantize them: `nonfinite`), -2 an allocation failed (MemoryError(no_memory), for kernels
    that allocate), any other code RuntimeError(refused)."""
    if not rc:
        return
    if rc == -3 and nonfinite:
        raise ValueError(NONFINITE_ACTIVATIONS)
    if rc == -2 and no_memory is not None:
        raise MemoryError(no_memory)
    raise RuntimeError(refused)


def rc_check(refused: str, no_memory: str | None = None, nonfinite: bool = False) -> Callable[[int], None]:
    """check_rc with one kernel's messages bound: rc -> None or raises (a RowKernel's check,
    called after every one-row call, so a zero code costs one test)."""
    def check(rc: int) -> None:
        if rc:
            check_rc(rc, refused, no_memory, nonfinite)
    return check


def streamed(t: torch.Tensor) -> torch.Tensor:
    """t, bytes a one-row kernel reads at every call (a prepared weight's codes or panels), after
    asking Linux to put it on transparent huge pages (kernels/hugepages.py: best effort, contents
    and address unchanged): the one place that decides which tensors go there."""
    hugepages.collapse(t)
    return t
