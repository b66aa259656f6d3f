"""Bindings of rowquant.c: the int8 activation quantizer of w8a8 layers per row (absmax, scales,
codes), the rescale of their int32 sums, and int8 rows to bfloat16."""
from __future__ import annotations

import ctypes

import torch


def declare_rowquant(lib: ctypes.CDLL) -> None:
    """The argument types of rowquant.c's functions."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_row_absmax.argtypes = [p, i64, i64, i64, p]
    lib.fb_row_absmax.restype = i64
    lib.fb_row_int8_scales.argtypes = [p, i64, i64, i64, p, p]
    lib.fb_row_int8_scales.restype = i64
    lib.fb_quantize_rows_int8.argtypes = [p, i64, i64, i64, p, i64, p, i32]
    lib.fb_quantize_rows_int8.restype = None
    lib.fb_scale_rows.argtypes = [p, i64, i64, i64, p, p]
    lib.fb_scale_rows.restype = None
    lib.fb_int8_rows_bf16.argtypes = [p, i64, i64, i64, p]
    lib.fb_int8_rows_bf16.restype = None


def _check_rows(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"native row kernels take a CPU float32 matrix with unit column stride, "
                         f"got {x.dtype} {x.device} shape {tuple(x.shape)} strides {x.stride()}")


def row_absmax(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(max |x| per row as float32 [rows], number of rows holding NaN or inf) for a float32
    matrix with unit column stride."""
    _check_rows(x)
    m, k = x.shape
    amax = torch.empty(m, dtype=torch.float32)
    bad = lib.fb_row_absmax(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, amax.data_ptr())
    return amax, int(bad)


def row_int8_scales(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(scale = amax / 127, recip = 1 / scale with 0 read as 1, both float32 [rows], number of
    rows holding NaN or inf) for a float32 matrix with unit column stride."""
    _check_rows(x)
    m, k = x.shape
    scale, recip = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.float32)
    bad = lib.fb_row_int8_scales(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, scale.data_ptr(),
                                 recip.data_ptr())
    return scale, recip, int(bad)


def quantize_rows_int8(lib: ctypes.CDLL, x: torch.Tensor, recip: torch.Tensor, offset: bool) -> torch.Tensor:
    """clamp(round_half_even(x * recip[row]), -128, 127) as int8 [rows, k], or as uint8 + 128
    with `offset`; recip is float32 with one value per row or a single value."""
    _check_rows(x)
    m, k = x.shape
    recip = recip.to(torch.float32).contiguous()
    if recip.numel() not in (1, m):
        raise ValueError(f"recip needs 1 or {m} values, got {recip.numel()}")
    q = torch.empty(m, k, dtype=torch.uint8 if offset else torch.int8)
    lib.fb_quantize_rows_int8(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, recip.data_ptr(),
                              1 if recip.numel() == m and m > 1 else 0, q.data_ptr(), 1 if offset else 0)
    return q


def scale_rows_(lib: ctypes.CDLL, y: torch.Tensor, row_scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[i, j] = fma(y[i, j], row_scales[i], bias[j]) in place (y * row_scales[i] without a
    bias); y float32 with unit column stride, row_scales and bias float32. Returns y."""
    _check_rows(y)
    m, n = y.shape
    row_scales = row_scales.reshape(-1).to(torch.float32).contiguous()
    if row_scales.numel() != m:
        raise ValueError(f"row_scales needs {m} values, got {row_scales.numel()}")
    if bias is not None:
        if bias.dtype != torch.float32 or bias.shape != (n,):
            raise ValueError(f"bias must be float32 of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
        bias = bias.contiguous()
    lib.fb_scale_rows(y.data_ptr(), m, n, y.stride(0) if m > 1 else n, row_scales.data_ptr(),
                      bias.data_ptr() if bias is not None else None)
    return y


def int8_rows_bf16(lib: ctypes.CDLL, q: torch.Tensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0..r1 of an int8 matrix q [N, K] as bfloat16 [r1 - r0, K], exactly (every int8 is a
    bfloat16). `out`: a contiguous bfloat16 buffer of at least that many values to write into
    (reused from block to block, it spares the page faults of fresh memory)."""
    if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError(f"q must be a contiguous CPU int8 matrix, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows {r0}..{r1} out of 0..{n}")
    count = (r1 - r0) * k
    if out is None:
        out = torch.empty(r1 - r0, k, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() < count:
        raise ValueError(f"out must be a contiguous bfloat16 tensor of at least {count} values")
    else:
        out = out.reshape(-1)[:count].view(r1 - r0, k)
    lib.fb_int8_rows_bf16(q.data_ptr(), k, r0, r1, out.data_ptr())
    return out
