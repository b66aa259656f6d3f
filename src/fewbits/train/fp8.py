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

  rowwise  per row along the reduction dimension of each GEMM, one power-of-two scale per row
           (train/gemm.py: the linear layers' three GEMMs, each operand scaled anew)

Per-tensor scales here are powers of two, 2^(floor(log2(max / amax)) - margin) capped at 2^127,
so scaling is exact in binary floating point and the emulated result round(x * s) / s is exactly
the value an FP8 GEMM would see. They are computed on the tensor's device (amax, history and
scale are device tensors): a cast never waits for the device. A non-finite amax (an overflowing, loss-scaled gradient) neither sets the
scale nor enters the history. Saturation would turn that inf into a finite value, so a ScaledCast
tells the engine whether each input was finite (see ScaledCast.finite_log) and the step is skipped.
"""
from __future__ import annotations

import math

import torch

from ..formats import get_format
from .casts import round_to, saturates

_OVERFLOW = "saturate"
FLOAT8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # torch's own FP8 dtypes


def float8_dtype(fmt) -> torch.dtype | None:
    """The torch float8 dtype holding exactly the values of `fmt` (None: there is none)."""
    return FLOAT8_DTYPES.get(get_format(fmt).name)


MAX_SCALE_EXP = 127  # the largest scale is 2^127: a float32 (and bfloat16) can hold it


def pow2_scale(amax: float, fmt_max: float, margin: int = 0) -> float:
    """The power of two s with amax * s <= fmt_max < 2 * amax * s, times 2^-margin, at most
    2^127 (1.0 for zero or non-finite amax). floor(log2 q) is read off q's exponent: exact."""
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    return 2.0 ** min(math.frexp(fmt_max / amax)[1] - 1 - margin, MAX_SCALE_EXP)


def pow2_scales(amax: torch.Tensor, fmt_max: float, margin: int = 0) -> torch.Tensor:
    """pow2_scale of every element of `amax`, on its device, as float32 (the same values: the
    quotient is formed in float64 as Python forms it)."""
    a = amax.double()
    exp = torch.frexp(fmt_max / a).exponent.to(torch.float64) - (1 + margin)
    s = torch.ldexp(torch.ones_like(a), exp.clamp(max=MAX_SCALE_EXP))
    return torch.where((a > 0) & torch.isfinite(a), s, torch.ones_like(s)).float()


