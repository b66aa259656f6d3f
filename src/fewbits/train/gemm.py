"""A linear layer's three GEMMs in a narrow format: forward Y = X W^T, grad-input dX = dY W and
grad-weight dW = dY^T X, run natively on the units built for them or emulated with the same
arithmetic.

Formats and scaling (Policy.forward / backward / fp8_recipe / grad_weight):
  int8, rowwise       SwitchBack / torchao int8 mixed precision style: every operand of every
                      GEMM is quantized anew along that GEMM's reduction dimension (X and W per
                      row of K for the forward; dY per row of N and W per column for grad-input;
                      dY and X per column of M for grad-weight), symmetric, scale = amax / 127,
                      the arithmetic of fewbits.kernels.int8.quantize_rows_int8; int32 sums.
  fp8, rowwise        the same layout, with power-of-two scales (fp8.pow2_scales) and E4M3 for X
                      and W, the backward format (E5M2) for dY.
  fp8, current/delayed per tensor: X, W and dY each through the engine's ScaledCast of that place
                      (the emulated fp8-hybrid's own casts and state), quantized once and reused
                      by both backward GEMMs, as the emulation's autograd does.
  grad_weight         the activations' format (e.g. "bf16"): dW runs as a plain GEMM in the
                      compute dtype on dY and X as they are.

Every GEMM is `qmm(a, b)` = (qa * da) @ (qb * db)^T, a [M, R] and b [N, R] both quantized along
R, with the dequantization factors da [M, 1] / [] and db [N, 1] / [].
  native int8   fewbits' AMX GEMM (kernels/csrc/int8mm.c) on CPUs with AMX, torch._int_mm
                elsewhere (oneDNN on other CPUs, cuBLASLt on CUDA): exact int32 sums; then
                y = (float32(acc) * da) * db (+ bias) rounded once to the compute dtype.
  emulated int8 the same integer sums from a float32 GEMM where they are exact (R * 128^2 < 2^24)
                and a float64 one elsewhere, then the same epilogue: bit for bit the native result.
  native fp8    torch._scaled_mm (FP8 tensor cores, compute capability 8.9+; CPU builds have a
                slow reference of it, used only when asked for): float32 sums, one rounding.
  emulated fp8  a GEMM in the compute dtype on the dequantized values (exact: FP8 values times
                powers of two), float32 sums: the same result up to the order of the float32
                additions (bit-identical where the sums are exact; tests/train/test_gemm.py).

A non-finite value in an operand: int8 quantization gives its row a non-finite scale, so the GEMM's
result is non-finite and the step's check sees it; FP8 saturates, so the finiteness of every
operand's amax is logged for the step as the engine's saturating casts are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats import IntFormat, get_format
from ..kernels.int8 import amx_ready, int8_gemm, int8_kernel, int_mm_exact, quantize_lines, rescale
from ..kernels.random import draw_seed
from .fp8 import ScaledCast, float8_dtype, pow2_scales, to_float8

GEMM_MODES = ("auto", "native", "emulated")
_EXACT_F32_ROWS = 2 ** 24 // (128 * 128)  # reduction length up to which float32 sums of int8 products are exact


# ---------------------------------------------------------------------------------------------
# operands
# ---------------------------------------------------------------------------------------------
@dataclass
class Operand:
    """q (int8 or float8, [rows, R]) and the float32 dequantization factor d ([rows, 1] or [])."""
    q: torch.Tensor
    d: torch.Tensor
    finite: torch.Tensor | None = None  # 0-dim bool: every row it came from was finite

    def t(self) -> Operand:
        """The transposed operand (only for per-tensor factors)."""
        return Operand(self.q.t(), self.d, self.finite)


def quantize_rows(t: torch.Tensor, fmt, margin: int = 0, mode: str = "nearest_even",
                  generator: torch.Generator | None = None, contiguous: bool = True) -> Operand:
    """t [rows, R] quantized along R (its dimension 1), one scale per row. t may be a transposed
    view; with contiguous=False the int8 codes may come back as one too (a GEMM's second
    operand: the AMX kernel packs either layout)."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        seed = draw_seed(generator) if mode == "stochastic" else None
        q, scale = quantize_lines(t, contiguous, seed=seed)
        return Operand(q, scale.unsqueeze(1), torch.isfinite(scale).all())
    amax = t.detach().abs().amax(dim=1, keepdim=True).float()
    s = pow2_scales(amax, fmt.max, margin)
    return Operand(to_float8(t.float() * s, fmt, mode, generator), 1.0 / s, torch.isfinite(amax).all())


