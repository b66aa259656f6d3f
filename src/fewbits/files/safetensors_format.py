"""Saving and loading quantized tensors and models: one safetensors file with JSON metadata.

File layout (format "fewbits", version 1). The safetensors header's `__metadata__` holds:
- "format": "fewbits", "version": "1", "content": "model" | "tensor" | "tensors",
  "fewbits_version": the writer's package version (informative);
- "quantized": JSON {name: {"scheme": QuantScheme.to_dict(), "shape": [...], "dtype": "float32",
  "module": "linear" | "embedding" | null}}; the tensors of entry `name` are stored under
  `<name>.<key>` for each key of QuantizedTensor.state_dict() (codes, scales, zero_points, ...);
- "entries" (content "tensors"): JSON list of the saved names in order (quantized or plain);
- "aliases" (content "model"): JSON {state-dict key: key it is stored under} for tied tensors;
- "checksum": "sha256:<hex>" over the rest of the metadata and every tensor's name, dtype,
  shape and bytes. safetensors checks the header's structure; the checksum catches a flipped
  bit anywhere else (a scheme field, a code byte) that would otherwise load as a wrong model.

A model file holds every tensor of the model's state_dict() as it is, except that each quantized
module (one with a `.qweight` QuantizedTensor) is stored as its qweight's tensors plus its
`<module>.bias`. Loading needs a float skeleton of the same architecture: the listed layers are
replaced by quantized modules and every other tensor is copied in. Loading checks everything
before it changes the model, so a bad file leaves the model as it was: the checksum, the type of
every metadata field (a strict schema: a crafted file raises FileFormatError, never a
RecursionError or TypeError), and every element code against its format.

Writes go to a file in a temporary directory beside the target, ".<target name>.fewbits-tmp-<8
characters>", that replaces the target only once it is complete and synced; the directory is
removed whether the write succeeds or fails. A save killed outright leaves it behind; the next
save of the same target removes it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping

import torch
from torch import nn

from .._version import __version__
from ..atomic import replacing
from ..formats import FLOAT_DTYPES
from ..quant.plan import is_quantized, quantized_module, set_submodule
from ..quant.modules import QuantEmbedding, embedding_scale
from ..quant.scheme import QuantScheme
from ..quant.tensor import STATE_KEYS, QuantizedTensor, expected_keys, stored_problem

FORMAT_MARKER = "fewbits"
FORMAT_VERSION = 1
CONTENTS = ("model", "tensor", "tensors")
SINGLE_TENSOR_NAME = "tensor"
_MAX_LISTED_PROBLEMS = 8


class FileFormatError(ValueError):
    """A file that cannot be loaded: unreadable as safetensors, not a fewbits file, a version this
    fewbits does not know, corrupted, metadata of the wrong structure or types, codes outside
    their format, or not matching the model it is loaded into."""

    def __init__(self, path, problem: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def save(obj, path) -> None:
    """Save a quantized (or float) model, a QuantizedTensor, or a dict {name: QuantizedTensor or
    tensor} to one safetensors file at `path`, atomically (see the module docstring)."""
    if isinstance(obj, nn.Module):
        content, tensors, meta = "model", *_model_entries(obj)
    elif isinstance(obj, QuantizedTensor):
        content, tensors, meta = "tensor", *_dict_entries({SINGLE_TENSOR_NAME: obj})
    elif isinstance(obj, Mapping):
        content, tensors, meta = "tensors", *_dict_entries(obj)
    else:
        raise TypeError(f"save() takes an nn.Module, a QuantizedTensor or a dict of them, got {type(obj).__name__}")
    metadata = {"format": FORMAT_MARKER, "version": str(FORMAT_VERSION), "content": content,
                "fewbits_version": __version__}
    metadata.update({k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    metadata["checksum"] = _checksum(metadata, tensors)
    _atomic_write(tensors, path, metadata)


def _qt_info(qt: QuantizedTensor, module_kind: str | None) -> dict:
    return {"scheme": qt.scheme.to_dict(), "shape": list(qt.shape), "dtype": _dtype_name(qt.dtype),
            "module": module_kind}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_FLOAT_DTYPES = {_dtype_name(d): d for d in FLOAT_DTYPES}  # the value dtypes, as the metadata names them


def _dict_entries(objs: Mapping) -> tuple[dict, dict]:
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    entries = []
    for name, value in objs.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"names of saved tensors must be non-empty strings, got {name!r}")
        if isinstance(value, QuantizedTensor):
            quantized[name] = _qt_info(value, None)
            for key, t in value.state_dict().items():
                _add(tensors, f"{name}.{key}", t)
        elif isinstance(value, torch.Tensor):
            _add(tensors, name, value)
        else:
            raise TypeError(f"{name!r}: save() stores QuantizedTensors and tensors, got {type(value).__name__}")
        entries.append(name)
    return _unshare(tensors, aliases=False)[0], {"quantized": quantized, "entries": entries}


def _add(tensors: dict, key: str, t: torch.Tensor) -> None:
    if key in tensors:
        raise ValueError(f"two saved tensors would be stored under the same key {key!r}; rename one")
    if t.layout != torch.strided:
        raise ValueError(f"{key!r} is a {t.layout} tensor; save() stores dense tensors")
    tensors[key] = t.detach()


def _module_kind(module: nn.Module) -> str:
    return "embedding" if isinstance(module, (QuantEmbedding, nn.Embedding)) else "linear"


def _model_entries(model: nn.Module) -> tuple[dict, dict]:
    quantized_names = [name for name, m in model.named_modules() if is_quantized(m)]
    if "" in quantized_names:
        raise ValueError("the model itself is a quantized module: save its .qweight (a QuantizedTensor) instead")
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    for name in quantized_names:
        if _owner(name, quantized) is not None:
            continue  # inside a quantized module already saved (its state is rebuilt with it)
        m = model.get_submodule(name)
        quantized[name] = _qt_info(m.qweight, _module_kind(m))
        for key, t in m.qweight.state_dict().items():
            _add(tensors, f"{name}.qweight.{key}", t)
        bias = getattr(m, "bias", None)
        if bias is not None:
            _add(tensors, f"{name}.bias", bias)
    for key, value in model.state_dict(keep_vars=True).items():
        if _owner(key, quantized) is not None:
            continue  # a quantized module's own buffers (derived kernel layouts) are rebuilt on load
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict entry {key!r} is a {type(value).__name__}; save() stores tensors only")
        _add(tensors, key, value)
    tensors, aliases = _unshare(tensors)
    return tensors, {"quantized": quantized, "aliases": aliases}


def _owner(key: str, names) -> str | None:
    """The name in `names` that `key` lies under ("a.b.c" lies under "a.b" and "a"), or None."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix in names:
            return prefix
    return None


