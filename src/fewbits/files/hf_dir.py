"""Hugging Face model directories of fewbits-quantized models: config.json (with a
`quantization_config`), safetensors shards (one `model.safetensors`, or shards named by
`model.safetensors.index.json`) and the tokenizer files.

Tensor names are the model's state_dict() names. A quantized module `m` (QuantLinear or
QuantEmbedding) is stored as its QuantizedTensor's tensors `m.qweight.<key>` (key in
fewbits.quant.tensor.STATE_KEYS: codes, scales, zero_points, minimums, ...) plus `m.bias`, and
`m.weight` as an empty uint8 tensor, the guard that makes transformers without fewbits refuse the
directory instead of loading random weights (see GUARD_DTYPE); as a
"tensor mapping" (the writers' input, read_tensors' output) it is one entry under the weight's
Hugging Face name, "m.weight" -> QuantizedTensor.

config.json's quantization_config (format version 1), validated strictly on read:

    {"quant_method": "fewbits", "format_version": 1, "fewbits_version": "<writer's version>",
     "schemes": {"<key>": QuantScheme.to_dict(), ...},
     "modules": {"<module name>": {"scheme": "<key>", "shape": [out, in], "dtype": "float32"}, ...}}

`shape` and `dtype` are the original weight's (what QuantizedTensor needs besides its tensors).
Whether a module is a Linear or an Embedding comes from the model the directory is loaded into.

Writing: ShardWriter(out_dir) builds the directory under a temporary name beside `out_dir`
(fewbits.atomic.DirectoryReplacement) and renames it when finish() has written everything, so an
exception, a Ctrl-C or a kill leaves nothing that looks finished (the next write of the same
target removes the leftovers). It holds one shard's tensors at a time. save_pretrained(model,
dir) writes an in-memory quantized transformers model with it.

Reading: read_tensors(dir) is a lazy Mapping over the directory's tensors (memory-mapped through
safetensors.safe_open: a value is read when it is looked up). Everything it can check without
reading tensor data -- the index, the shard headers, the quantization_config, every quantized
tensor's entries, shapes and dtypes -- is checked when it is built; codes outside their format
when a value is read. Every problem is a FileFormatError naming the file.

Loading a model: fewbits.files.hf_quantizer.from_pretrained(dir) (fb.from_pretrained) and
transformers' AutoModel*.from_pretrained(dir) once fewbits is imported (the same path: a
registered transformers quantizer, fewbits.files.hf_quantizer).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from .._version import __version__
from ..atomic import DirectoryReplacement
from ..quant.modules import QuantEmbedding, QuantLinear, embedding_scale
from ..quant.plan import is_quantized, set_submodule
from ..quant.scheme import QuantScheme
from ..quant.tensor import QuantizedTensor, expected_keys, state_shapes, stored_problem
from .safetensors_format import _FLOAT_DTYPES, FileFormatError, _dtype_name, _listing, _scheme_problem, _short

QUANT_METHOD = "fewbits"
QUANT_FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
QWEIGHT = "qweight"
DEFAULT_MAX_SHARD_BYTES = 2 * 2 ** 30
# tokenizer files copied from a directory (a tokenizer object writes its own with save_pretrained)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
_MAX_JSON_BYTES = 64 * 2 ** 20
_QCONFIG_FIELDS = {"quant_method", "format_version", "fewbits_version", "schemes", "modules"}
_MODULE_FIELDS = {"scheme", "shape", "dtype"}
# safetensors' dtype names -> torch dtypes (for checking headers before reading data)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}

# The guard: every quantized module m also stores "m.weight" as an empty uint8 tensor. transformers
# without fewbits skips a quantization_config it does not know (a warning) and would otherwise
# fill m.weight at random and run: with the guard it meets a weight of shape [0] where the model
# has [out, in] and refuses to load (a size mismatch). fewbits' reader and quantizer take the guard
# as part of the quantized module; directories written before it (no guard) read as they did.
GUARD_DTYPE = torch.uint8


def guard_tensor() -> torch.Tensor:
    """The tensor stored under a quantized module's weight name (see GUARD_DTYPE)."""
    return torch.empty(0, dtype=GUARD_DTYPE)


def _is_guard(shape, st_dtype: str) -> bool:
    return tuple(shape) == (0,) and _ST_DTYPES.get(st_dtype) == GUARD_DTYPE


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Write `tensors` (CPU, contiguous) as a safetensors file -- the 8-byte header length, the
    JSON header, the tensors' bytes in order -- straight from the tensors' memory.
    safetensors.torch.save_file first copies every tensor into a bytes object, which doubles
    the memory a shard takes while it is written; the file is the same format (safetensors'
    reader is what the tests read it with)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


