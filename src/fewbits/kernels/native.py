"""Small C kernels for hot loops that torch has no fused op for, built on first use.

torch runs one pass over memory per op, so a computation of six elementwise steps reads and
writes its data six times; torch.compile fuses them, but on this project's CPU its generated
code for a row reduction followed by a float -> int8 conversion took ~100 us for 64 x 4096
values against ~24 us for a plain C loop (the w8a8 activation quantizer), and a 16-entry table
lookup has no vector form in it at all (the 4-bit matmul). The C source lives in `csrc/`; the
first call compiles it
with the machine's C compiler (`$CC`, else cc) for this CPU into a cache directory and loads it
with ctypes. Where there is no compiler, the build fails or FEWBITS_NATIVE=0 is set,
`library()` is None and every caller keeps its torch path -- the reference the C kernels are
tested against: bit for bit, except the 4-bit matmul's float32 sums, whose order is its own.

Cache: $FEWBITS_CACHE, else $XDG_CACHE_HOME/fewbits, else ~/.cache/fewbits; the file name
hashes the source, the compiler's version, the flags and the CPU's feature flags, so a
changed source or another machine sharing the directory builds its own copy.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCES = ("rowquant.c", "lut4.c", "round32.c")
HEADERS = ("vec16.h",)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c99")
# OpenMP where the compiler has it: the library then shares the process's OpenMP runtime with
# torch (torch loads its libgomp.so.1 first; the loader reuses a library already loaded under
# that name), so its threads are torch's threads, sized by torch.set_num_threads
OPENMP_FLAGS = ("-fopenmp",)
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {}  # "lib": the CDLL or None, "reason": why not, "path": the built file
_local = threading.local()


def _cache_dir() -> Path:
    if os.environ.get("FEWBITS_CACHE"):
        return Path(os.environ["FEWBITS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fewbits"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or (shutil.which("gcc") if cc == "cc" else None)


def _build(cc: str) -> Path:
    src_dir = Path(__file__).with_name("csrc")
    sources = [src_dir / s for s in SOURCES]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in sources), *((src_dir / h).read_bytes() for h in HEADERS), version.encode(), " ".join(CFLAGS + OPENMP_FLAGS).encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"fewbits_native_{h.hexdigest()[:20]}.so"
    if target.exists():
        return target
    # build beside the target, then rename: a concurrent process never loads a partial file
    fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        for extra in (OPENMP_FLAGS, ()):  # without OpenMP if the compiler has none
            r = subprocess.run([cc, *CFLAGS, *extra, "-o", tmp, *map(str, sources), "-lm"],
                               capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            if r.returncode == 0:
                break
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_row_absmax.argtypes = [p, i64, i64, i64, p]
    lib.fb_row_absmax.restype = i64
    lib.fb_row_int8_scales.argtypes = [p, i64, i64, i64, p, p]
    lib.fb_row_int8_scales.restype = i64
    lib.fb_quantize_rows_int8.argtypes = [p, i64, i64, i64, p, i64, p, i32]
    lib.fb_quantize_rows_int8.restype = None
    lib.fb_scale_rows.argtypes = [p, i64, i64, i64, p, p]
    lib.fb_scale_rows.restype = None
    lib.fb_lut4_matmul.argtypes = [p, p, p, p, p, p, ctypes.c_float, p, i64, i64, i64, i64, p, i64, i64]
    lib.fb_lut4_matmul.restype = i32
    lib.fb_lut4_decode.argtypes = [p, p, p, p, ctypes.c_float, p, i64, i64, i64, i64, p]
    lib.fb_lut4_decode.restype = i32
    u32 = ctypes.c_uint32
    lib.fb_round_float_f32.argtypes = [p, p, i64, p, i32, i32, u32, u32]
    lib.fb_round_float_f32.restype = i32
    lib.fb_round_lut_f32.argtypes = [p, p, i64, p, i32, p]
    lib.fb_round_lut_f32.restype = None
    lib.fb_round_lut_sr_f32.argtypes = [p, p, i64, p, i32, p, u32, u32]
    lib.fb_round_lut_sr_f32.restype = None
    lib.fb_round32_vectorized.argtypes = []
    lib.fb_round32_vectorized.restype = i32


def library() -> ctypes.CDLL | None:
    """The loaded native library, built on the first call; None when it cannot be had (see
    `status()` for why; inside `turned_off()`, None)."""
    if getattr(_local, "off", False):
        return None
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, reason, path = None, "", None
        if os.environ.get("FEWBITS_NATIVE", "1").lower() in ("0", "off", "false", "no"):
            reason = "turned off by FEWBITS_NATIVE=0"
        elif (cc := _compiler()) is None:
            reason = "no C compiler found (set CC)"
        else:
            try:
                path = _build(cc)
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                reason = f"built with {os.path.basename(cc)}"
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                lib, reason = None, f"build failed: {e}"
        _state.update(lib=lib, reason=reason, path=path)
        return lib


@contextlib.contextmanager
def turned_off():
    """Inside the block (in this thread) library() is None, so callers take their torch paths:
    for measuring what the C kernels gain, and for tests."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