def _unshare(tensors: dict, aliases: bool = True) -> tuple[dict, dict]:
    """Tensors ready for safetensors: on the CPU, contiguous, no two sharing memory. With
    `aliases`, a tensor that is exactly another one (tied weights) is stored once and listed as
    an alias; any other sharing is stored as a copy."""
    out: dict[str, torch.Tensor] = {}
    alias_of: dict[str, str] = {}
    seen: dict[tuple, str] = {}          # exact view -> key stored
    storages: set[tuple] = set()
    for key, t in tensors.items():
        if t.device.type == "meta":
            raise ValueError(f"{key!r} is on the meta device: it holds no data to save")
        view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        storage = (t.device, t.untyped_storage().data_ptr())
        if aliases and t.numel() and view in seen:
            alias_of[key] = seen[view]
            continue
        t = t.cpu().contiguous()
        if t.numel() and storage in storages:
            t = t.clone()
        if t.numel():
            seen[view] = key
            storages.add(storage)
            storages.add((t.device, t.untyped_storage().data_ptr()))
        out[key] = t
    return out, alias_of


def _checksum(metadata: dict, tensors: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"\0{key}\0{_dtype_name(t.dtype)}\0{list(t.shape)}\0".encode())
        if t.numel():
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return "sha256:" + h.hexdigest()


