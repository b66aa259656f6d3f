"""A bounded reader of a GGUF file's header: read_header(path) -> GGUFHeader, or a FileFormatError
naming the file and the problem. Any GGUF that fewbits opens goes through it before another
reader (gguf-py's GGUFReader, transformers' GGUF loader, the tokenizer) sees the file.

Why not gguf-py's reader alone: it trusts the counts it reads. A metadata array that declares
2^40 entries in a 64 KB file makes it loop past the end of the file, allocating as it goes; a
tensor whose offset overlaps another, or lies one byte off, loads. Here every count is checked
against the bytes left in the file before anything is read (count x the smallest size an entry
can have), so the work and memory are bounded by the file's size, and the tensor table is held to
what ggml's own loader (gguf.cpp) requires:

- the magic "GGUF", version 2 or 3, little-endian (a big-endian file is named as such);
- metadata keys unique, non-empty UTF-8; value types 0..12; strings UTF-8; arrays of scalars or
  strings (not of arrays, as in llama.cpp); `general.alignment`, when present, a u32 power of two;
- tensor names unique, non-empty and shorter than 64 bytes; 1..4 dimensions, each positive, the
  first a multiple of the type's block; a GGML type gguf knows; tensor i's offset is the running sum of the earlier tensors'
  sizes, each padded to the alignment (so no two tensors share bytes, and none sits in padding);
  every tensor's bytes lie inside the file.

The values are returned as Python values (ints, floats, bools, strings, lists; numeric arrays
as numpy arrays), each with its GGUF type name, so a caller can insist on a type.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct

import numpy as np

from .safetensors_format import FileFormatError

__all__ = ["GGUFHeader", "GGUFTensorInfo", "GGUFValue", "read_header"]

_MAX_DIMS = 4
_MAX_NAME = 64  # GGML_MAX_NAME: a tensor name is shorter
# GGUF value type -> (name, struct format or None, fixed size; 0 for string / array)
_SCALARS = {0: ("u8", "<B", 1), 1: ("i8", "<b", 1), 2: ("u16", "<H", 2), 3: ("i16", "<h", 2),
            4: ("u32", "<I", 4), 5: ("i32", "<i", 4), 6: ("f32", "<f", 4), 7: ("bool", "<B", 1),
            10: ("u64", "<Q", 8), 11: ("i64", "<q", 8), 12: ("f64", "<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
INTEGER_TYPES = ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64")
FLOAT_TYPES = ("f32", "f64")


@dataclasses.dataclass(frozen=True)
class GGUFValue:
    """One metadata value: `type` is "u32", "f32", "string", "bool", ... or "array[ELEMENT]";
    `value` the Python value (a numpy array for a numeric array, a list otherwise)."""
    type: str
    value: object


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the table: `dims` as the file lists them (innermost first), `shape` in
    torch's order (outermost first); `start` the absolute file offset of its bytes."""
    name: str
    dims: tuple[int, ...]
    ggml_type: str
    start: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclasses.dataclass
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, GGUFValue]
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default=None):
        v = self.metadata.get(key)
        return default if v is None else v.value