# ---------------------------------------------------------------------------------------------
# the GEMM, native or emulated
# ---------------------------------------------------------------------------------------------
def qmm(a: Operand, b: Operand, out_dtype: torch.dtype, native: bool,
        bias: torch.Tensor | None = None) -> torch.Tensor:
    """(qa * da) @ (qb * db)^T (+ bias) in out_dtype (see the module docstring for the arithmetic)."""
    if a.q.dtype == torch.int8:
        return _int8_mm(a, b, out_dtype, native, bias)
    return _fp8_mm(a, b, out_dtype, native, bias)


def _int8_mm(a, b, out_dtype, native, bias):
    if native:  # fewbits' AMX GEMM on CPUs with AMX, else torch._int_mm (kernels.int8.int8_gemm)
        return int8_gemm(a.q, b.q, a.d, b.d, bias, out_dtype)
    work = torch.float32 if a.q.shape[1] <= _EXACT_F32_ROWS else torch.float64
    acc = a.q.to(work) @ b.q.to(work).t()  # integer values: exact
    return rescale(acc, a.d, b.d, bias, out_dtype)


def _fp8_mm(a, b, out_dtype, native, bias):
    if native:
        qa, qb = a.q.contiguous(), b.q.contiguous()  # row-major A, column-major B: cuBLASLt's layout
        da = a.d.reshape(-1, 1) if a.d.dim() else a.d
        db = b.d.reshape(1, -1) if b.d.dim() else b.d
        return torch._scaled_mm(qa, qb.t(), scale_a=da, scale_b=db, out_dtype=out_dtype,
                                bias=None if bias is None else bias.to(out_dtype))
    xa = (a.q.float() * (a.d.reshape(-1, 1) if a.d.dim() else a.d)).to(out_dtype)
    xb = (b.q.float() * (b.d.reshape(-1, 1) if b.d.dim() else b.d)).to(out_dtype)
    return torch.nn.functional.linear(xa, xb, None if bias is None else bias.to(out_dtype))


def _cuda_dims_ok(kind: str, k: int, n: int, m: int) -> bool:
    """Whether cuBLASLt takes the GEMM: FP8 wants every dimension a multiple of 16; int8
    (torch._int_mm) K and N multiples of 8 (M is padded by int8_int8_matmul)."""
    if kind == "fp8":
        return all(d % 16 == 0 and d > 0 for d in (k, n, m))
    return k % 8 == 0 and n % 8 == 0 and k > 0 and n > 0


# ---------------------------------------------------------------------------------------------
# where a policy's GEMMs run
# ---------------------------------------------------------------------------------------------
def native_support(kind: str, device: torch.device) -> str | None:
    """None when `kind` ("int8" or "fp8") GEMMs run natively on `device`, else why not."""
    device = torch.device(device)
    if kind == "int8":
        if not hasattr(torch, "_int_mm"):
            return f"torch {torch.__version__} has no torch._int_mm"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 5):
            return "int8 tensor cores need compute capability 7.5 or newer"
        if device.type not in ("cpu", "cuda"):
            return f"torch._int_mm does not run on {device.type}"
        return None
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type != "cuda":
        return "FP8 GEMMs need FP8 tensor cores (CUDA compute capability 8.9+); this CPU's torch._scaled_mm is a slow reference"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute capability 8.9+)"
    return None


