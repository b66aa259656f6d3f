"""compressed-tensors directories: fewbits' quantized models in the format vLLM, SGLang,
llm-compressor and transformers (through the `compressed-tensors` package) load.

A Hugging Face directory whose config.json holds a `quantization_config` with
`quant_method: "compressed-tensors"`: one config group per fewbits scheme, its `targets` the exact
module names that use it, `ignore` the Linear layers left in float. Per quantized Linear `m`:

- W4A16 / W8A16 integer weights (format "pack-quantized"): `m.weight_packed` (int32: the codes
  offset by 2^(bits-1) to unsigned, packed densely along each row, element i at bit i*bits),
  `m.weight_scale` (float32 [out, groups], or [out, 1] per channel), `m.weight_shape` (int64
  [out, in]) and, asymmetric, `m.weight_zero_point` (the zero points the same way, packed along
  the output dimension: int32 [ceil(out*bits/32), groups]);
- W8A8 int8 (format "int-quantized"): `m.weight` (int8), `m.weight_scale` (float32 [out, 1]);
  activations dynamic per token, symmetric;
- FP8 E4M3 (format "float-quantized"): `m.weight` (float8_e4m3fn), `m.weight_scale` (float32
  [out, 1] per channel, [1] per tensor); activations dynamic per token for w8a8_fp8, none
  otherwise.

The codes and scales are fewbits' own (RTN, GPTQ, per-layer allocation), moved without rounding:
compressed-tensors decompresses `(q - zero_point) * scale` in float32, the same arithmetic as
QuantizedTensor.dequantize, so the weights it gives equal fewbits' dequantized weights bit for bit
(tests/files/test_compressed_tensors.py checks it with transformers and the compressed-tensors
package). A scheme that has no such form (a float minimum, non-uniform codes, GGUF super-blocks,
groups that do not divide the width, activations in blocks) is a ValueError that names the
schemes that fit.
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Mapping

import torch

from ..formats import FloatFormat, IntFormat
from ..quant.scheme import QuantScheme, get_scheme
from ..quant.tensor import QuantizedTensor

QUANT_METHOD = "compressed-tensors"
# the presets that map onto compressed-tensors exactly (any group size that divides the width)
FITTING_PRESETS = ("int4", "int4_g32", "int4_asym", "int4_asym_g32", "int4_channel", "q4_0", "int8",
                   "int8_asym", "q8_0", "w8a8", "fp8", "fp8_channel", "w8a8_fp8")
_PACKED_BITS = (4, 8)
_TOKEN_ACTIVATIONS = {"strategy": "token", "dynamic": True, "symmetric": True, "group_size": None,
                      "block_structure": None, "observer": None, "actorder": None}


def _fits_hint() -> str:
    return f"schemes that fit compressed-tensors: {', '.join(FITTING_PRESETS)}"


def scheme_args(scheme) -> dict:
    """The compressed-tensors config group body ({"weights", "input_activations",
    "output_activations", "format"}) of a fewbits scheme, or a ValueError saying why it has no
    exact compressed-tensors form."""
    s: QuantScheme = get_scheme(scheme)
    fmt = s.format
    why = None
    if s.super_block is not None:
        why = "GGUF super-blocks (k-quants) exist only in GGUF"
    elif s.zero_point == "float":
        why = "a float minimum per group has no integer zero point to store"
    elif s.double_quant:
        why = "double-quantized scales are not compressed-tensors scales"
    elif s.granularity not in ("tensor", "channel", "group"):
        why = f"{s.granularity} blocks are not written by this exporter yet"
    elif s.granularity == "channel" and s.axis != 0:
        why = "scales per input column are not a compressed-tensors strategy"
    elif s.scale_format == "none":
        why = "a plain cast is a float model (save it in float)"
    if why is None and isinstance(fmt, IntFormat):
        if not s.symmetric and fmt.signed:
            why = (f"an asymmetric {fmt.name} keeps unsigned zero points beside signed codes, which "
                   "compressed-tensors' signed zero points cannot hold (the asymmetric presets use uint4 / uint8)")
        elif fmt.bits not in _PACKED_BITS:
            why = f"{fmt.bits}-bit integers are not packed by the engines (4 and 8 bits are)"
        elif s.granularity == "tensor":
            why = "one scale per tensor for integers is not written by this exporter"
    elif why is None and not (isinstance(fmt, FloatFormat) and fmt.name == "fp8_e4m3"):
        why = f"{fmt.name} codes have no compressed-tensors form here"
    act = s.activations
    if why is None and act is not None:
        ok = act.granularity == "channel" and act.axis == 0 and act.format == fmt and fmt.bits == 8
        if not ok:
            why = f"activations quantized as {act.label} are not dynamic per-token {fmt.name}"
    if why is not None:
        raise ValueError(f"{s.label} does not fit compressed-tensors: {why}; {_fits_hint()}")
    is_int = isinstance(fmt, IntFormat)
    weights = {"num_bits": fmt.bits, "type": "int" if is_int else "float", "symmetric": s.symmetric,
               "strategy": s.granularity, "group_size": s.group_size if s.granularity == "group" else None,
               "dynamic": False, "block_structure": None, "observer": None, "actorder": None}
    if act is None:
        form = "pack-quantized" if is_int else "float-quantized"
        inputs = None
    else:
        form = "int-quantized" if is_int else "float-quantized"
        inputs = {"num_bits": 8, "type": "int" if is_int else "float", **_TOKEN_ACTIVATIONS}
    return {"weights": weights, "input_activations": inputs, "output_activations": None, "format": form}


def _pack_int32(u: torch.Tensor, bits: int) -> torch.Tensor:
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
        raise RuntimeError("packing for compressed-tensors assumes a little-endian machine")
    return u.reshape(-1).view(torch.int32).reshape(rows, -1)  # bytes in order: little-endian words


def _offset_codes(values: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """fewbits integer values -> compressed-tensors' signed values: unsigned (asymmetric)
    formats are shifted down by 2^(bits-1), as compressed-tensors stores codes and zero points."""
    return values if fmt.signed else values - (1 << (fmt.bits - 1))


def check_module(module: str, scheme, shape) -> dict:
    """scheme_args of `module`'s scheme, after checking its weight's shape fits it: a ValueError
    naming the module otherwise."""
    s = get_scheme(scheme)
    args = scheme_args(s)
    if len(shape) != 2:
        raise ValueError(f"{module}: compressed-tensors stores 2-d Linear weights, this one is {list(shape)}")
    in_f = shape[1]
    if not _whole_groups(s, in_f):
        raise ValueError(f"{module}: {in_f} columns are not a whole number of groups of {s.group_size} "
                         f"({s.label}): compressed-tensors has no partial last group; presets that fit "
                         f"{in_f} columns: {', '.join(p for p in FITTING_PRESETS if _whole_groups(get_scheme(p), in_f))}")
    return args


def _whole_groups(s: QuantScheme, columns: int) -> bool:
    return s.granularity != "group" or columns % s.group_size == 0


def fits(scheme, widths=()) -> bool:
    """Whether compressed-tensors holds `scheme` exactly on layers of these input widths."""
    try:
        s = get_scheme(scheme)
        scheme_args(s)
    except ValueError:
        return False
    return all(_whole_groups(s, w) for w in widths)


# Linear layers that vLLM fuses into one (qkv_proj, gate_up_proj): each group must share one scheme
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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


def module_tensors(module: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    """The compressed-tensors entries of quantized Linear `module` (see the module docstring)."""
    s = qt.scheme
    args = check_module(module, s, qt.shape)
    out_f, in_f = qt.shape
    fmt = s.format
    scales = qt.scale_values()  # float32 [rows, groups]
    if s.granularity == "tensor":
        scales = scales.reshape(1)
    else:
        scales = scales.reshape(out_f, -1)
    entries = {f"{module}.weight_scale": scales.to(torch.float32).contiguous()}
    if isinstance(fmt, IntFormat):
        q = _offset_codes(qt.int_codes()[:, :in_f], fmt)
        if args["format"] == "int-quantized":
            entries[f"{module}.weight"] = q.to(torch.int8).contiguous()
        else:
            half = 1 << (fmt.bits - 1)
            entries[f"{module}.weight_packed"] = _pack_int32(q + half, fmt.bits)
            entries[f"{module}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int64)
            zp = qt.zero_point_values()
            if zp is not None:
                z = _offset_codes(zp, fmt).reshape(out_f, -1)
                entries[f"{module}.weight_zero_point"] = _pack_int32((z + half).t(), fmt.bits).t().contiguous()
    else:
        codes = qt.element_codes().reshape(out_f, -1)[:, :in_f].to(torch.uint8)
        entries[f"{module}.weight"] = codes.contiguous().view(torch.float8_e4m3fn)
    return entries


def quantization_config(plan: Mapping[str, QuantScheme], ignore=()) -> dict:
    """config.json's quantization_config for the quantized modules `plan` ({module: scheme}): one
    config group per scheme, targeting its modules by name; `ignore` the Linear layers in float."""
    from .._version import __version__

    groups: dict[str, dict] = {}
    by_scheme: dict[str, list[str]] = {}
    for module, scheme in plan.items():
        s = get_scheme(scheme)
        key = s.label
        if key not in groups:
            groups[key] = scheme_args(s)
        by_scheme.setdefault(key, []).append(module)
    config_groups = {f"group_{i}": {"targets": sorted(by_scheme[key]), **groups[key]}
                     for i, key in enumerate(sorted(groups))}
    forms = {g["format"] for g in config_groups.values()}
    return {"quant_method": QUANT_METHOD, "format": forms.pop() if len(forms) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": config_groups, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "producer": {"name": "fewbits", "version": __version__}}


def check_plan(plan: Mapping, model) -> None:
    """Every planned module of `model` (a skeleton is enough) is a Linear whose scheme and shape
    fit compressed-tensors; otherwise a ValueError naming the first that does not, before any work."""
    from torch import nn

    for module, scheme in plan.items():
        m = model.get_submodule(module)
        try:
            if not isinstance(m, nn.Linear):
                raise ValueError(f"compressed-tensors quantizes Linear layers; {module!r} is a {type(m).__name__} "
                                 "(leave the embeddings in float: no --embeddings)")
            check_module(module, scheme, tuple(m.weight.shape))
        except ValueError as e:
            raise ValueError(f"--format compressed-tensors: {e}" + ("" if module in str(e) else
                                                                    f" (layer {module!r})")) from None


def _linear_layers(config) -> tuple[set[str], str | None]:
    """The Linear layers of the model `config` describes (built on the meta device), and the name
    of its output layer (the one a tied model shares with its token embedding), if any."""
    from torch import nn

    from .streaming import model_skeleton
    model = model_skeleton(config)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return names, next((n for n, m in model.named_modules() if head is not None and m is head), None)


def write_compressed_tensors(out, tensors, *, tokenizer=None, overwrite: bool = False,
                             max_shard_bytes: int | None = None) -> str:
    """Write the fewbits directory's tensors `tensors` (hf_dir.read_tensors of it: a lazy mapping
    with `.config`, `.quantized`, `.directory`) as a compressed-tensors directory `out`. Every
    scheme is checked before anything is written; the directory appears only when complete."""
    from transformers import AutoConfig

    from .hf_dir import DEFAULT_MAX_SHARD_BYTES, ShardWriter, _module_of

    plan = {m: scheme for m, (scheme, _, _) in tensors.quantized.items()}
    for module, (scheme, shape, _) in tensors.quantized.items():
        try:
            check_module(module, scheme, shape)
        except ValueError as e:
            raise ValueError(f"--format compressed-tensors: {e}" + ("" if module in str(e) else
                                                                    f" (layer {module!r})")) from None
    linears, head = _linear_layers(AutoConfig.from_pretrained(tensors.directory))
    not_linear = sorted(set(plan) - linears)
    if not_linear:
        raise ValueError(f"--format compressed-tensors quantizes Linear layers; {not_linear[0]!r} is not one "
                         "(leave the embeddings in float: no --embeddings)")
    conflicts = fused_conflicts(plan, linears)
    if conflicts:
        warnings.warn(f"{len(conflicts)} group(s) of layers that vLLM fuses into one do not share a scheme, so vLLM "
                      f"will refuse this checkpoint (transformers loads it): {conflicts[0]}"
                      + (f" and {len(conflicts) - 1} more" if len(conflicts) > 1 else ""), stacklevel=2)
    qc = quantization_config(plan, ignore=linears - set(plan))
    with ShardWriter(out, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, overwrite=overwrite) as w:
        for name in tensors:
            value = tensors[name]
            if isinstance(value, QuantizedTensor):
                for key, t in module_tensors(_module_of(name), value).items():
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



__all__ = ["write_compressed_tensors"]