# ---------------------------------------------------------------------------------------------
# quantization_config
# ---------------------------------------------------------------------------------------------
def quantization_config(quantized: Mapping[str, QuantizedTensor]) -> dict:
    """The quantization_config of these quantized weights ({module name: QuantizedTensor}):
    each distinct scheme once, under its label (made unique with a suffix where two differ)."""
    schemes: dict[str, dict] = {}
    keys: dict[QuantScheme, str] = {}
    modules = {}
    for name, qt in quantized.items():
        s = qt.scheme
        if s not in keys:
            key = base = re.sub(r"[^A-Za-z0-9_.-]", "_", s.label) or "scheme"
            i = 1
            while key in schemes:
                key, i = f"{base}_{i}", i + 1
            keys[s] = key
            schemes[key] = s.to_dict()
        modules[name] = {"scheme": keys[s], "shape": [int(d) for d in qt.shape], "dtype": _dtype_name(qt.dtype)}
    return {"quant_method": QUANT_METHOD, "format_version": QUANT_FORMAT_VERSION, "fewbits_version": __version__,
            "schemes": schemes, "modules": modules}


def parse_quantization_config(path, qc) -> dict[str, tuple[QuantScheme, tuple[int, ...], torch.dtype]]:
    """{module name: (scheme, weight shape, weight dtype)} of a quantization_config, checked
    field by field (a FileFormatError naming `path` for anything of the wrong structure, type or
    value, a method other than fewbits, a version newer than this fewbits reads)."""
    where = "quantization_config"
    if not isinstance(qc, dict):
        raise FileFormatError(path, f"{where} must be a JSON object, got {_short(qc)}")
    if qc.get("quant_method") != QUANT_METHOD:
        raise FileFormatError(path, f"{where}: quant_method {_short(qc.get('quant_method'))} is not "
                              f"{QUANT_METHOD!r}; fewbits reads only its own quantized directories")
    unknown = sorted(set(qc) - _QCONFIG_FIELDS)
    if unknown:
        raise FileFormatError(path, f"{where}: unknown fields {_listing(unknown)} (known: {', '.join(sorted(_QCONFIG_FIELDS))})")
    missing = sorted(_QCONFIG_FIELDS - set(qc))
    if missing:
        raise FileFormatError(path, f"{where}: missing fields {_listing(missing)}")
    version = qc["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FileFormatError(path, f"{where}: bad format_version {_short(version)}")
    if version > QUANT_FORMAT_VERSION:
        raise FileFormatError(path, f"{where}: format_version {version} is newer than this fewbits reads "
                              f"(up to {QUANT_FORMAT_VERSION}): upgrade fewbits")
    if not isinstance(qc["fewbits_version"], str):
        raise FileFormatError(path, f"{where}: fewbits_version must be a string")
    if not isinstance(qc["schemes"], dict) or not isinstance(qc["modules"], dict):
        raise FileFormatError(path, f"{where}: 'schemes' and 'modules' must be JSON objects")
    schemes = {}
    for key, d in qc["schemes"].items():
        problem = _scheme_problem(d, allow_activations=True)
        if problem is None:
            try:
                schemes[key] = QuantScheme.from_dict(d)
            except (TypeError, ValueError, ArithmeticError) as e:
                problem = str(e)
        if problem:
            raise FileFormatError(path, f"{where}: scheme {_short(key)}: {problem}")
    out = {}
    for name, info in qc["modules"].items():
        w = f"{where}: module {_short(name)}"
        if not name or name.startswith(".") or name.endswith(".") or ".." in name:
            raise FileFormatError(path, f"{w}: not a module name")
        if not isinstance(info, dict) or set(info) != _MODULE_FIELDS:
            raise FileFormatError(path, f"{w}: must be an object with exactly {', '.join(sorted(_MODULE_FIELDS))}")
        scheme, shape, dtype = info["scheme"], info["shape"], info["dtype"]
        if not isinstance(scheme, str) or scheme not in schemes:
            raise FileFormatError(path, f"{w}: scheme {_short(scheme)} is not one of 'schemes' ({_listing(schemes)})")
        if not (isinstance(shape, list) and len(shape) == 2
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 2 ** 40 for d in shape)):
            raise FileFormatError(path, f"{w}: shape must be [rows, columns] of positive integers, got {_short(shape)}")
        if not isinstance(dtype, str) or dtype not in _FLOAT_DTYPES:
            raise FileFormatError(path, f"{w}: dtype {_short(dtype)} is not one of {', '.join(_FLOAT_DTYPES)}")
        out[name] = (schemes[scheme], tuple(shape), _FLOAT_DTYPES[dtype])
    return out


# What a shard written by ShardWriter records of the quantized modules in it, in its safetensors
# metadata: {module: {"scheme", "shape", "dtype"}} as quantization_config states them. config.json
# is a separate, editable file: a quantization_config changed after the write (a scheme's format
# int4 -> nf4 keeps the layout, so the codes would load through another codebook) no longer
# matches what the shard holding the codes was written as, and is refused. Shards written
# otherwise (transformers' save_pretrained of a loaded model) carry no record and are not checked.
SHARD_RECORD = "fewbits_modules"


def _module_record(scheme: QuantScheme, shape, dtype) -> dict:
    return {"scheme": scheme.to_dict(), "shape": [int(d) for d in shape], "dtype": _dtype_name(dtype)}


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def _module_of(name: str) -> str:
    """The module name of a quantized weight's Hugging Face name ("m.weight" -> "m")."""
    module, dot, leaf = name.rpartition(".")
    if not dot or leaf != "weight" or not module:
        raise ValueError(f"a QuantizedTensor is stored under its module's weight name ('<module>.weight'), got {name!r}")
    return module