def _write_safetensors(tensors: dict, path: str, metadata: dict) -> None:
    """Write the file (a seam: tests replace it with one that fails midway)."""
    from safetensors.torch import save_file
    save_file(tensors, path, metadata=metadata)


def _atomic_write(tensors: dict, path, metadata: dict) -> None:
    with replacing(path) as tmp:
        _write_safetensors(tensors, tmp, metadata)


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def load(path, model: nn.Module | None = None):
    """Load a file written by save().

    A QuantizedTensor file gives the QuantizedTensor, a dict file the dict. A model file needs
    `model`: a freshly constructed float model of the same architecture. Its layers saved as
    quantized are replaced by quantized modules and all its other tensors are loaded; the model
    is returned. Any problem with the file -- unreadable, truncated, corrupted, metadata of the
    wrong shape or type, codes outside their format, not matching the model -- raises
    FileFormatError (a ValueError) naming the file, and leaves the model untouched.
    """
    metadata, tensors = _read(path)
    content = metadata["content"]
    if content == "model":
        if model is None:
            raise ValueError(f"{os.fspath(path)} holds a model: pass model=, a freshly constructed float model "
                             "of the same architecture, to load it into")
        return _load_model(path, _parse_metadata(path, metadata), tensors, model)
    if model is not None:
        raise ValueError(f"{os.fspath(path)} holds quantized tensors, not a model: call load(path) without model=")
    fields = _parse_metadata(path, metadata)
    quantized = {name: qt for name, (qt, _) in _quantized_tensors(path, fields["quantized"], tensors, "{}.").items()}
    if content == "tensor":
        if set(quantized) != {SINGLE_TENSOR_NAME} or tensors:
            raise FileFormatError(path, "a single-tensor file must hold exactly one quantized tensor")
        return quantized[SINGLE_TENSOR_NAME]
    out = {}
    for name in fields["entries"]:
        if name in quantized:
            out[name] = quantized.pop(name)
        elif name in tensors:
            out[name] = tensors.pop(name)
        else:
            raise FileFormatError(path, f"entry {name!r} has no tensors in the file")
    leftover = sorted(set(quantized) | set(tensors))
    if leftover:
        raise FileFormatError(path, f"unexpected tensors not listed in 'entries': {_listing(leftover)}")
    return out


def _read(path) -> tuple[dict, dict]:
    """(metadata, tensors) of a fewbits file, checked for marker, version and checksum."""
    from safetensors import SafetensorError, safe_open
    path_s = os.fspath(path)
    if not os.path.isfile(path_s):
        if os.path.exists(path_s):
            raise FileFormatError(path, "not a regular file")
        raise FileNotFoundError(f"no such file: {path_s}")
    try:
        with safe_open(path_s, framework="pt", device="cpu") as f:
            metadata = f.metadata()
            _check_marker(path, metadata)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise FileFormatError(path, f"not a readable safetensors file (truncated or corrupted?): {e}") from None
    if metadata["checksum"] != _checksum(metadata, tensors):
        raise FileFormatError(path, "checksum mismatch: the file is corrupted")
    return metadata, tensors


def _check_marker(path, metadata) -> None:
    if not metadata or metadata.get("format") != FORMAT_MARKER:
        raise FileFormatError(path, "not a fewbits file (its safetensors metadata has no format='fewbits' marker); "
                              "a plain safetensors file loads with safetensors.torch.load_file")
    version = metadata.get("version", "")
    if not (version.isascii() and version.isdigit()):
        raise FileFormatError(path, f"bad format version {version!r}")
    if int(version) > FORMAT_VERSION:
        raise FileFormatError(path, f"format version {version} is newer than this fewbits reads "
                              f"(up to {FORMAT_VERSION}): upgrade fewbits")
    if int(version) < 1:
        raise FileFormatError(path, f"bad format version {version!r}")
    if metadata.get("content") not in CONTENTS:
        raise FileFormatError(path, f"unknown content {metadata.get('content')!r}")
    if not metadata.get("checksum", "").startswith("sha256:"):
        raise FileFormatError(path, "the checksum is missing")


