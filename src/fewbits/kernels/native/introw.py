"""Bindings of introw.c: integer codes of 2 to 8 bits with per-group scales and minimums, plain
or two-level (GGUF's Q8_0, Q5_0, Q5_1 and k-quants as fewbits holds them), read as stored
(`IntRowWeight`: the small-batch matmul, the one-row call of the decoder, and exact decode)."""
from __future__ import annotations

import ctypes

import torch

from .shared import PARAM_KINDS, check_rc, rc_check, streamed

MAX_M = 8  # rows of x a pass over the codes serves (introw.c's INTROW_MAX_M)


class _IntParam(ctypes.Structure):
    _fields_ = [("v", ctypes.c_void_p), ("sub", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("supers", ctypes.c_int64), ("per_super", ctypes.c_int64), ("kind", ctypes.c_int32),
                ("sub_bits", ctypes.c_int32), ("sub_signed", ctypes.c_int32), ("negate", ctypes.c_int32)]


class _IntRow(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("s", ctypes.POINTER(_IntParam)), ("m", ctypes.POINTER(_IntParam)),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("group", ctypes.c_int64), ("kx", ctypes.c_int64),
                ("bits", ctypes.c_int32), ("is_signed", ctypes.c_int32)]


def declare_introw(lib: ctypes.CDLL) -> None:
    """The argument types of introw.c's functions (also for a build of introw.c alone)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_introw_matmul.argtypes = [p, p, i64, i64, p]
    lib.fb_introw_matmul.restype = i32
    lib.fb_introw_row.argtypes = [p, p, p]
    lib.fb_introw_row.restype = i32
    lib.fb_introw_decode.argtypes = [p, i64, i64, p]
    lib.fb_introw_decode.restype = i32
    lib.fb_introw_vector.argtypes = []
    lib.fb_introw_vector.restype = i32


def introw_supported(bits: int, row_len: int, group: int) -> bool:
    """Whether introw.c takes codes of `bits` in rows of `row_len` in groups of `group`."""
    return 2 <= bits <= 8 and group >= 16 and group % 16 == 0 and row_len % group == 0


# raises for a non-zero return code of fb_introw_matmul / fb_introw_row
introw_rc = rc_check("the introw kernel refused its arguments", "the introw kernel could not allocate its copy of x")


class TwoLevel:
    """Two-level parameters as GGUF's k-quants store them: value = super[row, g // per_super] *
    sub-code[row, g] in float32 (negated for minimums: -(d * c)). sub: the packed low-first
    stream of the sub-codes ([rows, groups] fields of `sub_bits`), supers: [rows, supers] in
    float32, float16 or bfloat16."""

    def __init__(self, sub: torch.Tensor, sub_bits: int, sub_signed: bool, supers: torch.Tensor, per_super: int,
                 negate: bool = False):
        if int(per_super) < 1:
            raise ValueError(f"per_super must be at least 1, got {per_super}")
        self.sub, self.sub_bits, self.sub_signed = sub, int(sub_bits), bool(sub_signed)
        self.supers, self.per_super, self.negate = supers, int(per_super), bool(negate)


class IntRowWeight:
    """A weight W [n, row_len] of `bits`-wide integer codes (packed low-first, row after row;
    two's complement where `signed`) with per-group parameters (`group` columns each),
    W[r, c] = q * scale + minimum (each operation one float32 rounding; no minimum where None),
    prepared for introw.c: the arguments checked and converted once, so that a call costs one
    C call. scales / minimums: a tensor [n or 1, groups] (float32, float16 or bfloat16, read as
    stored) or a TwoLevel. The tensors are referenced, not copied, where they already have the
    layout the C code reads."""

    def __init__(self, codes: torch.Tensor, bits: int, signed: bool, n: int, row_len: int, group: int, scales,
                 minimums=None, huge_pages: bool = True):
        if int(n) < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not introw_supported(bits, row_len, group):
            raise ValueError(f"{bits}-bit codes in rows of {row_len} in groups of {group}: need 2-8 bits and groups "
                             "of a multiple of 16 that divide the rows")
        need = n * row_len * bits // 8
        if codes.dtype != torch.uint8 or codes.numel() < need or codes.device.type != "cpu":
            raise ValueError(f"codes must be CPU uint8 with at least {need} bytes")
        self.n, self.row_len, self.group, self.bits = int(n), int(row_len), int(group), int(bits)
        groups = row_len // group
        self._keep: list[torch.Tensor] = []
        self._s = self._param(scales, n, groups, "scales")
        self._m = self._param(minimums, n, groups, "minimums") if minimums is not None else None
        self._codes = codes.contiguous()
        if huge_pages:
            streamed(self._codes)
        self._signed = int(bool(signed))
        self._args = self._row_struct(row_len)  # matmul's and decode's (kx = row_len)
        self._row_args: list = []  # row_call's argument structs, alive as long as this weight

    def _tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dtype not in PARAM_KINDS or t.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU float32, float16 or bfloat16 tensor")
        t = t.contiguous()
        self._keep.append(t)
        return t

    def _param(self, p, n: int, groups: int, what: str) -> _IntParam:
        out = _IntParam()
        if isinstance(p, TwoLevel):
            supers = -(-groups // p.per_super)
            d = self._tensor(p.supers, f"{what}' super-block values")
            if d.numel() != n * supers:
                raise ValueError(f"{what} need {n * supers} super-block values, got {d.numel()}")
            sub_bytes = -(-n * groups * p.sub_bits // 8)
            if (p.sub.dtype != torch.uint8 or p.sub.device.type != "cpu" or p.sub.numel() < sub_bytes
                    or not 1 <= p.sub_bits <= 8):
                raise ValueError(f"{what} need {sub_bytes} CPU bytes of {p.sub_bits}-bit sub-codes")
            sub = p.sub.contiguous()
            self._keep.append(sub)
            out.v, out.sub, out.kind = d.data_ptr(), sub.data_ptr(), PARAM_KINDS[d.dtype]
            out.supers, out.per_super, out.rows = supers, p.per_super, n
            out.sub_bits, out.sub_signed, out.negate = p.sub_bits, int(p.sub_signed), int(p.negate)
            return out
        t = self._tensor(p, what)
        if t.numel() not in (groups, n * groups):
            raise ValueError(f"{what} needs {groups} or {n * groups} values, got {t.numel()}")
        out.v, out.kind, out.rows = t.data_ptr(), PARAM_KINDS[t.dtype], 1 if t.numel() == groups and n != 1 else n
        return out

    def _row_struct(self, kx: int) -> _IntRow:
        m = ctypes.pointer(self._m) if self._m is not None else None
        return _IntRow(self._codes.data_ptr(), ctypes.pointer(self._s), m, self.n, self.row_len, self.group, int(kx),
                       self.bits, self._signed)

    def own_nbytes(self, others) -> int:
        """Bytes of the tensors this weight holds that share no storage with any of `others`."""
        ptrs = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
        return sum(t.nbytes for t in self._keep if t.untyped_storage().data_ptr() not in ptrs)

    def matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k <= row_len] float32 @ W.T -> [M, n] float32 (columns from k on are padding, left
        out): x times the decoded weights (decode()'s, bit for bit), the products summed in float32
        in an order of introw.c's own; within float32 summation error of x @ the decoded weight."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] > self.row_len or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, <= {self.row_len}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, self.n, dtype=torch.float32)
        if self.n == 0 or m == 0:  # nothing to compute (an empty weight's pointers may be NULL)
            return y
        args = self._args if k == self.row_len else self._row_struct(k)
        introw_rc(lib.fb_introw_matmul(ctypes.byref(args), x.data_ptr(), max(k, 1), m, y.data_ptr()))
        return y

    def row_call(self, kx: int) -> int:
        """The address of this weight's arguments for introw.c's fb_introw_row(address, x, y): y [n]
        = x [kx] @ W.T for one contiguous float32 row, what matmul() computes for it, bit for bit.
        Valid while this weight lives."""
        if not 0 <= kx <= self.row_len:
            raise ValueError(f"kx must be in [0, {self.row_len}], got {kx}")
        r = self._row_struct(kx)
        self._row_args.append(r)
        return ctypes.addressof(r)

    def decode(self, lib: ctypes.CDLL, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0..r1 of W as float32 [r1 - r0, row_len] (padding columns included), bit-identical
        to QuantizedTensor.dequantize(): q * scale, then + minimum."""
        if not 0 <= r0 <= r1 <= self.n:
            raise ValueError(f"rows {r0}..{r1} out of 0..{self.n}")
        count = (r1 - r0) * self.row_len
        if out is None:
            out = torch.empty(r1 - r0, self.row_len, dtype=torch.float32)
        else:
            if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < count:
                raise ValueError(f"out must be a contiguous CPU float32 tensor of at least {count} values")
            out = out.reshape(-1)[:count].view(r1 - r0, self.row_len)
        if r1 == r0:
            return out
        check_rc(lib.fb_introw_decode(ctypes.byref(self._args), r0, r1, out.data_ptr()),
                 "fb_introw_decode refused its arguments")
        return out


def introw_vector(lib: ctypes.CDLL) -> bool:
    """Whether this build of introw.c unpacks 16 codes a step (AVX-512 VBMI) rather than one."""
    return bool(lib.fb_introw_vector())
