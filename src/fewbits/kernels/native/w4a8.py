"""Bindings of w4a8.c: 4-bit integer weights x int8 activations in blocks of 32, the products
summed exactly in int32 (`W4A8Weight`), and the activations' quantize-dequantize."""
from __future__ import annotations

import ctypes

import torch

from .shared import PARAM_KINDS, check_rc, rc_check, streamed


def declare_w4a8(lib: ctypes.CDLL) -> None:
    """The argument types of w4a8.c's functions (also for a build of it alone, as the tests make)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_w4a8_vectorized.argtypes = []
    lib.fb_w4a8_vectorized.restype = i32
    lib.fb_w4a8_matmul.argtypes = [p, p, i64, p, p, i32, p, i32, i32, i64, i64, p, i32]
    lib.fb_w4a8_matmul.restype = i32
    lib.fb_w4a8_linear.argtypes = [p, i64, i64, p, p, i32, p, i32, i32, i64, i64, p]
    lib.fb_w4a8_linear.restype = i32
    lib.fb_w4a8_row.argtypes = [p, p, p]
    lib.fb_w4a8_row.restype = i32
    lib.fb_w4a8_dequantized_x.argtypes = [p, i64, i64, i64, p, i32]
    lib.fb_w4a8_dequantized_x.restype = i32


def _w4a8_rc(rc: int, what: str) -> None:
    """Raise for w4a8.c's return codes: -3 NaN / inf activations, -2 no memory, -1 refused."""
    check_rc(rc, f"{what} refused its arguments", f"{what} could not allocate its scratch", nonfinite=True)


# raises for a non-zero return code of fb_w4a8_row (fb_w4a8_linear's)
w4a8_row_rc = rc_check("fb_w4a8_linear refused its arguments", "fb_w4a8_linear could not allocate its scratch",
                       nonfinite=True)