# ---------------------------------------------------------------------------------------------
# the metadata schema: every JSON field's type is checked before any of it is used
# ---------------------------------------------------------------------------------------------
_JSON_FIELDS = {"model": ("quantized", "aliases"), "tensor": ("quantized",), "tensors": ("quantized", "entries")}
_MAX_DIMS = 64
_MAX_CODEBOOK = 1 << 16  # quantized formats have at most 16 bits


def _is_int(lo: int, hi: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _optional(check):
    return lambda v: v is None or check(v)


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_INT64 = _is_int(-(2 ** 63), 2 ** 63 - 1)
# (required fields, {field: check}) of a custom format's description (QuantScheme's _format_spec);
# bit widths are bounded by what quantization stores, so no field can make a format costly to build
_FORMAT_SPECS = {
    "float": ({"exp_bits", "man_bits"}, {"exp_bits": _is_int(0, 16), "man_bits": _is_int(0, 16),
                                         "bias": _optional(_is_int(-(2 ** 16), 2 ** 16)), "specials": _is_str,
                                         "subnormals": _is_bool, "signed": _is_bool}),
    "int": ({"bits"}, {"bits": _is_int(1, 16), "signed": _is_bool}),
    "lookup": ({"name", "values"}, {"name": _is_str,
                                    "values": lambda v: (isinstance(v, list) and 2 <= len(v) <= _MAX_CODEBOOK
                                                         and all(_is_number(x) for x in v))}),
}
# every field of QuantScheme.to_dict(): a missing one takes the dataclass default
_SCHEME_FIELDS = {
    "format": None,  # checked by _check_format_spec
    "granularity": _is_str, "axis": _INT64, "group_size": _optional(_is_int(1, 2 ** 62)),
    "symmetric": _is_bool, "scale_format": _is_str, "scale_method": _is_str, "percentile": _is_number,
    "mx_scale_mode": _is_str, "mode": _is_str, "seed": _is_int(-(2 ** 63), 2 ** 64 - 1),
    "double_quant": _is_bool, "activations": None,  # None or a scheme without activations of its own
    "zero_point": _is_str, "super_block": _optional(_is_int(1, 2 ** 62)), "sub_scale_format": _optional(_is_str),
    "name": _optional(_is_str),
}


def _json_field(path, metadata: dict, key: str):
    try:
        return json.loads(metadata[key])
    except KeyError:
        raise FileFormatError(path, f"the metadata has no {key!r} entry") from None
    except json.JSONDecodeError as e:
        raise FileFormatError(path, f"the metadata's {key!r} entry is not valid JSON: {e}") from None
    except RecursionError:
        raise FileFormatError(path, f"the metadata's {key!r} entry is nested too deeply") from None


def _parse_metadata(path, metadata: dict) -> dict:
    """The JSON fields of the file's content kind, schema-checked: {"quantized": {name:
    (QuantScheme, shape, dtype, module kind)}, and "aliases" {key: stored key} (models) or
    "entries" [names] (dicts)}. Anything of the wrong shape or type is a FileFormatError."""
    content = metadata["content"]
    raw = {key: _json_field(path, metadata, key) for key in _JSON_FIELDS[content]}
    fields = {}
    if not isinstance(raw["quantized"], dict):
        raise FileFormatError(path, "the metadata's 'quantized' entry must be a JSON object")
    kinds = ("linear", "embedding") if content == "model" else (None,)
    fields["quantized"] = {name: _parse_quantized_info(path, name, info, kinds)
                           for name, info in raw["quantized"].items()}
    if content == "model":
        aliases = raw["aliases"]
        if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
            raise FileFormatError(path, "the metadata's 'aliases' entry must be a JSON object of strings")
        fields["aliases"] = aliases
    if content == "tensors":
        entries = raw["entries"]
        if (not isinstance(entries, list) or not all(isinstance(e, str) for e in entries)
                or len(set(entries)) != len(entries)):
            raise FileFormatError(path, "the metadata's 'entries' entry must be a JSON list of distinct strings")
        fields["entries"] = entries
    return fields


def _parse_quantized_info(path, name: str, info, kinds: tuple) -> tuple:
    where = f"quantized tensor {name!r}"
    if not isinstance(info, dict) or set(info) != {"scheme", "shape", "dtype", "module"}:
        raise FileFormatError(path, f"{where}: malformed description")
    shape, dtype, kind = info["shape"], info["dtype"], info["module"]
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_is_int(0, 2 ** 62)(s) for s in shape)
            and math.prod(shape) < 2 ** 62):
        raise FileFormatError(path, f"{where}: bad shape {_short(shape)}")
    if not isinstance(dtype, str) or dtype not in _FLOAT_DTYPES:
        raise FileFormatError(path, f"{where}: bad dtype {_short(dtype)}")
    if not (kind is None or isinstance(kind, str)) or kind not in kinds:
        raise FileFormatError(path, f"{where}: unknown module kind {_short(kind)} "
                              f"(a {'model' if kinds[0] else 'tensor'} file takes {' or '.join(map(repr, kinds))})")
    problem = _scheme_problem(info["scheme"], allow_activations=True)
    if problem:
        raise FileFormatError(path, f"{where}: bad scheme: {problem}")
    try:
        scheme = QuantScheme.from_dict(info["scheme"])
    except (TypeError, ValueError, ArithmeticError) as e:
        raise FileFormatError(path, f"{where}: bad scheme: {e}") from None
    return scheme, shape, _FLOAT_DTYPES[dtype], kind


