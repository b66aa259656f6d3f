"""Bindings of lut4.c: 4-bit codes of a 16-value table with per-group parameters (`Lut4Weight`:
the fused matmul, the one-row call, block decode, and the bf16 batch multiply of tiles.h, whose
presence `tiles` / `tiles_kind` report)."""
from __future__ import annotations

import ctypes

import torch

from .shared import PARAM_KINDS, check_rc, rc_check, streamed


def declare_lut4(lib: ctypes.CDLL) -> None:
    """The argument types of lut4.c's functions (also for a build of lut4.c alone, as the tests
    make one per instruction set)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    params = ctypes.POINTER(_Lut4Params)
    lib.fb_lut4_matmul.argtypes = [p, i64, i64, p, params, p, i64, i64, i64, i64, p]
    lib.fb_lut4_matmul.restype = i32
    lib.fb_lut4_decode.argtypes = [p, params, p, i64, i64, i64, i64, p, i32]
    lib.fb_lut4_decode.restype = i32
    lib.fb_lut4_row.argtypes = [p, p, p]
    lib.fb_lut4_row.restype = i32
    lib.fb_tiles.argtypes = []
    lib.fb_tiles.restype = i32
    lib.fb_lut4_tile_matmul.argtypes = [p, i32, i64, i64, p, params, p, i64, i64, i64, i64, p]
    lib.fb_lut4_tile_matmul.restype = i32
    lib.fb_lut4_tiles.argtypes = [p, p, i64, p]
    lib.fb_lut4_tiles.restype = i32


def lut4_supported(row_len: int, group: int) -> bool:
    """Whether fb_lut4_matmul takes rows of `row_len` codes in groups of `group`."""
    return row_len % 32 == 0 and group % 16 == 0 and group >= 16 and row_len % group == 0


class _Lut4Params(ctypes.Structure):
    """lut4.c's Params: per-group scales (or byte codes of them), zero points, minimums."""
    _fields_ = [("s", ctypes.c_void_p), ("z", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("s_kind", ctypes.c_int32), ("z_kind", ctypes.c_int32), ("m_kind", ctypes.c_int32),
                ("s_codes", ctypes.c_void_p), ("s_table", ctypes.c_void_p), ("s_mul", ctypes.c_float)]


def tiles(lib: ctypes.CDLL) -> bool:
    """Whether this build has tiles.h's fused bfloat16 batch multiply (on AMX tiles where the CPU
    has AMX-BF16 and Linux granted the tiles' state, else with AVX512-BF16 dot products):
    Lut4Weight.tile_matmul and Int8Weight.tile_matmul return None where not."""
    return tiles_kind(lib) > 0


def tiles_kind(lib: ctypes.CDLL) -> int:
    """How tiles.h's batch multiply runs here: 2 on AMX tiles, 1 with AVX512-BF16 dot products,
    0 not at all."""
    return int(lib.fb_tiles())


# raises for a non-zero return code of fb_lut4_matmul / fb_lut4_row / fb_lut4_tile_matmul
lut4_rc = rc_check("the lut4 kernel refused its arguments",
                   "the lut4 kernel could not allocate its copy of x or its scratch")


class _Lut4Row(ctypes.Structure):
    """lut4.c's Lut4Row: a weight's fixed arguments of fb_lut4_matmul for one row of x."""
    _fields_ = [("codes", ctypes.c_void_p), ("P", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("group", ctypes.c_int64), ("kx", ctypes.c_int64)]


class Lut4Weight:
    """A weight W [n, row_len] of 4-bit codes of a 16-value table with per-group parameters
    (`group` columns each), W[r, c] = ((table[code] - zero_point) * scale) + minimum, each
    operation one float32 rounding (QuantizedTensor.dequantize()'s; no zero point / minimum
    where None), prepared for lut4.c: the arguments are checked and converted once, so that a
    call costs one C call.

    codes: uint8, packed low-first, row_len / 2 bytes per row. scales, zero_points, minimums:
    [n or 1, groups] in float32, float16 or bfloat16 (read as they are stored; zero points as
    float values). The scales may instead be a tuple (byte codes [n, groups], float32 table
    [256], multiplier), each scale table[code] * multiplier (one float32 product: MX, NVFP4).
    The tensors are referenced, not copied, where they already have the layout the C code
    reads (n rows, contiguous). huge_pages: put the codes on transparent huge pages
    (kernels/hugepages.py); leave it False for a weight built for one call."""

    def __init__(self, codes: torch.Tensor, scales, table: torch.Tensor, n: int, row_len: int, group: int,
                 zero_points: torch.Tensor | None = None, minimums: torch.Tensor | None = None,
                 huge_pages: bool = True):
        if not lut4_supported(row_len, group):
            raise ValueError(f"rows of {row_len} codes in groups of {group}: need multiples of 32 and 16")
        if codes.dtype != torch.uint8 or codes.numel() < n * row_len // 2 or codes.device.type != "cpu":
            raise ValueError(f"codes must be CPU uint8 with at least {n * row_len // 2} bytes")
        if table.device.type != "cpu":
            raise ValueError("the table must be a CPU tensor")
        self.n, self.row_len, self.group = int(n), int(row_len), int(group)
        groups = row_len // group
        self._keep = []
        p = _Lut4Params()
        if isinstance(scales, tuple):
            scale_codes, scale_table, scale_mul = scales
            scale_codes = scale_codes.reshape(-1).contiguous()
            scale_table = scale_table.to(torch.float32).contiguous()
            if (scale_codes.dtype != torch.uint8 or scale_codes.numel() != n * groups or scale_table.numel() != 256
                    or scale_codes.device.type != "cpu" or scale_table.device.type != "cpu"):
                raise ValueError(f"coded scales need {n * groups} CPU byte codes and a CPU table of 256 values")
            self._keep += [scale_codes, scale_table]
            p.s_codes, p.s_table, p.s_mul = scale_codes.data_ptr(), scale_table.data_ptr(), float(scale_mul)
        else:
            p.s, p.s_kind = self._param(scales, n, groups, "scales")
        if zero_points is not None:
            p.z, p.z_kind = self._param(zero_points, n, groups, "zero_points")
        if minimums is not None:
            p.m, p.m_kind = self._param(minimums, n, groups, "minimums")
        self._params = p
        self._params_ref = ctypes.byref(p)
        table = table.to(torch.float32).contiguous()
        if table.numel() != 16:
            raise ValueError(f"the table needs 16 values, got {table.numel()}")
        self._table = table
        self._codes = codes.contiguous()
        if huge_pages:  # False for a weight built for one call: a madvise per call is no use
            self.huge_pages()
        self._row_args: list = []  # row_call's argument structs, alive as long as this weight

    def huge_pages(self) -> None:
        """The codes on transparent huge pages, as streamed puts them (once, for a weight kept)."""
        streamed(self._codes)

    def _param(self, t: torch.Tensor, n: int, groups: int, what: str) -> tuple[int, int]:
        if not isinstance(t, torch.Tensor) or t.dtype not in PARAM_KINDS or t.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU float32, float16 or bfloat16 tensor")
        if t.numel() not in (groups, n * groups):
            raise ValueError(f"{what} needs {groups} or {n * groups} values, got {t.numel()}")
        t = t.reshape(-1, groups).expand(n, groups).contiguous()
        self._keep.append(t)
        return t.data_ptr(), PARAM_KINDS[t.dtype]

    def own_nbytes(self, others) -> int:
        """Bytes of the tensors this weight holds that share no storage with any of `others`
        (the QuantizedTensor's own tensors): what it derived, e.g. float32 zero points."""
        ptrs = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
        return sum(t.nbytes for t in self._keep if t.untyped_storage().data_ptr() not in ptrs)

    def matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k <= row_len] float32 @ W.T -> [M, n] float32 (columns from k on are padding:
        x is read as zero there). The output rows are shared out over torch's OpenMP threads
        (where the library was built with OpenMP). Within float32 summation error of x @ the
        decoded weight; one row with AVX-512 and groups of 16, 32 or 64 (no zero points or
        minimums) sums table value times x per 8 columns and multiplies by the scale once
        (lut4.c's one_row; a row with an infinite or NaN scale takes each weight's product first,
        as decoding does), every other case multiplies x by the decoded weights."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] > self.row_len or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, <= {self.row_len}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        lut4_rc(lib.fb_lut4_matmul(x.data_ptr(), x.stride(0), x.shape[1], self._codes.data_ptr(), self._params_ref,
                                   self._table.data_ptr(), m, self.n, self.row_len, self.group, y.data_ptr()))
        return y

    def tile_matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, k <= row_len] (bfloat16, or float32 rounded to bfloat16 in the call: to nearest
        even, subnormals to zero, see tiles.h) @ bf16(W).T -> [M, n] float32 on AMX tiles (lut4.c's
        fb_lut4_tile_matmul): W decoded to bfloat16 as decode(..., torch.bfloat16) gives it (for
        groups of 16 or a multiple of 32 by the hardware's conversion, which takes float32
        subnormals to zero), 32 rows at a time into a buffer in the caches, the exact products of
        bfloat16 numbers summed in float32 (TDPBF16PS: subnormal bfloat16 inputs read as zero, as
        in oneDNN's bfloat16 GEMM). None where the tiles cannot be used (no AMX in this build, or
        Linux refused them): the caller takes another path."""
        if (x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.shape[1] > self.row_len
                or x.device.type != "cpu"):
            raise ValueError(f"x must be CPU bfloat16 or float32 [M, <= {self.row_len}], got {x.dtype} {tuple(x.shape)}")
        if not tiles(lib):  # nothing allocated or copied for a call that cannot run
            return None
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        rc = lib.fb_lut4_tile_matmul(x.data_ptr(), int(x.dtype == torch.float32), max(x.stride(0), x.shape[1]),
                                     x.shape[1], self._codes.data_ptr(), self._params_ref, self._table.data_ptr(), m,
                                     self.n, self.row_len, self.group, y.data_ptr())
        if rc == -3:
            return None
        lut4_rc(rc)
        return y

    def row_call(self, kx: int) -> int:
        """The address of this weight's arguments for lut4.c's fb_lut4_row(address, x, y): y [n] =
        x [kx] @ W.T for one contiguous float32 row x, what matmul() computes for it, bit for bit,
        in one C call of three arguments. Valid while this weight lives."""
        if not 0 <= kx <= self.row_len:
            raise ValueError(f"kx must be in [0, {self.row_len}], got {kx}")
        r = _Lut4Row(self._codes.data_ptr(), ctypes.addressof(self._params), self._table.data_ptr(),
                     self.n, self.row_len, self.group, int(kx))
        self._row_args.append(r)
        return ctypes.addressof(r)

    def decode(self, lib: ctypes.CDLL, r0: int, r1: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0..r1 of W decoded to [r1 - r0, row_len] (padding columns included): float32
        bit-identical to QuantizedTensor.dequantize(), or bfloat16 equal to that float32
        weight's .to(torch.bfloat16) for numbers (round to nearest even; NaN -> 0x7FC0).
        `out`: a contiguous CPU tensor of at least that many values to decode into (its first
        ones; a buffer reused from block to block spares the page faults of fresh memory)."""
        if not 0 <= r0 <= r1 <= self.n:
            raise ValueError(f"rows {r0}..{r1} out of 0..{self.n}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"lut4 decodes to float32 or bfloat16, not {dtype}")
        count = (r1 - r0) * self.row_len
        if out is None:
            out = torch.empty(r1 - r0, self.row_len, dtype=dtype)
        else:
            if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < count:
                raise ValueError(f"out must be a contiguous CPU {dtype} tensor of at least {count} values")
            out = out.reshape(-1)[:count].view(r1 - r0, self.row_len)
        rc = lib.fb_lut4_decode(self._codes.data_ptr(), self._params_ref, self._table.data_ptr(), self.row_len,
                                self.group, r0, r1, out.data_ptr(), 1 if dtype == torch.bfloat16 else 0)
        check_rc(rc, "fb_lut4_decode refused its arguments", "fb_lut4_decode could not allocate its scratch")
        return out
