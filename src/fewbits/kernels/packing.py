"""Sub-byte packing: store ``bits``-wide unsigned codes densely in bytes.

``pack(codes, bits, order)`` flattens ``codes`` in C order and writes code ``i``
into bits ``[i*bits, (i+1)*bits)`` of a bitstream; ``unpack`` is its exact
inverse.  The packed length is ``ceil(n * bits / 8)`` bytes and the padding bits
of the last byte are zero.  ``bits`` may be 1..8 (8 is the identity).

Two bitstream layouts exist in the wild, and which one a file or kernel expects
is a property of that file or kernel, so it is an explicit option:

``order="low_first"`` (little-endian bitstream)
    Stream bit ``j`` is bit ``j % 8`` (LSB = bit 0) of byte ``j // 8``, and
    each code is written least-significant bit first.  Equivalently: a group of
    codes is one little-endian integer, code ``k`` at shift ``k * bits``.
    For 4 bits the first code is in the *low* nibble: ``[1, 2] -> 0x21``.
    This is the ONNX ``uint4``/``int4`` layout and torch's
    ``float4_e2m1fn_x2`` (``val1 : val0`` = bits ``7654 : 3210``), the OCP MX
    FP4 packing.  For 2 bits, ``[0, 1, 2, 3] -> 0b11_10_01_00``.

``order="high_first"`` (MSB-first bitstream)
    Stream bit ``j`` is bit ``7 - j % 8`` of byte ``j // 8``, and each code is
    written most-significant bit first.  Equivalently: a group of codes is one
    big-endian integer, code ``k`` occupying the ``k``-th ``bits``-wide field
    counted from the top.  For 4 bits the first code is in the *high* nibble:
    ``[1, 2] -> 0x12`` (the bitsandbytes 4-bit convention); for 2 bits the
    first code sits in bits 7..6.  For 1 bit this is ``numpy.packbits``'s
    default ``bitorder="big"`` (``low_first`` is ``bitorder="little"``).

When ``bits`` does not divide 8 (3, 5, 6, 7) codes straddle byte boundaries.
The fast path packs whole groups of ``lcm(bits, 8) / bits`` codes into
``lcm(bits, 8) / 8`` bytes (e.g. 6 bits: 4 codes -> 3 bytes) through one
integer word per group, padding the codes to a whole group and trimming the
output.  ``pack_reference`` / ``unpack_reference`` build the bitstream one bit
at a time with Python ints; they define the semantics and are what the fast
path is tested against.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from .arguments import check_dense

__all__ = ["pack", "unpack", "pack_reference", "unpack_reference", "packed_nbytes"]

ORDERS = ("low_first", "high_first")

_INT_DTYPES = {
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
}


# ---------------------------------------------------------------- validation


def _check_bits(bits) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    bits = int(bits)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits}")
    return bits


def _check_order(order) -> str:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS[0]!r} or {ORDERS[1]!r}, got {order!r}")
    return order


def _check_count(count) -> int:
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    count = int(count)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return count


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits occupy: ``ceil(count * bits / 8)``."""
    return -(-_check_count(count) * _check_bits(bits) // 8)


def _group(bits: int, order: str) -> tuple[int, int, list[int], list[int]]:
    """The smallest whole-byte group of ``bits``-wide codes, as one integer word:
    (codes per group, bytes per group, each code's shift in the word, each byte's shift)."""
    width = math.lcm(bits, 8)
    per_group, group_bytes = width // bits, width // 8
    if order == "low_first":
        code_shift = [k * bits for k in range(per_group)]
        byte_shift = [8 * b for b in range(group_bytes)]
    else:
        code_shift = [width - (k + 1) * bits for k in range(per_group)]
        byte_shift = [width - 8 * (b + 1) for b in range(group_bytes)]
    return per_group, group_bytes, code_shift, byte_shift


def _word_dtype(width: int) -> torch.dtype:
    # Narrowest signed type whose non-negative range holds a whole group.
    if width <= 8:
        return torch.uint8
    if width <= 31:
        return torch.int32
    return torch.int64


def _numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array).reshape(-1)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        # Read-only arrays are fine: nothing here writes into the input.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