def _short(value) -> str:
    """repr(value), cut to a length an error message can carry (values come from the file)."""
    return _clip(repr(value))


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _scheme_problem(d, allow_activations: bool) -> str | None:
    """What is wrong with the types of a scheme description (QuantScheme.to_dict()), or None.
    The values themselves are checked by QuantScheme when it is built."""
    if not isinstance(d, dict):
        return f"a scheme description must be a JSON object, got {_short(d)}"
    unknown = sorted(set(d) - set(_SCHEME_FIELDS))
    if unknown:
        return f"unknown scheme fields: {_clip(', '.join(unknown))}"
    if "format" not in d:
        return "the scheme has no format"
    for key, value in d.items():
        if key == "format":
            problem = _format_problem(value)
            if problem:
                return problem
        elif key == "activations":
            if value is None:
                continue
            if not allow_activations:
                return "an activation scheme has no activations of its own"
            problem = _scheme_problem(value, allow_activations=False)
            if problem:
                return f"activations: {problem}"
        elif not _SCHEME_FIELDS[key](value):
            return f"field {key!r} has a value of the wrong type or range: {_short(value)}"
    return None


def _format_problem(spec) -> str | None:
    if isinstance(spec, str):
        return None  # a registered name: get_format checks it
    if not isinstance(spec, dict) or spec.get("kind") not in _FORMAT_SPECS:
        return f"bad format description {_short(spec)}"
    required, checks = _FORMAT_SPECS[spec["kind"]]
    fields = set(spec) - {"kind"}
    if not required <= fields or not fields <= set(checks):
        return f"bad {spec['kind']} format description {_short(spec)}"
    for key in fields:
        if not checks[key](spec[key]):
            return f"format field {key!r} has a value of the wrong type or range: {_short(spec[key])}"
    return None


def expected_state_keys(scheme: QuantScheme) -> set[str]:
    """The keys of QuantizedTensor.state_dict() for a tensor in this scheme."""
    return set(expected_keys(scheme))