def status() -> dict:
    """{'available': bool, 'reason': str, 'path': str | None} (builds the library if needed)."""
    lib = library()
    if getattr(_local, "off", False):
        return {"available": False, "reason": "turned off in this thread by native.turned_off()", "path": None}
    return {"available": lib is not None, "reason": _state.get("reason", ""),
            "path": str(_state["path"]) if _state.get("path") else None}


def reset() -> None:
    """Forget the loaded library (the next call builds or loads it again); for tests."""
    with _lock:
        _state.clear()


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


LUT4_MAX_ROWS = 8  # rows of x per call of the C kernel (more: call it again)


def lut4_supported(row_len: int, group: int) -> bool:
    """Whether fb_lut4_matmul takes rows of `row_len` codes in groups of `group`."""
    return row_len % 32 == 0 and group % 16 == 0 and group >= 16 and row_len % group == 0


def lut4_matmul(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scales, table: torch.Tensor, n: int,
                row_len: int, group: int) -> torch.Tensor:
    """x [M, k <= row_len] float32 @ W.T -> [M, n] float32, W[r, c] = table[code] * scale[r,
    c // group] with 4-bit codes packed low-first, row_len / 2 bytes per row (columns from k on
    are padding: x is read as zero there). `scales`: float32 [n or 1, groups], or a tuple
    (byte codes [n, groups], float32 table [256], multiplier) for scales kept coded, each
    table[code] * multiplier (one float32 product). The output rows are shared out over torch's
    OpenMP threads (where the library was built with OpenMP)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] > row_len:
        raise ValueError(f"x must be float32 [M, <= {row_len}], got {x.dtype} {tuple(x.shape)}")
    if not lut4_supported(row_len, group):
        raise ValueError(f"rows of {row_len} codes in groups of {group}: need multiples of 32 and 16")
    if codes.dtype != torch.uint8 or codes.numel() < n * row_len // 2:
        raise ValueError(f"codes must be uint8 with at least {n * row_len // 2} bytes")
    scale_args, keep = _lut4_scale_args(scales, n, row_len // group)
    table = _lut4_table(table)
    codes = codes.contiguous()
    m_all = x.shape[0]
    y = torch.empty(m_all, n, dtype=torch.float32)
    for m0 in range(0, m_all, LUT4_MAX_ROWS):
        xs = x[m0:m0 + LUT4_MAX_ROWS]
        xp = torch.nn.functional.pad(xs, (0, row_len - xs.shape[1])) if xs.shape[1] < row_len else xs
        xe, xo = xp[:, 0::2].contiguous(), xp[:, 1::2].contiguous()
        out = y[m0:m0 + LUT4_MAX_ROWS]
        if lib.fb_lut4_matmul(xe.data_ptr(), xo.data_ptr(), codes.data_ptr(), *scale_args, table.data_ptr(),
                              xs.shape[0], n, row_len, group, out.data_ptr(), 0, n):
            raise RuntimeError("fb_lut4_matmul refused its arguments")
    return y


def _lut4_scale_args(scales, n: int, groups: int):
    """(the four scale arguments of the C functions, the tensors they point into)."""
    if isinstance(scales, tuple):
        scale_codes, scale_table, scale_mul = scales
        scale_codes = scale_codes.reshape(-1).contiguous()
        scale_table = scale_table.to(torch.float32).contiguous()
        if scale_codes.dtype != torch.uint8 or scale_codes.numel() != n * groups or scale_table.numel() != 256:
            raise ValueError(f"coded scales need {n * groups} byte codes and a table of 256 values")
        return (None, scale_codes.data_ptr(), scale_table.data_ptr(), float(scale_mul)), (scale_codes, scale_table)
    scales = scales.to(torch.float32).reshape(-1, groups).expand(n, groups).contiguous()
    return (scales.data_ptr(), None, None, 1.0), (scales,)


def _lut4_table(table: torch.Tensor) -> torch.Tensor:
    table = table.to(torch.float32).contiguous()
    if table.numel() != 16:
        raise ValueError(f"the table needs 16 values, got {table.numel()}")
    return table


def lut4_decode(lib: ctypes.CDLL, codes: torch.Tensor, scales, table: torch.Tensor, n: int, row_len: int,
                group: int, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of the weight lut4_matmul reads, decoded to float32 [r1 - r0, row_len],
    bit-identical to QuantizedTensor.dequantize() (padding columns included)."""
    if not lut4_supported(row_len, group):
        raise ValueError(f"rows of {row_len} codes in groups of {group}: need multiples of 32 and 16")
    if codes.dtype != torch.uint8 or codes.numel() < n * row_len // 2 or not 0 <= r0 <= r1 <= n:
        raise ValueError(f"codes must be uint8 with at least {n * row_len // 2} bytes, 0 <= r0 <= r1 <= {n}")
    scale_args, keep = _lut4_scale_args(scales, n, row_len // group)
    table = _lut4_table(table)
    codes = codes.contiguous()
    out = torch.empty(r1 - r0, row_len, dtype=torch.float32)
    if lib.fb_lut4_decode(codes.data_ptr(), *scale_args, table.data_ptr(), row_len, group, r0, r1, out.data_ptr()):
        raise RuntimeError("fb_lut4_decode refused its arguments")
    return out


# --- rounding of float32 values (round32.c) ------------------------------------------------
def _check_flat(x: torch.Tensor, out: torch.Tensor) -> None:
    for t in (x, out):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"native rounding takes contiguous CPU float32 tensors, got {t.dtype} {t.device}")
    if out.numel() != x.numel():
        raise ValueError(f"out has {out.numel()} values for {x.numel()}")


