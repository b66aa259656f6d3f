"""What the standard quantized directory formats share (compressed-tensors, GPTQ, bitsandbytes): a
Hugging Face directory whose config.json holds the format's `quantization_config` and whose
quantized Linear layers are stored as the format's tensors, holding fewbits' own codes and scales
moved without rounding.

A format is a StandardFormat (the FORMAT of fewbits.files.compressed_tensors, gptq_format and
bnb_format; fewbits.files.standard_formats lists them) that says which schemes it holds exactly
(`scheme_args`, a ValueError naming the presets that fit otherwise), which layer shapes
(`shape_problem`) and plans (`layout_problem`), the tensors of one quantized module
(`module_tensors`) and the config (`quantization_config`). The checks before any work
(`check_module`, `check_plan`, `fits`) and the writer (`write`: every scheme checked before
anything is written; the directory appears only when complete) are the same for all. A format
that `reads` also says how to read a directory back (`read_plan`, `leaf_specs`, `read_module`),
and `to_fewbits` turns one into a fewbits directory with the same codes and scales.
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Mapping

import torch

from ..quant.scheme import QuantScheme, get_scheme
from ..quant.tensor import QuantizedTensor
from .safetensors_format import FileFormatError

# Linear layers that vLLM fuses into one (qkv_proj, gate_up_proj): each group must share one scheme
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def pack_int32(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `bits`-bit values [rows, cols] (int64) packed along each row into int32 words,
    element i at bit i*bits (4 or 8 bits: whole bytes, little-endian words); the last word padded
    with zeros."""
    rows, cols = u.shape
    per = 32 // bits
    pad = (-cols) % per
    u = torch.nn.functional.pad(u.to(torch.uint8), (0, pad))
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    if sys.byteorder != "little":
        raise RuntimeError("packing int32 words assumes a little-endian machine")
    return u.reshape(-1).view(torch.int32).reshape(rows, -1)  # bytes in order: little-endian words


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """pack_int32's inverse: int32 words [rows, n] -> the unsigned values [rows, count] (int16:
    room for the signed values one step away, two bytes a value)."""
    if sys.byteorder != "little":
        raise RuntimeError("unpacking int32 words assumes a little-endian machine")
    b = words.contiguous().view(torch.uint8).reshape(words.shape[0], -1)  # element i at bit i*bits
    if bits == 4:
        b = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)
    return b[:, :count].to(torch.int16)


def fused_conflicts(plan: Mapping, linears) -> list[str]:
    """The fused groups (see _FUSED) whose layers do not all share one scheme (or all stay in
    float): vLLM loads each group as one layer and refuses a checkpoint that mixes them."""
    found = []
    for name in sorted(linears):
        parent, _, leaf = name.rpartition(".")
        for group in _FUSED:
            if leaf == group[0]:
                members = [f"{parent}.{g}" if parent else g for g in group]
                if all(m in linears for m in members):
                    kinds = {get_scheme(plan[m]).label if m in plan else "float" for m in members}
                    if len(kinds) > 1:
                        found.append(f"{', '.join(members)} ({' / '.join(sorted(kinds))})")
    return found


def linears_of(model) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """{name: weight shape} of a model's Linear layers, and the name of its output layer (the one
    a tied model shares with its token embedding), if any."""
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return linears, next((n for n, m in model.named_modules() if head is not None and m is head), None)


def linear_layers(config) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """linears_of the model `config` describes (built on the meta device)."""
    from .streaming import model_skeleton
    return linears_of(model_skeleton(config))


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'AEIOU' else 'a'} {word}"