def _quantized_tensors(path, listed: dict, tensors: dict, prefix_fmt: str) -> dict:
    """{name: (QuantizedTensor, module kind)} for the parsed entries `listed` (see
    _parse_metadata), their tensors (stored under prefix_fmt.format(name) + key) popped from
    `tensors`; each one's codes checked against its format."""
    out = {}
    for name, (scheme, shape, dtype, kind) in listed.items():
        where = f"quantized tensor {name!r}"
        prefix = prefix_fmt.format(name)
        want = expected_state_keys(scheme)
        present = {k[len(prefix):] for k in tensors if k.startswith(prefix) and k[len(prefix):] in STATE_KEYS}
        if present != want:
            missing, extra = sorted(want - present), sorted(present - want)
            raise FileFormatError(path, f"{where} in scheme {scheme.label}: "
                                  + (f"missing {', '.join(missing)}" if missing else "")
                                  + ("; " if missing and extra else "")
                                  + (f"unexpected {', '.join(extra)}" if extra else ""))
        try:
            qt = QuantizedTensor.from_state_dict(scheme, shape, dtype, {k: tensors[prefix + k] for k in want})
        except (TypeError, ValueError, IndexError) as e:
            raise FileFormatError(path, f"{where}: {e}") from None
        bad = stored_problem(qt)
        if bad:
            raise FileFormatError(path, f"{where}: {bad}")
        for k in want:
            del tensors[prefix + k]
        out[name] = (qt, kind)
    return out


def _listing(names) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED_PROBLEMS])
    return shown + (f" (and {len(names) - _MAX_LISTED_PROBLEMS} more)" if len(names) > _MAX_LISTED_PROBLEMS else "")