class ShardWriter:
    """Writes a Hugging Face directory tensor by tensor (see the module docstring).

    `add(name, value)` takes a float tensor under its state-dict name, or a QuantizedTensor under
    its module's weight name ("m.weight", stored as m.qweight.<key>); the tensors go into the
    current shard, which is written to disk once the next tensor would make it larger than
    `max_shard_bytes` (a tensor larger than that gets a shard of its own), so memory holds about
    one shard. `finish(config, tokenizer=None, quantization_config=None)` writes the last shard,
    the index (model.safetensors.index.json, shards model-0000i-of-0000n.safetensors) or the one
    model.safetensors, config.json (the config with the quantization_config of the quantized
    tensors added, unless quantization_config is given: it must list exactly those) and the
    tokenizer, then renames the directory into place. Used as a context manager, an exception
    leaves nothing behind; abort() does the same by hand.
    """

    def __init__(self, out_dir, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False):
        if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
        self.out_dir = os.fspath(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._dir = DirectoryReplacement(self.out_dir, overwrite=overwrite)
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_schemes: dict[str, dict] = {}  # module -> what the shard records of it (SHARD_RECORD)
        self._shard_bytes = 0
        self._storages: set = set()
        self._written: list[tuple[str, list[str]]] = []  # (temporary file name, keys) per written shard
        self._names: set[str] = set()   # stored keys
        self._logical: set[str] = set()  # names as added
        self.quantized: dict[str, QuantizedTensor] = {}  # module -> QuantizedTensor (metadata only kept)
        self._quantized_info: dict[str, tuple] = {}
        self.total_bytes = 0
        self.finished = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self.finished:
            self.abort()
        return False

    @property
    def tmp_dir(self) -> str:
        return self._dir.tmp

    def add(self, name: str, value) -> None:
        if self.finished:
            raise RuntimeError("this ShardWriter has finished or was aborted")
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if name in self._logical:
            raise ValueError(f"{name!r} was added already")
        if isinstance(value, QuantizedTensor):
            module = _module_of(name)
            parts = {f"{module}.{QWEIGHT}.{k}": t for k, t in value.state_dict().items()}
            parts[name] = guard_tensor()
            info = (value.scheme, tuple(value.shape), value.dtype)
        elif isinstance(value, torch.Tensor):
            module, parts, info = None, {name: value}, None
        else:
            raise TypeError(f"{name!r}: a ShardWriter stores tensors and QuantizedTensors, got {type(value).__name__}")
        for key, t in parts.items():
            if key in self._names:
                raise ValueError(f"{name!r} would be stored under {key!r}, which another entry already uses")
            if t.layout != torch.strided:
                raise ValueError(f"{key!r} is a {t.layout} tensor; only dense tensors are stored")
            if t.device.type == "meta":
                raise ValueError(f"{key!r} is on the meta device: it holds no data to save")
        nbytes = sum(t.nbytes for t in parts.values())
        if self._shard and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        for key, t in parts.items():
            t = t.detach().cpu().contiguous()
            storage = t.untyped_storage().data_ptr()
            if t.numel() and storage in self._storages:  # safetensors refuses tensors sharing memory
                t = t.clone()
            self._storages.add(t.untyped_storage().data_ptr())
            self._shard[key] = t
            self._names.add(key)
        self._shard_bytes += nbytes
        self.total_bytes += nbytes
        self._logical.add(name)
        if module is not None:
            self._quantized_info[module] = info
            self._shard_schemes[module] = _module_record(*info)

    def _flush(self) -> None:
        if not self._shard:
            return
        tmp_name = f"shard-{len(self._written):05d}.safetensors"
        metadata = {"format": "pt"}
        if self._shard_schemes:
            metadata[SHARD_RECORD] = json.dumps(self._shard_schemes, separators=(",", ":"))
        try:
            write_safetensors(os.path.join(self._dir.tmp, tmp_name), self._shard, metadata=metadata)
        except OSError as e:  # a full disk, a quota
            raise OSError(f"cannot write {self.out_dir}: {e}") from None
        self._written.append((tmp_name, list(self._shard)))
        self._shard, self._shard_bytes, self._storages, self._shard_schemes = {}, 0, set(), {}

    def finish(self, config, tokenizer=None, quantization_config: dict | None = None) -> str:
        """Write everything left and rename the directory into place; returns its path."""
        if self.finished:
            raise RuntimeError("this ShardWriter has finished or was aborted")
        try:
            cfg = _config_dict(config)
            qc = self._quantization_config(quantization_config)
            if qc is not None:
                cfg["quantization_config"] = qc
            if not self._written and not self._shard:
                raise ValueError("no tensors were added: a model directory needs its weights")
            self._flush()
            tmp = self._dir.tmp
            n = len(self._written)
            if n == 1:
                os.rename(os.path.join(tmp, self._written[0][0]), os.path.join(tmp, SINGLE_NAME))
            else:
                weight_map = {}
                for i, (tmp_name, keys) in enumerate(self._written, 1):
                    final = f"model-{i:05d}-of-{n:05d}.safetensors"
                    os.rename(os.path.join(tmp, tmp_name), os.path.join(tmp, final))
                    weight_map.update(dict.fromkeys(keys, final))
                index = {"metadata": {"total_size": self.total_bytes},
                         "weight_map": dict(sorted(weight_map.items()))}
                _write_json(os.path.join(tmp, INDEX_NAME), index)
            _write_json(os.path.join(tmp, CONFIG_NAME), cfg)
            if tokenizer is not None:
                _write_tokenizer(tokenizer, tmp)
            self._dir.commit()
        except BaseException:
            self.abort()
            raise
        self.finished = True
        return self.out_dir

    def _quantization_config(self, given: dict | None) -> dict | None:
        derived = None
        if self._quantized_info:
            derived = quantization_config({m: _Info(*i) for m, i in self._quantized_info.items()})
        if given is None:
            return derived
        if not self._quantized_info and isinstance(given, dict) and given.get("quant_method") != QUANT_METHOD:
            return given  # another format's (fewbits.files.compressed_tensors): its entries were added as tensors
        parsed = parse_quantization_config("quantization_config", given)
        want = dict(self._quantized_info)
        if {m: (s, tuple(sh), dt) for m, (s, sh, dt) in parsed.items()} != want:
            raise ValueError("the quantization_config given does not describe the QuantizedTensors added "
                             f"(it lists {_listing(sorted(parsed))}; added: {_listing(sorted(want))})")
        return given

    def abort(self) -> None:
        """Remove everything written so far."""
        self.finished = True
        self._shard = {}
        self._dir.abort()


class _Info:
    """What quantization_config() reads of a QuantizedTensor, without its tensors."""

    def __init__(self, scheme, shape, dtype):
        self.scheme, self.shape, self.dtype = scheme, shape, dtype


def _config_dict(config) -> dict:
    if isinstance(config, Mapping):
        cfg = json.loads(json.dumps(dict(config)))  # a JSON copy: refuses what JSON cannot hold
    elif hasattr(config, "to_dict"):
        cfg = config.to_dict()
    else:
        raise TypeError(f"config must be a dict or a transformers PretrainedConfig, got {type(config).__name__}")
    cfg.pop("quantization_config", None)
    return cfg


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_tokenizer(tokenizer, directory: str) -> None:
    """A tokenizer object's own files (save_pretrained), or the tokenizer files of a directory."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    src = os.fspath(tokenizer)
    if not os.path.isdir(src):
        raise ValueError(f"tokenizer must be a tokenizer object or a directory holding its files, got {src!r}")
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if not found:
        raise ValueError(f"{src} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    for name in found:
        shutil.copyfile(os.path.join(src, name), os.path.join(directory, name))


def model_class(architectures):
    """The transformers class that builds a model of config.json's `architectures`: the first
    one transformers has (LlamaForCausalLM, BertModel, ...), else AutoModelForCausalLM when a
    name ends in ForCausalLM, else AutoModel. A name transformers has that is not a model class
    (AutoTokenizer, ...) is a ValueError."""
    import transformers

    names = [a for a in (architectures or []) if isinstance(a, str)]
    for name in names:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
        if cls is not None:  # AutoTokenizer, a function, ...: not something that builds a model
            raise ValueError(f"architectures names {name!r}, which is not a transformers model class")
    causal = any(a.endswith("ForCausalLM") for a in names)
    return transformers.AutoModelForCausalLM if causal else transformers.AutoModel


def model_tensors(model: nn.Module) -> dict:
    """The tensor mapping of a model: {state-dict name: tensor} with each quantized module `m`
    as one entry "m.weight" -> its QuantizedTensor (and its bias as "m.bias"). Tied weights the
    model declares (transformers' all_tied_weights_keys, e.g. lm_head.weight) are left out, as
    transformers' save_pretrained leaves them out: loading ties them again."""
    quantized = {name: m for name, m in model.named_modules() if is_quantized(m)}
    if "" in quantized:
        raise ValueError("the model itself is a quantized module: it has no module names to store")
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    out: dict = {}
    done = set()
    for key, value in model.state_dict().items():
        owner = _owner(key, quantized)
        if owner is not None:
            if owner not in done:
                qt = quantized[owner].qweight
                out[f"{owner}.weight"] = qt.plain() if hasattr(qt, "plain") else qt
                done.add(owner)
            if key == f"{owner}.bias":
                out[key] = value
            continue
        if key in tied:
            continue
        out[key] = value
    return out


def _owner(key: str, names) -> str | None:
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in names:
            return prefix
    return None


def save_pretrained(model: nn.Module, out_dir, tokenizer=None, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    overwrite: bool = False) -> str:
    """Write a quantized transformers model (fb.quantize_model's result, in memory) as a Hugging
    Face directory that fb.from_pretrained and transformers' from_pretrained load: its config
    with the quantization_config, the safetensors shards, the generation config where the model
    has one, and the tokenizer (an object, or a directory to copy its files from)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError("save_pretrained() takes a transformers model (one with a .config); for another "
                        "module use fb.save, or a ShardWriter with a config of your own")
    tensors = model_tensors(model)
    with ShardWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        for name, value in tensors.items():
            writer.add(name, value)
        del tensors
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)()
        if generation is not None and can_generate and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(writer.tmp_dir)
        cfg = _config_dict(config)
        cfg["architectures"] = [type(model).__name__]  # as transformers' save_pretrained records it
        return writer.finish(cfg, tokenizer)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _read_json(path: str, what: str):
    try:
        size = os.path.getsize(path)
        if size > _MAX_JSON_BYTES:
            raise FileFormatError(path, f"{what} is {size} bytes, more than the {_MAX_JSON_BYTES} a {what} may be")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileFormatError(path, f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise FileFormatError(path, f"{what} is nested too deeply") from None


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def check_layer_count(config_path: str, config: dict | None, names) -> None:
    """config.json's layer count must not exceed the layers the tensors hold in any one stack
    (checked before a model of that many layers is built: 20000 layers stated for a 2-layer model
    would take minutes and gigabytes on the meta device alone); a FileFormatError naming
    config.json. Weights a model of the stated count lacks are caught when it loads
    (hf_quantizer.from_pretrained refuses missing keys)."""
    if not config:
        return
    for key in _LAYER_KEYS:
        if key in config:
            stated = config[key]
            break
    else:
        return
    if isinstance(stated, bool) or not isinstance(stated, int) or stated < 1:
        raise FileFormatError(config_path, f"{key} must be a positive integer, got {stated!r}")
    stacks: dict[str, set[int]] = {}  # "model.layers." -> the indices found under it
    for n in names:
        m = _LAYER_INDEX.search(n)
        if m is not None:
            stacks.setdefault(n[:m.start(1)], set()).add(int(m.group(1)))
    if not stacks:
        return
    # more layers than any stack holds (the hang); fewer is left to the loader's own checks: a
    # vision tower of more blocks (Qwen2-VL) or a multi-token-prediction layer (DeepSeek-V3)
    # beside the decoder's stack is no contradiction
    prefix, present = max(stacks.items(), key=lambda kv: len(kv[1]))
    if stated > len(present):
        raise FileFormatError(config_path, f"{key} is {stated}, but the weights hold {len(present)} layer(s) "
                              f"({prefix}{min(present)}..{max(present)})")


_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "vocab_size", "max_position_embeddings", "num_hidden_layers", "type_vocab_size")
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache", "output_hidden_states",
          "output_attentions", "return_dict", "is_decoder", "is_encoder_decoder")
_FLOAT_DTYPES_NAMED = ("float32", "float16", "bfloat16", "float64", "auto")


def check_config_values(config_path: str, config: dict | None) -> None:
    """The config.json values that size or scale the model, checked before transformers reads
    them (which lets a NaN rms_norm_eps or a rope_theta of 0 through to NaN logits, and turns a
    head count of 0 into a ZeroDivisionError): sizes positive integers below 2^31 (a context
    length below 2^63), the head
    counts dividing as attention needs, epsilons, rope theta and scaling factors finite and > 0,
    flags booleans, dtype a float dtype, hidden_act an activation transformers has. A
    FileFormatError naming config.json; keys that are absent (or null where transformers
    allows it) are left to transformers' defaults."""
    if not config:
        return

    def fail(problem):
        raise FileFormatError(config_path, problem)

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for key in _SIZES:
        v = config.get(key)
        if v is None:
            continue
        top = 63 if key == "max_position_embeddings" else 31  # a context limit allocates nothing itself
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v < 2 ** top:
            fail(f"{key} must be an integer from 1 to 2^{top} - 1, got {v!r}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    hidden = config.get("hidden_size")
    if heads is not None and hidden is not None and config.get("head_dim") is None and hidden % heads:
        fail(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)")
    ropes = [config] + [config[k] for k in ("rope_parameters", "rope_scaling") if isinstance(config.get(k), dict)]
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            fail(f"{key} must be an object, got {config[key]!r}")
    for where in ropes:
        for key in _POSITIVE_FLOATS + ("factor",):
            if where is config and key == "factor":
                continue
            v = where.get(key)
            if v is None:
                continue
            if not number(v) or not math.isfinite(v) or v <= 0:
                fail(f"{key} must be a finite number > 0, got {v!r}")
        if where is not config and where.get("rope_type", where.get("type")) == "linear" and "factor" not in where:
            fail("linear rope scaling needs its factor")
    for key in _FLAGS:
        v = config.get(key)
        if v is not None and not isinstance(v, bool):
            fail(f"{key} must be true or false, got {v!r}")
    if config.get("return_dict") is False:
        fail("return_dict false: a model that returns tuples cannot be run by fewbits (or transformers' "
             "generation); remove the key")
    for key in ("dtype", "torch_dtype"):
        v = config.get(key)
        if v is not None and v not in _FLOAT_DTYPES_NAMED:
            fail(f"{key} must be one of {', '.join(_FLOAT_DTYPES_NAMED)}, got {v!r}")
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        fail(f"architectures must be a list of class names, got {archs!r}")
    act = config.get("hidden_act")
    if act is not None:
        from transformers.activations import ACT2FN
        if not isinstance(act, str) or act not in ACT2FN:
            fail(f"hidden_act {act!r} is not an activation transformers has")


class HFTensors(Mapping):
    """read_tensors' lazy mapping (see read_tensors). `.config` is config.json's content (or
    None), `.quantized` {module: (scheme, shape, dtype)}, `.files` the shard paths. foreign:
    another format's quantized directory (its quantization_config not read here: every tensor
    is a plain one, whatever its dtype; fewbits.files.standard_dir reads them)."""

    def __init__(self, directory, foreign: bool = False):
        self.directory = d = os.fspath(directory)
        if not os.path.isdir(d):
            if os.path.exists(d):
                raise FileFormatError(d, "not a directory (a Hugging Face model is a directory)")
            raise FileNotFoundError(f"no such directory: {d}")
        config_path = os.path.join(d, CONFIG_NAME)
        self.config = _read_json(config_path, "config.json") if os.path.isfile(config_path) else None
        if self.config is not None and not isinstance(self.config, dict):
            raise FileFormatError(config_path, "config.json must hold a JSON object")
        check_config_values(config_path, self.config)
        qc = (self.config or {}).get("quantization_config")
        self.foreign = foreign
        self.quantized = parse_quantization_config(config_path, qc) if qc is not None and not foreign else {}
        self._handles: dict[str, object] = {}
        self._records: dict[str, dict] = {}  # shard -> its SHARD_RECORD
        self.files, where = self._shards()
        self._float: dict[str, str] = {}     # name -> shard path
        self._qt: dict[str, str] = {}        # "m.weight" -> module m
        self._order: list[str] = []
        self._check(where)
        check_layer_count(config_path, self.config, self._order)

    # --- the shards -----------------------------------------------------------------------------
    def _shards(self) -> tuple[list[str], dict[str, str]]:
        d = self.directory
        index_path, single = os.path.join(d, INDEX_NAME), os.path.join(d, SINGLE_NAME)
        has_index, has_single = os.path.isfile(index_path), os.path.isfile(single)
        if not has_index and not has_single:
            other = sorted(n for n in os.listdir(d) if n.endswith((".bin", ".pt", ".pth", ".gguf", ".safetensors")))
            raise FileFormatError(d, f"no model weights: neither {SINGLE_NAME} nor {INDEX_NAME}"
                                  + (f" (found {_listing(other)}; fewbits reads safetensors directories)" if other else ""))
        if has_index and has_single:
            raise FileFormatError(d, f"both {SINGLE_NAME} and {INDEX_NAME}: which one holds the model is ambiguous; "
                                  "remove one")
        if has_single:
            return [single], self._header_keys([single])
        index = _read_json(index_path, "index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise FileFormatError(index_path, "the index must be a JSON object with a 'weight_map' object of "
                                  "tensor name -> shard file name")
        if not weight_map:
            raise FileFormatError(index_path, "the index lists no tensors: no model weights")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if os.path.basename(n) != n or n in (".", "..") or not n.endswith(".safetensors")]
        if bad:
            raise FileFormatError(index_path, f"shard names must be .safetensors file names in the same directory, "
                                  f"got {_listing(bad)}")
        missing = [n for n in names if not os.path.isfile(os.path.join(d, n))]
        if missing:
            raise FileFormatError(index_path, f"the index names shards that are not there: {_listing(missing)}")
        unlisted = sorted(n for n in os.listdir(d) if n.startswith("model") and n.endswith(".safetensors")
                          and n not in names)
        if unlisted:
            raise FileFormatError(index_path, f"shards not in the index: {_listing(unlisted)} (a leftover of another "
                                  "model? remove them or rebuild the index)")
        paths = [os.path.join(d, n) for n in names]
        where = self._header_keys(paths)
        for key, shard in weight_map.items():
            path = os.path.join(d, shard)
            if where.get(key) != path:
                raise FileFormatError(path, f"tensor {key!r} is listed in the index for this shard but is not in it"
                                      + (f" (it is in {os.path.basename(where[key])})" if key in where else ""))
        extra = sorted(set(where) - set(weight_map))
        if extra:
            raise FileFormatError(where[extra[0]], f"tensors not listed in the index: {_listing(extra)}")
        return paths, where

    def _header_keys(self, paths: list[str]) -> dict[str, str]:
        where: dict[str, str] = {}
        for path in paths:
            for key in self._handle(path).keys():
                if key in where:
                    raise FileFormatError(path, f"tensor {key!r} is also in {os.path.basename(where[key])}: "
                                          "duplicate names across shards")
                where[key] = path
        return where

    def _check_record(self, module: str, scheme: QuantScheme, shape, dtype, shard: str) -> None:
        """config.json's entry of `module` against what its shard recorded when written (SHARD_RECORD)."""
        records = self._records.get(shard)
        if records is None:
            raw = (self._handle(shard).metadata() or {}).get(SHARD_RECORD)
            try:
                records = json.loads(raw) if raw is not None else {}
            except ValueError:
                records = None
            if not isinstance(records, dict):
                raise FileFormatError(shard, f"its {SHARD_RECORD} metadata is not a JSON object")
            self._records[shard] = records
        record = records.get(module)
        if record is None:
            return
        try:
            same = (isinstance(record, dict) and QuantScheme.from_dict(record.get("scheme")) == scheme
                    and record.get("shape") == list(shape) and record.get("dtype") == _dtype_name(dtype))
        except (TypeError, ValueError, ArithmeticError, AttributeError):
            same = False
        if not same:
            config_path = os.path.join(self.directory, CONFIG_NAME)
            raise FileFormatError(config_path, f"quantization_config states module {module!r} as {scheme.label} "
                                  f"{list(shape)} {_dtype_name(dtype)}, but {os.path.basename(shard)} was written with "
                                  f"{_short(record)}: config.json was changed after the model was written")

    def _handle(self, path: str):
        from safetensors import SafetensorError, safe_open
        h = self._handles.get(path)
        if h is None:
            try:
                h = safe_open(path, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise FileFormatError(path, f"not a readable safetensors file (truncated or corrupted?): {e}") from None
            self._handles[path] = h
        return h

    def _header(self, path: str, key: str) -> tuple[tuple[int, ...], str]:
        sl = self._handle(path).get_slice(key)
        return tuple(sl.get_shape()), sl.get_dtype()

    # --- checks from the headers ------------------------------------------------------------------
    def _check(self, where: dict[str, str]) -> None:
        found: dict[str, dict[str, str]] = {m: {} for m in self.quantized}
        for key, path in where.items():
            module, dot, leaf = key.rpartition(f".{QWEIGHT}.")
            if dot and not self.foreign:
                if module not in self.quantized:
                    raise FileFormatError(path, f"{key!r} is a quantized entry of module {module!r}, which the "
                                          "quantization_config does not list" if self.quantized else
                                          f"{key!r} is a quantized entry, but config.json has no fewbits "
                                          "quantization_config")
                found[module][leaf] = path
            else:
                self._float[key] = path
        self._qparts = found
        for module, (scheme, shape, dtype) in self.quantized.items():
            parts = found[module]
            want = state_shapes(scheme, shape)
            first = next(iter(parts.values()), self.files[0])
            missing = sorted(set(want) - set(parts))
            extra = sorted(set(parts) - set(want))
            if missing or extra:
                raise FileFormatError(first, f"quantized weight {module!r} ({scheme.label}): "
                                      + (f"missing {', '.join(f'{module}.{QWEIGHT}.{k}' for k in missing)}" if missing else "")
                                      + ("; " if missing and extra else "")
                                      + (f"unexpected {', '.join(extra)}" if extra else ""))
            for k, (sh, dt) in want.items():
                got_shape, got_dtype = self._header(parts[k], f"{module}.{QWEIGHT}.{k}")
                if got_shape != tuple(sh) or _ST_DTYPES.get(got_dtype) != dt:
                    raise FileFormatError(parts[k], f"{module}.{QWEIGHT}.{k}: {got_dtype} {list(got_shape)} stored, "
                                          f"{scheme.label} of shape {list(shape)} needs {_dtype_name(dt)} {list(sh)}")
            self._check_record(module, scheme, shape, dtype, parts["codes"] if "codes" in parts else first)
            name = f"{module}.weight"
            if name in self._float:
                if not _is_guard(*self._header(self._float[name], name)):
                    raise FileFormatError(self._float[name], f"{name!r} is stored both as a float tensor and quantized")
                del self._float[name]  # the guard (GUARD_DTYPE): part of the quantized module
            self._qt[name] = module
        seen = set()
        for key in where:  # the names in stored order, each quantized weight once
            module, dot, _ = key.rpartition(f".{QWEIGHT}.")
            name = f"{module}.weight" if dot and not self.foreign else key
            if name not in seen:
                seen.add(name)
                self._order.append(name)

    # --- the mapping ------------------------------------------------------------------------------
    def _read(self, path: str, key: str) -> torch.Tensor:
        """One tensor's data, through a handle of its own that is closed at once: pages a
        memory map has touched count in the process's resident memory for as long as it stays
        open, so a kept handle would make streaming a whole model hold all of it."""
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(path, framework="pt", device="cpu") as h:
                return h.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise FileFormatError(path, f"not a readable safetensors file (truncated or corrupted?): {e}") from None

    def __getitem__(self, name: str):
        if name in self._float:
            path = self._float[name]
            return self._read(path, name)
        module = self._qt.get(name)
        if module is None:
            raise KeyError(name)
        scheme, shape, dtype = self.quantized[module]
        tensors = {}
        for k in expected_keys(scheme):
            key = f"{module}.{QWEIGHT}.{k}"
            tensors[k] = self._read(self._where_q(module, k), key)
        path = self._where_q(module, "codes")
        try:
            qt = QuantizedTensor.from_state_dict(scheme, shape, dtype, tensors)
        except (TypeError, ValueError) as e:
            raise FileFormatError(path, f"quantized weight {module!r}: {e}") from None
        problem = stored_problem(qt)
        if problem:
            raise FileFormatError(path, f"quantized weight {module!r}: {problem}")
        return qt

    def _where_q(self, module: str, key: str) -> str:
        return self._qparts[module][key]

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype | None, str]:
        """(shape, dtype, file) of an entry, from the headers and the quantization_config (no
        data read): a quantized weight's original shape and dtype; dtype None for a safetensors
        dtype torch has no name for here."""
        if name in self._float:
            path = self._float[name]
            shape, dtype = self._header(path, name)
            return shape, _ST_DTYPES.get(dtype), path
        module = self._qt.get(name)
        if module is None:
            raise KeyError(name)
        _, shape, dtype = self.quantized[module]
        return tuple(shape), dtype, self._where_q(module, "codes")

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def stored_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.files)

    def close(self) -> None:
        self._handles.clear()


def empty_quantized_modules(model: nn.Module, plan: dict, where="quantization_config") -> nn.Module:
    """Replace each module of `plan` ({name: (scheme, shape, dtype)}, parse_quantization_config's
    result) by an empty QuantLinear / QuantEmbedding on the meta device, for load_state_dict or
    transformers' loader to fill. Everything is checked first (the module exists, is an
    nn.Linear or nn.Embedding with that weight shape, its weight is not tied to another one):
    a FileFormatError naming `where` lists every problem, and the model is left as it was."""
    tied = set()
    for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied.update((k, v))
    problems, new = [], {}
    for name, (scheme, shape, dtype) in plan.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            problems.append(f"the model has no module {name!r}")
            continue
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            problems.append(f"{name!r} is a {type(module).__name__}, not an nn.Linear or nn.Embedding")
            continue
        if tuple(module.weight.shape) != tuple(shape):
            problems.append(f"{name!r}: weight shape {list(module.weight.shape)} in the model, {list(shape)} quantized")
            continue
        if f"{name}.weight" in tied:
            problems.append(f"{name!r}: its weight is tied to another one in this model, which a quantized "
                            "layer cannot share")
            continue
        if isinstance(module, nn.Linear):
            bias = module.bias
            new[name] = QuantLinear.empty(scheme, shape, dtype, bias=bias is not None,
                                          bias_dtype=bias.dtype if bias is not None else None)
        else:
            if module.max_norm is not None:
                problems.append(f"{name!r}: an embedding with max_norm cannot be quantized")
                continue
            new[name] = QuantEmbedding.empty(scheme, shape, dtype, module.padding_idx, scale=embedding_scale(module))
    if problems:
        raise FileFormatError(where, f"does not match the model ({len(problems)} problem"
                              f"{'s' if len(problems) > 1 else ''}): {'; '.join(problems[:8])}")
    for name, m in new.items():
        set_submodule(model, name, m)
    return model


def mismatches(model: nn.Module, tensors: HFTensors, names: Mapping[str, str] | None = None) -> list[str]:
    """What the stored tensors would not fit in `model` (on the meta device or not), from the
    headers only: for each {model state-dict name: stored name} of `names` (default: every name
    both hold), a shape other than the model's, or a floating-point tensor of the model stored
    as integers. One line per problem, naming the file."""
    state = model.state_dict(keep_vars=True)
    if names is None:
        names = {n: n for n in state if n in tensors}
    problems = []
    for name, key in names.items():
        want = state[name]
        shape, dtype, path = tensors.info(key)
        where = os.path.basename(path)
        if tuple(shape) != tuple(want.shape):
            problems.append(f"{key} ({where}): shape {list(shape)} stored, the model's config.json gives "
                            f"{list(want.shape)}")
        elif want.is_floating_point() and not (dtype is not None and dtype.is_floating_point):
            problems.append(f"{key} ({where}): {_dtype_name(dtype) if dtype is not None else 'an unknown dtype'} "
                            "stored for a floating-point tensor")
    return problems


def check_fits(model: nn.Module, tensors: HFTensors, names: Mapping[str, str] | None = None) -> None:
    """mismatches() as one FileFormatError naming the directory (nothing when all fit)."""
    problems = mismatches(model, tensors, names)
    if problems:
        raise FileFormatError(tensors.directory, f"the weights do not fit the model of config.json "
                              f"({len(problems)} problem{'s' if len(problems) > 1 else ''}): "
                              + "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))


def read_tensors(directory, foreign: bool = False) -> HFTensors:
    """A lazy Mapping over a Hugging Face directory's tensors (see the module docstring): float
    tensors under their names, fewbits-quantized weights as QuantizedTensors under "m.weight".
    FileFormatError (naming the file) for a directory without weights, an index naming missing
    shards or tensors not in them, duplicate names across shards, shards not in the index, a bad
    quantization_config, quantized entries missing, extra or of the wrong shape or dtype; codes
    outside their format when the value is read. foreign: see HFTensors."""
    return HFTensors(directory, foreign=foreign)


__all__ = ["ShardWriter", "read_tensors", "save_pretrained"]
