"""Thin wrappers around torch's own low-bit CPU matmul kernels, and the layouts they expect.

Every wrapper here states the arithmetic of the kernel it calls, because the quantized modules
promise results equal to `F.linear(x, qweight.dequantize())` up to exactly that arithmetic:

int4 weight-only -- `aten._weight_int4pack_mm_for_cpu` ("tinygemm"):
    weight value = (u - 8) * s + z, u the unsigned 4-bit code, (s, z) per (group, output
    channel) stored as bfloat16 pairs in `scales_and_zeros` [K / group, N, 2]; activations and
    the result are bfloat16 (the AVX-512/AVX2 kernels exist only for bfloat16: float32 runs a
    scalar loop), products accumulate in float32. Group sizes 32/64/128/256, N a multiple of 16,
    K a multiple of the group size. The packed weight is [N, K / 2] uint8 (4 bits per value),
    but its nibbles are permuted into blocks of BLOCK_N output channels that depend on the CPU
    capability torch dispatches to (see `int4pack_layout`).
int8 weight-only -- `aten._weight_int8pack_mm`:
    y = bf16(float32(x_bf16 . w_int8) * s_bf16); K must be a multiple of 16 (other K read out of
    bounds in torch 2.x: wrong results or a crash), and the float32/float16 variants are scalar
    loops, so activations go in as bfloat16. Its AVX-512/AMX code reads the weight and the
    activations with aligned vector loads: a tensor not starting on a 64-byte boundary (a view
    at an offset, or what safetensors hands back) kills the process with SIGSEGV from 4 rows of
    activations on. Everything it is given passes through `aligned` first.
w8a8 -- int8 x int8 -> int32, exact integer accumulation, then one float32 rescale:
    `onednn.qlinear_pointwise` on a prepacked weight (uint8 activations with zero point 128 carry
    the int8 values exactly; its signed-int8 activation path is a slow reference loop), or
    `torch._int_mm` where oneDNN is not there.
bf16 -- oneDNN's bfloat16 GEMM behind F.linear: float32 accumulation, bfloat16 result.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..formats import LookupFormat, get_format, torch_dtype
from ..kernels import decode, int8, native, pack, unpack

INT4_GROUP_SIZES = (256, 128, 64, 32)  # the group sizes tinygemm's CPU kernel accepts
INT4_N_MULTIPLE = 16
INT8PACK_K_MULTIPLE = 16


KERNEL_ALIGNMENT = 64  # bytes; what torch's CPU allocator gives and AVX-512 aligned loads need


def aligned(t: torch.Tensor, alignment: int = KERNEL_ALIGNMENT) -> torch.Tensor:
    """`t` itself when it is contiguous and starts on an `alignment`-byte boundary, else a
    contiguous copy that does. Every tensor handed to a kernel that needs aligned memory goes
    through here (see the module docstring); checking costs well under a microsecond."""
    if t.is_contiguous() and t.data_ptr() % alignment == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if out.data_ptr() % alignment:  # an allocator with a smaller alignment: cut a window out of more
        nbytes = t.numel() * t.element_size()
        buf = torch.empty(nbytes + alignment, dtype=torch.uint8, device=t.device)
        start = -buf.data_ptr() % alignment
        out = buf[start:start + nbytes].view(t.dtype).view(t.shape)
    return out.copy_(t)


SERIAL_MAX_NUMEL = 1 << 20  # elementwise steps on at most this many values run on one thread


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block (see one_thread_if_small for why), restored after."""
    threads = torch.get_num_threads()
    if threads <= 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def one_thread_if_small(numel: int):
    """Run the small elementwise steps around a kernel (casts, activation quantization, rescale,
    bias) on one thread; the kernel itself keeps all threads.

    Why: each multi-threaded torch op is a parallel region that ends in a barrier. On a machine
    whose few cores are shared with other work, a barrier waits until the descheduled thread
    runs again -- about 12 ms per region on this project's 2-core VM under load, against tens
    of microseconds of work for an activation of 64 x 4096. torch.set_num_threads changes the
    calling thread's OpenMP and MKL settings only, and costs well under a microsecond."""
    if numel > SERIAL_MAX_NUMEL:
        yield
        return
    with one_thread():
        yield