def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """{GGML type id: (name, block size, bytes per block)}, from the gguf package's tables."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a GGUF file needs the gguf package: pip install gguf") from None
    return {int(t): (t.name, block, size) for t, (block, size) in gguf.GGML_QUANT_SIZES.items()}


class _Cursor:
    def __init__(self, path: str, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, problem: str):
        raise FileFormatError(self.path, problem)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} needs {n} bytes at offset {self.pos}, past the end of the file ({self.size} bytes)")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def count(self, what: str, smallest: int) -> int:
        """A u64 count of entries that each take at least `smallest` bytes, bounded by the file."""
        n = self.scalar("<Q", 8, what)
        left = self.size - self.pos
        if n * smallest > left:
            self.fail(f"{what} declares {n} entries, more than the {left} bytes left in the file can hold")
        return n

    def string(self, what: str) -> str:
        n = self.scalar("<Q", 8, what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8 text")

    def value(self, vtype: int, what: str) -> GGUFValue:
        if vtype in _SCALARS:
            name, fmt, size = _SCALARS[vtype]
            v = self.scalar(fmt, size, what)
            return GGUFValue(name, bool(v) if name == "bool" else v)
        if vtype == _STRING:
            return GGUFValue("string", self.string(what))
        if vtype != _ARRAY:
            self.fail(f"{what} has value type {vtype}, not a GGUF type (0..12)")
        etype = self.scalar("<I", 4, what + "'s element type")
        if etype in _SCALARS:
            name, _, size = _SCALARS[etype]
            n = self.count(what, size)
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=n, offset=self.pos).copy()
            self.pos += n * size
            return GGUFValue(f"array[{name}]", arr.astype(bool) if name == "bool" else arr)
        if etype == _STRING:
            n = self.count(what, 8)
            return GGUFValue("array[string]", [self.string(f"{what}[{i}]") for i in range(n)])
        if etype == _ARRAY:  # llama.cpp's reader refuses them too; no key it or fewbits reads is one
            self.fail(f"{what} is an array of arrays, which GGUF readers (llama.cpp's) do not take")
        self.fail(f"{what} has element type {etype}, not a GGUF type (0..12)")


def read_header(path) -> GGUFHeader:
    """The validated header of the GGUF file at `path` (see the module docstring)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise FileFormatError(path, f"{size} bytes: too short for a GGUF header (24 bytes at least)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size)
    except IsADirectoryError:
        raise FileFormatError(path, "a directory, not a GGUF file") from None


def _parse(path: str, buf, size: int) -> GGUFHeader:
    c = _Cursor(path, buf, size)
    if bytes(buf[:4]) != b"GGUF":
        c.fail(f"not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF')")
    c.pos = 4
    version = c.scalar("<I", 4, "the version")
    if version not in (2, 3):
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in (2, 3):
            c.fail(f"a big-endian GGUF file (version {swapped}); fewbits, like llama.cpp on x86 and ARM, reads "
                   "little-endian GGUF files only")
        c.fail(f"GGUF version {version}; fewbits reads versions 2 and 3")
    n_tensors = c.count("the tensor count", 32)
    n_kv = c.count("the metadata count", 13)
    metadata: dict[str, GGUFValue] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if not key:
            c.fail(f"metadata key {i} is empty")
        if key in metadata:
            c.fail(f"metadata key {key!r} appears twice")
        vtype = c.scalar("<I", 4, f"the type of {key!r}")
        metadata[key] = c.value(vtype, f"metadata {key!r}")
    alignment = 32
    if "general.alignment" in metadata:
        a = metadata["general.alignment"]
        if a.type != "u32" or a.value == 0 or a.value & (a.value - 1):
            c.fail(f"general.alignment must be a u32 power of two, got {a.type} {a.value!r}")
        alignment = a.value
    types = _ggml_types()
    raw = []
    names = set()
    for i in range(n_tensors):
        name = c.string(f"tensor {i}'s name")
        if not name or len(name.encode("utf-8")) >= _MAX_NAME:
            c.fail(f"tensor {i}'s name {name[:80]!r} is empty or not shorter than {_MAX_NAME} bytes (llama.cpp's limit)")
        if name in names:
            c.fail(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = c.scalar("<I", 4, f"{name}'s dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            c.fail(f"tensor {name}: {n_dims} dimensions (GGUF has 1 to {_MAX_DIMS})")
        dims = tuple(c.scalar("<Q", 8, f"{name}'s dimensions") for _ in range(n_dims))
        if any(d == 0 for d in dims):
            c.fail(f"tensor {name}: a dimension of 0 in {list(dims)}")
        type_id = c.scalar("<I", 4, f"{name}'s type")
        if type_id not in types:
            c.fail(f"tensor {name}: GGML type {type_id} is not one the gguf package knows")
        offset = c.scalar("<Q", 8, f"{name}'s offset")
        tname, block, bsize = types[type_id]
        if dims[0] % block:
            c.fail(f"tensor {name}: rows of {dims[0]} values, not a multiple of {tname}'s block of {block}")
        count = math.prod(dims)
        if count // block * bsize > size:
            c.fail(f"tensor {name}: {list(dims)} in {tname} is larger than the whole file ({size} bytes)")
        raw.append((name, dims, tname, offset, count // block * bsize))
    data_offset = -(-c.pos // alignment) * alignment
    tensors, running = [], 0
    for name, dims, tname, offset, nbytes in raw:
        if offset != running:
            c.fail(f"tensor {name}: offset {offset}, but the tensors before it end at {running} (each padded to "
                   f"{alignment} bytes): tensors must follow one another, as llama.cpp's loader requires")
        start = data_offset + offset
        if start + nbytes > size:
            c.fail(f"tensor {name}: its {nbytes} bytes at offset {start} run past the end of the file ({size} "
                   "bytes): truncated?")
        tensors.append(GGUFTensorInfo(name, dims, tname, start, nbytes))
        running = offset + -(-nbytes // alignment) * alignment
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors, alignment=alignment,
                      data_offset=data_offset, file_size=size)


# ---------------------------------------------------------------------------------------------
# typed access to the keys, and the vocabulary's checks (the reader's and the GGUF writer's copy)
# ---------------------------------------------------------------------------------------------
TOKEN_ARRAYS = {"tokenizer.ggml.tokens": "array[string]", "tokenizer.ggml.token_type": "array[i32]",
                 "tokenizer.ggml.scores": "array[f32]", "tokenizer.ggml.merges": "array[string]"}
SPECIAL_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "unknown": "unk_token_id", "padding": "pad_token_id"}


class Keys:
    """Typed access to a header's llama.* keys; every problem a FileFormatError naming the file."""

    def __init__(self, header: GGUFHeader, prefix: str):
        self.h, self.prefix = header, prefix

    def fail(self, problem: str):
        raise FileFormatError(self.h.path, problem)

    def _value(self, key: str, types: tuple[str, ...], kind: str, required: bool):
        """(full key, the value or None where absent and not required), of one of `types`."""
        full = self.prefix + key
        v = self.h.metadata.get(full)
        if v is None:
            if required:
                self.fail(f"{full} is missing")
            return full, None
        if v.type not in types:
            self.fail(f"{full} must be {kind}, got {v.type} {shown(v.value)}")
        return full, v.value

    def int(self, key: str, default=None, minimum: int = 1):
        full, v = self._value(key, INTEGER_TYPES, "an integer", default is None)
        if v is None:
            return default
        if v < minimum:
            self.fail(f"{full} must be at least {minimum}, got {v}")
        return int(v)

    def float(self, key: str, default=None, zero_ok: bool = False):
        full, v = self._value(key, FLOAT_TYPES, "a float", default is None)
        if v is None:
            return default
        x = float(v)
        if not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok):
            self.fail(f"{full} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {x}")
        return x

    def string(self, key: str, default=None):
        _, v = self._value(key, ("string",), "a string", False)
        return default if v is None else v


def shown(value) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_vocabulary(header: GGUFHeader, rows: int, what: str = "rows of token_embd.weight") -> dict:
    """The file's special token ids {config field: id} (bos_token_id, ...) once its vocabulary
    (tokenizer.ggml.*) has passed the checks llama.cpp's loader relies on: the arrays of the types
    llama.cpp writes, as long as the token list, no more tokens than `rows` (the embedding's;
    `what` names them in the message), and every special id inside the vocabulary; a
    FileFormatError otherwise."""
    def fail(problem):
        raise FileFormatError(header.path, problem)

    model = header.metadata.get("tokenizer.ggml.model")
    if model is not None and model.type != "string":
        fail(f"tokenizer.ggml.model must be a string, got {model.type}")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    n = None
    for key, kind in TOKEN_ARRAYS.items():
        v = header.metadata.get(key)
        if v is None:
            continue
        if v.type != kind:
            fail(f"{key} must be an {kind}, got {v.type}")
        if key != "tokenizer.ggml.merges" and tokens is not None and len(v.value) != len(tokens.value):
            fail(f"{key} has {len(v.value)} entries for {len(tokens.value)} tokens")
    if tokens is not None:
        n = len(tokens.value)
        if n > rows:
            fail(f"the vocabulary has {n} tokens, more than the {rows} {what}")
    k = Keys(header, "tokenizer.ggml.")
    ids = {}
    for name, field in SPECIAL_IDS.items():
        tid = k.int(f"{name}_token_id", -1, minimum=0)
        if tid < 0:
            continue
        if tid >= (n if n is not None else rows):
            fail(f"tokenizer.ggml.{name}_token_id {tid} is outside the vocabulary of {n if n is not None else rows}")
        ids[field] = tid
    return ids