@dataclass
class GemmRoute:
    """How an engine runs its linear layers' GEMMs: `kind` int8 / fp8, per-tensor or row-wise
    scales, natively or emulated (and why not natively), and how many GEMMs ran each way."""
    kind: str
    rowwise: bool
    native: bool
    reason: str | None
    grad_weight_lowp: bool
    forward_fmt: object
    backward_fmt: object
    margin: int = 0
    counts: dict = field(default_factory=lambda: {"native": 0, "emulated": 0})

    def describe(self) -> str:
        scaling = "row-wise" if self.rowwise else "per-tensor"
        where = ("native: " + (int8_kernel() if self.kind == "int8" else "torch._scaled_mm")
                 if self.native else f"emulated ({self.reason})")
        gw = "" if self.grad_weight_lowp else ", grad-weight in the compute dtype"
        return f"{self.kind} {scaling} GEMMs, {where}{gw}"

    def mm(self, a: Operand, b: Operand, out_dtype, bias=None) -> torch.Tensor:
        native = self.native
        if native and a.q.device.type == "cuda" and not _cuda_dims_ok(self.kind, a.q.shape[1], b.q.shape[0],
                                                                      a.q.shape[0]):
            native = False  # cuBLASLt's shape rules: then the emulation, the same arithmetic
        self.counts["native" if native else "emulated"] += 1
        return qmm(a, b, out_dtype, native, bias)


def plan_route(policy, device: torch.device, mode: str = "auto") -> GemmRoute | None:
    """The GemmRoute of `policy` on `device` (None: its linear layers run on casts or plain dtypes).
    mode: "auto" (native where the hardware does it), "native" (FP8 on this CPU's reference
    _scaled_mm too; ValueError where it cannot run at all), "emulated"."""
    if mode not in GEMM_MODES:
        raise ValueError(f"gemm={mode!r}: choose one of {', '.join(GEMM_MODES)}")
    fwd, bwd = get_format(policy.forward), get_format(policy.backward)
    if isinstance(fwd, IntFormat):
        kind = "int8"
    elif float8_dtype(fwd) is not None and float8_dtype(bwd) is not None and \
            policy.fp8_recipe in ("none", "current", "delayed", "rowwise"):
        kind = "fp8"
    else:
        return None
    rowwise = policy.fp8_recipe == "rowwise"
    bad = [m for m in (policy.forward_rounding, policy.backward_rounding) if m not in ("nearest_even", "stochastic")]
    if kind == "int8" and bad:
        raise ValueError(f"int8 GEMM operands round to nearest or stochastically, not {bad[0]!r}")
    reason = native_support(kind, device)
    if mode == "native" and reason is not None and not (kind == "fp8" and hasattr(torch, "_scaled_mm")
                                                          and torch.device(device).type == "cpu"):
        raise ValueError(f"gemm='native': {reason}")
    if kind == "int8" and reason is None and torch.device(device).type == "cpu" and not amx_ready() \
            and not int_mm_exact() and mode == "auto":
        # oneDNN without VNNI saturates int16 pair sums: auto keeps the exact emulation there
        reason = "torch._int_mm's int8 sums are not exact on this CPU (oneDNN without VNNI)"
    if mode == "emulated":
        native, reason = False, "asked for"
    elif mode == "native":
        native, reason = True, None
    else:
        native = reason is None
    if not native and not rowwise and kind == "fp8":
        return None  # per-tensor FP8 emulation: the engine's casts around plain GEMMs (the same arithmetic)
    return GemmRoute(kind, rowwise, native, reason, policy.grad_weight is None, fwd, bwd, policy.fp8_margin)


