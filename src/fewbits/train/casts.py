"""Autograd-aware emulated casts: a tensor rounded to a fewbits format in the forward pass, its
gradient rounded to (another) format in the backward pass.

`round_to` is the one rounding entry point of train/: torch's own casts where their semantics are
fb.round's exactly (fp32/bf16 input to bf16 or fp16, nearest-even, overflow to inf — the IEEE
casts), fb.round for everything else. tests/train/test_casts.py checks the two agree.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..formats import get_format, torch_dtype
from ..kernels import round as fb_round

def native_dtype(fmt_name) -> torch.dtype | None:
    """The torch dtype that stores exactly the values of a format, if there is one and training
    computes in it: fp32, bf16, fp16 (fp64 is not one: a float32 model's values are fp64 values
    already, so an fp64 role is no cast)."""
    dtype = torch_dtype(fmt_name)
    return None if dtype == torch.float64 else dtype


def round_to(x: torch.Tensor, fmt, mode: str = "nearest_even", overflow: str | None = None,
             generator: torch.Generator | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to the values of `fmt`, in x's dtype (into `out` if given)."""
    fmt = get_format(fmt)
    target = native_dtype(fmt)
    if target is not None and x.dtype != torch.float64 and mode != "stochastic":
        if target == x.dtype or (target == torch.float32 and x.is_floating_point()):
            # every value of x is already a value of the format
            return x if out is None else out.copy_(x)
        if mode == "nearest_even" and overflow in (None, "inf"):
            return x.to(target).to(x.dtype) if out is None else out.copy_(x.to(target))
    return fb_round(x, fmt, mode=mode, overflow=overflow, generator=generator, out=out)


def saturates(fmt, overflow: str | None = None) -> bool:
    """Whether rounding to `fmt` under `overflow` (None: the format's default) turns an infinity
    into a finite value. Such a cast would hide a non-finite tensor from the step's inf/NaN
    check, so the engine checks what enters it (NaN stays NaN under every overflow policy)."""
    return get_format(fmt).check_overflow(overflow) == "saturate"


Quantize = Callable[[torch.Tensor], torch.Tensor]


class _Cast(torch.autograd.Function):
    """forward: fwd(x) (or x); backward: bwd(grad) (or grad) — a straight-through rounding."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x) if fwd is not None else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.bwd(grad) if ctx.bwd is not None else grad), None, None


def cast(x: torch.Tensor, forward: Quantize | None = None, backward: Quantize | None = None) -> torch.Tensor:
    """x through `forward` (e.g. a rounding to fp8) with its gradient through `backward`.

    The cast itself is straight-through for autograd: d cast(x)/dx = 1, so the gradient that
    reaches x is exactly backward(incoming gradient)."""
    if forward is None and backward is None:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):
        return forward(x) if forward is not None else x
    return _Cast.apply(x, forward, backward)
