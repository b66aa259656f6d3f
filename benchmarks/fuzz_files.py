"""Fuzz fewbits' files: bit flips, truncations and structured mutations of fb.save files, training
checkpoints, GGUF files and quantized Hugging Face directories' config.json.

    python benchmarks/fuzz_files.py                      # --size small: 735 trials, 1-2 min on 2 cores
    python benchmarks/fuzz_files.py --size smoke         # a few of each (the test's run)
    python benchmarks/fuzz_files.py --size all           # every structured mutation (~4300), 4-5 min
    python benchmarks/fuzz_files.py --size large         # every structured mutation, 600 flips per file
    python benchmarks/fuzz_files.py --json fuzz.json     # every group's counts, each trial and each failure
    python benchmarks/fuzz_files.py --kinds "checkpoint,fb model"   # some file kinds only
    python benchmarks/fuzz_files.py --kinds "gguf q4_0" --only 57 --save-failures bad/   # one trial again,
                                                         # its mutated file written to bad/

The files (written once per run, in a temporary directory):
  fb model       fb.save of a small quantized model: embedding (int4 asym, groups of 32), nf4 with
                 double quantization, int8, w8a8 and a float head, a LayerNorm and a buffer
  fb qtensor     fb.save of one QuantizedTensor (mxfp4)
  fb tensor      fb.save of a dict holding one plain float tensor
  checkpoint     save_checkpoint of an Engine (MLP, AdamW, bf16-mixed) after two steps
  checkpoint 8b  the same under bf16-mixed-8bit-adam (packed 8-bit optimizer states)
  gguf q4_0      a q4_0 GGUF (fewbits.files.convert) of a synthetic llama (hidden 64, 2 layers, 4 heads,
                 2 kv heads, vocab 384, byte-level BPE tokenizer), loaded with fb.from_pretrained
  gguf q4_k_m    the same recipe at hidden 256, so that Q4_K / Q6_K blocks are read
  hf config      a fewbits int4 Hugging Face directory of the hidden-64 model: its config.json mutated

Each flip or truncation writes one corrupted copy -- one bit flipped at one position, or the file
cut to one length; positions and lengths are drawn a quarter from the first 512 bytes (the
headers), a quarter from the last 512 (a zip's central directory) and half from anywhere. The
model files also get structured mutations, drawn per group from every one there is:
  header    (GGUF) the tensor and metadata counts, the version, a key's / string's / tensor name's
            length, an array's count: 0, off by one, 2^32, 2^40, 2^63, 2^64 - 1
  type      (GGUF) a metadata key's value type id (every other id, 13, 255, 2^32 - 1), an array's
            element type
  metadata  (GGUF) every llama.* / general.* key and special token id set to 0, -1, off by one,
            x2, huge, NaN, inf, tiny, x1.5, or to another type (string, array, f32 for an int, i32
            for a float, bool, a wider or narrower int); keys dropped; keys added (RoPE scaling
            linear / yarn / none, expert counts, unknown llama.* keys, alignment, architecture)
  offset    (GGUF) a tensor's offset +-1 byte, +-alignment, 0, the previous tensor's (shared),
            swapped with the next one's, beyond the file, 2^63
  tensor    (GGUF) a tensor's dims (x2, +-1 block, +1, 0, 2^63, swapped), dimension count, GGML type
  block     (GGUF) random bytes over a block of a tensor's data, fp16 block scales set to NaN, +-inf,
            65504, 0, subnormal, -1; an F32 tensor's value set to NaN, inf, 3e38, 0, -1
  value     (config.json) each numeric field set to 0, -1, off by one, huge, 1e30, a string, a float,
            null, a list, true, NaN, inf; each boolean / string field changed
  delete    (config.json) each top-level key deleted
  arch      (config.json) architectures naming other classes (sequence classification, base model,
            other families, a tokenizer, nothing), of the wrong type, deleted
  qconfig   (config.json) quantization_config's method, version, each scheme field (group size,
            format, symmetry, scale format, granularity, ...), a module's shape, dtype, scheme;
            modules deleted, renamed, added

Loads: fb.load(path, model=...) into a float skeleton for fb model, fb.load(path) for the tensor
files, load_checkpoint into a fresh Engine of the same model, optimizer and policy for the
checkpoints, fb.from_pretrained(path) for the model files. Every load of a bad file must raise
the documented error -- FileFormatError (naming the file) for fb.load and fb.from_pretrained, the
checkpoint module's error class for load_checkpoint (CheckpointError; ValueError where it has
none) -- and leave the target exactly as it was. A model file that loads is judged by an oracle
that reads the file without fewbits' reader: for a GGUF, gguf-py's GGUFReader, its metadata
mapped to a LlamaConfig as llama.cpp reads it, and every tensor through gguf.quants.dequantize
into a float transformers model; for config.json, transformers' model of the stated config with
the intact directory's weights. The table counts, per file kind and corruption:
  raised     the documented error, target unchanged
  harmless   (model files) loaded, and the logits on a fixed input are bit-identical to the intact
             file's, with the oracle agreeing (for a GGUF: the config carries what the file says)
  honoured   (model files) loaded and different, and the difference is what the file now says: the
             loaded config carries each llama.* value (eps, freq_base, RoPE scaling, ...); every
             weight equals gguf.quants.dequantize of the file's bytes, bit for bit; the logits
             match the oracle's model within the intact file's own kernel gap (or, where weights
             changed, each changed linear layer computes x @ W.T within its rounding bound)
  silent     no error at all, and not explained: an fb.save file or checkpoint that loaded (the
             intact state or not); a model file whose weights, config or logits are not what the
             file says, that states weights it does not hold (initialized at random), or that
             states an unusable value (a config.json rms_norm_eps of inf, rope_theta NaN or <= 0)
  crashed    the interpreter died (a signal, or killed by the memory limit)
  hung       a trial ran past --trial-timeout seconds (default 60)
  partial    the documented error, but the target was changed first (a partial overwrite)
  other      another exception type escaped (or a FileFormatError that does not name the file, or a
             model file loaded and its first forward pass raised)
The trials run in a worker process under an address-space limit (--memory-gb, default 6; a
MemoryError counts as other); when it dies or hangs, the trial it was running counts as crashed
or hung and a new worker resumes with the next trial. The exit status is 1 when any trial was not
raised, harmless or honoured.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import random
import struct
import subprocess
import sys
import tempfile
import threading

# trials per corruption: a count, or None for every structured mutation there is
SIZES = {"smoke": {"flip": 3, "truncate": 4, "header": 3, "type": 2, "metadata": 4, "offset": 2, "tensor": 2,
                   "block": 3, "value": 4, "delete": 2, "arch": 2, "qconfig": 3},
         "small": {"flip": 32, "truncate": 12, "header": 16, "type": 16, "metadata": 48, "offset": 12, "tensor": 16,
                   "block": 24, "value": 48, "delete": 16, "arch": 15, "qconfig": 40},
         "all": {"flip": 32, "truncate": 12, "header": None, "type": None, "metadata": None, "offset": None,
                 "tensor": None, "block": None, "value": None, "delete": None, "arch": None, "qconfig": None},
         "large": {"flip": 600, "truncate": 200, "header": None, "type": None, "metadata": None, "offset": None,
                   "tensor": None, "block": None, "value": None, "delete": None, "arch": None, "qconfig": None}}
FB_KINDS = ("fb model", "fb qtensor", "fb tensor", "checkpoint", "checkpoint 8b")
MODEL_KINDS = ("gguf q4_0", "gguf q4_k_m", "hf config")
KINDS = FB_KINDS + MODEL_KINDS
CORRUPTIONS = ("flip", "truncate")
GROUPS = {"gguf": CORRUPTIONS + ("header", "type", "metadata", "offset", "tensor", "block"),
          "hf": CORRUPTIONS + ("value", "delete", "arch", "qconfig")}
OUTCOMES = ("raised", "harmless", "honoured", "silent", "crashed", "hung", "partial", "other")
PASSING = ("raised", "harmless", "honoured")
_FILES = {"fb model": "model.safetensors", "fb qtensor": "qtensor.safetensors", "fb tensor": "tensor.safetensors",
          "checkpoint": "engine.ckpt", "checkpoint 8b": "engine-8bit.ckpt", "gguf q4_0": "q4_0.gguf",
          "gguf q4_k_m": "q4_k_m.gguf", "hf config": "hf-int4"}
_POLICIES = {"checkpoint": "bf16-mixed", "checkpoint 8b": "bf16-mixed-8bit-adam"}
_EDGE = 512


# ---------------------------------------------------------------------------------------------
# the plan (no torch needed: the parent process stays light)
# ---------------------------------------------------------------------------------------------
def _spots(rng: random.Random, size: int, count: int, lo: int = 0) -> list[int]:
    """`count` offsets in [lo, size): a quarter among the first 512 bytes, a quarter among the
    last 512, half anywhere."""
    out = []
    for i in range(count):
        band = i % 4
        if band == 0:
            out.append(rng.randrange(lo, min(size, lo + _EDGE)))
        elif band == 1:
            out.append(rng.randrange(max(lo, size - _EDGE), size))
        else:
            out.append(rng.randrange(lo, size))
    return out


def make_plan(sizes: dict[str, int], size: str, seed: int, kinds=KINDS, structures=None) -> list[dict]:
    """Trials: {"kind", "corruption", "at" (offset or length), "bit"}; the first truncations of
    each kind are the edge lengths 0, 1, 8 and size - 1. A model file's structured mutations
    (structures[kind]: {group: [(what, edit), ...]}) are drawn per group: {"kind", "corruption"
    (the group), "what", "edit"}. A kind's trials do not depend on which other kinds are fuzzed."""
    counts = SIZES[size]
    plan = []
    for index, kind in enumerate(KINDS):
        if kind not in kinds:
            continue
        rng = random.Random(seed * 1000 + index)
        n = sizes[kind]
        for at in _spots(rng, n, counts["flip"]):
            plan.append({"kind": kind, "corruption": "flip", "at": at, "bit": rng.randrange(8)})
        edges = [0, 1, 8, n - 1]
        lengths = edges + _spots(rng, n, max(0, counts["truncate"] - len(edges)))
        for at in lengths[:counts["truncate"]]:
            plan.append({"kind": kind, "corruption": "truncate", "at": at, "bit": None})
        for group, candidates in (structures or {}).get(kind, {}).items():
            want = counts[group]
            picked = range(len(candidates)) if want is None or want >= len(candidates) else \
                sorted(rng.sample(range(len(candidates)), want))
            for i in picked:
                what, edit = candidates[i]
                plan.append({"kind": kind, "corruption": group, "what": what, "edit": edit})
    return plan