FLOAT_KINDS = ("scaled", "fixed", "pow2")  # round32.c's kind numbers


def round_float_f32(lib, x: torch.Tensor, out: torch.Tensor, params: torch.Tensor, kind: str, mode: int,
                    seed) -> torch.Tensor:
    """x rounded into out by floatround's kernel `kind` (scaled, fixed or pow2) and its finishing
    step; params: int32, round32.c's P_* layout; mode: the index in fewbits.formats.MODES;
    seed: the pair of 31-bit seeds (stochastic rounding)."""
    _check_flat(x, out)
    rc = lib.fb_round_float_f32(x.data_ptr(), out.data_ptr(), x.numel(), params.data_ptr(), FLOAT_KINDS.index(kind),
                                int(mode), int(seed[0]), int(seed[1]))
    if rc != 0:
        raise ValueError(f"fb_round_float_f32 refused kind {kind!r}, mode {mode}")
    return out


def round_lut_f32(lib, x: torch.Tensor, out: torch.Tensor, thresholds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values[#{j: x > thresholds[j]}] (NaN for NaN) into out; float32 thresholds (<= 15,
    ascending) and values (one more)."""
    _check_flat(x, out)
    lib.fb_round_lut_f32(x.data_ptr(), out.data_ptr(), x.numel(), thresholds.data_ptr(), thresholds.numel(),
                         values.data_ptr())
    return out


def round_lut_sr_f32(lib, x: torch.Tensor, out: torch.Tensor, th_down: torch.Tensor, values: torch.Tensor,
                     seed) -> torch.Tensor:
    """Stochastic rounding to the codebook `values` (th_down: x > th_down[j] <=> x >= values[j+1])."""
    _check_flat(x, out)
    lib.fb_round_lut_sr_f32(x.data_ptr(), out.data_ptr(), x.numel(), th_down.data_ptr(), th_down.numel(),
                            values.data_ptr(), int(seed[0]), int(seed[1]))
    return out