def scaled_round(x: torch.Tensor, fmt, scale: float | torch.Tensor, mode: str = "nearest_even",
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
    was finite) as a 0-dim bool tensor on the input's device (no wait for the device; the
    engine reads them all at once in step()).

    The per-tensor recipes keep amax, history and scale on the input's device: the history is a
    ring of `history_len` amaxes (-1 marks an empty place), and `history` / `last_scale` read
    it back when asked (telemetry, checkpoints, tests)."""

    def __init__(self, fmt, recipe: str = "none", mode: str = "nearest_even", history_len: int = 16,
                 margin: int = 0, block: int = 32, generator: torch.Generator | None = None):
        self.fmt = get_format(fmt)
        self.recipe, self.mode, self.margin, self.block = recipe, mode, margin, block
        self.history_len = history_len
        self._hist = torch.full((history_len,), -1.0)
        self._last_scale = torch.ones(())
        self.generator = generator
        self.observer = None
        self.hides_nonfinite = recipe != "none" or saturates(self.fmt)
        self.finite_log: list | None = None
        self.label = ""

    @property
    def history(self) -> list[float]:
        """The amaxes the next delayed scale comes from, oldest first."""
        return [v for v in self._hist.tolist() if v >= 0]

    @property
    def last_scale(self) -> float:
        return float(self._last_scale)

    def scale_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scale to use now, x's amax), 0-dim float32 tensors on x's device; the history
        takes x's amax if it is finite."""
        if self._hist.device != x.device:
            self._hist = self._hist.to(x.device)
        amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        ref = amax
        if self.recipe == "delayed":
            past = self._hist.amax()
            ref = torch.where(past >= 0, past, amax)  # an empty history: x's own amax
        scale = pow2_scales(ref, self.fmt.max, self.margin)
        rolled = torch.cat([self._hist[1:], amax.to(self._hist.dtype).reshape(1)])
        self._hist = torch.where(torch.isfinite(amax), rolled, self._hist)
        self._last_scale = scale
        return scale, amax

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, d): x scaled and rounded to the format, held in its torch float8 dtype, and the
        float32 dequantization factor d = 1 / scale (so x ~ q * d), for an FP8 GEMM; the same
        bookkeeping and values as calling the cast (a per-tensor recipe or plain rounding)."""
        if self.recipe not in ("none", "current", "delayed"):
            raise ValueError(f"quantize() is per tensor; recipe {self.recipe!r} is not")
        if float8_dtype(self.fmt) is None:
            raise ValueError(f"{self.fmt.name} has no torch float8 dtype")
        log = self.finite_log if self.hides_nonfinite else None
        if self.recipe == "none":
            scale = torch.ones((), device=x.device)
            amax = None
        else:
            scale, amax = self.scale_for(x)
        if log is not None:
            log.append((self.label, torch.isfinite(amax) if amax is not None else torch.isfinite(x).all()))
        # plain rounding overflows as the format does (E5M2: to inf, which the step then sees),
        # as __call__ rounds; the scaled recipes saturate
        q = to_float8(x.float() * scale, self.fmt, self.mode, self.generator,
                      saturate=self.recipe != "none" or saturates(self.fmt))
        if self.observer is not None:
            self.observer(x, (q.float() / scale).to(x.dtype), self)
        return q, 1.0 / scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        log = self.finite_log if self.hides_nonfinite else None
        if self.recipe == "mx":
            out, amax = _mx_round(x, self.fmt, self.block, self.mode, self.generator)
            if log is not None:
                log.append((self.label, torch.isfinite(amax).all()))
        elif self.recipe in ("current", "delayed"):
            scale, amax = self.scale_for(x)
            q = round_to(x * scale.to(x.dtype), self.fmt, self.mode, _OVERFLOW, self.generator)
            out = q.mul_((1.0 / scale).to(x.dtype))
            if log is not None:
                log.append((self.label, torch.isfinite(amax)))
        else:
            if log is not None:
                log.append((self.label, torch.isfinite(x).all()))
            out = round_to(x, self.fmt, self.mode, None, self.generator)
        if self.observer is not None:
            self.observer(x, out, self)
        return out

    def state_dict(self) -> dict:
        return {"history": self.history, "last_scale": self.last_scale}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s output; ValueError (before any change) if it is malformed."""
        real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not (isinstance(state, dict) and set(state) == {"history", "last_scale"}
                and isinstance(state["history"], list) and all(real(v) for v in state["history"])
                and real(state["last_scale"])):
            raise ValueError("an FP8 cast state is {'history': [numbers], 'last_scale': number}")
        vals = [float(v) for v in state["history"]]
        if any(not (v >= 0 and math.isfinite(v)) for v in vals):
            raise ValueError("an FP8 cast's amax history holds finite amaxes >= 0")
        if not (float(state["last_scale"]) > 0 and math.isfinite(float(state["last_scale"]))):
            raise ValueError("an FP8 cast's last scale is a finite number > 0")
        vals = vals[-self.history_len:]
        hist = torch.full((self.history_len,), -1.0, device=self._hist.device)
        if vals:
            hist[-len(vals):] = torch.tensor(vals, dtype=hist.dtype)
        self._hist = hist
        self._last_scale = torch.tensor(float(state["last_scale"]), device=self._hist.device)


def to_float8(y: torch.Tensor, fmt, mode: str = "nearest_even",
              generator: torch.Generator | None = None, saturate: bool = True) -> torch.Tensor:
    """y (already scaled) rounded to `fmt`, held in the format's float8 dtype: with saturation,
    or (saturate=False) with the format's own overflow (E5M2: inf, as the emulated plain
    rounding keeps it). Nearest-even is torch's own cast, after a clamp to +-max when saturating
    (the same values as fb.round's: tests/train/test_gemm.py); other modes round through fb.round."""
    fmt = get_format(fmt)
    dtype = float8_dtype(fmt)
    if mode == "nearest_even":
        return (y.clamp(-fmt.max, fmt.max) if saturate else y).to(dtype)  # NaN stays NaN
    return round_to(y, fmt, mode, _OVERFLOW if saturate else None, generator).to(dtype)
