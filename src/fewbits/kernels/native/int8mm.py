"""Bindings of int8mm.c: the AMX int8 GEMM and its VNNI panels, the one-row VNNI kernel
(`Int8Panels`: w8a8 layers' prepared weight), and the fused bf16 -> int8 line quantizers."""
from __future__ import annotations

import ctypes

import torch

from .shared import check_rc, rc_check, streamed


def declare_int8mm(lib: ctypes.CDLL) -> None:
    """The argument types of int8mm.c's functions (also for a build of it alone, as the tests make)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_amx_int8_ready.argtypes = []
    lib.fb_amx_int8_ready.restype = i32
    lib.fb_amx_packed_bytes.argtypes = [i64, i64]
    lib.fb_amx_packed_bytes.restype = i64
    lib.fb_amx_pack_b.argtypes = [p, i64, i64, i64, p]
    lib.fb_amx_pack_b.restype = None
    lib.fb_amx_gemm_s8.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i64, i64, p, i64, i32]
    lib.fb_amx_gemm_s8.restype = i32
    lib.fb_amx_pack_bt.argtypes = [p, i64, i64, i64, p]
    lib.fb_amx_pack_bt.restype = None
    lib.fb_amx_gemv_ready.argtypes = []
    lib.fb_amx_gemv_ready.restype = i32
    lib.fb_amx_gemv_u8.argtypes = [p, i64, p, i64, p, ctypes.c_float, p, p, p]
    lib.fb_amx_gemv_u8.restype = i32
    lib.fb_w8a8_amx_row.argtypes = [p, p, p]
    lib.fb_w8a8_amx_row.restype = i32
    lib.fb_vnni_ready.argtypes = []
    lib.fb_vnni_ready.restype = i32
    lib.fb_vnni_gemm_u8.argtypes = [p, i64, i64, i64, p, i64, p, p, p, p, p, i64]
    lib.fb_vnni_gemm_u8.restype = i32
    lib.fb_q8_rows_bf16.argtypes = [p, i64, i64, i64, p, i64, p, p]
    lib.fb_q8_rows_bf16.restype = None
    lib.fb_q8_cols_bf16.argtypes = [p, i64, i64, i64, p, i64, i32, p, p, p]
    lib.fb_q8_cols_bf16.restype = None


def amx_int8_ready(lib: ctypes.CDLL) -> bool:
    """Whether int8mm.c's AMX GEMM runs here: the build has AMX and Linux granted the tile state."""
    return bool(lib.fb_amx_int8_ready())


_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int32: 2}

AMX_GEMV_MAX_K = 65536  # fb_amx_gemv_u8's sums stay exact in int32 up to this reduction length


def amx_pack(lib: ctypes.CDLL, qb: torch.Tensor) -> torch.Tensor:
    """qb [N, K] int8 (row-major, or the transpose of a row-major [K, N]) packed into int8mm.c's
    AMX panels (fb_amx_pack_b / fb_amx_pack_bt), the B operand of fb_amx_gemm_s8."""
    n, k = qb.shape
    packed = torch.empty(lib.fb_amx_packed_bytes(n, k), dtype=torch.int8)
    if qb.stride(0) == 1 and n > 1 and k > 1:  # the transpose of a row-major [K, N]: packed from it
        lib.fb_amx_pack_bt(qb.data_ptr(), k, n, qb.stride(1), packed.data_ptr())
    else:
        b = qb if qb.stride(1) == 1 else qb.contiguous()
        lib.fb_amx_pack_b(b.data_ptr(), n, k, b.stride(0) if n > 1 else k, packed.data_ptr())
    return packed


