"""int8 x int8 GEMMs with exact int32 accumulation, and the dynamic symmetric int8 quantizer of
their operands (float32 scales amax / 127 per row or per tensor). The quantized modules' w8a8
layers and training's int8-mixed policy both run on these, so the arithmetic is one definition.
"""
from __future__ import annotations

import functools
import math

import torch

from . import native
from .random import random_words


def divide(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b, correctly rounded on every device. CUDA divides a tensor by a Python number as
    a * (1 / b), which can round differently from the CPU's a / b; a divisor that is a tensor on
    the device gets CUDA's true division, so the scales come out bit-identical to the CPU's."""
    if a.device.type == "cpu":
        return a / b
    return a / a.new_full((), b)  # a fill on the device: no host-to-device copy per call


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1/scale with zero scales mapped to 1 (an all-zero group stays zero either way)."""
    return 1.0 / torch.where(scale == 0, torch.ones_like(scale), scale)


INT_MM_CUDA_MIN_ROWS = 17  # cuBLASLt's int8 GEMM behind torch._int_mm refuses M <= 16


def int8_int8_matmul(q_act: torch.Tensor, w_int8: torch.Tensor) -> torch.Tensor:
    """Exact int32 q_act [M, K] @ w_int8[N, K].T with torch._int_mm (no shape limits on CPU;
    on CUDA K and N are multiples of 8, and fewer than 17 rows are padded with zero rows)."""
    m = q_act.shape[0]
    if q_act.device.type == "cuda" and m < INT_MM_CUDA_MIN_ROWS:
        padded = q_act.new_zeros(INT_MM_CUDA_MIN_ROWS, q_act.shape[1])
        padded[:m] = q_act
        return torch._int_mm(padded, w_int8.t())[:m]
    return torch._int_mm(q_act, w_int8.t())


def quantize_rows_int8(x2d: torch.Tensor, per_row: bool, round_scale=None, saturate: bool = True,
                       offset: bool = False, backend: str = "auto",
                       nonfinite: str = "raise", seed: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization of activations, with the arithmetic of
    fewbits.quant.quantize(x, int8 absmax scheme): scale = amax / 127 (rounded to the scheme's
    scale format by `round_scale`; None keeps float32 scales), q = round_half_even(x * (1 /
    scale)) saturated to int8, a zero scale read as 1, and 0 where that product is NaN (0 times
    the infinite reciprocal of a scale below 2^-128). Returns (q, scale float32 [M] or [1]); q
    is int8, or with `offset` uint8 holding q + 128 (what oneDNN's uint8 GEMM takes).

    nonfinite "raise" refuses NaN or inf (ValueError; on CUDA that check waits for the device);
    "keep" quantizes such a row to zeros and gives it a non-finite scale (NaN or inf), so a GEMM
    with it yields non-finite values and nothing waits for the device (training's int8 GEMMs: the
    step's own inf/NaN check then skips the step).

    seed (two ints): stochastic rounding instead, q = clamp(floor(x * (1 / scale) + u), -128, 127)
    in float32 with u = (w >> 8) * 2^-24, w the counter-based random word (kernels.random) of
    the element's index in x2d read row by row; unbiased: E[q] = x / scale inside the range.

    backend "auto" runs the fused C kernels of fewbits.kernels.native where they could be built
    and torch ops otherwise; "torch" and "native" force one (the two agree bit for bit).
    saturate=False lets the torch path skip the clamp where it cannot change anything: with
    float32 scales of normal magnitude |x * (1 / scale)| <= 127 (1 + 2^-22) rounds to at most
    127. Scales rounded to a narrower format may round down, and subnormal ones lose precision:
    those are clamped."""
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")
    if nonfinite not in ("raise", "keep"):
        raise ValueError(f"nonfinite must be 'raise' or 'keep', got {nonfinite!r}")
    x = x2d.to(torch.float32)
    if x.numel() == 0:  # no values: zero scales (per row, or one per tensor), no codes
        q = torch.zeros(x.shape, dtype=torch.uint8 if offset else torch.int8, device=x.device)
        return q, torch.zeros(x.shape[0] if per_row else 1, dtype=torch.float32, device=x.device)
    if backend != "torch" and x.device.type == "cpu" and seed is None:
        lib = native.library()
        if lib is not None:
            return _quantize_rows_int8_native(lib, x, per_row, round_scale, offset, nonfinite)
    if backend == "native":
        raise RuntimeError(f"the native kernels are not available: {native.status()['reason']}")
    round_scale = round_scale or (lambda v: v)
    # max(amax, -amin) reads x twice and allocates nothing as big as x (abs() would; and
    # vector_norm(inf) is ~20x slower in torch 2.x); all of them propagate NaN
    if per_row:
        amax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())
    else:
        amax = torch.maximum(x.amax(), x.amin().neg_()).reshape(1)
    if nonfinite == "keep":  # no look at the values on the host: every guard applies
        lo, hi = 0.0, math.inf
    else:
        lo, hi = torch.aminmax(amax)  # one small reduction answers both checks below
        lo, hi = float(lo), float(hi)
        if not math.isfinite(hi):
            raise ValueError(native.NONFINITE_ACTIVATIONS)
    scale = round_scale(divide(amax, 127.0))
    recip = 1.0 / (scale if lo > 0 else torch.where(scale == 0, torch.ones_like(scale), scale))
    t = torch.mul(x, recip.unsqueeze(1))
    if seed is not None:
        idx = torch.arange(t.numel(), dtype=torch.int64, device=t.device).view(t.shape)
        u = (random_words(idx, int(seed[0]), int(seed[1])) >> 8).to(torch.float32).mul_(2.0 ** -24)
        t = t.add_(u).floor_()
    else:
        t = t.round_()
    if lo < 2.0 ** -100:  # a subnormal scale: 1 / scale may be inf, 0 * inf NaN
        t.nan_to_num_(0.0)
    if saturate or lo < 2.0 ** -100 or seed is not None:
        t.clamp_(-128, 127)
    q = t.to(torch.int8)  # float -> int8 and a bit flip are ~3x faster than float -> uint8
    if offset:
        u = q.view(torch.uint8)
        return torch.bitwise_xor(u, 0x80, out=u), scale
    return q, scale


def _quantize_rows_int8_native(lib, x: torch.Tensor, per_row: bool, round_scale, offset: bool,
                               nonfinite: str = "raise"):
    """quantize_rows_int8 with the amax and the quantization each one fused pass of C (see
    fewbits.kernels.native); bit-identical to quantize_rows_int8's torch path (tested)."""
    if x.stride(1) != 1 or (not per_row and not x.is_contiguous()):
        x = x.contiguous()
    rows = x if per_row else x.reshape(1, -1)
    if round_scale is None:
        scale, recip, bad = native.row_int8_scales(lib, rows)
    else:
        amax, bad = native.row_absmax(lib, rows)
    if bad and nonfinite == "raise":
        raise ValueError(native.NONFINITE_ACTIVATIONS)
    if round_scale is not None:
        scale = round_scale(amax / 127.0)
        recip = reciprocal(scale)
    return native.quantize_rows_int8(lib, x, recip, offset), scale


def rescale(acc: torch.Tensor, da: torch.Tensor | None, db: torch.Tensor | None,
            bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(float32(acc) * da[:, None]) * db[None, :] (+ bias), each a float32 operation, rounded
    once to out_dtype: the epilogue of an int8 GEMM whose operands are scaled per row (da, [M]
    or a 0-dim tensor) and per column (db, [N] or 0-dim)."""
    y = acc.to(torch.float32)
    if da is not None:
        y = y.mul_(da.reshape(-1, 1) if da.dim() else da)
    if db is not None:
        y = y.mul_(db.reshape(1, -1) if db.dim() else db)
    if bias is not None:
        y = y.add_(bias.to(torch.float32))
    return y.to(out_dtype)


def int8_gemm(qa: torch.Tensor, qb: torch.Tensor, da: torch.Tensor | None = None,
              db: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """rescale(qa @ qb.T, da, db, bias): the int32 sums of int8 qa [M, K] and qb [N, K], then
    the rescale, on the fastest kernel here: on a CPU with AMX, fewbits' own AMX GEMM with the
    rescale fused into its store (csrc/int8mm.c), else torch._int_mm and `rescale`. The two are
    bit for bit the same (the sums are exact, the rescale the same float32 operations).
    backend: "auto", "amx" (ValueError where it cannot run), "torch"."""
    if backend not in ("auto", "amx", "torch"):
        raise ValueError(f"backend must be 'auto', 'amx' or 'torch', got {backend!r}")
    if backend != "torch" and qa.device.type == "cpu":
        lib = native.library()
        per_vector = all(v is None or v.dim() <= 1 or v.numel() == max(v.shape) for v in (da, db))
        if lib is not None and per_vector and out_dtype in (torch.float32, torch.bfloat16):
            expand = lambda v, size: None if v is None else (  # noqa: E731
                v.reshape(-1).float().expand(size).contiguous() if v.numel() == 1 else v.reshape(-1).float())
            out = native.amx_int8_gemm(lib, qa, qb, expand(da, qa.shape[0]), expand(db, qb.shape[0]),
                                       None if bias is None else bias.to(torch.float32), out_dtype)
            if out is not None:
                return out
    if backend == "amx":
        raise ValueError("the AMX int8 GEMM does not run here (no AMX, no native library, or not a CPU tensor)")
    return rescale(int8_int8_matmul(qa.contiguous(), qb.contiguous()), da, db, bias, out_dtype)


def amx_ready() -> bool:
    """Whether int8_gemm runs fewbits' AMX kernel on this CPU."""
    lib = native.library()
    return lib is not None and native.amx_int8_ready(lib)


def int8_kernel(device: torch.device | str = "cpu") -> str:
    """The kernel int8_gemm runs on `device`, in words."""
    if torch.device(device).type == "cpu":
        return "fewbits AMX int8 GEMM" if amx_ready() else "torch._int_mm (oneDNN)"
    return "torch._int_mm"


def quantize_lines(x2d: torch.Tensor, contiguous: bool = True, backend: str = "auto",
                   seed: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_int8(x2d, per_row=True, nonfinite="keep") for a GEMM operand that may be a
    transposed view: on a CPU, bfloat16 input goes through one fused C pass per direction
    (csrc/int8mm.c), rows or columns in memory alike; the codes come back contiguous, or with
    contiguous=False possibly as a transposed view (what int8_gemm's second operand may be).
    Bit for bit quantize_rows_int8's result (with `seed`: its stochastic rounding)."""
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")
    if backend != "torch" and x2d.device.type == "cpu" and x2d.dtype == torch.bfloat16 and x2d.dim() == 2 \
            and x2d.numel() > 0:
        lib = native.library()
        if lib is not None:
            return native.q8_bf16(lib, x2d, contiguous, seed)
    if backend == "native":
        raise ValueError("the fused int8 quantizer takes 2-D CPU bfloat16 tensors with the native library built")
    return quantize_rows_int8(x2d, True, nonfinite="keep", backend="torch" if backend == "torch" else "auto",
                              seed=seed)


def sums_exactly(matmul, prepare=None) -> bool:
    """Whether a CPU int8 GEMM `matmul(q, w, prepare(w))` -> the int32 sums of q [rows, K] and
    w [N, K] is exact here, tried on worst-case values against an int64 matmul.

    oneDNN without VNNI (AVX2-only CPUs such as AMD EPYC Rome and Milan, AVX-512 without VNNI;
    ONEDNN_MAX_CPU_ISA=AVX2 imitates them) multiplies uint8 x int8 pairs with vpmaddubsw, whose
    int16 sum of two products saturates (2 x 255 x 127 > 32767): the int32 results come out wrong
    by up to 4e4, silently. oneDNN picks its kernel by shape, so the probe runs 1, 32 and 256
    rows, each with K a multiple of 64 and K not (200), N = 24, with the worst case (127, weight
    rows 127 and -127) in the first and last rows, where blocks and tails start and end."""
    g = torch.Generator().manual_seed(0)
    try:
        for k in (64, 200):  # |sums| <= K * 127^2 < 2^24: a float32 result is exact too
            w = torch.randint(-127, 128, (24, k), generator=g).to(torch.int8)
            w[0], w[1], w[-1] = 127, -127, 127
            prepared = prepare(w) if prepare is not None else None
            for rows in (1, 32, 256):
                q = torch.randint(-127, 128, (rows, k), generator=g).to(torch.int8)
                q[0], q[-1] = 127, 127
                want = q.to(torch.int64) @ w.to(torch.int64).t()
                if not torch.equal(matmul(q, w, prepared).to(torch.int64), want):
                    return False
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def int_mm_exact() -> bool:
    """Whether torch._int_mm sums exactly on this CPU (sums_exactly; once per process)."""
    return sums_exactly(lambda q, w, _: int8_int8_matmul(q, w))
