"""GGUF's legacy block formats as bytes: a QuantizedTensor of the presets q8_0, q4_0, q4_1, q5_0,
q5_1 written as the blocks of 32 values llama.cpp reads (ggml-common.h), little-endian:

- Q8_0 (34 bytes): fp16 d, 32 int8 q;                          w = d * q
- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;                w = d * (q - 8)
- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles;        w = d * q + m
- Q5_0 (22 bytes): fp16 d, uint32 qh, 16 bytes of nibbles;     w = d * (q - 16)
- Q5_1 (24 bytes): fp16 d, fp16 m, uint32 qh, 16 bytes;        w = d * q + m

Byte j of the nibbles holds element j in its low nibble and element j + 16 in its high one; in
Q5_*, bit i of qh is bit 4 of element i. The presets quantize as `gguf.quants.quantize` does
(scale_method "gguf"), so these bytes equal the gguf package's own, and `gguf.quants.dequantize`
of them equals QuantizedTensor.dequantize() bit for bit; decode_blocks reads such bytes back
into a QuantizedTensor. Needs no gguf package.

Known difference: a block whose scale overflows fp16 (Q8_0: |x| > 65504 * 127) gets an infinite d
in gguf and the saturated 65504 in fewbits (round_scales saturates).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..kernels import encode, pack
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
}


def _unnamed(scheme: QuantScheme) -> QuantScheme:
    return dataclasses.replace(scheme, name=None)


def gguf_block_type(scheme) -> str:
    """The GGML type name ("Q4_0", ...) of a scheme that is one of the GGUF block presets (by its
    fields, whatever its name); a ValueError naming the supported presets otherwise."""
    s = _unnamed(get_scheme(scheme))
    for name, (preset, _, _) in GGUF_BLOCK_TYPES.items():
        if _unnamed(get_scheme(preset)) == s:
            return name
    presets = ", ".join(p for p, _, _ in GGUF_BLOCK_TYPES.values())
    raise ValueError(f"scheme {get_scheme(scheme).label!r} has no GGUF block format; the GGUF block schemes are "
                     f"{presets}")


def _halves(t: torch.Tensor) -> np.ndarray:
    """fp16 [rows, groups] -> uint8 [rows, groups, 2], little-endian."""
    return np.ascontiguousarray(t.detach().cpu().numpy().astype("<f2")).view(np.uint8).reshape(*t.shape, 2)


def encode_blocks(qt: QuantizedTensor) -> np.ndarray:
    """The GGUF block bytes of a QuantizedTensor in q8_0 / q4_0 / q4_1 / q5_0 / q5_1: uint8 of
    shape (*shape[:-1], shape[-1] // 32 * bytes_per_block), as `gguf.quants.quantize` returns them
    (a GGUFWriter takes this array with raw_dtype = the GGML type). The last dimension must be a
    multiple of 32: GGUF blocks have no padding."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"encode_blocks() takes a QuantizedTensor, got {type(qt).__name__}")
    name = gguf_block_type(qt.scheme)
    _, _, type_size = GGUF_BLOCK_TYPES[name]
    shape = tuple(qt.shape)
    if len(shape) == 0 or shape[-1] % BLOCK:
        raise ValueError(f"GGUF {name} needs rows of a multiple of {BLOCK} values (the last dimension); "
                         f"shape {shape} has rows of {shape[-1] if shape else 0}")
    rows, cols, _, groups = qt.scheme.layout(shape)
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


def decode_blocks(blocks, type_name: str, shape, dtype: torch.dtype = torch.float32) -> QuantizedTensor:
    """A QuantizedTensor of the matching preset from GGUF block bytes of type `type_name` ("Q4_0",
    ...) holding a tensor of `shape` (numpy shape order: the last dimension is the row). The
    bytes are checked against the shape first (a file's tensor is untrusted); the result's
    dequantize() equals gguf.quants.dequantize of the same bytes."""
    if type_name not in GGUF_BLOCK_TYPES:
        raise ValueError(f"unknown GGUF block type {type_name!r}; supported: {', '.join(GGUF_BLOCK_TYPES)}")
    preset, _, type_size = GGUF_BLOCK_TYPES[type_name]
    scheme = get_scheme(preset)
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0 or shape[-1] % BLOCK or any(s < 0 for s in shape):
        raise ValueError(f"GGUF {type_name} holds rows of a multiple of {BLOCK} values; shape {shape} has not")
    raw = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(-1)
    rows, _, _, groups = scheme.layout(shape)
    if raw.size != rows * groups * type_size:
        raise ValueError(f"GGUF {type_name} data for shape {shape} must be {rows * groups * type_size} bytes "
                         f"({rows * groups} blocks of {type_size}), got {raw.size}")
    b = raw.reshape(rows, groups, type_size)

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
    # the element codes of these integer values, packed as quantize() packs them
    v = torch.from_numpy(values.reshape(-1)).to(torch.float32)
    codes = encode(v, scheme.format).reshape(-1)
    return QuantizedTensor(scheme, shape, dtype, pack(codes.to(torch.uint8), bits, order=_PACK_ORDER),
                           scales=scales, minimums=minimums)