def structures_of(kind: str, data: bytes, seed: int) -> dict:
    """The structured mutations of a model file's pristine bytes (no torch needed)."""
    rng = random.Random(seed * 1000 + KINDS.index(kind) + 500)
    if kind.startswith("gguf"):
        return gguf_mutations(_Layout(data), rng)
    return _config_mutations(json.loads(data), rng)


def corrupted(data: bytes, trial: dict) -> bytes:
    if trial["corruption"] == "truncate":
        return data[:trial["at"]]
    out = bytearray(data)
    out[trial["at"]] ^= 1 << trial["bit"]
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# model files: GGUF files and a quantized Hugging Face directory's config.json, loaded with
# fb.from_pretrained and judged against an independent oracle
# ---------------------------------------------------------------------------------------------
_GGUF_SCALARS = {"u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"), "u32": (4, "<I"),
                 "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<?"), "u64": (10, "<Q"), "i64": (11, "<q"),
                 "f64": (12, "<d")}
_GGUF_TYPE_NAMES = {v[0]: k for k, v in _GGUF_SCALARS.items()} | {8: "string", 9: "array"}
_GGML = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "BF16": 30}
_GGML_NAMES = {v: k for k, v in _GGML.items()}
# GGML type -> (values per block, bytes per block, byte offsets of the block's fp16 scales)
_BLOCKS = {"F32": (1, 4, ()), "F16": (1, 2, ()), "BF16": (1, 2, ()), "Q4_0": (32, 18, (0,)),
           "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)),
           "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}
_HUGE64 = (2 ** 32, 2 ** 40, 2 ** 63, 2 ** 64 - 1)
IDS = [[1, 5, 77, 200, 3, 258, 40, 9]]  # the fixed input whose logits are compared


class _Layout:
    """Where each field of a (pristine, well-formed) GGUF file lies: written for the fuzzer, not
    shared with fewbits' reader, so that byte-level edits know what they hit."""

    def __init__(self, data: bytes):
        self.data = data
        self.version, self.n_tensors, self.n_kv = struct.unpack_from("<IQQ", data, 4)
        p = 24
        self.kv = []
        for _ in range(self.n_kv):
            n = struct.unpack_from("<Q", data, p)[0]
            e = {"len_pos": p, "key": data[p + 8:p + 8 + n].decode()}
            p += 8 + n
            e["type_pos"] = p
            vtype = struct.unpack_from("<I", data, p)[0]
            p += 4
            e["vtype"], e["value_pos"] = vtype, p
            p = self._value(vtype, p, e)
            e["end"] = p
            self.kv.append(e)
        self.tensors = []
        for _ in range(self.n_tensors):
            n = struct.unpack_from("<Q", data, p)[0]
            t = {"len_pos": p, "name": data[p + 8:p + 8 + n].decode()}
            p += 8 + n
            t["ndims_pos"] = p
            nd = struct.unpack_from("<I", data, p)[0]
            t["dims_pos"] = p + 4
            t["dims"] = list(struct.unpack_from(f"<{nd}Q", data, p + 4))
            p += 4 + 8 * nd
            t["type_pos"], t["ggml"] = p, _GGML_NAMES[struct.unpack_from("<I", data, p)[0]]
            t["offset_pos"], t["offset"] = p + 4, struct.unpack_from("<Q", data, p + 4)[0]
            p += 12
            self.tensors.append(t)
        self.kv_end, self.info_end = self.tensors[0]["len_pos"] if self.tensors else p, p
        align = next((self._scalar(e) for e in self.kv if e["key"] == "general.alignment"), 32)
        self.alignment = align
        self.data_offset = -(-p // align) * align
        for t in self.tensors:
            block, size, _ = _BLOCKS[t["ggml"]]
            count = 1
            for d in t["dims"]:
                count *= d
            t["start"], t["nbytes"] = self.data_offset + t["offset"], count // block * size

    def _scalar(self, e):
        return struct.unpack_from(_GGUF_SCALARS[_GGUF_TYPE_NAMES[e["vtype"]]][1], self.data, e["value_pos"])[0]

    def _value(self, vtype: int, p: int, e: dict) -> int:
        data = self.data
        if vtype == 8:
            e.setdefault("str_len_pos", p)
            return p + 8 + struct.unpack_from("<Q", data, p)[0]
        if vtype == 9:
            etype, n = struct.unpack_from("<IQ", data, p)
            e.update(elem_pos=p, count_pos=p + 4, count=n, etype=etype)
            p += 12
            for _ in range(n):
                p = self._value(etype, p, {})
            return p
        return p + struct.calcsize(_GGUF_SCALARS[_GGUF_TYPE_NAMES[vtype]][1])

    def value(self, key: str):
        e = next(e for e in self.kv if e["key"] == key)
        return self._scalar(e) if e["vtype"] not in (8, 9) else None


def _encode(kind: str, value) -> bytes:
    """A GGUF value of type `kind` ("u32", "string", "array[i32]", ...): type id and payload."""
    if kind.startswith("array["):
        element = kind[6:-1]
        out = struct.pack("<IIQ", 9, (_GGUF_SCALARS.get(element) or (8,))[0], len(value))
        return out + b"".join(_encode(element, v)[4:] for v in value)
    if kind == "string":
        raw = value.encode()
        return struct.pack("<IQ", 8, len(raw)) + raw
    tid, fmt = _GGUF_SCALARS[kind]
    return struct.pack("<I", tid) + struct.pack(fmt, value)


def gguf_mutated(layout: _Layout, edit: dict) -> bytes:
    """The pristine file with one structured edit applied:
    {"op": "poke", "writes": [[offset, struct format, value], ...]}  fields overwritten in place;
    {"op": "set", "key", "type", "value"} / {"op": "drop", "key"}  a metadata entry replaced, added
        or removed (the header re-padded, so the tensors' relative offsets still hold);
    {"op": "bytes", "at", "hex"}  raw bytes written at an offset (block data)."""
    data = layout.data
    if edit["op"] == "poke":
        out = bytearray(data)
        for at, fmt, value in edit["writes"]:
            struct.pack_into(fmt, out, at, value)
        return bytes(out)
    if edit["op"] == "bytes":
        out = bytearray(data)
        raw = bytes.fromhex(edit["hex"])
        out[edit["at"]:edit["at"] + len(raw)] = raw
        return bytes(out)
    entries, found = [], False
    for e in layout.kv:
        if e["key"] != edit["key"]:
            entries.append(data[e["len_pos"]:e["end"]])
            continue
        found = True
        if edit["op"] == "set":
            entries.append(data[e["len_pos"]:e["type_pos"]] + _encode(edit["type"], edit["value"]))
    if edit["op"] == "set" and not found:
        key = edit["key"].encode()
        entries.append(struct.pack("<Q", len(key)) + key + _encode(edit["type"], edit["value"]))
    head = bytearray(data[:24])
    struct.pack_into("<Q", head, 16, len(entries))
    head += b"".join(entries) + data[layout.kv_end:layout.info_end]
    head += b"\0" * (-len(head) % layout.alignment)
    return bytes(head) + data[layout.data_offset:]


def _value_edits(kind: str, value) -> list[tuple[str, str, object]]:
    """(label, type, value) replacements of one metadata value: out of range, non-finite, off by
    one, of another type."""
    out = []
    if kind in ("f32", "f64"):
        out += [("0", kind, 0.0), ("negative", kind, -abs(value or 1.0)), ("NaN", kind, float("nan")),
                ("inf", kind, float("inf")), ("huge", kind, 3e38), ("tiny", kind, 1e-38),
                ("x1.5", kind, value * 1.5), ("as i32", "i32", int(value)), ("as u32 1", "u32", 1),
                ("as string", "string", repr(value)), ("as array", "array[f32]", [value]),
                ("as bool", "bool", True), ("as f64", "f64", value)]
    elif kind in ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"):
        out += [("0", kind, 0), ("-1", "i32", -1), ("+1", kind, value + 1), ("-1 off", kind, max(value - 1, 0)),
                ("x2", kind, value * 2), ("huge u32", "u32", 2 ** 32 - 1), ("huge i32", "i32", 2 ** 31 - 1),
                ("huge u64", "u64", 2 ** 63), ("as f32", "f32", float(value)), ("as f32 NaN", "f32", float("nan")),
                ("as string", "string", str(value)), ("as array", "array[i32]", [value]), ("as bool", "bool", True),
                ("as i64", "i64", value), ("as u16", "u16", value % 65536)]
    elif kind == "string":
        out += [("empty", "string", ""), ("other", "string", "gpt2"), ("upper", "string", str(value).upper()),
                ("as u32", "u32", 1), ("as array", "array[string]", [value])]
    elif kind == "bool":
        out += [("flipped", "bool", not value), ("as u32 7", "u32", 7), ("as string", "string", "true")]
    return out


def gguf_mutations(layout: _Layout, rng: random.Random) -> dict[str, list[tuple[str, dict]]]:
    """Every structured mutation of the file, by group: (what, edit for gguf_mutated)."""
    groups: dict[str, list] = {g: [] for g in ("header", "type", "metadata", "offset", "tensor", "block")}
    poke = lambda writes: {"op": "poke", "writes": writes}  # noqa: E731
    # header counts: the tensor and metadata counts, string lengths, array counts
    for label, pos, n in (("tensor count", 8, layout.n_tensors), ("metadata count", 16, layout.n_kv)):
        for v in (0, n - 1, n + 1, *_HUGE64):
            groups["header"].append((f"{label} {n} -> {v}", poke([[pos, "<Q", v]])))
    for v in (1, 4, 2 ** 24):
        groups["header"].append((f"version {layout.version} -> {v}", poke([[4, "<I", v]])))
    for e in layout.kv:
        n = len(e["key"].encode())
        for v in (0, n - 1, n + 1, 2 ** 40, 2 ** 64 - 1):
            groups["header"].append((f"key length of {e['key']} {n} -> {v}", poke([[e["len_pos"], "<Q", v]])))
        if "str_len_pos" in e:
            n = struct.unpack_from("<Q", layout.data, e["str_len_pos"])[0]
            where = "first string of " if e["vtype"] == 9 else "string "
            for v in (0, n + 1, 2 ** 40, 2 ** 64 - 1):
                groups["header"].append((f"length of the {where}{e['key']} {n} -> {v}",
                                         poke([[e["str_len_pos"], "<Q", v]])))
        if "count_pos" in e:
            n = e["count"]
            for v in (0, n - 1, n + 1, 2 ** 40, 2 ** 64 - 1):
                groups["header"].append((f"array count of {e['key']} {n} -> {v}", poke([[e["count_pos"], "<Q", v]])))
    for t in layout.tensors[:4]:
        n = len(t["name"])
        for v in (0, n + 1, 2 ** 40, 2 ** 64 - 1):
            groups["header"].append((f"name length of tensor {t['name']} {n} -> {v}", poke([[t["len_pos"], "<Q", v]])))
    # metadata types: one key's type id (and an array's element type) changed
    for e in layout.kv:
        for v in [*range(13), 13, 255, 2 ** 32 - 1]:
            if v != e["vtype"]:
                groups["type"].append((f"type of {e['key']} {_GGUF_TYPE_NAMES[e['vtype']]} -> {v}",
                                       poke([[e["type_pos"], "<I", v]])))
        if "elem_pos" in e:
            for v in (0, 4, 5, 6, 8, 9, 10, 13, 2 ** 32 - 1):
                if v != e["etype"]:
                    groups["type"].append((f"element type of {e['key']} {e['etype']} -> {v}",
                                           poke([[e["elem_pos"], "<I", v]])))
    # metadata values: every llama.* key (and a few others) set to each bad value, dropped; keys added
    for e in layout.kv:
        key = e["key"]
        if not (key.startswith("llama.") or key.startswith("general.") or key.endswith("_token_id")):
            continue
        kind = _GGUF_TYPE_NAMES[e["vtype"]]
        current = layout.value(key) if kind not in ("string", "array") else \
            layout.data[e["str_len_pos"] + 8:e["end"]].decode() if kind == "string" else None
        for label, vkind, v in _value_edits(kind, current):
            groups["metadata"].append((f"{key} = {label} ({vkind} {v!r})", {"op": "set", "key": key, "type": vkind,
                                                                            "value": v}))
        groups["metadata"].append((f"{key} dropped", {"op": "drop", "key": key}))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.model"):
        groups["metadata"].append((f"{key} dropped", {"op": "drop", "key": key}))
    added = [("llama.rope.scaling.type", "string", "linear"), ("llama.rope.scaling.factor", "f32", 4.0),
             ("llama.rope.scaling.factor", "f32", 1.0), ("llama.rope.scaling.factor", "f32", float("nan")),
             ("llama.rope.scale_linear", "f32", 2.0), ("llama.rope.scaling.type", "string", "yarn"),
             ("llama.rope.scaling.type", "string", "none"), ("llama.expert_count", "u32", 8),
             ("llama.expert_count", "u32", 0), ("llama.attention.clamp_kqv", "f32", 8.0),
             ("llama.attention.key_length", "u32", 32), ("llama.attention.value_length", "u32", 8),
             ("llama.logit_scale", "f32", 2.0), ("llama.use_parallel_residual", "bool", True),
             ("llama.nonsense", "u32", 1), ("general.alignment", "u32", 64), ("general.alignment", "u32", 3),
             ("general.alignment", "u32", 0), ("general.alignment", "string", "32"), ("general.name", "string", "x"),
             ("general.architecture", "string", "mistral"), ("general.architecture", "string", "qwen2"),
             ("tokenizer.ggml.padding_token_id", "u32", 10 ** 6), ("tokenizer.ggml.unknown_token_id", "i32", -5),
             ("tokenizer.ggml.model", "string", "nonsense"), ("tokenizer.ggml.tokens", "array[u32]", [1, 2, 3]),
             ("tokenizer.ggml.scores", "array[f32]", [0.0]), ("tokenizer.ggml.token_type", "array[string]", ["x"])]
    for key, vkind, v in added:
        groups["metadata"].append((f"{key} = {vkind} {v!r}", {"op": "set", "key": key, "type": vkind, "value": v}))
    # tensor offsets: one byte off, an alignment off, shared, swapped, beyond the file
    tensors, size, align = layout.tensors, len(layout.data), layout.alignment
    for i, t in enumerate(tensors):
        o = t["offset"]
        cases = [("+1", o + 1), ("+alignment", o + align), ("beyond the file", size), ("2^63", 2 ** 63),
                 ("2^64-1", 2 ** 64 - 1)]
        if o:
            cases += [("-1", o - 1), ("-alignment", o - align), ("0", 0)]
        if i:
            cases.append(("the previous tensor's (shared)", tensors[i - 1]["offset"]))
        for label, v in cases:
            groups["offset"].append((f"offset of {t['name']} {o} -> {label} {v}", poke([[t["offset_pos"], "<Q", v]])))
        if i + 1 < len(tensors):
            u = tensors[i + 1]
            groups["offset"].append((f"offsets of {t['name']} and {u['name']} swapped",
                                     poke([[t["offset_pos"], "<Q", u["offset"]], [u["offset_pos"], "<Q", o]])))
    # tensor dims and types
    for t in tensors:
        d, pos, block = t["dims"], t["dims_pos"], _BLOCKS[t["ggml"]][0]
        cases = [("dims[0] x2", [[pos, "<Q", d[0] * 2]]), ("dims[0] + block", [[pos, "<Q", d[0] + block]]),
                 ("dims[0] - block", [[pos, "<Q", max(d[0] - block, 0)]]), ("dims[0] + 1", [[pos, "<Q", d[0] + 1]]),
                 ("dims[0] 0", [[pos, "<Q", 0]]), ("dims[0] 2^63", [[pos, "<Q", 2 ** 63]]),
                 ("n_dims 0", [[t["ndims_pos"], "<I", 0]]), ("n_dims 5", [[t["ndims_pos"], "<I", 5]]),
                 ("n_dims 2^32-1", [[t["ndims_pos"], "<I", 2 ** 32 - 1]])]
        if len(d) == 2:
            cases += [("dims[1] + 1", [[pos + 8, "<Q", d[1] + 1]]), ("dims[1] - 1", [[pos + 8, "<Q", d[1] - 1]]),
                      ("dims[1] x2", [[pos + 8, "<Q", d[1] * 2]]), ("dims[1] / 2", [[pos + 8, "<Q", d[1] // 2]])]
            if d[0] != d[1]:
                cases.append(("dims swapped", [[pos, "<Q", d[1]], [pos + 8, "<Q", d[0]]]))
            cases.append(("n_dims 1", [[t["ndims_pos"], "<I", 1]]))
        else:
            cases.append(("n_dims 2", [[t["ndims_pos"], "<I", 2]]))
        for label, writes in cases:
            groups["tensor"].append((f"{t['name']} ({t['ggml']} {d}): {label}", poke(writes)))
        for name, v in [*_GGML.items(), ("removed Q4_2", 4), ("unknown 99", 99), ("2^32-1", 2 ** 32 - 1)]:
            if name != t["ggml"]:
                groups["tensor"].append((f"{t['name']}: type {t['ggml']} -> {name}",
                                         poke([[t["type_pos"], "<I", v]])))
    # block data: random bytes over a block, and each kind of bad fp16 scale, in each tensor
    scales = [("NaN", 0x7E00), ("+inf", 0x7C00), ("-inf", 0xFC00), ("65504", 0x7BFF), ("0", 0x0000),
              ("subnormal", 0x0001), ("-1", 0xBC00)]
    floats32 = [("NaN", float("nan")), ("inf", float("inf")), ("3e38", 3e38), ("0", 0.0), ("-1", -1.0)]
    for t in tensors:
        _, bsize, offsets = _BLOCKS[t["ggml"]]
        nblocks = t["nbytes"] // bsize
        b = rng.randrange(nblocks)
        at = t["start"] + b * bsize
        n = max(bsize, 16)
        groups["block"].append((f"{t['name']}: {n} random bytes at block {b}",
                                {"op": "bytes", "at": at, "hex": rng.randbytes(n).hex()}))
        groups["block"].append((f"{t['name']}: 5 random bytes at byte {at - t['start'] + 3}",
                                {"op": "bytes", "at": at + 3, "hex": rng.randbytes(5).hex()}))
        for off in offsets:
            for label, bits in scales:
                groups["block"].append((f"{t['name']}: block {b}'s fp16 scale at +{off} = {label}",
                                        poke([[at + off, "<H", bits]])))
        if t["ggml"] == "F32":
            for label, v in floats32:
                groups["block"].append((f"{t['name']}: value {b} = {label}", poke([[at, "<f", v]])))
        if t["ggml"] == "F16":
            for label, bits in scales:
                groups["block"].append((f"{t['name']}: value {b} = {label}", poke([[at, "<H", bits]])))
    return groups


def _config_mutations(config: dict, rng: random.Random) -> dict[str, list[tuple[str, dict]]]:
    """Every structured mutation of a fewbits directory's config.json, by group: (what, edit);
    an edit is {"path": [keys...], "value": v} or {"path": [...], "delete": True}."""
    groups: dict[str, list] = {g: [] for g in ("value", "delete", "arch", "qconfig")}

    def numeric(path, v):
        cases = [("0", 0), ("-1", -1), ("+1", v + 1), ("-1 off", v - 1), ("huge", 2 ** 31), ("2^62", 2 ** 62),
                 ("1e30", 1e30), ("string", str(v)), ("null", None), ("list", [v]), ("true", True),
                 ("NaN", float("nan")), ("inf", float("inf"))]
        cases += [("float", v + 0.5), ("x2", v * 2)] if isinstance(v, int) else [("x1.5", v * 1.5), ("int", int(v))]
        return [(f"{'.'.join(path)} = {label} ({x!r})", {"path": path, "value": x}) for label, x in cases]

    for key, v in config.items():
        if key == "quantization_config" or key == "architectures":
            continue
        if isinstance(v, bool):
            for x in (not v, "yes", None, 1):
                groups["value"].append((f"{key} = {x!r}", {"path": [key], "value": x}))
        elif isinstance(v, (int, float)):
            groups["value"] += numeric([key], v)
        elif isinstance(v, str):
            alt = {"hidden_act": ["gelu", "relu", "nonsense"], "model_type": ["mistral", "gpt2", "nonsense"],
                   "dtype": ["float16", "bfloat16", "int8", "nonsense"]}.get(key, ["", "nonsense"])
            for x in alt + [7, None]:
                groups["value"].append((f"{key} = {x!r}", {"path": [key], "value": x}))
        elif isinstance(v, dict):
            for sub, w in v.items():
                if isinstance(w, (int, float)) and not isinstance(w, bool):
                    groups["value"] += numeric([key, sub], w)
                elif sub == "rope_type":
                    for x in ("linear", "yarn", "dynamic", "nonsense", None):
                        groups["value"].append((f"{key}.rope_type = {x!r}", {"path": [key, sub], "value": x}))
            if key == "rope_parameters":
                for extra in ({"rope_type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": -1.0},
                              {"rope_type": "default", "factor": 4.0}):
                    groups["value"].append((f"rope_parameters += {extra}",
                                            {"path": [key], "value": {**v, **extra}}))
        groups["delete"].append((f"{key} deleted", {"path": [key], "delete": True}))
    for x in (["LlamaForSequenceClassification"], ["LlamaModel"], ["LlamaForQuestionAnswering"], ["AutoTokenizer"],
              ["MistralForCausalLM"], ["GPT2LMHeadModel"], ["Qwen2ForCausalLM"], ["Nope"], [], "LlamaForCausalLM",
              None, 7, ["LlamaForCausalLM", "Nope"], [["LlamaForCausalLM"]]):
        groups["arch"].append((f"architectures = {x!r}", {"path": ["architectures"], "value": x}))
    groups["arch"].append(("architectures deleted", {"path": ["architectures"], "delete": True}))
    qc = config["quantization_config"]
    q = ["quantization_config"]
    for key in qc:
        groups["qconfig"].append((f"quantization_config.{key} deleted", {"path": q + [key], "delete": True}))
    for x in ("gptq", "bitsandbytes", None, "FEWBITS"):
        groups["qconfig"].append((f"quant_method = {x!r}", {"path": q + ["quant_method"], "value": x}))
    for x in (0, 2, 99, "1", None, 1.0):
        groups["qconfig"].append((f"format_version = {x!r}", {"path": q + ["format_version"], "value": x}))
    for name, scheme in qc["schemes"].items():
        s = q + ["schemes", name]
        for field, values in (("group_size", [64, 32, 256, 7, 0, -1, "128", None, 2 ** 40]),
                              ("format", ["int8", "nf4", "fp8_e4m3", "int2", "nope", None]),
                              ("name", ["int8", "nf4", "", None]), ("symmetric", [False, "yes"]),
                              ("scale_format", ["fp16", "bf16", "e8m0", "nope"]),
                              ("granularity", ["channel", "tensor", "block", "nope"]), ("axis", [1, -1, 2, None]),
                              ("double_quant", [True]), ("zero_point", ["float", "nope"]),
                              ("mode", ["stochastic", "nope"]), ("activations", ["int8", "fp8_e4m3", {"x": 1}]),
                              ("scale_method", ["mse", "percentile", "nope"]), ("percentile", [50.0, -1, None]),
                              ("seed", [1, -1, "0"])):
            for x in values:
                groups["qconfig"].append((f"scheme {name}.{field} = {x!r}", {"path": s + [field], "value": x}))
        groups["qconfig"].append((f"scheme {name} renamed 'other'", {"rename": s, "to": "other"}))
        groups["qconfig"].append((f"scheme {name}.extra = 1", {"path": s + ["extra"], "value": 1}))
    modules = sorted(qc["modules"])
    for name in modules[:3] + modules[-2:]:
        m = q + ["modules", name]
        shape = qc["modules"][name]["shape"]
        for label, x in (("swapped", shape[::-1]), ("rows + 1", [shape[0] + 1, shape[1]]),
                         ("cols x2", [shape[0], shape[1] * 2]), ("[0, c]", [0, shape[1]]), ("1-d", shape[:1]),
                         ("huge", [2 ** 39, shape[1]]), ("strings", [str(d) for d in shape])):
            groups["qconfig"].append((f"modules.{name}.shape {label} ({x!r})", {"path": m + ["shape"], "value": x}))
        for x in ("float16", "bfloat16", "int8", "nope", None):
            groups["qconfig"].append((f"modules.{name}.dtype = {x!r}", {"path": m + ["dtype"], "value": x}))
        for x in ("nope", None, 1):
            groups["qconfig"].append((f"modules.{name}.scheme = {x!r}", {"path": m + ["scheme"], "value": x}))
        groups["qconfig"].append((f"modules.{name} deleted", {"path": m, "delete": True}))
        groups["qconfig"].append((f"modules.{name} renamed", {"rename": m, "to": name.replace("layers", "layer")}))
    some = qc["modules"][modules[0]]
    for extra in ("lm_head", "model.embed_tokens", "model.layers.0.mlp", "model.layers.9.mlp.up_proj", ".x"):
        groups["qconfig"].append((f"modules.{extra} added", {"path": q + ["modules", extra], "value": some}))
    return groups


def config_mutated(config: dict, edit: dict) -> bytes:
    out = json.loads(json.dumps(config))
    if "rename" in edit:
        *parent, key = edit["rename"]
        node = out
        for k in parent:
            node = node[k]
        node[edit["to"]] = node.pop(key)
        if parent[-1] == "schemes":  # keep the modules pointing at it: only the name changed
            for m in out["quantization_config"]["modules"].values():
                if m["scheme"] == key:
                    m["scheme"] = edit["to"]
    else:
        *parent, key = edit["path"]
        node = out
        for k in parent:
            node = node[k]
        if edit.get("delete"):
            del node[key]
        else:
            node[key] = edit["value"]
    return json.dumps(out, indent=2).encode()


def _tokenizer(path) -> None:
    """A byte-level BPE tokenizer (the GGUF writer needs one), as in tests/files/test_gguf_trust.py."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"th": 256, "the": 257, "<|endoftext|>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "h"), ("th", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def _unpermute(w, n_head: int):
    """llama.cpp's converter permutes q/k rows for its RoPE; this puts them back (numpy)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Verdict(Exception):
    """The oracle's finding that a loaded model is not what the file says (-> silent)."""


class _ModelFiles:
    """The GGUF files and the quantized directory: built once, loaded with fb.from_pretrained,
    each load judged against an oracle that reads the file independently (gguf-py's reader and
    gguf.quants.dequantize for a GGUF; transformers' config and the intact weights for config.json)."""

    def __init__(self, workdir: str, kinds):
        import numpy as np
        import torch
        import transformers

        import fewbits as fb
        from fewbits.files import FileFormatError, gguf_recipe
        from fewbits.files.conversion import convert
        from fewbits.models import synthetic_llama_config, write_synthetic_llama
        transformers.logging.set_verbosity_error()
        try:
            from transformers.utils import logging as tlog
            tlog.disable_progress_bar()
        except Exception:  # noqa: BLE001 - cosmetic
            pass
        torch.set_num_threads(1)
        self.np, self.torch, self.transformers, self.fb, self.error = np, torch, transformers, fb, FileFormatError
        self.workdir = workdir
        self.ids = torch.tensor(IDS)
        self.data, self.layout, self.config, self.base = {}, {}, {}, {}
        for kind in kinds:
            hidden, inter = (256, 512) if kind == "gguf q4_k_m" else (64, 128)
            src = os.path.join(workdir, f"src{hidden}")
            if not os.path.exists(src):
                cfg = synthetic_llama_config("135m", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                                             tie_word_embeddings=True)
                write_synthetic_llama(src + ".tmp", cfg, dtype=torch.float32, norm_range=(0.5, 1.5), seed=hidden)
                _tokenizer(src + ".tmp")
                os.replace(src + ".tmp", src)
            path = os.path.join(workdir, _FILES[kind])
            if not os.path.exists(path):
                if kind.startswith("gguf"):
                    config = transformers.AutoConfig.from_pretrained(src)
                    tmp = path[:-len(".gguf")] + ".tmp.gguf"
                    convert(src, tmp, gguf_recipe(kind.split()[1], config), embeddings=True, tied="untie")
                    os.replace(tmp, path)
                else:
                    fb.files.convert(src, path, "int4")
            if kind.startswith("gguf"):
                with open(path, "rb") as f:
                    self.data[kind] = f.read()
                self.layout[kind] = _Layout(self.data[kind])
            else:
                with open(os.path.join(path, "config.json"), "rb") as f:
                    self.data[kind] = f.read()
                self.config[kind] = json.loads(self.data[kind])
                work = os.path.join(workdir, "corrupted-hf")  # the directory each trial's config.json goes into
                if not os.path.exists(work):
                    os.makedirs(work + ".tmp", exist_ok=True)
                    for name in os.listdir(path):
                        if name != "config.json":
                            os.link(os.path.join(path, name), os.path.join(work + ".tmp", name))
                    os.replace(work + ".tmp", work)
            # the intact file: its load, its logits, the oracle's logits and how far the two are apart
            model = fb.from_pretrained(path)
            weights = self._weights(model)
            logits = self._logits(model)
            self.base[kind] = {"weights": weights, "logits": logits}
            ref = self._oracle(kind, path, model)  # raises when the oracle disagrees with the intact file
            gap = (logits - ref).abs().max().item()
            scale = ref.abs().max().item()
            self.base[kind]["tolerance"] = max(4 * gap / scale, 1e-5)

    # --- the loaded model ---------------------------------------------------------------------
    def _weights(self, model, keep_dtype: bool = False) -> dict:
        """{name: float32 tensor} of every weight the model holds, quantized ones dequantized
        (keep_dtype: float parameters in their own dtype)."""
        torch = self.torch
        out, inside = {}, set()
        for name, m in model.named_modules():
            q = getattr(m, "qweight", None)
            if q is not None and not isinstance(q, torch.nn.Parameter):
                out[f"{name}.weight"] = q.dequantize(torch.float32)
                inside.add(name)
        for name, p in model.named_parameters(remove_duplicate=False):
            if name.rpartition(".")[0] not in inside:
                out[name] = p.detach() if keep_dtype else p.detach().float()
        return out

    def _logits(self, model):
        with self.torch.inference_mode():
            out = model(self.ids)
        if isinstance(out, tuple):  # return_dict false
            t = out[0]
        else:
            t = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        return t.detach().float()

    # --- the oracles --------------------------------------------------------------------------
    def _oracle(self, kind: str, path: str, model):
        """The logits the file means, computed without fewbits' reader; raises _Verdict when the
        loaded model's weights or config are not what the file says."""
        if kind.startswith("gguf"):
            return self._gguf_oracle(kind, path, model)
        return self._config_oracle(kind, path, model)

    def _gguf_oracle(self, kind: str, path: str, model):
        import gguf
        np, torch, transformers = self.np, self.torch, self.transformers
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:  # noqa: BLE001
            raise _Verdict(f"loaded, but gguf-py cannot read the file: {type(e).__name__}: {str(e)[:120]}")

        def meta(key, default=None):
            f = reader.fields.get(key)
            if f is None:
                return default
            v = f.contents()
            if isinstance(v, (str, list)) or isinstance(v, bool):
                raise _Verdict(f"loaded, but {key} is {type(v).__name__} {v!r:.40}")
            return v
        tensors = {t.name: t for t in reader.tensors}
        embed = tensors["token_embd.weight"]
        hidden, vocab = (int(d) for d in embed.shape)
        heads = int(meta("llama.attention.head_count"))
        kv = int(meta("llama.attention.head_count_kv", heads))
        head_dim = int(meta("llama.attention.key_length", hidden // heads))
        rope = {"rope_type": "default", "rope_theta": float(meta("llama.rope.freq_base", 10000.0))}
        scaling = reader.fields.get("llama.rope.scaling.type")
        scaling = "linear" if scaling is None else scaling.contents()
        factor = float(meta("llama.rope.scaling.factor", 0.0)) or float(meta("llama.rope.scale_linear", 0.0))
        if scaling == "linear" and factor not in (0.0, 1.0):
            rope.update(rope_type="linear", factor=factor)
        elif scaling not in ("linear", "none"):
            raise _Verdict(f"loaded, but llama.rope.scaling.type is {scaling!r}, which llama.cpp applies")
        cfg = dict(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=int(meta("llama.block_count")),
                   intermediate_size=int(meta("llama.feed_forward_length")), num_attention_heads=heads,
                   num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=int(meta("llama.context_length")),
                   rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon")), rope_parameters=rope,
                   tie_word_embeddings="output.weight" not in tensors)
        got = model.config
        for field, want in cfg.items():
            if field in ("tie_word_embeddings", "rope_parameters"):
                continue
            have = getattr(got, field, None)
            if have != want:
                raise _Verdict(f"config {field} is {have!r}, the file says {want!r}")
        have_rope = dict(getattr(got, "rope_parameters", None) or {})
        for k, want in rope.items():
            if have_rope.get(k) != want:
                raise _Verdict(f"config rope_parameters[{k!r}] is {have_rope.get(k)!r}, the file says {want!r}")
        for name in ("bos", "eos"):
            tid = meta(f"tokenizer.ggml.{name}_token_id")
            if tid is not None and getattr(got, f"{name}_token_id", None) != int(tid):
                have = getattr(got, f"{name}_token_id", None)
                raise _Verdict(f"config {name}_token_id is {have}, the file says {tid}")
        config = transformers.LlamaConfig(**cfg)
        with torch.device("meta"):
            skeleton = transformers.LlamaForCausalLM(config)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
        state = {}
        for hf in skeleton.state_dict():
            g = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if g is None or g not in tensors:
                continue
            t = tensors[g]
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
            if g.endswith("attn_q.weight"):
                w = _unpermute(w, heads)
            elif g.endswith("attn_k.weight"):
                w = _unpermute(w, kv)
            state[hf] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        loaded = self._weights(model)
        for name, want in state.items():
            have = loaded.get(name)
            if have is None or have.shape != want.shape:
                raise _Verdict(f"weight {name}: {None if have is None else tuple(have.shape)}, the file holds "
                               f"{tuple(want.shape)}")
            if not torch.equal(have, want):
                diff = (have - want).abs().nan_to_num(float("inf")).max().item()
                raise _Verdict(f"weight {name} differs from gguf.quants.dequantize of the file's bytes "
                               f"(max {diff:.3g})")
        reference = transformers.LlamaForCausalLM(config).float().eval()
        missing, unexpected = reference.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq")]
        if missing:
            raise _Verdict(f"loaded, but the file holds no {', '.join(missing[:3])}")
        intact = self.base[kind]["weights"]
        changed = [n for n, w in loaded.items() if n not in intact or not torch.equal(w, intact[n])]
        if changed:
            # the weights are the file's, bit for bit (above); what is left to check is that each
            # layer computes with them. End to end, a kernel's rounding (bf16 activations in the
            # k-quants' int4 matmul) grows with the weights a mutation made, so each changed
            # linear layer is held to the rounding bound of its own product instead.
            self._check_layers(model, changed, loaded)
            return None
        return self._logits(reference)

    def _check_layers(self, model, changed, loaded) -> None:
        torch = self.torch
        g = torch.Generator().manual_seed(7)
        for name in changed:
            module = model.get_submodule(name.rpartition(".")[0])
            if not isinstance(module, torch.nn.Module) or not hasattr(module, "in_features"):
                continue  # an embedding row or a norm: used as stored, checked end to end above
            w = loaded[name]
            x = torch.randn(8, w.shape[1], generator=g)
            with torch.inference_mode():
                y = module(x).float()
            exact = x.double() @ w.double().T
            bound = 2.0 ** -7 * (x.double().abs() @ w.double().abs().T) + 1e-6
            bad = ((y.double() - exact).abs() > bound) & torch.isfinite(exact)
            if bool(bad.any()):
                i = int(bad.flatten().nonzero()[0])
                raise _Verdict(f"layer {name.rpartition('.')[0]} does not compute with its weights: "
                               f"{y.flatten()[i].item():.6g} where x @ W.T is {exact.flatten()[i].item():.6g}")

    def _config_oracle(self, kind: str, directory: str, model):
        """transformers' model of the (mutated) config.json, given the intact directory's weights."""
        torch, transformers = self.torch, self.transformers
        with open(os.path.join(directory, "config.json")) as f:
            stated = json.load(f)
        stated.pop("quantization_config", None)
        self._usable(stated)
        ref_dir = os.path.join(self.workdir, "oracle-config")
        os.makedirs(ref_dir, exist_ok=True)
        with open(os.path.join(ref_dir, "config.json"), "w") as f:
            json.dump(stated, f)
        try:
            config = transformers.AutoConfig.from_pretrained(ref_dir)
            arch = (stated.get("architectures") or [None])[0]
            cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
            if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
                cls = transformers.AutoModelForCausalLM
                reference = cls.from_config(config, dtype=torch.float32)
            else:
                reference = cls._from_config(config, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            raise _Verdict(f"loaded, but transformers cannot build the config.json it states: "
                           f"{type(e).__name__}: {str(e)[:120]}")
        weights = dict(self.base[kind]["weights"])
        if self.config[kind].get("tie_word_embeddings") and not getattr(config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)  # tied in the intact directory: not stored
        target = reference.state_dict()
        state, used = {}, set()
        for k, v in weights.items():
            for name in (k, k[len("model."):] if k.startswith("model.") else None):
                if name in target and name not in state:
                    state[name] = v
                    used.add(k)
                    break
        unused = [k for k in weights if k not in used and not (k == "lm_head.weight" and k not in target)]
        if unused:
            raise _Verdict(f"loaded, but the model the config states ignores the weights {', '.join(unused[:3])}")
        try:
            missing, _ = reference.load_state_dict(state, strict=False)
        except RuntimeError as e:
            raise _Verdict(f"loaded, but the stored weights do not fit the config: {str(e)[:160]}")
        tied = getattr(config, "tie_word_embeddings", False)
        missing = [m for m in missing if not m.endswith("inv_freq") and not (tied and m == "lm_head.weight")]
        if missing:
            raise _Verdict(f"loaded, but the directory holds no {', '.join(missing[:3])} (initialized at random)")
        if tied:
            reference.tie_weights()
        loaded = self._weights(model, keep_dtype=True)  # config.json's dtype casts the float weights
        for name, want in state.items():
            have = loaded.get(name) if name in loaded else loaded.get("model." + name)
            if have is not None and have.shape == want.shape and not torch.equal(have, want.to(have.dtype)):
                diff = (have.float() - want).abs().max().item()
                raise _Verdict(f"weight {name} differs from the stored one (max {diff:.3g})")
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return self._logits(reference.to(dtype).eval())

    @staticmethod
    def _usable(stated: dict) -> None:
        """Values the numbers depend on must be usable: a config.json that states an rms_norm_eps
        of inf or a rope_theta of NaN states no model (the GGUF reader refuses the same)."""
        rope = stated.get("rope_parameters") if isinstance(stated.get("rope_parameters"), dict) else {}
        for key, v in (("rms_norm_eps", stated.get("rms_norm_eps")), ("rope_parameters.rope_theta",
                       rope.get("rope_theta")), ("rope_parameters.factor", rope.get("factor"))):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise _Verdict(f"loaded, but {key} = {v!r} is not a usable value (a finite number > 0)")

    # --- one trial ----------------------------------------------------------------------------
    def mutated(self, trial: dict) -> bytes:
        kind, data = trial["kind"], self.data[trial["kind"]]
        if trial["corruption"] in CORRUPTIONS:
            return corrupted(data, trial)
        if kind.startswith("gguf"):
            return gguf_mutated(self.layout[kind], trial["edit"])
        return config_mutated(self.config[kind], trial["edit"])

    def trial(self, trial: dict) -> tuple[str, str]:
        kind = trial["kind"]
        raw = self.mutated(trial)
        if kind.startswith("gguf"):
            path = named = os.path.join(self.workdir, "corrupted-" + _FILES[kind])
        else:
            path = os.path.join(self.workdir, "corrupted-hf")
            named = path
        with open(os.path.join(path, "config.json") if not kind.startswith("gguf") else path, "wb") as f:
            f.write(raw)
        try:
            model = self.fb.from_pretrained(path)
        except self.error as e:
            if named not in str(e):
                return "other", f"FileFormatError not naming the file: {str(e)[:200]}"
            return "raised", ""
        except Exception as e:  # noqa: BLE001 - the fuzzer's point: which errors escape
            return "other", f"{type(e).__name__}: {str(e)[:200]}"
        return self.judge(kind, path, model)

    def judge(self, kind: str, path: str, model) -> tuple[str, str]:
        """harmless, honoured or silent: a loaded model against the oracle."""
        torch = self.torch
        base = self.base[kind]
        try:
            logits = self._logits(model)
        except Exception as e:  # noqa: BLE001
            return "other", f"loaded; the first forward pass raised {type(e).__name__}: {str(e)[:160]}"
        same = logits.shape == base["logits"].shape and torch.equal(logits, base["logits"])
        if same and not kind.startswith("gguf"):
            return "harmless", ""  # config.json: the weights are the intact directory's, so nothing changed
        try:
            ref = self._oracle(kind, path, model)
        except _Verdict as v:
            return "silent", f"{v} (logits {'identical to' if same else 'differ from'} the intact file's)"
        if ref is None:  # changed weights, each the file's and each computed with (_check_layers)
            return "harmless" if same else "honoured", ""
        if logits.shape != ref.shape:
            return "silent", f"logits of shape {tuple(logits.shape)}, the file's model gives {tuple(ref.shape)}"
        if same:
            return "harmless", ""
        same_nan = torch.equal(torch.isfinite(logits), torch.isfinite(ref)) and torch.equal(
            logits[~torch.isfinite(logits)].nan_to_num(0.0), ref[~torch.isfinite(ref)].nan_to_num(0.0))
        finite = torch.isfinite(ref)
        tol = base["tolerance"] if logits.dtype == torch.float32 and ref.dtype == torch.float32 else 2e-2
        half = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32) != torch.float32
        tol = 2e-2 if half else tol
        gap = (logits[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
        scale = ref[finite].abs().max().item() if finite.any() else 1.0
        if same_nan and gap <= tol * max(scale, 1e-30):
            return "honoured", ""
        return "silent", f"logits differ from the file's model by {gap:.3g} (tolerance {tol * scale:.3g})"


# ---------------------------------------------------------------------------------------------
# the worker: builds the originals once, then runs trials from --start, one JSON line each
# ---------------------------------------------------------------------------------------------
def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Targets:
    """Builds the originals and fresh targets, loads files, fingerprints states (torch here)."""

    def __init__(self, workdir: str, kinds=KINDS):
        import torch
        from torch import nn

        import fewbits as fb
        from fewbits.quant import quantize
        from fewbits.files import FileFormatError
        from fewbits.quant.model import quantize_model
        from fewbits.train import Engine, load_checkpoint, save_checkpoint
        from fewbits.train import checkpoint as ckpt
        torch.set_num_threads(1)
        self.torch, self.nn, self.fb, self.Engine = torch, nn, fb, Engine
        self.quantize_model, self.load_checkpoint = quantize_model, load_checkpoint
        self.fb_error = FileFormatError
        self.ckpt_error = getattr(ckpt, "CheckpointError", ValueError)
        self.workdir = workdir
        paths = {k: os.path.join(workdir, _FILES[k]) for k in kinds}
        g = torch.Generator().manual_seed(1)
        for kind, path in paths.items():  # a worker resumed after a crash finds them written
            if os.path.exists(path):
                continue
            if kind == "fb model":
                model = self._model(seed=0)
                quantize_model(model, {"up": "nf4_dq", "down": "int8", "mid": "w8a8", "emb": "int4_asym_g32",
                                       "head": None}, embeddings=True)
                fb.save(model, path)
            elif kind == "fb qtensor":
                fb.save(quantize(torch.randn(32, 64, generator=g), "mxfp4"), path)
            elif kind == "fb tensor":
                fb.save({"weight": torch.randn(48, 40, generator=g)}, path)
            else:
                engine = self._engine(_POLICIES[kind])
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
                for _ in range(2):
                    engine.train_step(nn.functional.cross_entropy(engine.model(x), y))
                save_checkpoint(engine, path)
        self.data = {}
        for kind, path in paths.items():
            with open(path, "rb") as f:
                self.data[kind] = f.read()
        self.reference = {k: self._fingerprint(*self._load(k, paths[k])) for k in kinds}

    def _model(self, seed: int):
        nn, torch = self.nn, self.torch

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(40, 64, padding_idx=0)
                self.up = nn.Linear(64, 96)
                self.norm = nn.LayerNorm(96)
                self.down = nn.Linear(96, 64, bias=False)
                self.mid = nn.Linear(64, 64)
                self.head = nn.Linear(64, 12)
                self.register_buffer("offset", torch.linspace(-1, 1, 64))

        torch.manual_seed(seed)
        return Tiny()

    def _engine(self, policy: str):
        torch, nn = self.torch, self.nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 10))
        return self.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy, seed=3)

    def fresh(self, kind: str):
        if kind == "fb model":
            return self._model(seed=1)
        if kind in _POLICIES:
            return self._engine(_POLICIES[kind])
        return None

    def _load(self, kind: str, path: str, target=None):
        """(kind, what the load produced): the target it filled, or the loaded object."""
        target = self.fresh(kind) if target is None else target
        if kind == "fb model":
            return kind, self.fb.load(path, model=target)
        if kind in _POLICIES:
            self.load_checkpoint(target, path)
            return kind, target
        return kind, self.fb.load(path)

    def expected_error(self, kind: str):
        return self.ckpt_error if kind in _POLICIES else self.fb_error

    # --- fingerprints: a SHA-256 over every tensor and value a load can change -----------------
    def _fingerprint(self, kind: str, obj) -> str:
        h = hashlib.sha256()
        if obj is None:
            return "none"
        if kind == "fb model":
            for name, m in obj.named_modules():
                h.update(f"{name}:{type(m).__name__};".encode())
                if getattr(m, "qweight", None) is not None:
                    h.update(m.qweight.scheme.label.encode())
                    self._walk(m.qweight.state_dict(), h)
            self._walk(obj.state_dict(), h)
        elif kind in _POLICIES:
            e = obj
            self._walk(e.model.state_dict(), h)
            self._walk([(x.master, x.compensation) for x in e.entries], h)
            self._walk(e.optimizer.state_dict(), h)
            self._walk([e.scaler.state_dict(), e.step_count, list(e.overflows)], h)
            self._walk({k: g.get_state() for k, g in e.generators.items()}, h)
        else:
            self._walk(obj.state_dict() if hasattr(obj, "state_dict") else obj, h)
        return h.hexdigest()

    def _walk(self, obj, h) -> None:
        torch = self.torch
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"{")
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                self._walk(obj[k], h)
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[")
            for v in obj:
                self._walk(v, h)
            h.update(b"]")
        elif hasattr(obj, "to_dict"):  # PackedState and the like
            self._walk(obj.to_dict(), h)
        else:
            h.update(repr(obj).encode())

    def trial(self, trial: dict) -> tuple[str, str]:
        """(outcome, detail) of one corrupted load."""
        kind = trial["kind"]
        path = os.path.join(self.workdir, "corrupted-" + _FILES[kind])
        with open(path, "wb") as f:
            f.write(corrupted(self.data[kind], trial))
        target = self.fresh(kind)
        before = self._fingerprint(kind, target)
        try:
            self._load(kind, path, target)
        except self.expected_error(kind) as e:
            after = self._fingerprint(kind, target)
            if after != before:
                return "partial", f"{type(e).__name__} after changing the target: {str(e)[:160]}"
            return "raised", ""
        except Exception as e:  # noqa: BLE001 - the fuzzer's point: which errors escape
            return "other", f"{type(e).__name__}: {str(e)[:200]}"
        same = self._fingerprint(kind, target if target is not None else self._load(kind, path)[1])
        return "silent", ("loaded the intact file's state" if same == self.reference[kind]
                          else "loaded a different state")


def worker(workdir: str, size: str, seed: int, kinds: tuple, start: int, sabotage: dict, only=None) -> None:
    """Run the plan's trials from `start`, one JSON line before and after each. `sabotage`
    ({trial: "crash" | "hang" | "memory"}) makes the worker itself die, stall or allocate 64 GB at
    that trial: the test of the fuzzer's own crash accounting and of its memory limit."""
    import signal
    import time
    import warnings
    warnings.simplefilter("ignore")
    fb_kinds = tuple(k for k in kinds if k in FB_KINDS)
    model_kinds = tuple(k for k in kinds if k in MODEL_KINDS)
    targets = _Targets(workdir, fb_kinds) if fb_kinds else None
    models = _ModelFiles(workdir, model_kinds) if model_kinds else None
    data = {**(targets.data if targets else {}), **(models.data if models else {})}
    structures = {k: structures_of(k, data[k], seed) for k in model_kinds}
    plan = make_plan({k: len(d) for k, d in data.items()}, size, seed, kinds, structures)
    from fewbits.files import FileFormatError
    _emit({"event": "plan", "trials": len(plan), "plan": plan, "sizes": {k: len(d) for k, d in data.items()},
           "errors": {"fb": FileFormatError.__name__,
                      "checkpoint": targets.ckpt_error.__name__ if targets else "CheckpointError"}})
    for i in range(start, len(plan)):
        if only and i not in only:
            continue
        _emit({"event": "start", "trial": i})
        if sabotage.get(i) == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if sabotage.get(i) == "hang":
            time.sleep(3600)
        if sabotage.get(i) == "memory":  # 64 GB at once: the memory limit makes this a MemoryError (a crash)
            bytearray(64 << 30)
        outcome, detail = (models if plan[i]["kind"] in MODEL_KINDS else targets).trial(plan[i])
        _emit({"event": "result", "trial": i, "outcome": outcome, "detail": detail})
    _emit({"event": "done"})


# ---------------------------------------------------------------------------------------------
# the parent: runs workers, counts, prints the table
# ---------------------------------------------------------------------------------------------
def _lines(proc, q) -> None:
    for line in proc.stdout:
        q.put(line)
    q.put(None)


def _limit_memory(limit_bytes: int):
    def apply():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return apply


def run(size: str, seed: int, trial_timeout: float, workdir: str, kinds=KINDS, sabotage=(), log=print,
        memory_gb: float = 6.0, only=()) -> dict:
    results: dict[int, tuple[str, str]] = {}
    plan_info = None
    start = 0
    while True:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--size", size, "--seed", str(seed),
               "--workdir", workdir, "--start", str(start), "--kinds", ",".join(kinds)]
        cmd += [a for s in sabotage for a in ("--sabotage", s)]
        cmd += ["--only", ",".join(map(str, only))] if only else []
        limit = _limit_memory(int(memory_gb * 2 ** 30)) if memory_gb else None
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=limit)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc, q), daemon=True).start()
        current, done, hung = None, False, False
        while True:
            timeout = trial_timeout if current is not None else max(trial_timeout, 300)
            try:
                line = q.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                hung = True
                break
            if line is None:
                break
            msg = json.loads(line)
            if msg["event"] == "plan":
                plan_info = msg
            elif msg["event"] == "start":
                current = msg["trial"]
            elif msg["event"] == "result":
                results[msg["trial"]] = (msg["outcome"], msg["detail"])
                current = None
            elif msg["event"] == "done":
                done = True
        rc = proc.wait()
        if done:
            break
        if current is None:
            raise RuntimeError(f"the fuzz worker failed outside any trial (exit status {rc}); see its stderr")
        why = f"hung for more than {trial_timeout:g} s" if hung else f"exit status {rc}"
        results[current] = ("hung" if hung else "crashed", why)
        log(f"trial {current}: the worker died ({why}); resuming with the next trial")
        start = current + 1
        if start >= plan_info["trials"]:
            break
    sizes = plan_info["sizes"]
    plan = plan_info["plan"]
    groups = {(k, c): {o: 0 for o in ("trials",) + OUTCOMES} for k in KINDS if k in kinds
              for c in (GROUPS[k.split()[0]] if k in MODEL_KINDS else CORRUPTIONS)}
    failures = []
    for i, trial in enumerate(plan):
        if i not in results:  # --only
            continue
        outcome, detail = results[i]
        g = groups[(trial["kind"], trial["corruption"])]
        g["trials"] += 1
        g[outcome] += 1
        if outcome not in PASSING:
            failures.append({**trial, "trial": i, "outcome": outcome, "detail": detail})
    return {"size": size, "seed": seed, "file_sizes": sizes, "errors": plan_info["errors"],
            "trials": [{"kind": t["kind"], "corruption": t["corruption"], "mutation": describe(t),
                        "outcome": results[i][0], "detail": results[i][1]} for i, t in enumerate(plan) if i in results],
            "groups": [{"kind": k, "corruption": c, **v} for (k, c), v in groups.items()],
            "failures": failures}


def table(report: dict) -> str:
    head = f"{'file':<14} {'corruption':<10} {'trials':>6} " + " ".join(f"{o:>8}" for o in OUTCOMES)
    rows = [head, "-" * len(head)]
    for g in report["groups"]:
        if g["trials"]:
            rows.append(f"{g['kind']:<14} {g['corruption']:<10} {g['trials']:>6} "
                        + " ".join(f"{g[o]:>8}" for o in OUTCOMES))
    total = {o: sum(g[o] for g in report["groups"]) for o in ("trials",) + OUTCOMES}
    rows += ["-" * len(head),
             f"{'all':<14} {'':<10} {total['trials']:>6} " + " ".join(f"{total[o]:>8}" for o in OUTCOMES)]
    return "\n".join(rows)


def describe(f: dict) -> str:
    if f["corruption"] == "flip":
        return f"bit {f['bit']} of byte {f['at']}"
    if f["corruption"] == "truncate":
        return f"cut to {f['at']} bytes"
    return f["what"]


def save_failures(report: dict, workdir: str, dest: str) -> list[str]:
    """Write each failing trial's file (the mutated GGUF, or the mutated config.json) into
    `dest`, rebuilt here from the pristine files (so hangs and crashes are saved too)."""
    os.makedirs(dest, exist_ok=True)
    written = []
    for f in report["failures"]:
        kind = f["kind"]
        if kind not in MODEL_KINDS:
            continue
        original = os.path.join(workdir, _FILES[kind])
        with open(os.path.join(original, "config.json") if kind == "hf config" else original, "rb") as fh:
            data = fh.read()
        if f["corruption"] in CORRUPTIONS:
            raw = corrupted(data, f)
        elif kind.startswith("gguf"):
            raw = gguf_mutated(_Layout(data), f["edit"])
        else:
            raw = config_mutated(json.loads(data), f["edit"])
        name = f"trial{f['trial']}-" + ("config.json" if kind == "hf config" else _FILES[kind])
        with open(os.path.join(dest, name), "wb") as fh:
            fh.write(raw)
        written.append(name)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the counts and every failing trial to PATH")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"file kinds to fuzz, comma-separated (default: all: "
                   f"{', '.join(KINDS)})")
    p.add_argument("--trial-timeout", type=float, default=60.0, help="seconds a trial may take (default 60)")
    p.add_argument("--memory-gb", type=float, default=6.0, help="the worker's address-space limit (RLIMIT_AS) in "
                   "GB (default 6; 0: none)")
    p.add_argument("--only", default="", metavar="N,M,...", help="run these trials of the plan only (a failure's "
                   "trial number, with the same --size, --seed and --kinds: to reproduce it)")
    p.add_argument("--save-failures", metavar="DIR", help="write each failing trial's GGUF / config.json to DIR")
    p.add_argument("--show", type=int, default=10, help="failing trials to list (default 10)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sabotage", action="append", default=[], metavar="crash:N|hang:N|memory:N",
                   help="make the worker crash (SIGSEGV), hang or allocate 64 GB at trial N: tests the fuzzer's own "
                   "accounting and its memory limit")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"unknown file kinds {unknown}; choose from {', '.join(KINDS)}")
    sabotage = {}
    for s in args.sabotage:
        what, _, n = s.partition(":")
        if what not in ("crash", "hang", "memory") or not n.isdigit():
            p.error(f"--sabotage takes crash:N, hang:N or memory:N, got {s!r}")
        sabotage[int(n)] = what
    only = {int(n) for n in args.only.split(",") if n.strip()} if args.only else set()
    if args.worker:
        worker(args.workdir, args.size, args.seed, kinds, args.start, sabotage, only)
        return 0
    with tempfile.TemporaryDirectory(prefix="fewbits-fuzz-") as workdir:
        report = run(args.size, args.seed, args.trial_timeout, workdir, kinds, args.sabotage,
                     memory_gb=args.memory_gb, only=sorted(only))
        if args.save_failures:
            saved = save_failures(report, workdir, args.save_failures)
            if saved:
                print(f"{len(saved)} failing files written to {args.save_failures}")
    print(f"fuzz_files --size {args.size} --seed {args.seed}: file sizes "
          + ", ".join(f"{k} {v} B" for k, v in report["file_sizes"].items()))
    print(f"documented errors: fb.load {report['errors']['fb']}, load_checkpoint {report['errors']['checkpoint']}")
    print(table(report))
    for f in report["failures"][:args.show]:
        print(f"  trial {f['trial']}: {f['kind']}, {describe(f)}: {f['outcome']} ({f['detail']})")
    if len(report["failures"]) > args.show:
        print(f"  ... and {len(report['failures']) - args.show} more")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