def _has_op(namespace, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False


BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names of hardware bf16 products


@functools.lru_cache(maxsize=None)
def fast_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX-BF16 tiles or AVX512-BF16
    dot products, which oneDNN's bf16 GEMM behind F.linear uses): there a bf16 GEMM ran 4-5x as
    fast as float32's at 16-256 rows (Xeon with AMX, one thread); elsewhere oneDNN emulates it."""
    return any(f in native.cpu_flags() for f in BF16_MATMUL_FLAGS)


# ---------------------------------------------------------------------------------------------
# int4: torch's packed layout
# ---------------------------------------------------------------------------------------------
def _unpack_int4pack(packed: torch.Tensor, n: int, k: int, block_n: int, halves: bool) -> torch.Tensor:
    """Unsigned nibbles [n, k] (uint8) of a tinygemm CPU weight packed with blocks of `block_n`
    output channels. Each block is stored as [k, block_n / 2] bytes; in a full block byte j holds
    channel j (low nibble) and channel j + block_n/2 (high) when `halves`, else channels 2j and
    2j + 1; a partial last block always uses the 2j, 2j + 1 pairing."""
    flat = packed.reshape(-1)
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    full = n // block_n
    head = full * k * block_n // 2
    if full:
        b = flat[:head].view(full, k, block_n // 2)
        lo, hi = b & 0x0F, b >> 4
        rows = torch.cat([lo, hi], dim=2) if halves else torch.stack([lo, hi], dim=3).reshape(full, k, block_n)
        out[: full * block_n] = rows.permute(0, 2, 1).reshape(full * block_n, k)
    tail = n - full * block_n
    if tail:
        b = flat[head:].view(k, tail // 2)
        out[full * block_n:] = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(k, tail).t()
    return out


_LAYOUT_CANDIDATES = {  # name: (block_n, halves) -- from torch's weight_to_int4pack_kernel
    "avx512": (64, True),
    "avx2": (32, True),
    "scalar": (32, False),
}


@functools.lru_cache(maxsize=None)
def int4pack_layout() -> str | None:
    """Which packed layout this process's `_convert_weight_to_int4pack_for_cpu` writes, found by
    packing a probe (full blocks and a partial one of every candidate) and unpacking it each
    way; None when the ops are missing or no known layout matches (then int4 runs dequantized)."""
    if not (_has_op("aten", "_convert_weight_to_int4pack_for_cpu") and _has_op("aten", "_weight_int4pack_mm_for_cpu")):
        return None
    n, k = 64 * 2 + 48, 6
    probe = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    except (RuntimeError, NotImplementedError):
        return None
    if packed.dtype != torch.uint8 or packed.numel() * 2 != n * k:
        return None
    for name, (block_n, halves) in _LAYOUT_CANDIDATES.items():
        if torch.equal(_unpack_int4pack(packed, n, k, block_n, halves).to(torch.int32), probe):
            return name
    return None


def int4_op_group_size(group_size: int) -> int | None:
    """The largest group size tinygemm accepts that divides `group_size` (scales are repeated
    to it), or None."""
    for g in INT4_GROUP_SIZES:
        if group_size % g == 0:
            return g
    return None


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles [N, K] (any integer dtype, values 0..15) -> tinygemm's packed weight."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 1)


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of pack_int4: the unsigned nibbles [n, k] (uint8)."""
    layout = int4pack_layout()
    if layout is None:
        raise RuntimeError("torch's int4 CPU packing is not available or has an unknown layout")
    block_n, halves = _LAYOUT_CANDIDATES[layout]
    return _unpack_int4pack(packed, n, k, block_n, halves)


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """tinygemm's bfloat16 [groups, N, 2] from float scales and additive zeros [N, groups]."""
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def int4_matmul(x_bf16: torch.Tensor, packed: torch.Tensor, group_size: int,
                scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 @ W.T with W = (u - 8) * s + z -> [M, N] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16, packed, group_size, scales_and_zeros)


# ---------------------------------------------------------------------------------------------
# int8 weight-only
# ---------------------------------------------------------------------------------------------
def int8pack_available() -> bool:
    return _has_op("aten", "_weight_int8pack_mm")


def int8_weight_matmul(x_bf16: torch.Tensor, w_int8: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 @ (w_int8 [N, K] * s[:, None]).T -> [M, N] bfloat16 (K % 16 == 0).
    Every argument is made 64-byte aligned (a no-op for the weights QuantLinear built aligned)."""
    return torch.ops.aten._weight_int8pack_mm(aligned(x_bf16), aligned(w_int8), aligned(scales_bf16))


# ---------------------------------------------------------------------------------------------
# w8a8: dynamic int8 activations
# ---------------------------------------------------------------------------------------------
def onednn_int8_available() -> bool:
    return (torch.backends.mkldnn.is_available() and _has_op("onednn", "qlinear_prepack")
            and _has_op("onednn", "qlinear_pointwise"))


def onednn_prepack_int8(w_int8: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of an int8 weight [N, K] (an opaque mkldnn tensor; to_dense() gives
    back the [K, N] transpose)."""
    return torch.ops.onednn.qlinear_prepack(w_int8.contiguous(), None)


def onednn_unpack_int8(prepacked: torch.Tensor) -> torch.Tensor:
    """The int8 weight [N, K] a prepacked oneDNN weight holds."""
    return prepacked.to_dense().t().contiguous()


def onednn_prepacked_nbytes(n: int, k: int) -> int:
    """Bytes of a prepacked int8 weight: the values plus oneDNN's int32 per-channel
    compensation (the process RSS grows by about this much per prepacked 4096x4096 weight)."""
    return n * k + 4 * n


@functools.lru_cache(maxsize=32)
def _zero_weight_points(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def int8_int8_matmul_onednn(q_act_u8: torch.Tensor, prepacked: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """float32(sum_k q[m, k] * w[n, k]) * w_scales[n] -> [M, N] float32, with the activations
    given as q + 128 in uint8 (oneDNN's zero point 128 reads them back as q): exact int32
    accumulation, one float32 rounding for the product with the scale."""
    return torch.ops.onednn.qlinear_pointwise(q_act_u8, 1.0, 128, prepacked, w_scales,
                                              _zero_weight_points(w_scales.shape[0]), None,
                                              1.0, 0, torch.float32, "none", [], "")


# int8 x int8 GEMMs and the dynamic int8 activation quantizer live in kernels.int8 (training's
# int8-mixed policy uses them too); these names stay for the quantized modules
INT_MM_CUDA_MIN_ROWS = int8.INT_MM_CUDA_MIN_ROWS
int8_int8_matmul = int8.int8_int8_matmul
quantize_rows_int8 = int8.quantize_rows_int8


# ---------------------------------------------------------------------------------------------
# decoding codes through lookup tables (the dequantize-on-the-fly path)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def value_table(fmt, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 value of every code of a format of up to 8 bits (exactly fb.decode's values; NaN
    for the unused codes of a codebook with fewer than 2^bits entries), on `device`."""
    if torch.device(device).type != "cpu":
        return value_table(fmt).to(device)
    n = fmt.num_values if isinstance(fmt, LookupFormat) else 2 ** fmt.bits
    table = torch.full((2 ** fmt.bits,), float("nan"))
    table[:n] = decode(torch.arange(n), fmt, dtype=torch.float32)
    return table


@functools.lru_cache(maxsize=64)
def byte_table(fmt, device: torch.device | str = "cpu") -> torch.Tensor:
    """[256, 8 / bits] float32: the values of the codes packed low-first in each byte value, for
    formats whose width divides 8 (one gather decodes a whole byte), on `device`."""
    if torch.device(device).type != "cpu":
        return byte_table(fmt).to(device)
    bits = fmt.bits
    per = 8 // bits
    b = torch.arange(256)
    codes = torch.stack([(b >> (j * bits)) & (2 ** bits - 1) for j in range(per)], dim=1)
    return value_table(fmt)[codes].contiguous()


def decode_codes(codes: torch.Tensor, fmt, count: int, start: int = 0) -> torch.Tensor:
    """float32 values of `count` element codes starting at element `start` of a QuantizedTensor's
    stored codes (packed low-first bytes for formats of up to 8 bits, int16 bit patterns for
    16-bit ones). Equal to fb.decode of those codes."""
    fmt = get_format(fmt)
    bits = fmt.bits
    if bits > 8:
        c = codes[start:start + count]
        native = torch_dtype(fmt) if bits == 16 else None
        if native is not None and get_format(fmt.name) == fmt:
            return c.view(native).to(torch.float32)
        return decode(c.to(torch.int64) & 0xFFFF, fmt, dtype=torch.float32)
    if 8 % bits == 0 and (start * bits) % 8 == 0:
        per = 8 // bits
        first = start * bits // 8
        nbytes = -(-count // per)
        idx = codes[first:first + nbytes].to(torch.int32)
        table = byte_table(fmt, codes.device)
        vals = torch.index_select(table, 0, idx).reshape(-1) if per > 1 else torch.index_select(table.reshape(-1), 0, idx)
        return vals[:count]
    # widths that straddle bytes (3, 5, 6, 7): unpack from the last boundary where a byte and
    # a code begin together (every lcm(bits, 8) bits)
    per_group = math.lcm(bits, 8) // bits
    group = start // per_group
    skip = start - group * per_group
    first = group * per_group * bits // 8
    n = skip + count
    c = unpack(codes[first:first + -(-n * bits // 8)], bits, n, order="low_first").to(torch.int32)
    return torch.index_select(value_table(fmt, codes.device), 0, c[skip:])


def pack_low_first(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack(codes.reshape(-1).to(torch.uint8), bits, order="low_first")