# ---------------------------------------------------------------- fast path


def pack(codes, bits: int, order: str = "low_first"):
    """Pack unsigned ``bits``-wide codes into a dense byte stream.

    ``codes``: torch tensor or numpy array of an integer dtype, any shape or
    strides; flattened in C order; every value must be in ``[0, 2**bits)``.
    Returns a 1-D uint8 tensor (numpy array if ``codes`` was numpy) of
    ``ceil(n * bits / 8)`` bytes, on the same device as ``codes``.
    """
    bits = _check_bits(bits)
    order = _check_order(order)
    from_numpy = isinstance(codes, np.ndarray)
    if from_numpy:
        kind = codes.dtype.kind
        if kind not in "iu":
            raise TypeError(
                f"codes must have an integer dtype, got numpy {codes.dtype}"
                + (" (bool is not accepted; cast to uint8)" if kind == "b" else "")
            )
        if codes.size and not (bits == 8 and codes.dtype == np.uint8):
            # Checked in numpy's own dtype so uint64 values >= 2**63 are reported as they are.
            _check_range(int(codes.min()), int(codes.max()), bits)
        flat = _numpy_to_torch(codes)
    elif isinstance(codes, torch.Tensor):
        if codes.dtype not in _INT_DTYPES:
            hint = " (bool is not accepted; cast to uint8)" if codes.dtype == torch.bool else ""
            raise TypeError(f"codes must have an integer dtype, got {codes.dtype}{hint}")
        check_dense(codes, "codes")
        flat = codes.reshape(-1)
    else:
        raise TypeError(
            f"codes must be a torch.Tensor or numpy.ndarray, got {type(codes).__name__}"
        )

    if flat.dtype in (torch.uint16, torch.uint32, torch.uint64):
        # torch has almost no kernels for these (not even max); int64 does.
        was_uint64 = flat.dtype == torch.uint64
        flat = flat.to(torch.int64)
    else:
        was_uint64 = False
    if not from_numpy and flat.numel() and not (bits == 8 and flat.dtype == torch.uint8):
        lo, hi = (v.item() for v in torch.aminmax(flat))
        if was_uint64 and lo < 0:
            raise ValueError(
                f"codes out of range for {bits}-bit packing: max >= 2**63, "
                f"allowed [0, {(1 << bits) - 1}]"
            )
        _check_range(lo, hi, bits)

    out = _pack_flat(flat, bits, order)
    return out.cpu().numpy() if from_numpy else out


def _check_range(lo: int, hi: int, bits: int) -> None:
    if lo < 0 or hi >= (1 << bits):
        raise ValueError(
            f"codes out of range for {bits}-bit packing: min {lo}, max {hi}, "
            f"allowed [0, {(1 << bits) - 1}]"
        )


