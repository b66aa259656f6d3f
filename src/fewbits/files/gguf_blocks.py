"""GGUF's block formats as bytes: a QuantizedTensor of the presets q8_0, q4_0, q4_1, q5_0, q5_1
(blocks of 32 values) and q2_k, q3_k, q4_k, q5_k, q6_k (super-blocks of 256) written as the blocks llama.cpp
reads (ggml-common.h), little-endian:

- Q8_0 (34 bytes): fp16 d, 32 int8 q;                          w = d * q
- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;                w = d * (q - 8)
- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles;        w = d * q + m
- Q5_0 (22 bytes): fp16 d, uint32 qh, 16 bytes of nibbles;     w = d * (q - 16)
- Q5_1 (24 bytes): fp16 d, fp16 m, uint32 qh, 16 bytes;        w = d * q + m
- IQ4_NL (18 bytes): fp16 d, 16 bytes of nibbles;              w = d * kvalues[q] (fewbits' iq4_nl
  codebook: -127, -104, ..., 113; the nibble is the index, fewbits' code)

Byte j of the nibbles holds element j in its low nibble and element j + 16 in its high one; in
Q5_*, bit i of qh is bit 4 of element i. The presets quantize as `gguf.quants.quantize` does
(scale_method "gguf"), so these bytes equal the gguf package's own (IQ4_NL, which gguf only
dequantizes: fewbits chooses the codes by llama.cpp's signed-scale search,
fewbits.quant.lookup_search), and `gguf.quants.dequantize`
of them equals QuantizedTensor.dequantize() bit for bit; decode_blocks reads such bytes back
into a QuantizedTensor. Needs no gguf package.

The k-quants (super-blocks of 256; sub-block j = values 32j..32j+31, Q2_K, Q3_K, Q6_K: 16j..16j+15):

- Q2_K (84 bytes): 16 bytes of 4-bit sub-scales sc (low nibble) and sub-minimums m (high nibble),
  64 bytes qs, fp16 d, fp16 dmin;                           w = (d * sc) * q - (dmin * m)
- Q3_K (110 bytes): 32 bytes hmask, 64 bytes qs, 12 bytes of 6-bit signed sub-scales (stored
  sc + 32), fp16 d;                                         w = (d * sc) * q, q in -4..3

- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit sub-scales sc[8] and sub-minimums m[8],
  128 bytes of nibbles;                                     w = (d * sc) * q - (dmin * m)
- Q5_K (176 bytes): as Q4_K, with 32 bytes qh before the nibbles (bit i of qh[l]: bit 4 of
  element 32i + l)
- Q6_K (210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 sub-scales, fp16 d; w = (d * sc) * (q - 32)

The 12 scale bytes of Q4_K/Q5_K: byte j (j < 4) holds sc[j] and, in its top two bits, bits 4-5 of
sc[j + 4]; byte j + 4 likewise m[j] and m[j + 4]; byte j + 8 the low nibbles of sc[j + 4] (low)
and m[j + 4] (high). Nibbles: byte 32c + l holds element 64c + l (low) and 64c + 32 + l (high).
Q6_K, per half h of 128 values: ql[64h + l] holds elements 128h + l (low) and 128h + 64 + l
(high), ql[64h + 32 + l] elements 128h + 32 + l and 128h + 96 + l; qh[32h + l] bits 4-5 of
elements 128h + l, +32, +64, +96 in bit pairs 0, 2, 4, 6. Q2_K and Q3_K, per half h of 128
values: bits 2j..2j+1 of qs[32h + l] hold the low two bits of element 128h + 32j + l (j < 4; Q2_K:
its whole code q); in Q3_K bit 4h + j of hmask[l] is bit 2 of that element's q + 4. Q3_K's
scale bytes: byte j (j < 8) holds bits 0-3 of sc[j] + 32 (low) and of sc[j + 8] + 32 (high), byte
8 + k bits 4-5 of sc[k + 4i] + 32 in bit pair i (i < 4). The gguf package only dequantizes
these types; fewbits chooses the codes (fewbits.quant.scales.SuperBlockScales, or GPTQ), and
gguf.quants.dequantize of the bytes equals QuantizedTensor.dequantize() bit for bit.

Known difference: a block whose scale overflows fp16 (Q8_0: |x| > 65504 * 127) gets an infinite d
in gguf and the saturated 65504 in fewbits (round_scales saturates).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..kernels import encode, pack, unpack
from ..quant.scheme import QuantScheme, get_scheme
from ..quant.tensor import _PACK_ORDER, QuantizedTensor

BLOCK = 32
# GGML type name -> (fewbits preset, GGMLQuantizationType value, bytes per block)
GGUF_BLOCK_TYPES = {
    "Q4_0": ("q4_0", 2, 18),
    "Q4_1": ("q4_1", 3, 20),
    "Q5_0": ("q5_0", 6, 22),
    "Q5_1": ("q5_1", 7, 24),
    "Q8_0": ("q8_0", 8, 34),
    "IQ4_NL": ("iq4_nl", 20, 18),
    "Q2_K": ("q2_k", 10, 84),
    "Q3_K": ("q3_k", 11, 110),
    "Q4_K": ("q4_k", 12, 144),
    "Q5_K": ("q5_k", 13, 176),
    "Q6_K": ("q6_k", 14, 210),
}


def _stored_as(scheme: QuantScheme) -> QuantScheme | None:
    """The scheme with the fields that do not change what is stored (name, how the scales and codes
    are chosen: scale_method, percentile, mode, seed; the activations' scheme, a choice made when
    the layer runs: w4a8's weights are Q4_0) set to one value; None if that is no scheme."""
    try:
        return dataclasses.replace(scheme, name=None, scale_method="absmax", percentile=99.9,
                                   mode="nearest_even", seed=0, activations=None)
    except ValueError:
        return None


def gguf_block_type(scheme) -> str:
    """The GGML type name ("Q4_0", ...) of a scheme stored as one of the GGUF block presets is
    (its fields, whatever its name; how it chooses scales and codes does not matter: q4_k with
    scale_method "absmax" is Q4_K too); a ValueError naming the supported presets otherwise."""
    s = _stored_as(get_scheme(scheme))
    for name, (preset, _, _) in GGUF_BLOCK_TYPES.items():
        if s is not None and _stored_as(get_scheme(preset)) == s:
            return name
    presets = ", ".join(p for p, _, _ in GGUF_BLOCK_TYPES.values())
    raise ValueError(f"scheme {get_scheme(scheme).label!r} has no GGUF block format; the GGUF block schemes are "
                     f"{presets}")


def block_values(type_name: str) -> int:
    """Values per block of a GGUF block type: 32 (Q8_0, Q4_0, ...) or 256 (the k-quants)."""
    scheme = get_scheme(GGUF_BLOCK_TYPES[type_name][0])
    return scheme.super_block or scheme.group_size


def _halves(t: torch.Tensor) -> np.ndarray:
    """fp16 [rows, groups] -> uint8 [rows, groups, 2], little-endian."""
    return np.ascontiguousarray(t.detach().cpu().numpy().astype("<f2")).view(np.uint8).reshape(*t.shape, 2)


def encode_blocks(qt: QuantizedTensor) -> np.ndarray:
    """The GGUF block bytes of a QuantizedTensor in q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / iq4_nl / q2_k /
    q3_k / q4_k / q5_k / q6_k: uint8 of shape (*shape[:-1], shape[-1] // block * bytes_per_block), as
    `gguf.quants.quantize` returns them (a GGUFWriter takes this array with raw_dtype = the GGML
    type). The last dimension must be a multiple of the block (32; 256 for the k-quants): GGUF
    blocks have no padding.

    Works on the packed codes as bytes (the fewbits codes of an integer format are the value's
    two's complement bits, GGUF's are value + 2^(b-1): one XOR of the top bit; IQ4_NL's codebook
    index is both; 4-bit codes are
    moved nibble by nibble without unpacking); _encode_blocks_reference, the plain version through
    integer values, gives the same bytes (tested)."""
    name, shape, block, type_size = _check_encodable(qt)
    if qt.scheme.super_block is not None:
        blocks = _encode_k_fast(qt, name)
    else:
        blocks = _encode_legacy_fast(qt, name)
    assert blocks.shape[-1] == type_size
    return blocks.reshape(*shape[:-1], shape[-1] // block * type_size)


def _check_encodable(qt) -> tuple[str, tuple, int, int]:
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"encode_blocks() takes a QuantizedTensor, got {type(qt).__name__}")
    name = gguf_block_type(qt.scheme)
    _, _, type_size = GGUF_BLOCK_TYPES[name]
    shape = tuple(qt.shape)
    block = block_values(name)
    if len(shape) == 0 or shape[-1] % block:
        raise ValueError(f"GGUF {name} needs rows of a multiple of {block} values (the last dimension); "
                         f"shape {shape} has rows of {shape[-1] if shape else 0}")
    return name, shape, block, type_size


def _packed_bytes(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy()).reshape(-1)


def _codes_u8(packed: torch.Tensor, bits: int, count: int) -> np.ndarray:
    """The first `count` codes of a low_first stream of `bits`-wide codes, uint8 [count]."""
    p = _packed_bytes(packed)
    if bits == 8:
        return p[:count]
    if bits == 4:
        c = np.empty(2 * p.size, dtype=np.uint8)
        c[0::2] = p & 0x0F
        c[1::2] = p >> 4
        return c[:count]
    return unpack(p, bits, count, order=_PACK_ORDER)


def _pack_u8(codes: np.ndarray, bits: int) -> torch.Tensor:
    """uint8 codes (C order) packed low_first as quantize() packs them, a uint8 tensor."""
    c = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return torch.from_numpy(c.copy())
    if bits == 4:
        if c.size % 2:
            c = np.concatenate([c, np.zeros(1, np.uint8)])
        return torch.from_numpy(c[0::2] | (c[1::2] << 4))
    return torch.from_numpy(np.ascontiguousarray(pack(c, bits, order=_PACK_ORDER)))


def _split_nibbles(p: np.ndarray) -> np.ndarray:
    """fewbits' packed bytes p [..., 2h] of 4h codes c (byte i: c[2i] low, c[2i+1] high) as GGUF's
    [..., 2h] (byte j: c[j] low, c[j + 2h] high)."""
    h = p.shape[-1] // 2
    a, b = p[..., :h], p[..., h:]
    out = np.empty_like(p)
    out[..., 0::2] = (a & 0x0F) | (b << 4)
    out[..., 1::2] = (a >> 4) | (b & 0xF0)
    return out


def _join_nibbles(o: np.ndarray) -> np.ndarray:
    """Inverse of _split_nibbles: GGUF's nibble bytes [..., 2h] as fewbits' packed bytes."""
    even, odd = o[..., 0::2], o[..., 1::2]
    return np.concatenate([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1)


def _encode_legacy_fast(qt: QuantizedTensor, name: str) -> np.ndarray:
    """Blocks of 32 values, uint8 [rows, groups, type_size]."""
    rows, cols, _, groups = qt.scheme.layout(tuple(qt.shape))
    bits = qt.scheme.format.bits
    _, _, type_size = GGUF_BLOCK_TYPES[name]
    out = np.empty((rows, groups, type_size), dtype=np.uint8)
    out[..., 0:2] = _halves(qt.scales)
    at = 2
    if qt.minimums is not None:
        out[..., 2:4] = _halves(qt.minimums)
        at = 4
    flip = 0 if qt.minimums is not None or name in ("Q8_0", "IQ4_NL") else 1 << (bits - 1)  # two's complement -> offset
    if bits == 4:  # the nibbles as they are packed, moved
        p = _packed_bytes(qt.codes)[: rows * cols // 2].reshape(rows, groups, 16)
        out[..., at:] = _split_nibbles(p) ^ (flip * 0x11)
        return out
    q = _codes_u8(qt.codes, bits, rows * cols).reshape(rows, groups, BLOCK) ^ flip
    if name == "Q8_0":
        out[..., at:] = q
        return out
    out[..., at:at + 4] = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")  # qh, little-endian uint32
    out[..., at + 4:] = (q[..., :16] & 0x0F) | (q[..., 16:] << 4)
    return out


def _encode_k_fast(qt: QuantizedTensor, name: str) -> np.ndarray:
    """k-quant super-blocks, uint8 [rows * super-blocks, type_size] (see the module docstring)."""
    s = qt.scheme
    rows, supers, per = s.super_layout(qt.shape)
    n = rows * supers
    _, _, type_size = GGUF_BLOCK_TYPES[name]
    sub = s.sub_scale_format_of
    out = np.empty((n, type_size), dtype=np.uint8)
    sc = _codes_u8(qt.sub_scales, sub.bits, n * per).reshape(n, per)  # int8: two's complement bytes
    d = _halves(qt.super_scales).reshape(n, 2)
    if name in ("Q2_K", "Q3_K"):
        return _encode_low_k_fast(qt, name, n, sc, d, out)
    if name == "Q6_K":
        q = (_codes_u8(qt.codes, 6, n * 256) ^ 32).reshape(n, 2, 4, 32)  # [half, quarter, l], value + 32
        ql = out[:, :128].reshape(n, 2, 2, 32)
        ql[:, :, 0] = (q[:, :, 0] & 0x0F) | (q[:, :, 2] << 4)
        ql[:, :, 1] = (q[:, :, 1] & 0x0F) | (q[:, :, 3] << 4)
        hi = q >> 4
        out[:, 128:192] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
        out[:, 192:208] = sc
        out[:, 208:210] = d
        return out
    m = _codes_u8(qt.sub_minimums, sub.bits, n * per).reshape(n, per)
    out[:, 0:2] = d
    out[:, 2:4] = _halves(qt.super_minimums).reshape(n, 2)
    out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    if name == "Q4_K":
        p = _packed_bytes(qt.codes)[: n * 128].reshape(n, 4, 32)  # 64 codes per chunk
        out[:, 16:] = _split_nibbles(p).reshape(n, 128)
        return out
    q = _codes_u8(qt.codes, 5, n * 256).reshape(n, 4, 2, 32)  # [chunk of 64, low/high half, l]
    bits = ((q.reshape(n, 8, 32) >> 4) & 1).transpose(0, 2, 1)  # [n, l, i]: bit i of qh[l]
    out[:, 16:48] = np.packbits(np.ascontiguousarray(bits), axis=-1, bitorder="little")[..., 0]
    out[:, 48:] = ((q[:, :, 0] & 0x0F) | (q[:, :, 1] << 4)).reshape(n, 128)
    return out


def _encode_low_k_fast(qt: QuantizedTensor, name: str, n: int, sc: np.ndarray, d: np.ndarray,
                       out: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K super-blocks into out uint8 [n, type_size]; sc: the raw sub-scale codes [n, 16]."""
    q = _codes_u8(qt.codes, qt.scheme.format.bits, n * 256).reshape(n, 2, 4, 32)  # [half, j, l]
    if name == "Q3_K":
        q = q ^ 4  # two's complement -> value + 4
        bits = ((q >> 2) & 1).reshape(n, 8, 32).transpose(0, 2, 1)  # [n, l, i]: bit i of hmask[l]
        out[:, 0:32] = np.packbits(np.ascontiguousarray(bits), axis=-1, bitorder="little")[..., 0]
        qs = out[:, 32:96]
    else:
        qs = out[:, 16:80]
    low = q & 3
    qs[:] = (low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)).reshape(n, 64)
    if name == "Q2_K":
        m = _codes_u8(qt.sub_minimums, 4, n * 16).reshape(n, 16)
        out[:, 0:16] = sc | (m << 4)
        out[:, 80:82] = d
        out[:, 82:84] = _halves(qt.super_minimums).reshape(n, 2)
        return out
    u = sc ^ 32  # 6-bit two's complement -> value + 32
    out[:, 96:104] = (u[:, :8] & 0x0F) | ((u[:, 8:] & 0x0F) << 4)
    hi = (u >> 4).reshape(n, 4, 4)  # [i, k]: sc[4i + k]
    out[:, 104:108] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    out[:, 108:110] = d
    return out


def _encode_blocks_reference(qt: QuantizedTensor) -> np.ndarray:
    """encode_blocks() as first written, through the integer values (int_codes, int64): the
    reference encode_blocks is tested against."""
    name, shape, block, type_size = _check_encodable(qt)
    if qt.scheme.super_block is not None:
        blocks = _encode_k_reference(qt, name)
        assert blocks.shape[-1] == type_size
        return blocks.reshape(*shape[:-1], shape[-1] // block * type_size)
    rows, cols, _, groups = qt.scheme.layout(shape)
    if name == "IQ4_NL":  # the codebook index is the nibble
        v = qt.element_codes().cpu().to(torch.int64).reshape(rows, groups, BLOCK).numpy() - 8
    else:
        v = qt.int_codes().cpu().reshape(rows, groups, BLOCK).numpy()
    parts = [_halves(qt.scales)]
    if qt.minimums is not None:
        parts.append(_halves(qt.minimums))
    if name == "Q8_0":
        parts.append(v.astype(np.int8).view(np.uint8))
    else:
        q = (v + (0 if qt.minimums is not None else 2 ** (qt.scheme.format.bits - 1))).astype(np.uint8)
        if qt.scheme.format.bits == 5:
            high = ((q >> 4) & 1).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
            qh = np.bitwise_or.reduce(high, axis=-1).astype("<u4")
            parts.append(np.ascontiguousarray(qh).view(np.uint8).reshape(rows, groups, 4))
        parts.append((q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4))
    blocks = np.concatenate(parts, axis=-1)
    assert blocks.shape[-1] == type_size
    return blocks.reshape(*shape[:-1], groups * type_size)


def _encode_k_reference(qt: QuantizedTensor, name: str) -> np.ndarray:
    """k-quant super-blocks, uint8 [rows * super-blocks, type_size] (see the module docstring)."""
    s = qt.scheme
    rows, supers, per = s.super_layout(qt.shape)
    n = rows * supers
    v = qt.int_codes().cpu().numpy().reshape(n, 256)
    sc = qt.sub_scale_codes().cpu().numpy().reshape(n, per)
    d = _halves(qt.super_scales).reshape(n, 2)
    if name in ("Q2_K", "Q3_K"):
        return _encode_low_k_reference(qt, name, v, sc, d)
    if name == "Q6_K":
        q = (v + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, l]
        lo = q & 0xF
        ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)  # [n, 2, 64]
        hi = q >> 4
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
        return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d], axis=-1)
    m = qt.sub_scale_codes(minimums=True).cpu().numpy().reshape(n, per)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=-1)
    q = v.astype(np.uint8).reshape(n, 4, 2, 32)  # [chunk of 64, low/high half, l]
    parts = [d, _halves(qt.super_minimums).reshape(n, 2), scales]
    if name == "Q5_K":
        bits = ((q.reshape(n, 8, 32) >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(bits, axis=1))
    parts.append(((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128))
    return np.concatenate(parts, axis=-1)


def _encode_low_k_reference(qt: QuantizedTensor, name: str, v: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K super-blocks, element by element as llama.cpp's quantize_row_q2_K_ref /
    q3_K_ref lay them out: v the integer values [n, 256], sc the sub-scale values [n, 16]."""
    n = v.shape[0]
    size = GGUF_BLOCK_TYPES[name][2]
    out = np.zeros((n, size), dtype=np.uint8)
    q = v + (4 if name == "Q3_K" else 0)  # Q3_K stores value + 4
    qs_at = 32 if name == "Q3_K" else 16
    for e in range(256):
        h, j, l = e // 128, (e % 128) // 32, e % 32
        out[:, qs_at + 32 * h + l] |= ((q[:, e] & 3) << (2 * j)).astype(np.uint8)
        if name == "Q3_K":
            out[:, l] |= (((q[:, e] >> 2) & 1) << (4 * h + j)).astype(np.uint8)
    if name == "Q2_K":
        m = qt.sub_scale_codes(minimums=True).cpu().numpy().reshape(n, 16)
        out[:, 0:16] = (sc | (m << 4)).astype(np.uint8)
        out[:, 80:82] = d
        out[:, 82:84] = _halves(qt.super_minimums).reshape(n, 2)
        return out
    u = sc + 32
    for j in range(16):
        if j < 8:
            out[:, 96 + j] |= (u[:, j] & 0xF).astype(np.uint8)
        else:
            out[:, 96 + j - 8] |= ((u[:, j] & 0xF) << 4).astype(np.uint8)
        out[:, 104 + j % 4] |= ((u[:, j] >> 4) << (2 * (j // 4))).astype(np.uint8)
    out[:, 108:110] = d
    return out


def _decode_low_k_reference(b: np.ndarray, type_name: str):
    """(element values int64 [n, 256], sub-scale values [n, 16], sub-minimum values or None) of Q2_K /
    Q3_K super-blocks b uint8 [n, size], element by element as llama.cpp's dequantize_row_q2_K / q3_K."""
    n = b.shape[0]
    values = np.zeros((n, 256), dtype=np.int64)
    qs_at = 32 if type_name == "Q3_K" else 16
    for e in range(256):
        h, j, l = e // 128, (e % 128) // 32, e % 32
        q = (b[:, qs_at + 32 * h + l].astype(np.int64) >> (2 * j)) & 3
        if type_name == "Q3_K":
            q = q - np.where((b[:, l] >> (4 * h + j)) & 1, 0, 4)
        values[:, e] = q
    if type_name == "Q2_K":
        return values, (b[:, 0:16] & 0xF).astype(np.int64), (b[:, 0:16] >> 4).astype(np.int64)
    sc = np.zeros((n, 16), dtype=np.int64)
    for j in range(16):
        low = (b[:, 96 + j] & 0xF) if j < 8 else (b[:, 96 + j - 8] >> 4)
        sc[:, j] = (low | (((b[:, 104 + j % 4] >> (2 * (j // 4))) & 3) << 4)).astype(np.int64) - 32
    return values, sc, None


def _decode_k_reference(b: np.ndarray, scheme: QuantScheme, type_name: str, shape, dtype) -> QuantizedTensor:
    """A QuantizedTensor of a k-quant preset from its super-blocks b uint8 [rows, supers, size]."""
    rows, supers, size = b.shape
    n = rows * supers
    b = b.reshape(n, size)

    def halves(at):
        return torch.from_numpy(np.ascontiguousarray(b[:, at:at + 2]).view("<f2")[:, 0].astype(np.float16))

    def packed(codes, fmt):  # integer values -> the codes quantize() packs
        c = encode(torch.from_numpy(codes.reshape(-1).astype(np.float32)), fmt)
        return pack(c.to(torch.uint8), fmt.bits, order=_PACK_ORDER)

    sub = scheme.sub_scale_format_of
    parts = {}
    if type_name in ("Q2_K", "Q3_K"):
        values, sc, m = _decode_low_k_reference(b, type_name)
        parts.update(sub_scales=packed(sc, sub), super_scales=halves(80 if type_name == "Q2_K" else 108).reshape(rows, supers))
        if m is not None:
            parts.update(sub_minimums=packed(m, sub), super_minimums=halves(82).reshape(rows, supers))
    elif type_name == "Q6_K":
        ql, qh = b[:, :128].reshape(n, 2, 2, 32), b[:, 128:192].reshape(n, 2, 1, 32)
        low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        values = (low | (high << 4)).astype(np.int64).reshape(n, 256) - 32
        parts["sub_scales"] = packed(b[:, 192:208].view(np.int8), sub)
        parts["super_scales"] = halves(208).reshape(rows, supers)
    else:
        sb = b[:, 4:16]
        sc = np.concatenate([sb[:, :4] & 63, (sb[:, 8:] & 0xF) | ((sb[:, :4] >> 6) << 4)], axis=-1)
        m = np.concatenate([sb[:, 4:8] & 63, (sb[:, 8:] >> 4) | ((sb[:, 4:8] >> 6) << 4)], axis=-1)
        at = 16
        high = 0
        if type_name == "Q5_K":
            qh = b[:, 16:48]
            high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, 4, 2, 32) << 4
            at = 48
        qs = b[:, at:at + 128].reshape(n, 4, 1, 32)
        low = np.concatenate([qs & 0xF, qs >> 4], axis=2)
        values = (low | high).astype(np.int64).reshape(n, 256)
        parts.update(sub_scales=packed(sc, sub), super_scales=halves(0).reshape(rows, supers),
                     sub_minimums=packed(m, sub), super_minimums=halves(2).reshape(rows, supers))
    codes = packed(values, scheme.format)
    return QuantizedTensor(scheme, shape, dtype, codes, **parts)


def decode_blocks(blocks, type_name: str, shape, dtype: torch.dtype = torch.float32) -> QuantizedTensor:
    """A QuantizedTensor of the matching preset from GGUF block bytes of type `type_name` ("Q4_0",
    ...) holding a tensor of `shape` (numpy shape order: the last dimension is the row). The
    bytes are checked against the shape first (a file's tensor is untrusted); the result's
    dequantize() equals gguf.quants.dequantize of the same bytes. Works on bytes as
    encode_blocks does; equal to _decode_blocks_reference (tested)."""
    b, scheme, shape = _check_decodable(blocks, type_name, shape)
    if scheme.super_block is not None:
        return _decode_k_fast(b, scheme, type_name, shape, dtype)
    rows, groups, _ = b.shape
    bits = scheme.format.bits

    def halves(at):
        return torch.from_numpy(np.ascontiguousarray(b[..., at:at + 2]).view("<f2")[..., 0].astype(np.float16))

    scales = halves(0)
    minimums = halves(2) if scheme.zero_point == "float" else None
    at = 4 if minimums is not None else 2
    flip = 0 if minimums is not None or type_name in ("Q8_0", "IQ4_NL") else 1 << (bits - 1)  # offset -> two's complement
    if bits == 4:
        codes = torch.from_numpy(_join_nibbles(b[..., at:]).reshape(-1) ^ (flip * 0x11))
    elif type_name == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(b[..., at:]).reshape(-1))
    else:
        high = np.unpackbits(np.ascontiguousarray(b[..., at:at + 4]), axis=-1, bitorder="little") << 4
        qs = b[..., at + 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | high
        codes = _pack_u8(q ^ flip, bits)
    return QuantizedTensor(scheme, shape, dtype, codes, scales=scales, minimums=minimums)


def _check_decodable(blocks, type_name: str, shape):
    """(uint8 [rows, blocks per row, type_size], the preset, the shape) after the checks."""
    if type_name not in GGUF_BLOCK_TYPES:
        raise ValueError(f"unknown GGUF block type {type_name!r}; supported: {', '.join(GGUF_BLOCK_TYPES)}")
    preset, _, type_size = GGUF_BLOCK_TYPES[type_name]
    scheme = get_scheme(preset)
    shape = tuple(int(s) for s in shape)
    block = block_values(type_name)
    if len(shape) == 0 or shape[-1] % block or any(s < 0 for s in shape):
        raise ValueError(f"GGUF {type_name} holds rows of a multiple of {block} values; shape {shape} has not")
    raw = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(-1)
    rows, cols, _, groups = scheme.layout(shape)
    count = rows * (cols // block)
    if raw.size != count * type_size:
        raise ValueError(f"GGUF {type_name} data for shape {shape} must be {count * type_size} bytes "
                         f"({count} blocks of {type_size}), got {raw.size}")
    return raw.reshape(rows, cols // block, type_size), scheme, shape


def _decode_k_fast(b: np.ndarray, scheme: QuantScheme, type_name: str, shape, dtype) -> QuantizedTensor:
    """A QuantizedTensor of a k-quant preset from its super-blocks b uint8 [rows, supers, size]."""
    rows, supers, size = b.shape
    n = rows * supers
    b = b.reshape(n, size)

    def halves(at):
        return torch.from_numpy(np.ascontiguousarray(b[:, at:at + 2]).view("<f2")[:, 0].astype(np.float16))

    sub = scheme.sub_scale_format_of
    parts = {}
    if type_name in ("Q2_K", "Q3_K"):
        qs = b[:, 16:80] if type_name == "Q2_K" else b[:, 32:96]
        q = (qs.reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [half, j, l]
        if type_name == "Q2_K":
            codes = _pack_u8(q, 2)
            parts.update(sub_scales=_pack_u8(b[:, 0:16] & 0xF, 4), super_scales=halves(80).reshape(rows, supers),
                         sub_minimums=_pack_u8(b[:, 0:16] >> 4, 4), super_minimums=halves(82).reshape(rows, supers))
        else:
            high = np.unpackbits(np.ascontiguousarray(b[:, 0:32])[:, :, None], axis=-1, bitorder="little")  # [n, l, i]
            high = np.ascontiguousarray(high.transpose(0, 2, 1)).reshape(n, 2, 4, 32) << 2
            codes = _pack_u8((q | high) ^ 4, 3)  # value + 4 -> two's complement
            sb = b[:, 96:108]
            low = np.concatenate([sb[:, :8] & 0xF, sb[:, :8] >> 4], axis=-1)  # sc[j] + 32, bits 0-3
            hi = (sb[:, 8:12].reshape(n, 1, 4) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [i, k]
            parts.update(sub_scales=_pack_u8((low | (hi.reshape(n, 16) << 4)) ^ 32, 6),
                         super_scales=halves(108).reshape(rows, supers))
    elif type_name == "Q6_K":
        ql, qh = b[:, :128].reshape(n, 2, 2, 32), b[:, 128:192].reshape(n, 2, 1, 32)
        low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        codes = _pack_u8((low | (high << 4)) ^ 32, 6)  # value + 32 -> two's complement
        parts["sub_scales"] = _pack_u8(b[:, 192:208], sub.bits)
        parts["super_scales"] = halves(208).reshape(rows, supers)
    else:
        sb = b[:, 4:16]
        sc = np.concatenate([sb[:, :4] & 63, (sb[:, 8:] & 0xF) | ((sb[:, :4] >> 6) << 4)], axis=-1)
        m = np.concatenate([sb[:, 4:8] & 63, (sb[:, 8:] >> 4) | ((sb[:, 4:8] >> 6) << 4)], axis=-1)
        if type_name == "Q4_K":
            codes = torch.from_numpy(_join_nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(-1))
        else:
            qh = np.ascontiguousarray(b[:, 16:48])
            high = np.unpackbits(qh[:, :, None], axis=-1, bitorder="little")  # [n, l, i]
            high = np.ascontiguousarray(high.transpose(0, 2, 1)).reshape(n, 4, 2, 32) << 4
            qs = b[:, 48:176].reshape(n, 4, 1, 32)
            codes = _pack_u8(np.concatenate([qs & 0xF, qs >> 4], axis=2) | high, 5)
        parts.update(sub_scales=_pack_u8(sc, sub.bits), super_scales=halves(0).reshape(rows, supers),
                     sub_minimums=_pack_u8(m, sub.bits), super_minimums=halves(2).reshape(rows, supers))
    return QuantizedTensor(scheme, shape, dtype, codes, **parts)


def _decode_blocks_reference(blocks, type_name: str, shape, dtype: torch.dtype = torch.float32) -> QuantizedTensor:
    """decode_blocks() as first written, through int64 values and encode(): the reference
    decode_blocks is tested against."""
    b, scheme, shape = _check_decodable(blocks, type_name, shape)
    if scheme.super_block is not None:
        return _decode_k_reference(b, scheme, type_name, shape, dtype)

    def halves(at):
        return torch.from_numpy(np.ascontiguousarray(b[..., at:at + 2]).view("<f2")[..., 0].astype(np.float16))

    scales = halves(0)
    minimums = halves(2) if scheme.zero_point == "float" else None
    at = 4 if minimums is not None else 2
    bits = scheme.format.bits
    if type_name == "Q8_0":
        values = b[..., at:].view(np.int8).astype(np.int64)
    else:
        qh = None
        if bits == 5:
            qh = np.ascontiguousarray(b[..., at:at + 4]).view("<u4")[..., 0].astype(np.uint32)
            at += 4
        qs = b[..., at:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
        if qh is not None:
            q |= ((qh[..., None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.int64) << 4
        values = q - (0 if minimums is not None else 2 ** (bits - 1))
    if type_name == "IQ4_NL":  # the nibbles are the codebook indices: fewbits' codes as they are
        codes = torch.from_numpy(values.reshape(-1) + 8)
        return QuantizedTensor(scheme, shape, dtype, pack(codes.to(torch.uint8), bits, order=_PACK_ORDER), scales=scales)
    # the element codes of these integer values, packed as quantize() packs them
    v = torch.from_numpy(values.reshape(-1)).to(torch.float32)
    codes = encode(v, scheme.format).reshape(-1)
    return QuantizedTensor(scheme, shape, dtype, pack(codes.to(torch.uint8), bits, order=_PACK_ORDER),
                           scales=scales, minimums=minimums)
