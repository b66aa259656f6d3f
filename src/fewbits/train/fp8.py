"""FP8-style scaling recipes: how a tensor is scaled into a narrow format's range before rounding.

  none     plain rounding: values below the format's smallest subnormal flush to zero, above
           its max saturate (or become inf, by the format's overflow default)
  current  per tensor: the scale comes from this tensor's own amax
  delayed  per tensor: the scale comes from the largest amax of the previous `history_len` casts
           at the same place in the model (Transformer Engine's recipe); this tensor's amax then
           joins the history. The first cast, with an empty history, uses its own amax.
  mx       per block of `block` consecutive values along the last dimension, one power-of-two
           (E8M0) scale each: 2^(floor(log2(block amax)) - emax of the element format), as the
           OCP Microscaling spec computes it; elements saturate.

Per-tensor scales here are powers of two, 2^(floor(log2(max / amax)) - margin), so scaling is
exact in binary floating point and the emulated result round(x * s) / s is exactly the value an
FP8 GEMM would see. A non-finite amax (an overflowing, loss-scaled gradient) neither sets the
scale nor enters the history. Saturation would turn that inf into a finite value, so a ScaledCast
tells the engine whether each input was finite (see ScaledCast.finite_log) and the step is skipped.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from ..formats import get_format
from .casts import round_to, saturates

_OVERFLOW = "saturate"


def pow2_scale(amax: float, fmt_max: float, margin: int = 0) -> float:
    """The power of two s with amax * s <= fmt_max < 2 * amax * s (1.0 for zero or non-finite amax)."""
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    return 2.0 ** (math.floor(math.log2(fmt_max / amax)) - margin)


def scaled_round(x: torch.Tensor, fmt, scale: float, mode: str = "nearest_even",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """round(x * scale, fmt) / scale, saturating (the scale is a power of two: exact)."""
    if scale == 1.0:
        return round_to(x, fmt, mode, _OVERFLOW, generator)
    q = round_to(x * scale, fmt, mode, _OVERFLOW, generator)
    return q.mul_(1.0 / scale)


def mx_round(x: torch.Tensor, fmt, block: int = 32, mode: str = "nearest_even",
             generator: torch.Generator | None = None) -> torch.Tensor:
    """x in MX blocks along its last dimension: per block an E8M0 scale X = 2^(floor(log2 amax) -
    emax_elem) and elements round(x / X, fmt) saturated; returns the dequantized values X * q."""
    return _mx_round(x, fmt, block, mode, generator)[0]


def _mx_round(x, fmt, block, mode, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(mx_round's result, the amax of every block: inf or NaN where the block held one)."""
    fmt = get_format(fmt)
    if x.dim() == 0:
        x2 = x.reshape(1, 1)
    else:
        x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[-1]
    pad = (-n) % block
    work = x2.float()
    if pad:
        work = torch.nn.functional.pad(work, (0, pad))
    blocks = work.reshape(work.shape[0], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    emax_elem = math.floor(math.log2(fmt.max))
    # floor(log2(amax)) exactly, from the float's exponent; zero blocks get the smallest scale
    exp = torch.frexp(amax).exponent - 1
    shared = (exp - emax_elem).clamp(-127, 127)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -127))
    scale = torch.ldexp(torch.ones_like(amax), shared)
    q = round_to(blocks / scale, fmt, mode, _OVERFLOW, generator) * scale
    q = q.reshape(work.shape)[:, :n] if pad else q.reshape(work.shape)
    return q.reshape(x.shape).to(x.dtype), amax


class ScaledCast:
    """A callable rounding tensors to `fmt` under one recipe, keeping the state of one place in
    the model (its amax history). `observe(before, after)` is called when telemetry asks.

    Every recipe but plain rounding to a format with infinities saturates: an inf becomes a
    finite value, and a step that met one would go on as if nothing happened. While
    `finite_log` is a list, each call whose rounding saturates appends (label, whether its input
    was finite): a bool where the recipe already fetched the amax (current, delayed), else a
    0-dim bool tensor on the input's device (no wait for the device; the engine reads them all
    at once in step())."""

    def __init__(self, fmt, recipe: str = "none", mode: str = "nearest_even", history_len: int = 16,
                 margin: int = 0, block: int = 32, generator: torch.Generator | None = None):
        self.fmt = get_format(fmt)
        self.recipe, self.mode, self.margin, self.block = recipe, mode, margin, block
        self.history: deque[float] = deque(maxlen=history_len)
        self.generator = generator
        self.observer = None
        self.last_scale = 1.0
        self.hides_nonfinite = recipe != "none" or saturates(self.fmt)
        self.finite_log: list | None = None
        self.label = ""

    def scale_for(self, x: torch.Tensor) -> tuple[float, float]:
        """(scale to use now, amax of x)."""
        amax = float(x.detach().abs().amax()) if x.numel() else 0.0
        if self.recipe == "current" or not self.history:
            return pow2_scale(amax, self.fmt.max, self.margin), amax
        return pow2_scale(max(self.history), self.fmt.max, self.margin), amax

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        log = self.finite_log if self.hides_nonfinite else None
        if self.recipe == "mx":
            out, amax = _mx_round(x, self.fmt, self.block, self.mode, self.generator)
            if log is not None:
                log.append((self.label, torch.isfinite(amax).all()))
        elif self.recipe in ("current", "delayed"):
            scale, amax = self.scale_for(x)
            self.last_scale = scale
            out = scaled_round(x, self.fmt, scale, self.mode, self.generator)
            if math.isfinite(amax):
                self.history.append(amax)
            if log is not None:
                log.append((self.label, math.isfinite(amax)))
        else:
            if log is not None:
                log.append((self.label, torch.isfinite(x).all()))
            out = round_to(x, self.fmt, self.mode, None, self.generator)
        if self.observer is not None:
            self.observer(x, out, self)
        return out

    def state_dict(self) -> dict:
        return {"history": list(self.history), "last_scale": self.last_scale}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s output; ValueError (before any change) if it is malformed."""
        real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not (isinstance(state, dict) and set(state) == {"history", "last_scale"}
                and isinstance(state["history"], list) and all(real(v) for v in state["history"])
                and real(state["last_scale"])):
            raise ValueError("an FP8 cast state is {'history': [numbers], 'last_scale': number}")
        self.history.clear()
        self.history.extend(float(v) for v in state["history"])
        self.last_scale = float(state["last_scale"])