def _pack_flat(flat: torch.Tensor, bits: int, order: str) -> torch.Tensor:
    n = flat.numel()
    nbytes = -(-n * bits // 8)
    if bits == 8:
        return flat.to(torch.uint8, copy=True)
    per_group, group_bytes, code_shift, byte_shift = _group(bits, order)
    ngroups = -(-n // per_group)
    code = flat.to(_word_dtype(8 * group_bytes))
    pad = ngroups * per_group - n
    if pad:
        code = torch.cat([code, code.new_zeros(pad)])
    code = code.view(ngroups, per_group)

    word = code[:, 0] << code_shift[0]
    for k in range(1, per_group):
        word |= code[:, k] << code_shift[k]

    out = torch.empty((ngroups, group_bytes), dtype=torch.uint8, device=flat.device)
    for b in range(group_bytes):
        out[:, b] = (word >> byte_shift[b]) & 0xFF
    return out.view(-1)[:nbytes]


def unpack(packed, bits: int, count: int, order: str = "low_first"):
    """Inverse of :func:`pack`: read ``count`` codes of ``bits`` bits.

    ``packed``: uint8 torch tensor or numpy array (flattened in C order) of
    exactly ``ceil(count * bits / 8)`` bytes.  Returns a 1-D uint8 tensor
    (numpy array if ``packed`` was numpy) of ``count`` codes.
    """
    bits = _check_bits(bits)
    order = _check_order(order)
    count = _check_count(count)
    from_numpy = isinstance(packed, np.ndarray)
    if from_numpy:
        if packed.dtype != np.uint8:
            raise TypeError(f"packed must have dtype uint8, got numpy {packed.dtype}")
        flat = _numpy_to_torch(packed)
    elif isinstance(packed, torch.Tensor):
        if packed.dtype != torch.uint8:
            raise TypeError(f"packed must have dtype torch.uint8, got {packed.dtype}")
        check_dense(packed, "packed")
        flat = packed.reshape(-1)
    else:
        raise TypeError(
            f"packed must be a torch.Tensor or numpy.ndarray, got {type(packed).__name__}"
        )

    expected = -(-count * bits // 8)
    if flat.numel() != expected:
        raise ValueError(
            f"packed has {flat.numel()} bytes but {count} codes of {bits} bits need "
            f"exactly {expected} bytes"
        )
    out = _unpack_flat(flat, bits, count, order)
    return out.cpu().numpy() if from_numpy else out


def _unpack_flat(flat: torch.Tensor, bits: int, count: int, order: str) -> torch.Tensor:
    if bits == 8:
        return flat.clone()
    per_group, group_bytes, code_shift, byte_shift = _group(bits, order)
    ngroups = -(-count // per_group)
    byte = flat.to(_word_dtype(8 * group_bytes))
    pad = ngroups * group_bytes - flat.numel()
    if pad:
        byte = torch.cat([byte, byte.new_zeros(pad)])
    byte = byte.view(ngroups, group_bytes)

    word = byte[:, 0] << byte_shift[0]
    for b in range(1, group_bytes):
        word |= byte[:, b] << byte_shift[b]

    mask = (1 << bits) - 1
    out = torch.empty((ngroups, per_group), dtype=torch.uint8, device=flat.device)
    for k in range(per_group):
        out[:, k] = (word >> code_shift[k]) & mask
    return out.view(-1)[:count]


# ---------------------------------------------------------------- reference


def pack_reference(codes_list, bits: int, order: str = "low_first") -> bytes:
    """Slow, obviously correct :func:`pack`: build the bitstream one bit at a time."""
    bits = _check_bits(bits)
    order = _check_order(order)
    stream: list[int] = []
    for code in codes_list:
        code = int(code)
        if not 0 <= code < (1 << bits):
            raise ValueError(f"code {code} out of range [0, {(1 << bits) - 1}] for {bits} bits")
        code_bits = [(code >> i) & 1 for i in range(bits)]  # LSB first
        stream.extend(code_bits if order == "low_first" else code_bits[::-1])
    stream.extend([0] * (-len(stream) % 8))
    out = bytearray()
    for start in range(0, len(stream), 8):
        value = 0
        for i, bit in enumerate(stream[start : start + 8]):
            value |= bit << (i if order == "low_first" else 7 - i)
        out.append(value)
    return bytes(out)


def unpack_reference(data: bytes, bits: int, count: int, order: str = "low_first") -> list[int]:
    """Slow, obviously correct :func:`unpack`: read the bitstream one bit at a time."""
    bits = _check_bits(bits)
    order = _check_order(order)
    count = _check_count(count)
    data = bytes(data)
    expected = -(-count * bits // 8)
    if len(data) != expected:
        raise ValueError(
            f"packed has {len(data)} bytes but {count} codes of {bits} bits need "
            f"exactly {expected} bytes"
        )
    stream: list[int] = []
    for value in data:
        byte_bits = [(value >> i) & 1 for i in range(8)]  # LSB first
        stream.extend(byte_bits if order == "low_first" else byte_bits[::-1])
    codes = []
    for i in range(count):
        code_bits = stream[i * bits : (i + 1) * bits]
        if order == "high_first":
            code_bits = code_bits[::-1]
        codes.append(sum(bit << k for k, bit in enumerate(code_bits)))
    return codes