class _W4A8Row(ctypes.Structure):
    """w4a8.c's W4A8Row: a weight's fixed arguments of fb_w4a8_linear for one row of x."""
    _fields_ = [("codes", ctypes.c_void_p), ("s", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("s_kind", ctypes.c_int64), ("m_kind", ctypes.c_int64), ("is_signed", ctypes.c_int64),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


def _w4a8_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """(x, its row stride) for w4a8.c, which reads rows of k values at that stride: broadcast or
    overlapping rows copied dense; a single row's stride is k, whatever torch says."""
    m = x.shape[0]
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    return x, (x.stride(0) if m > 1 else k)


def w4a8_dequantized_x(lib: ctypes.CDLL, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] float32 quantized per block of 32 columns as W4A8Weight.linear does, then
    dequantized: xq * sx in float32, equal to fewbits.quant.quantize(x, int8 group-32 absmax
    scheme).dequantize(); with dtype=torch.bfloat16 that float32 rounded to bfloat16 (nearest
    even, as .to(torch.bfloat16) does), in the same pass. ValueError where x holds NaN or inf."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32 or x.shape[1] == 0 or x.device.type != "cpu":
        raise ValueError(f"x must be CPU float32 [M, K] with K a positive multiple of 32, got {x.dtype} {tuple(x.shape)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    m, k = x.shape
    x, ldx = _w4a8_rows(x, k)
    out = torch.empty(m, k, dtype=dtype)
    if m == 0:
        return out
    _w4a8_rc(lib.fb_w4a8_dequantized_x(x.data_ptr(), ldx, m, k, out.data_ptr(), int(dtype == torch.bfloat16)),
             "fb_w4a8_dequantized_x")
    return out


class W4A8Weight:
    """A weight W [n, k] of 4-bit integer codes in groups of 32 columns, each group with a float
    scale s (and, for uint4 codes, a float minimum mn): w = s * (c) for signed int4 codes c, w =
    s * u + mn for uint4 codes u -- prepared for w4a8.c's int4 x int8 dot products, which take
    activations quantized per block of 32 columns (int8 codes, float32 scales) and sum the
    products of codes exactly (see w4a8.c for the float32 operations around them).

    codes: uint8 [n, k / 2], low nibble first. scales, minimums: [n, k / 32] float32, float16 or
    bfloat16, referenced as stored (no copy where contiguous)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, n: int, k: int, signed: bool,
                 minimums: torch.Tensor | None = None):
        n, k = int(n), int(k)
        if k <= 0 or k % 32:
            raise ValueError(f"w4a8 takes rows of a multiple of 32 columns, got {k}")
        if codes.dtype != torch.uint8 or codes.device.type != "cpu" or codes.numel() != n * k // 2:
            raise ValueError(f"codes must be CPU uint8 with {n * k // 2} bytes")
        if signed and minimums is not None:
            raise ValueError("signed int4 codes take no minimums")
        self.n, self.k, self.signed = n, k, bool(signed)
        self._codes = streamed(codes.reshape(-1).contiguous())
        self._scales, self._s_kind = self._param(scales, n, k // 32, "scales")
        self._mins, self._m_kind = (None, 0) if minimums is None else self._param(minimums, n, k // 32, "minimums")
        self._row_args: list = []  # row_call's argument structs, alive as long as this weight
        # fb_w4a8_linear's arguments after x's (the tensors above are held, so the pointers stay)
        self._args = (self._codes.data_ptr(), self._scales.data_ptr(), self._s_kind,
                      self._mins.data_ptr() if self._mins is not None else None, self._m_kind,
                      1 if self.signed else 0, self.n, self.k)

    def row_call(self) -> int:
        """The address of this weight's arguments for w4a8.c's fb_w4a8_row(address, x, y): y [n]
        for one contiguous float32 row x [k], what linear() computes for it, bit for bit, in one C
        call of three arguments (return codes as fb_w4a8_linear's: w4a8_row_rc). Valid while
        this weight lives."""
        c, s, sk, mn, mk, signed, n, k = self._args
        r = _W4A8Row(c, s, mn, sk, mk, signed, n, k)
        self._row_args.append(r)
        return ctypes.addressof(r)

    @staticmethod
    def _param(t, n: int, groups: int, what: str):
        if not isinstance(t, torch.Tensor) or t.dtype not in PARAM_KINDS or t.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU float32, float16 or bfloat16 tensor")
        if t.numel() != n * groups:
            raise ValueError(f"{what} needs {n * groups} values, got {t.numel()}")
        return t.reshape(-1).contiguous(), PARAM_KINDS[t.dtype]

    def own_nbytes(self, others) -> int:
        """Bytes this weight holds that share no storage with `others` (copies it had to make)."""
        ptrs = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
        held = [t for t in (self._codes, self._scales, self._mins) if t is not None]
        return sum(t.nbytes for t in held if t.untyped_storage().data_ptr() not in ptrs)

    def matmul(self, lib: ctypes.CDLL, xq: torch.Tensor, sx: torch.Tensor, force_scalar: bool = False) -> torch.Tensor:
        """xq [M, k] int8 codes and sx [M, k / 32] float32 block scales of the activations ->
        y [M, n] float32 (see w4a8.c)."""
        if (xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != self.k or xq.device.type != "cpu"
                or sx.dtype != torch.float32 or tuple(sx.shape) != (xq.shape[0], self.k // 32) or sx.device.type != "cpu"):
            raise ValueError(f"xq must be CPU int8 [M, {self.k}] and sx float32 [M, {self.k // 32}], got "
                             f"{xq.dtype} {tuple(xq.shape)} and {sx.dtype} {tuple(sx.shape)}")
        xq, sx = xq.contiguous(), sx.contiguous()
        m = xq.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0 or self.n == 0:
            return y
        mins = self._mins.data_ptr() if self._mins is not None else None
        _w4a8_rc(lib.fb_w4a8_matmul(xq.data_ptr(), sx.data_ptr(), m, self._codes.data_ptr(), self._scales.data_ptr(),
                                    self._s_kind, mins, self._m_kind, 1 if self.signed else 0, self.n, self.k,
                                    y.data_ptr(), 1 if force_scalar else 0), "fb_w4a8_matmul")
        return y

    def linear(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k] float32 -> y [M, n] float32: x quantized per block of 32 columns (int8,
        float32 scales amax / 127, as fewbits.quant.quantize does) inside the same C call, then
        matmul(). ValueError where x holds NaN or inf (which that quantization cannot represent)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        m = x.shape[0]
        x, ldx = _w4a8_rows(x, self.k)
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0 or self.n == 0:
            return y
        _w4a8_rc(lib.fb_w4a8_linear(x.data_ptr(), ldx, m, *self._args, y.data_ptr()), "fb_w4a8_linear")
        return y