class StandardFormat:
    """One standard directory format (see the module docstring). Subclasses set `name` (the
    --format value), `fitting_presets` and `budget_candidates`, and define scheme_args,
    module_tensors and quantization_config; shape_problem, layout_problem and default_rules
    when the format constrains shapes or plans further; read_plan, leaf_specs and read_module
    where it `reads`."""

    name: str = ""
    fitting_presets: tuple[str, ...] = ()
    budget_candidates: tuple[str, ...] = ()  # what --budget chooses among, per layer
    keeps_head_in_float = False  # the output layer is never quantized (--tied untie is refused)
    reads = False  # whether to_fewbits reads the format (read_plan, leaf_specs, read_module)

    # -- what a subclass defines ---------------------------------------------------------------
    def scheme_args(self, scheme) -> dict:
        """The format's description of `scheme` (its config entry), or a ValueError saying why
        the format has no exact form of it (ending with fits_hint())."""
        raise NotImplementedError

    def module_tensors(self, module: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The format's entries of quantized Linear `module`, after check_module."""
        raise NotImplementedError

    def quantization_config(self, plan: Mapping[str, QuantScheme], ignore=()) -> dict:
        """config.json's quantization_config for the quantized modules `plan` ({module: scheme});
        `ignore`: the Linear layers left in float."""
        raise NotImplementedError

    def shape_problem(self, s: QuantScheme, shape) -> str | None:
        """Why a [out, in] weight does not fit scheme `s` in this format, or None. By default:
        groups must divide the width (the standards have no partial last group)."""
        in_f = shape[1]
        if s.granularity == "group" and in_f % s.group_size:
            return (f"{in_f} columns are not a whole number of groups of {s.group_size} ({s.label}): "
                    f"{self.name} has no partial last group")
        return None

    # -- reading: a directory in this format (fewbits' or another tool's) as fewbits' own ----------
    def read_plan(self, path: str, qc: dict, linears: Mapping[str, tuple[int, int]], head: str | None,
                  info) -> dict[str, QuantScheme]:
        """{module: scheme} of the quantized Linear layers config.json's quantization_config
        states, `linears` {name: weight shape} being the model's and `head` its output layer;
        info(name) -> (shape, dtype) of a stored tensor, from its header (None if there is none).
        A FileFormatError naming `path` for what this reader does not take."""
        raise FileFormatError(path, f"fewbits does not read {self.name} directories (it writes them)")

    def leaf_specs(self, scheme: QuantScheme, shape) -> dict[str, tuple[tuple[int, ...] | None, tuple]]:
        """{leaf: (shape or None for any, allowed dtypes)} of a quantized module's tensors (the
        names after "<module>."), checked from the headers before anything is read."""
        raise NotImplementedError

    def read_module(self, module: str, entries: dict[str, torch.Tensor], scheme: QuantScheme, shape,
                    dtype: torch.dtype, qc: dict) -> QuantizedTensor:
        """The QuantizedTensor of quantized Linear `module` (weight `shape`) from its entries
        {leaf: tensor} of leaf_specs' shapes and dtypes (qc: the quantization_config); a
        ValueError for what the data holds wrong (codes, zero points, group indices)."""
        raise NotImplementedError

    def to_fewbits(self, directory, out, *, overwrite: bool = False) -> str:
        """Write the directory `directory` in this format as a fewbits Hugging Face directory
        `out` holding the same codes and scales (QuantizedTensors), for fewbits to load and run.
        config.json and every tensor's header are checked before anything is read or written;
        what only the data shows (codes, zero points, group indices, non-finite scales) is found
        layer by layer, and then nothing appears at `out`."""
        from transformers import AutoConfig

        from .hf_dir import CONFIG_NAME, ShardWriter, read_tensors
        from .streaming import model_skeleton

        directory = os.fspath(directory)
        config_path = os.path.join(directory, CONFIG_NAME)
        tensors = read_tensors(directory, foreign=True)
        config = dict(tensors.config or {})
        qc = config.pop("quantization_config", None)
        if not isinstance(qc, dict) or qc.get("quant_method") != self.name:
            raise FileFormatError(config_path, f"not a {self.name} directory (quantization_config's quant_method)")
        try:
            linears, head = linears_of(model_skeleton(AutoConfig.from_pretrained(directory)))
        except Exception as e:  # noqa: BLE001 - what transformers makes of a config it cannot build
            raise FileFormatError(config_path, f"transformers cannot build the model it describes: "
                                  f"{type(e).__name__}: {e}") from None
        plan = self.read_plan(config_path, qc, linears, head,
                              lambda name: tensors.info(name)[:2] if name in tensors else None)
        dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "float32"), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            dtype = torch.float32
        owner = {}
        for module, scheme in plan.items():
            for leaf, (want_shape, want_dtypes) in self.leaf_specs(scheme, linears[module]).items():
                name = f"{module}.{leaf}"
                if name not in tensors:
                    raise FileFormatError(config_path, f"{module!r} is quantized ({self.name}) but {name!r} is not "
                                          "in the directory")
                got_shape, got_dtype, where = tensors.info(name)
                if got_dtype not in want_dtypes or (want_shape is not None and tuple(got_shape) != want_shape):
                    raise FileFormatError(where, f"{name} is {got_dtype} {list(got_shape)}; {scheme.label} of shape "
                                          f"{list(linears[module])} needs " + " or ".join(map(str, want_dtypes))
                                          + (f" {list(want_shape)}" if want_shape is not None else ""))
                owner[name] = module
        for name in tensors:
            if name in owner:
                continue
            got_dtype, where = tensors.info(name)[1:]
            module = name.rsplit(".", 1)[0]
            if not self._float_entry(got_dtype):
                raise FileFormatError(where, f"{name!r} ({got_dtype}) is not a float tensor and no quantized layer of "
                                      f"the {self.name} config holds it")
            if (module in plan and name == f"{module}.weight") or ".qweight." in name:
                raise FileFormatError(where, f"{name!r} is stored beside the {self.name} entries of a quantized "
                                      "layer (two weights for one layer)")
        done = set()
        with ShardWriter(out, overwrite=overwrite) as w:
            for name in tensors:
                module = owner.get(name)
                if module is None:
                    w.add(name, tensors[name])
                elif module not in done:
                    done.add(module)
                    scheme = plan[module]
                    entries = {leaf: tensors[f"{module}.{leaf}"] for leaf in self.leaf_specs(scheme, linears[module])}
                    try:
                        qt = self.read_module(module, entries, scheme, linears[module], dtype, qc)
                    except ValueError as e:
                        raise FileFormatError(tensors.info(name)[2], f"{module}: {e}") from None
                    w.add(f"{module}.weight", qt)
            generation = os.path.join(directory, "generation_config.json")
            if os.path.isfile(generation):
                shutil.copyfile(generation, os.path.join(w.tmp_dir, "generation_config.json"))
            return w.finish(config)

    @staticmethod
    def _float_entry(dtype) -> bool:
        return isinstance(dtype, torch.dtype) and dtype.is_floating_point

    # -- shared ------------------------------------------------------------------------------------
    def fits_hint(self) -> str:
        return f"schemes that fit {self.name}: {', '.join(self.fitting_presets)}"

    def check_module(self, module: str, scheme, shape) -> dict:
        """scheme_args of `module`'s scheme, after checking its weight's shape fits it: a
        ValueError naming the module otherwise."""
        s = get_scheme(scheme)
        args = self.scheme_args(s)
        if len(shape) != 2:
            raise ValueError(f"{module}: {self.name} stores 2-d Linear weights, this one is {list(shape)}")
        why = self.shape_problem(s, shape)
        if why is not None:
            fit = [p for p in self.fitting_presets if self.shape_problem(get_scheme(p), shape) is None]
            raise ValueError(f"{module}: {why}; presets that fit a {shape[0]} x {shape[1]} weight: "
                             f"{', '.join(fit) or 'none'}")
        return args

    def fits(self, scheme, shapes=()) -> bool:
        """Whether the format holds `scheme` exactly on weights of these [out, in] shapes (an int
        is an input width alone)."""
        try:
            s = get_scheme(scheme)
            self.scheme_args(s)
        except ValueError:
            return False
        return all(self.shape_problem(s, (8, w) if isinstance(w, int) else tuple(w)) is None for w in shapes)

    def layout_problem(self, plan: Mapping, linears, head: str | None) -> str | None:
        """Why the format cannot hold this plan ({module: scheme}) of a model whose Linear layers
        are `linears` and output layer `head` as a whole, or None (any plan, by default)."""
        return None

    def default_rules(self, scheme, config):
        """The rules a scheme given alone stands for in this format, for the model `config`
        (a transformers config) describes (by default: itself, for every Linear layer)."""
        return scheme

    def _named(self, module: str, e: ValueError) -> ValueError:
        return ValueError(f"--format {self.name}: {e}" + ("" if module in str(e) else f" (layer {module!r})"))

    def check_plan(self, plan: Mapping, model) -> None:
        """Every planned module of `model` (a skeleton is enough) is a Linear whose scheme and
        shape fit the format; otherwise a ValueError naming the first that does not, before any
        work."""
        from torch import nn

        linears, head = linears_of(model)
        why = self.layout_problem(plan, linears, head)
        if why is not None:
            raise ValueError(f"--format {self.name}: {why}")
        for module, scheme in plan.items():
            m = model.get_submodule(module)
            try:
                if not isinstance(m, nn.Linear):
                    raise ValueError(f"{self.name} quantizes Linear layers; {module!r} is {_a(type(m).__name__)} "
                                     "(leave the embeddings in float: no --embeddings)")
                self.check_module(module, scheme, tuple(m.weight.shape))
            except ValueError as e:
                raise self._named(module, e) from None

    def write(self, out, tensors, *, tokenizer=None, overwrite: bool = False,
              max_shard_bytes: int | None = None) -> str:
        """Write the fewbits directory's tensors `tensors` (hf_dir.read_tensors of it: a lazy
        mapping with `.config`, `.quantized`, `.directory`) as a directory of this format at `out`.
        Every scheme is checked before anything is written; the directory appears only when
        complete."""
        from transformers import AutoConfig

        from .hf_dir import DEFAULT_MAX_SHARD_BYTES, ShardWriter, _module_of

        plan = {m: scheme for m, (scheme, _, _) in tensors.quantized.items()}
        for module, (scheme, shape, _) in tensors.quantized.items():
            try:
                self.check_module(module, scheme, shape)
            except ValueError as e:
                raise self._named(module, e) from None
        linears, head = linear_layers(AutoConfig.from_pretrained(tensors.directory))
        not_linear = sorted(set(plan) - set(linears))
        if not_linear:
            raise ValueError(f"--format {self.name} quantizes Linear layers; {not_linear[0]!r} is not one "
                             "(leave the embeddings in float: no --embeddings)")
        why = self.layout_problem(plan, linears, head)
        if why is not None:
            raise ValueError(f"--format {self.name}: {why}")
        conflicts = fused_conflicts(plan, linears)
        if conflicts:
            warnings.warn(f"{len(conflicts)} group(s) of layers that vLLM fuses into one do not share a scheme, so "
                          f"vLLM will refuse this checkpoint (transformers loads it): {conflicts[0]}"
                          + (f" and {len(conflicts) - 1} more" if len(conflicts) > 1 else ""), stacklevel=2)
        qc = self.quantization_config(plan, ignore=set(linears) - set(plan))
        with ShardWriter(out, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, overwrite=overwrite) as w:
            for name in tensors:
                value = tensors[name]
                if isinstance(value, QuantizedTensor):
                    for key, t in self.module_tensors(_module_of(name), value).items():
                        w.add(key, t)
                else:
                    w.add(name, value)
            generation = os.path.join(tensors.directory, "generation_config.json")
            if os.path.isfile(generation):
                shutil.copyfile(generation, os.path.join(w.tmp_dir, "generation_config.json"))
            cfg = dict(tensors.config or {})
            cfg.pop("quantization_config", None)
            if head in plan and cfg.get("tie_word_embeddings"):
                # the output layer quantized on its own (untied): a tied config would make the engines
                # look for its weight in the float embedding
                cfg["tie_word_embeddings"] = False
            return w.finish(cfg, tokenizer, quantization_config=qc)


__all__ = ["StandardFormat"]
