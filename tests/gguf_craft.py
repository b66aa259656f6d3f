"""Crafting GGUF files byte by byte for the loader's tests: any metadata type or value, any tensor
table (offsets included), any count, either byte order -- what a hostile or broken writer makes.

    rewrite(src, dst, set={"llama.block_count": ("u32", 20000)}, drop=("llama.vocab_size",),
            tensors=lambda infos: infos, data=lambda name, raw: raw)

reads `src` with fewbits.files.gguf_header and writes it again with the edits. A value is
(type name, value): "u32", "i32", "f32", "string", "bool", ..., or "array[ELEMENT]" with a list.
"""
from __future__ import annotations

import struct

import numpy as np

from fewbits.files.gguf_header import read_header

TYPES = {"u8": (0, "B"), "i8": (1, "b"), "u16": (2, "H"), "i16": (3, "h"), "u32": (4, "I"), "i32": (5, "i"),
         "f32": (6, "f"), "bool": (7, "?"), "string": (8, None), "array": (9, None), "u64": (10, "Q"),
         "i64": (11, "q"), "f64": (12, "d")}
GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14, "BF16": 30}


def _string(s: str, e: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack(e + "Q", len(raw)) + raw


def _value(kind: str, value, e: str) -> bytes:
    if kind.startswith("array["):
        element = kind[6:-1]
        out = struct.pack(e + "IQ", TYPES[element][0], len(value))
        return out + b"".join(_value(element, v, e) for v in value)
    if kind == "string":
        return _string(value, e)
    return struct.pack(e + TYPES[kind][1], value)


def serialize(metadata: list[tuple[str, str, object]], tensors: list[tuple[str, tuple[int, ...], str, int]],
              data: bytes, *, alignment: int = 32, version: int = 3, big_endian: bool = False) -> bytes:
    """A GGUF file: metadata [(key, type, value)], tensors [(name, dims innermost first, GGML type
    name, offset into the data)], the data blob placed at the aligned end of the header."""
    e = ">" if big_endian else "<"
    out = bytearray(b"GGUF" + struct.pack(e + "IQQ", version, len(tensors), len(metadata)))
    for key, kind, value in metadata:
        out += _string(key, e)
        out += struct.pack(e + "I", TYPES["array" if kind.startswith("array[") else kind][0])
        out += _value(kind, value, e)
    for name, dims, ggml, offset in tensors:
        out += _string(name, e) + struct.pack(e + "I", len(dims))
        out += b"".join(struct.pack(e + "Q", d) for d in dims)
        out += struct.pack(e + "IQ", GGML_TYPES[ggml], offset)
    out += b"\0" * (-len(out) % alignment)
    return bytes(out) + data


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def rewrite(src, dst, *, set: dict | None = None, drop=(), tensors=None, data=None, big_endian: bool = False) -> None:
    """Write `src` again as `dst` with metadata keys set / dropped, the tensor table passed through
    tensors(list of [name, dims, type, offset]) and each tensor's bytes through data(name, bytes)."""
    h = read_header(src)
    meta = [(k, v.type, _plain(v.value)) for k, v in h.metadata.items() if k not in drop and k not in (set or {})]
    meta += [(k, kind, value) for k, (kind, value) in (set or {}).items()]
    with open(src, "rb") as f:
        blob = f.read()
    infos = [[t.name, t.dims, t.ggml_type, t.start - h.data_offset] for t in h.tensors]
    chunks = {t.name: blob[t.start:t.start + t.nbytes] for t in h.tensors}
    if data is not None:
        chunks = {n: data(n, raw) for n, raw in chunks.items()}
    # the data blob as laid out in src (offsets kept), before the table is edited
    body = bytearray(blob[h.data_offset:])
    for name, _, _, offset in infos:
        body[offset:offset + len(chunks[name])] = chunks[name]
    if tensors is not None:
        infos = tensors(infos)
    with open(dst, "wb") as f:
        f.write(serialize(meta, [tuple(i) for i in infos], bytes(body), alignment=h.alignment,
                          big_endian=big_endian))