def _load_model(path, fields: dict, tensors: dict, model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    already = [name or "<the model>" for name, m in model.named_modules() if is_quantized(m)]
    if already:
        raise ValueError(f"load() needs a freshly constructed float model; this one already has quantized "
                         f"modules: {_listing(already)}")
    quantized = _quantized_tensors(path, fields["quantized"], tensors, "{}.qweight.")
    aliases = fields["aliases"]
    problems: list[str] = []

    # --- quantized layers: the skeleton must have a float Linear/Embedding of the right shape --------
    new_modules: dict[str, tuple[nn.Module, QuantizedTensor, torch.Tensor | None]] = {}
    for name, (qt, kind) in quantized.items():
        if not name:
            problems.append("a quantized entry has an empty module name")
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            problems.append(f"the model has no module {name!r}")
            continue
        want_type = {"linear": nn.Linear, "embedding": nn.Embedding}[kind]  # _parse_metadata checked it
        if not isinstance(module, want_type):
            problems.append(f"{name!r} is a {type(module).__name__} in the model, an nn.{want_type.__name__} in the file")
            continue
        if tuple(module.weight.shape) != tuple(qt.shape):
            problems.append(f"{name!r}: weight shape {tuple(module.weight.shape)} in the model, "
                            f"{tuple(qt.shape)} in the file")
            continue
        bias = tensors.pop(f"{name}.bias", None)
        model_bias = getattr(module, "bias", None) if kind == "linear" else None
        if (bias is None) != (model_bias is None):
            problems.append(f"{name!r}: " + ("the model has a bias, the file has none" if bias is None
                                             else "the file has a bias, the model has none"))
            continue
        if bias is not None and (tuple(bias.shape) != tuple(model_bias.shape) or not bias.is_floating_point()):
            problems.append(f"{name!r}: bias {bias.dtype} {tuple(bias.shape)} in the file, "
                            f"{model_bias.dtype} {tuple(model_bias.shape)} in the model")
            continue
        new_modules[name] = (module, qt, bias)

    # --- every other tensor: exactly the skeleton's state, same dtype and shape ----------------------
    state = model.state_dict(keep_vars=True)
    float_keys = [k for k in state if _owner(k, quantized) is None]
    sources: dict[str, torch.Tensor] = {}
    for key in float_keys:
        stored = aliases.get(key, key)
        src = tensors.get(stored)
        target = state[key]
        if src is None:
            problems.append(f"missing tensor {key!r}")
        elif not isinstance(target, torch.Tensor):
            problems.append(f"the model's state entry {key!r} is not a tensor")
        elif src.dtype != target.dtype or src.shape != target.shape:
            problems.append(f"{key!r}: {_dtype_name(src.dtype)} {tuple(src.shape)} in the file, "
                            f"{_dtype_name(target.dtype)} {tuple(target.shape)} in the model")
        elif target.is_meta and _slot(model, key) is None:
            problems.append(f"{key!r} is on the meta device and is no parameter or buffer to assign")
        else:
            sources[key] = src
    used = {aliases.get(k, k) for k in float_keys}
    unexpected = sorted(set(tensors) - used) + sorted(set(aliases) - set(float_keys))
    if unexpected:
        problems.append(f"tensors the model does not have: {_listing(unexpected)}")
    if problems:
        raise FileFormatError(path, f"does not match the model ({len(problems)} problem"
                              f"{'s' if len(problems) > 1 else ''}): {'; '.join(problems[:_MAX_LISTED_PROBLEMS])}"
                              + (f"; and {len(problems) - _MAX_LISTED_PROBLEMS} more" if len(problems) > _MAX_LISTED_PROBLEMS else ""))

    # --- build the quantized modules off to the side -------------------------------------------------
    built = {}
    for name, (module, qt, bias) in new_modules.items():
        try:
            built[name] = quantized_module(_shadow(module, bias), _to_device_of(qt, module.weight))
        except (TypeError, ValueError, RuntimeError) as e:
            raise FileFormatError(path, f"cannot build the quantized module {name!r}: {e}") from None

    # --- only now change the model ---------------------------------------------------------------
    for name, new in built.items():
        set_submodule(model, name, new)
    assigned: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, src in sources.items():
            target = state[key]
            if target.is_meta:  # a skeleton built on the meta device: take the loaded tensor itself
                if id(target) not in assigned:
                    assigned[id(target)] = (nn.Parameter(src, requires_grad=target.requires_grad)
                                            if isinstance(target, nn.Parameter) else src)
                _assign(model, key, assigned[id(target)])
            else:
                target.copy_(src)
    return model


def _to_device_of(qt: QuantizedTensor, ref: torch.Tensor) -> QuantizedTensor:
    return qt if ref.is_meta or ref.device == qt.device else qt.to(ref.device)


def _shadow(module: nn.Module, bias: torch.Tensor | None) -> nn.Module:
    """A copy of the skeleton's Linear/Embedding with no weight data (meta) and the loaded bias,
    for quantized_module(): the skeleton's own tensors stay untouched until everything is built."""
    w = module.weight
    if isinstance(module, nn.Embedding):
        shadow = nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                              max_norm=module.max_norm, norm_type=module.norm_type,
                              scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse,
                              device="meta", dtype=w.dtype)
        shadow.scalar_embed_scale = embedding_scale(module)  # Gemma's factor, kept by the quantized one
        return shadow
    shadow = nn.Linear(module.in_features, module.out_features, bias=False, device="meta", dtype=w.dtype)
    if bias is not None:
        device = module.bias.device if not module.bias.is_meta else bias.device
        shadow.bias = nn.Parameter(bias.to(device), requires_grad=module.bias.requires_grad)
    return shadow


def _slot(model: nn.Module, key: str) -> tuple[dict, str] | None:
    """The (_parameters or _buffers dict, name) that state-dict `key` lives in, or None when the
    key was made by a custom state-dict hook."""
    owner_name, _, attr = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_name) if owner_name else model
    except AttributeError:
        return None
    for slots in (owner._parameters, owner._buffers):
        if attr in slots:
            return slots, attr
    return None


def _assign(model: nn.Module, key: str, value: torch.Tensor) -> None:
    slots, attr = _slot(model, key)
    slots[attr] = value