def _amx_gemm_panels(lib: ctypes.CDLL, qa: torch.Tensor, packed: torch.Tensor, n: int, da, db, bias,
                     out_dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """fb_amx_gemm_s8 of qa [M, K] int8 (padded here to M % 32 == 0, K % 64 == 0 with zeros) and
    amx_pack's panels of an [n, K] B; da / db / bias contiguous float32 or None: (rc, out [M, n])."""
    m, k = qa.shape
    mp, kp = -(-max(m, 1) // 32) * 32, -(-max(k, 1) // 64) * 64
    a = qa if (mp == m and kp == k and qa.stride(1) == 1) else \
        torch.nn.functional.pad(qa, (0, kp - k, 0, mp - m))
    out = torch.empty(m, n, dtype=out_dtype)
    ptr = lambda v: None if v is None else v.data_ptr()  # noqa: E731
    rc = lib.fb_amx_gemm_s8(a.data_ptr(), mp, kp, a.stride(0), packed.data_ptr(), n, ptr(da), ptr(db), ptr(bias),
                            m, n, out.data_ptr(), n, _OUT_KINDS[out_dtype])
    return rc, out


def amx_w8a8_ready(lib: ctypes.CDLL) -> bool:
    """Whether Int8Panels runs here with its batches on the tiles: int8mm.c's AMX GEMM and its VNNI
    one-row kernel."""
    return bool(lib.fb_amx_gemv_ready())


def vnni_w8a8_ready(lib: ctypes.CDLL) -> bool:
    """Whether Int8Panels runs here with VNNI dot products alone (tiles=False): AVX512-VNNI in the
    build, AMX or not."""
    return bool(lib.fb_vnni_ready())


# raises for a non-zero return code of fb_w8a8_amx_row
w8a8_amx_row_rc = rc_check("the w8a8 row kernel cannot run here", "the w8a8 row kernel could not allocate its buffer",
                           nonfinite=True)


class _W8A8Row(ctypes.Structure):
    """int8mm.c's W8A8Row: a w8a8 weight's fixed arguments for one row of x."""
    _fields_ = [("bp", ctypes.c_void_p), ("colsum128", ctypes.c_void_p), ("sw", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class Int8Panels:
    """An int8 weight W [n, k] packed once into int8mm.c's AMX panels (fb_amx_pack_b), with 128 times
    its row sums, for w8a8 inference: y = (float32(q @ W.T) * sx[:, None]) * sw[None, :] (+ bias),
    the int32 sums exact -- one row with VNNI dot products over the panels (fb_amx_gemv_u8);
    batches of int8 activations on the tiles (tiles=True: fb_amx_gemm_s8, rows padded to 32) or,
    on CPUs without AMX (tiles=False), with the same VNNI dot products row by row
    (fb_vnni_gemm_u8); the same float32 steps everywhere, so a row gives the bits it gives inside a
    batch. The panels are the only copy of the codes: codes(panels, n, k) derives them."""

    def __init__(self, lib: ctypes.CDLL, q: torch.Tensor, tiles: bool = True):
        self.tiles = bool(tiles)
        if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu":
            raise ValueError(f"q must be a 2-D CPU int8 tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if not 0 < k <= AMX_GEMV_MAX_K:
            raise ValueError(f"rows of 1 to {AMX_GEMV_MAX_K} codes, got {k}")
        self.n, self.k, self.kp = int(n), int(k), -(-int(k) // 64) * 64
        self.panels = streamed(amx_pack(lib, q))
        self.colsum128 = q.sum(1, dtype=torch.int32) * 128
        self._row_args: list = []  # row_call's argument structs (and scales), alive as long as this weight

    @staticmethod
    def codes(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """W [n, k] int8 from its panels: panel (nb, kb) row r byte 4c + j = W[16 nb + c][64 kb + 4 r + j]."""
        kb_n = -(-k // 64)
        p = panels.view(-1, kb_n, 16, 16, 4).permute(0, 3, 1, 2, 4)  # [nb, c, kb, r, j]
        return p.reshape(-1, kb_n * 64)[:n, :k].contiguous()

    def row_call(self, sw: torch.Tensor) -> int:
        """The address of this weight's arguments (and the weight scales sw [n] float32, held
        with them) for int8mm.c's fb_w8a8_amx_row(address, x, y): one contiguous float32 row x
        [k] quantized per token in C, then the one-row kernel, without a bias: what QuantLinear's
        general path computes for it, bit for bit. Valid while this object lives."""
        sw = sw.reshape(-1).to(torch.float32).contiguous()
        if sw.numel() != self.n:
            raise ValueError(f"sw needs {self.n} values, got {sw.numel()}")
        r = _W8A8Row(self.panels.data_ptr(), self.colsum128.data_ptr(), sw.data_ptr(), self.n, self.k)
        self._row_args.append((r, sw))
        return ctypes.addressof(r)

    def vnni_rows(self, m: int) -> bool:
        """Whether a batch of m rows runs the VNNI kernels (uint8 codes + 128), else the tiles (int8)."""
        return m == 1 or not self.tiles

    def matmul(self, lib: ctypes.CDLL, q: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """q [M, k]: uint8 codes + 128 where vnni_rows(M) (one row, or every batch without
        tiles: the VNNI kernels' operand), else int8 codes; sx [M] (or [1]), sw [n], bias [n] or
        None: float32 -> y [M, n] float32."""
        m = q.shape[0] if q.dim() == 2 else -1
        vnni = self.vnni_rows(m)
        if q.dim() != 2 or q.shape[1] != self.k or q.dtype != (torch.uint8 if vnni else torch.int8):
            raise ValueError(f"q must be [M, {self.k}], " + ("uint8 (+128)" if vnni else "int8") +
                             f" for {m} rows here; got {q.dtype} {tuple(q.shape)}")
        for v, sizes, name in ((sx, (m, 1), "sx"), (sw, (self.n,), "sw"), (bias, (self.n,), "bias")):
            if v is not None and (v.dtype != torch.float32 or v.numel() not in sizes):
                raise ValueError(f"{name} must be {sizes[0]} float32 values")
        bias = None if bias is None else bias.contiguous()  # held here while the C call reads it
        if vnni:
            # k padded to the panels' 64 with x's zeros (128); the panels' padding is zero anyway
            xu = q if self.kp == self.k else torch.nn.functional.pad(q, (0, self.kp - self.k), value=128)
            xu = xu.contiguous()
            y = torch.empty(m, self.n, dtype=torch.float32)
            bp = None if bias is None else bias.data_ptr()
            if m == 1:
                rc = lib.fb_amx_gemv_u8(xu.data_ptr(), self.kp, self.panels.data_ptr(), self.n,
                                        self.colsum128.data_ptr(), float(sx.reshape(-1)[0]), sw.data_ptr(), bp,
                                        y.data_ptr())
            else:
                sxm = sx.reshape(-1).expand(m).contiguous()
                rc = lib.fb_vnni_gemm_u8(xu.data_ptr(), m, self.kp, self.kp, self.panels.data_ptr(), self.n,
                                         self.colsum128.data_ptr(), sxm.data_ptr(), sw.data_ptr(), bp, y.data_ptr(),
                                         self.n)
        else:
            rc, y = _amx_gemm_panels(lib, q, self.panels, self.n, sx.reshape(-1).expand(m).contiguous(), sw, bias,
                                     torch.float32)
        check_rc(rc, "the int8 panel kernels refused their arguments")
        return y


def amx_int8_gemm(lib: ctypes.CDLL, qa: torch.Tensor, qb: torch.Tensor, da: torch.Tensor | None,
                  db: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """(float32(qa @ qb.T) * da[:, None]) * db[None, :] (+ bias) in out_dtype (float32 / bfloat16),
    or the int32 sums (out_dtype int32); qa [M, K], qb [N, K] int8 CPU tensors, the factors
    float32 [M] / [N] or None. None when AMX is not there. Pads M to 32 and K to 64 with zeros."""
    if out_dtype not in _OUT_KINDS:
        raise ValueError(f"out_dtype must be float32, bfloat16 or int32, got {out_dtype}")
    for t, name in ((qa, "qa"), (qb, "qb")):
        if t.dtype != torch.int8 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a 2-D CPU int8 tensor, got {t.dtype} {tuple(t.shape)}")
    m, k = qa.shape
    n = qb.shape[0]
    if qb.shape[1] != k:
        raise ValueError(f"qa {tuple(qa.shape)} and qb {tuple(qb.shape)} differ in their reduction length")
    if m == 0 or n == 0 or k == 0:
        return None  # nothing to sum: the caller's torch path
    vecs = []
    for v, size, name in ((da, m, "da"), (db, n, "db"), (bias, n, "bias")):
        if v is not None:
            v = v.reshape(-1)
            if v.dtype != torch.float32 or v.numel() != size or v.device.type != "cpu":
                raise ValueError(f"{name} must be {size} float32 values on the CPU")
            v = v.contiguous()
        vecs.append(v)
    if not amx_int8_ready(lib):  # after the checks: bad operands are refused on every CPU
        return None
    rc, out = _amx_gemm_panels(lib, qa, amx_pack(lib, qb), n, *vecs, out_dtype)
    if rc != 0:
        return None
    return out


def q8_bf16(lib: ctypes.CDLL, x: torch.Tensor, contiguous: bool = True,
            seed: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of a bfloat16 matrix x [m, k] quantized along its rows
    (kernels.int8.quantize_rows_int8's arithmetic, nonfinite="keep"; with `seed`, stochastic
    rounding as kernels.int8.quantize_rows_int8(seed=...) defines it). x may be a transposed view
    (x.stride(0) == 1): its columns in memory are then the lines quantized. The codes come back
    contiguous, or with contiguous=False possibly as the transpose of a contiguous [k, m] (what
    the AMX GEMM packs directly)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D CPU bfloat16 tensor, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    scale = torch.empty(m, dtype=torch.float32)
    sd = None if seed is None else torch.tensor([int(seed[0]) & 0xFFFFFFFF, int(seed[1]) & 0xFFFFFFFF],
                                                dtype=torch.int64).to(torch.int32)
    sp = None if sd is None else sd.data_ptr()
    if x.stride(1) == 1 or m <= 1 or k <= 1:
        x = x if x.stride(1) == 1 else x.contiguous()
        q = torch.empty(m, k, dtype=torch.int8)
        lib.fb_q8_rows_bf16(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, q.data_ptr(), k, scale.data_ptr(), sp)
        return q, scale
    base = x.t()  # [k, m], rows contiguous in memory when x is a transposed view
    if base.stride(1) != 1:
        base = base.contiguous()
    work = torch.empty(m, dtype=torch.float32)
    if contiguous:  # q [m, k]: the transpose written out
        q = torch.empty(m, k, dtype=torch.int8)
        lib.fb_q8_cols_bf16(base.data_ptr(), k, m, base.stride(0), q.data_ptr(), k, 1, scale.data_ptr(),
                            work.data_ptr(), sp)
        return q, scale
    qt = torch.empty(k, m, dtype=torch.int8)
    lib.fb_q8_cols_bf16(base.data_ptr(), k, m, base.stride(0), qt.data_ptr(), m, 0, scale.data_ptr(),
                        work.data_ptr(), sp)
    return qt.t(), scale
