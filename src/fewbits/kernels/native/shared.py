"""What the binding modules share: the text of the non-finite activations error, the dtype
codes of their parameter tensors, and the tensors their one-row kernels stream at every call."""
from __future__ import annotations

import torch

from .. import hugepages

NONFINITE_ACTIVATIONS = "the activations contain NaN or inf, which dynamic int8 quantization cannot represent"
PARAM_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # lut4.c's / w4a8.c's P_F32, P_F16, P_BF16


def streamed(t: torch.Tensor) -> torch.Tensor:
    """t, bytes a one-row kernel reads at every call (a prepared weight's codes or panels), after
    asking Linux to put it on transparent huge pages (kernels/hugepages.py: best effort, contents
    and address unchanged): the one place that decides which tensors go there."""
    hugepages.collapse(t)
    return t