# ---------------------------------------------------------------------------------------------
# the linear layer
# ---------------------------------------------------------------------------------------------
@dataclass
class LinearCall:
    """What one F.linear call needs: the route, the compute dtype, the per-tensor casts (x, w,
    dy) of its place in the model, and where its finiteness checks go."""
    route: GemmRoute
    out_dtype: torch.dtype
    casts: tuple[ScaledCast, ScaledCast, ScaledCast] | None = None
    forward_log: list | None = None
    backward_log: list | None = None
    label: str = ""
    modes: tuple[str, str] = ("nearest_even", "nearest_even")  # rounding of forward / backward operands
    generator: torch.Generator | None = None

    def rows(self, t: torch.Tensor, fmt, log: list | None, backward: bool = False, second: bool = False) -> Operand:
        """t quantized along its rows; `second`: the GEMM's second operand (any layout)."""
        op = quantize_rows(t, fmt, self.route.margin, self.modes[backward], self.generator, not second)
        if log is not None:
            log.append((self.label, op.finite))
        return op


class _LowpLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, call: LinearCall):
        route = call.route
        x2 = x.reshape(-1, x.shape[-1])
        ctx.empty = x2.numel() == 0 or w.numel() == 0
        if ctx.empty:  # no rows (an expert no token reached) or no features: sums of nothing
            ctx.call, ctx.x_shape, ctx.has_bias = call, x.shape, b is not None
            y = x2.new_zeros(x2.shape[0], w.shape[0], dtype=call.out_dtype)
            if b is not None:
                y = y + b.to(call.out_dtype)
            return y.reshape(*x.shape[:-1], w.shape[0])
        if route.rowwise:
            xa = call.rows(x2, route.forward_fmt, call.forward_log)
            wa = call.rows(w, route.forward_fmt, call.forward_log, second=True)
            saved = (x2, w)
        else:
            xa = Operand(*call.casts[0].quantize(x2))
            wa = Operand(*call.casts[1].quantize(w))
            saved = (xa.q, xa.d, wa.q, wa.d) + ((x2,) if not route.grad_weight_lowp else ())
        y = route.mm(xa, wa, call.out_dtype, b)
        ctx.call, ctx.x_shape, ctx.has_bias = call, x.shape, b is not None
        ctx.save_for_backward(*saved)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        call = ctx.call
        route = call.route
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = gy.reshape(-1, gy.shape[-1])
        dt = call.out_dtype
        if ctx.empty:
            k = ctx.x_shape[-1]
            return (gy.new_zeros(ctx.x_shape, dtype=dt) if need_x else None,
                    gy.new_zeros(g2.shape[1], k, dtype=dt) if need_w else None,
                    g2.to(dt).sum(0) if need_b and ctx.has_bias else None, None)
        log = call.backward_log
        dx = dw = db = None
        g_bias = g2  # what the bias gradient sums: the gradient as the GEMMs see it per tensor
        if route.rowwise:
            x2, w = ctx.saved_tensors
            if need_x:
                dx = route.mm(call.rows(g2, route.backward_fmt, log, True),
                              call.rows(w.t(), route.forward_fmt, log, second=True), dt)
            if need_w:
                if route.grad_weight_lowp:
                    dw = route.mm(call.rows(g2.t(), route.backward_fmt, log, True),
                                  call.rows(x2.t(), route.forward_fmt, log, second=True), dt)
                else:
                    dw = g2.to(dt).t() @ x2.to(dt)
        else:
            xq, xd, wq, wd, *rest = ctx.saved_tensors
            ga = Operand(*call.casts[2].quantize(g2))
            if need_b and ctx.has_bias:  # the emulation's autograd sums the rounded gradient
                g_bias = (ga.q.float() * ga.d).to(dt)
            if need_x:
                dx = route.mm(ga, Operand(wq, wd).t(), dt)
            if need_w:
                if route.grad_weight_lowp:
                    dw = route.mm(ga.t(), Operand(xq, xd).t(), dt)
                else:
                    dw = g2.to(dt).t() @ rest[0].to(dt)
        if need_b and ctx.has_bias:
            db = g_bias.to(dt).sum(0)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None


def lowp_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, call: LinearCall) -> torch.Tensor:
    """F.linear(x, w, b) with its three GEMMs on `call.route` (autograd included)."""
    return _LowpLinear.apply(x, w, b, call)
