"""Bindings of int8w.c: int8 weight-only layers, each output the float32 sum of code x x times
its row's scale (`Int8Weight`: up to max_rows rows, one row, and tiles.h's bf16 batches)."""
from __future__ import annotations

import ctypes

import torch

from .lut4 import tiles
from .shared import rc_check, streamed


def declare_int8w(lib: ctypes.CDLL) -> None:
    """The argument types of int8w.c's functions (also for a build of int8w.c alone)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_int8w_matmul.argtypes = [p, i64, i64, p, p, i64, i64, p]
    lib.fb_int8w_matmul.restype = i32
    lib.fb_int8w_row.argtypes = [p, p, p]
    lib.fb_int8w_row.restype = i32
    lib.fb_int8w_tile_matmul.argtypes = [p, i32, i64, i64, p, p, i64, i64, p]
    lib.fb_int8w_tile_matmul.restype = i32
    lib.fb_int8w_tiles.argtypes = [p, p, i64, p]
    lib.fb_int8w_tiles.restype = i32
    lib.fb_int8w_max_rows.argtypes = []
    lib.fb_int8w_max_rows.restype = i32


# raises for a non-zero return code of fb_int8w_matmul / fb_int8w_row / fb_int8w_tile_matmul
int8w_rc = rc_check("the int8 kernel refused its arguments", "the int8 kernel could not allocate its buffers")


class _Int8WRow(ctypes.Structure):
    """int8w.c's Int8WRow: a weight's fixed arguments of fb_int8w_matmul for one row of x."""
    _fields_ = [("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


class Int8Weight:
    """An int8 weight-only layer's weight W = q * s (codes q [n, k] int8, one float32 scale per
    row) prepared for int8w.c: x [M <= max_rows(lib), k] float32 @ W.T as each row's float32 sum
    of q * x times its scale (see int8w.c). The tensors are referenced, not copied, where they are
    contiguous already."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu" or q.shape[1] == 0:
            raise ValueError(f"q must be a CPU int8 matrix [n, k > 0], got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if scales.numel() != n or scales.device.type != "cpu" or not scales.is_floating_point():
            raise ValueError(f"scales must be {n} CPU float values")
        self.n, self.k = int(n), int(k)
        self._q = streamed(q.contiguous())
        self._s = scales.reshape(-1).to(torch.float32).contiguous()
        self._row_args: list = []

    @staticmethod
    def max_rows(lib: ctypes.CDLL) -> int:
        return int(lib.fb_int8w_max_rows())

    def matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k] float32 (M <= max_rows) -> y [M, n] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if not 0 <= x.shape[0] <= self.max_rows(lib):
            raise ValueError(f"x may have at most {self.max_rows(lib)} rows, got {x.shape[0]}")
        if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.k):
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        ldx = x.stride(0) if m > 1 else self.k
        int8w_rc(lib.fb_int8w_matmul(x.data_ptr(), ldx, m, self._q.data_ptr(), self._s.data_ptr(), self.n, self.k,
                                     y.data_ptr()))
        return y

    def tile_matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, k] (bfloat16, or float32 rounded to bfloat16 in the call, see Lut4Weight's) @ q.T
        on AMX tiles (int8w.c's fb_int8w_tile_matmul): each output the float32 sum of the exact
        products of x and the codes (TDPBF16PS, see tiles.h) times its row's scale -> [M, n]
        float32; None where the tiles cannot be used (no AMX in this build, or Linux refused
        them)."""
        if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be CPU bfloat16 or float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if not tiles(lib):  # nothing allocated or copied for a call that cannot run
            return None
        if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.k):
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        rc = lib.fb_int8w_tile_matmul(x.data_ptr(), int(x.dtype == torch.float32), x.stride(0) if m > 1 else self.k, m,
                                      self._q.data_ptr(), self._s.data_ptr(), self.n, self.k, y.data_ptr())
        if rc == -3:
            return None
        int8w_rc(rc)
        return y

    def row_call(self) -> int:
        """The address of this weight's arguments for int8w.c's fb_int8w_row(address, x, y): y [n]
        for one contiguous float32 row x [k], what matmul() computes for it, bit for bit. Valid
        while this weight lives."""
        r = _Int8WRow(self._q.data_ptr(), self._s.data_ptr(), self.n, self.k)
        self._row_args.append(r)
        return ctypes.addressof(r)
