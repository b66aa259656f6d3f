"""What the standard quantized directory formats share (compressed-tensors, GPTQ): a Hugging Face
directory whose config.json holds the format's `quantization_config` and whose quantized Linear
layers are stored as the format's tensors, holding fewbits' own codes and scales moved without
rounding.

A format is a StandardFormat (fewbits.files.compressed_tensors.FORMAT, fewbits.files.gptq_format
.FORMAT) that says which schemes it holds exactly (`scheme_args`, a ValueError naming the presets
that fit otherwise), which layer shapes (`shape_problem`), the tensors of one quantized module
(`module_tensors`) and the config (`quantization_config`). The checks before any work
(`check_module`, `check_plan`, `fits`) and the writer (`write`: every scheme checked before
anything is written; the directory appears only when complete) are the same for all.
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


def linear_layers(config) -> tuple[set[str], str | None]:
    """The Linear layers of the model `config` describes (built on the meta device), and the name
    of its output layer (the one a tied model shares with its token embedding), if any."""
    from torch import nn

    from .streaming import model_skeleton
    model = model_skeleton(config)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return names, next((n for n, m in model.named_modules() if head is not None and m is head), None)


class StandardFormat:
    """One standard directory format (see the module docstring). Subclasses set `name` (the
    --format value), `fitting_presets` and `budget_candidates`, and define scheme_args,
    module_tensors and quantization_config; shape_problem when the format constrains shapes
    beyond whole groups."""

    name: str = ""
    fitting_presets: tuple[str, ...] = ()
    budget_candidates: tuple[str, ...] = ()  # what --budget chooses among, per layer
    # one scheme for every Linear layer but the output layer, which stays in float (what
    # transformers' loader of the format can read: it quantizes every Linear of the decoder blocks,
    # with one config)
    one_scheme_head_in_float: bool = False

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
        are `linears` and output layer `head` as a whole, or None."""
        if not self.one_scheme_head_in_float:
            return None
        if head is not None and head in plan:
            return (f"the output layer {head!r} is quantized, and transformers' {self.name} loader reads it as a "
                    "float layer (random weights): leave it in float (a first rule {" + repr(head) + ": None}; a scheme "
                    "given alone is applied so)")
        labels = sorted({get_scheme(s).label for s in plan.values()})
        if len(labels) > 1:
            return (f"{self.name} holds one scheme for all layers, this plan has {len(labels)} ({', '.join(labels)}); "
                    "compressed-tensors holds mixed plans")
        floats = sorted(set(linears) - set(plan) - {head})
        if floats:
            return (f"{floats[0]!r}" + (f" and {len(floats) - 1} more Linear layers" if len(floats) > 1 else "")
                    + f" would stay in float, and transformers' {self.name} loader quantizes every Linear layer "
                    "but the output layer (reading a float one as random weights); compressed-tensors lists them "
                    "in `ignore`")
        return None

    def _named(self, module: str, e: ValueError) -> ValueError:
        return ValueError(f"--format {self.name}: {e}" + ("" if module in str(e) else f" (layer {module!r})"))

    def check_plan(self, plan: Mapping, model) -> None:
        """Every planned module of `model` (a skeleton is enough) is a Linear whose scheme and
        shape fit the format; otherwise a ValueError naming the first that does not, before any
        work."""
        from torch import nn

        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        why = self.layout_problem(plan, linears, next((n for n, m in model.named_modules()
                                                       if head is not None and m is head), None))
        if why is not None:
            raise ValueError(f"--format {self.name}: {why}")
        for module, scheme in plan.items():
            m = model.get_submodule(module)
            try:
                if not isinstance(m, nn.Linear):
                    raise ValueError(f"{self.name} quantizes Linear layers; {module!r} is a {type(m).__name__} "
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
        not_linear = sorted(set(plan) - linears)
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
        qc = self.quantization_config(plan, ignore=linears - set(plan))
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
