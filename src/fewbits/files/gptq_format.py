"""GPTQ directories: fewbits' quantized models in the GPTQ checkpoint format that vLLM (gptq,
gptq_marlin), SGLang, TGI, ExLlama and GPTQModel (and transformers through it) load.

A Hugging Face directory whose config.json holds a `quantization_config` with `quant_method:
"gptq"`, `checkpoint_format: "gptq"` (v1), `sym: true`, `desc_act: false`. Per quantized Linear `m`
with `bits` 4 or 8 (p = 32 / bits values per int32 word):

- `m.qweight`: int32 [in / p, out], the unsigned codes u = q + 2^(bits-1) packed along the input
  dimension: row i holds inputs i*p .. i*p+p-1 of each column, input i*p+j at bit j*bits;
- `m.scales`: float16 [groups, out] (one group per channel for group_size -1);
- `m.qzeros`: int32 [groups, out / p], every value 2^(bits-1) - 1 (version 1 stores the zero
  point minus one; the readers add it back), packed along the output dimension the same way;
- `m.g_idx`: int32 [in], input i's group (i // group_size; no act-order);

so that the readers' dequantization (u - zero) * scale = q * scale is fewbits' own (the readers
compute it in float16, rounding fewbits' float32 product once). Only symmetric signed 4- and 8-bit
integers under fp16 scales, per group or per output channel, fit (the w4a16, w4a16_g32, w8a16, q4_0
and q8_0 presets): vLLM's GPTQ kernels are symmetric-only, the format keeps scales in fp16, and it
quantizes weights alone. One scheme holds every Linear layer of the decoder blocks, and the
layers outside them (the output layer, a classifier, projections) stay in float: transformers
(through optimum and GPTQModel) quantizes the Linear layers under the blocks' prefix with the one
config and reads a quantized lm_head, a float layer there or GPTQModel's per-module `dynamic`
overrides as random weights, without an error. Mixed plans go to compressed-tensors.

fewbits reads GPTQ directories back, its own and other tools' (read_plan, leaf_specs,
read_module; StandardFormat.to_fewbits): symmetric, version 1 or 2 ("gptq_v2": zero points
stored as they are), 4 or 8 bits, without act-order or `dynamic`.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..formats import IntFormat
from ..quant.scheme import QuantScheme, get_scheme
from ..quant.tensor import QuantizedTensor
from .safetensors_format import FileFormatError
from .standard_dir import StandardFormat, linear_layers, pack_int32, unpack_int32

QUANT_METHOD = "gptq"
FITTING_PRESETS = ("w4a16", "w4a16_g32", "q4_0", "w8a16", "q8_0")
_BITS = (4, 8)
# where optimum's GPTQ loader looks for the decoder blocks, in its order (optimum.gptq.constants)
_BLOCK_PATTERNS = ("transformer.h", "model.decoder.layers", "gpt_neox.layers", "model.layers",
                   "model.language_model.layers", "h", "decoder.layers", "layers")


def block_prefix(names) -> str | None:
    """The decoder blocks' prefix among these module names, found as transformers' GPTQ loader
    finds it: the first pattern any name starts with."""
    names = list(names)
    return next((p for p in _BLOCK_PATTERNS if any(n.startswith(p) for n in names)), None)


def _group_size(s: QuantScheme) -> int:
    return s.group_size if s.granularity == "group" else -1


class GPTQ(StandardFormat):
    name = QUANT_METHOD
    fitting_presets = FITTING_PRESETS
    reads = True
    budget_candidates = ()  # one scheme for every layer: nothing to choose per layer
    keeps_head_in_float = True

    def layout_problem(self, plan, linears, head) -> str | None:
        """What transformers' GPTQ loader (optimum + GPTQModel) reads is every Linear layer under
        the decoder blocks (block_prefix), all of one bits and group_size; everything else in
        float. It ignores `lm_head: true` and per-module `dynamic` overrides, and reads anything
        else as random weights without an error."""
        prefix = block_prefix(linears)
        if prefix is None:
            return ("transformers' GPTQ loader quantizes the Linear layers of decoder blocks under "
                    f"{', '.join(_BLOCK_PATTERNS[:5])}, ..., and this model has none (an encoder such as BERT: "
                    "write compressed-tensors)")
        inside = {n for n in linears if n.startswith(prefix + ".")}
        outside = sorted(set(plan) - inside)
        if outside:
            return (f"{outside[0]!r}" + (f" and {len(outside) - 1} more lie" if len(outside) > 1 else " lies")
                    + f" outside the decoder blocks ({prefix}.*), which transformers' GPTQ loader reads as float "
                    "layers (random weights): leave them in float (a scheme given alone is applied to "
                    f"{prefix}.* only)")
        floats = sorted(inside - set(plan))
        if floats:
            return (f"{floats[0]!r}" + (f" and {len(floats) - 1} more Linear layers" if len(floats) > 1 else "")
                    + f" would stay in float, and transformers' GPTQ loader quantizes every Linear layer under "
                    f"{prefix} (reading a float one as random weights); compressed-tensors lists them in `ignore`")
        kinds = {tuple(self.scheme_args(s).values()) for s in plan.values()}
        if len(kinds) > 1:
            labels = sorted({get_scheme(s).label for s in plan.values()})
            return (f"GPTQ holds one bits and group_size for all layers, this plan has {len(kinds)} "
                    f"({', '.join(labels)}); compressed-tensors holds mixed plans")
        return None

    def default_rules(self, scheme, config):
        prefix = block_prefix(linear_layers(config)[0])
        return {f"{prefix}.*": scheme} if prefix is not None else scheme

    def scheme_args(self, scheme) -> dict:
        """{"bits", "group_size"} of a fewbits scheme in GPTQ, or a ValueError saying why GPTQ has
        no exact form of it."""
        s: QuantScheme = get_scheme(scheme)
        fmt = s.format
        why = None
        if s.super_block is not None:
            why = "GGUF super-blocks (k-quants) exist only in GGUF"
        elif not isinstance(fmt, IntFormat):
            why = f"GPTQ holds integer codes, not {fmt.name}"
        elif s.activations is not None:
            why = (f"GPTQ checkpoints quantize weights only, and {s.label} quantizes the activations too "
                   "(compressed-tensors holds w8a8)")
        elif s.zero_point == "float":
            why = "a float minimum per group has no integer zero point to store"
        elif not s.symmetric or not fmt.signed:
            why = ("vLLM's GPTQ kernels are symmetric-only, so fewbits writes symmetric codes alone "
                   "(compressed-tensors holds the asymmetric int4_asym presets)")
        elif fmt.bits not in _BITS:
            why = f"{fmt.bits}-bit integers are not written by this exporter (4 and 8 bits are)"
        elif s.double_quant:
            why = "double-quantized scales are not GPTQ scales"
        elif s.granularity not in ("channel", "group") or (s.granularity == "channel" and s.axis != 0):
            why = "GPTQ keeps one scale per output channel or per group of inputs"
        elif s.scale_format != "fp16":
            why = (f"GPTQ stores scales in fp16 and {s.label} keeps them in {s.scale_format} (w4a16, "
                   "w4a16_g32 and w8a16 are the fp16-scale twins of int4, int4_g32 and int8)")
        if why is not None:
            raise ValueError(f"{s.label} does not fit GPTQ: {why}; {self.fits_hint()}")
        return {"bits": fmt.bits, "group_size": _group_size(s)}

    def shape_problem(self, s: QuantScheme, shape) -> str | None:
        why = super().shape_problem(s, shape)
        if why is not None:
            return why
        per = 32 // s.format.bits
        out_f, in_f = shape
        if in_f % per or out_f % per:
            return (f"GPTQ packs {per} {s.format.bits}-bit codes into each int32 word along both dimensions, "
                    f"and a {out_f} x {in_f} weight is not a whole number of words")
        return None

    def module_tensors(self, module: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The GPTQ entries of quantized Linear `module` (see the module docstring)."""
        s = qt.scheme
        args = self.check_module(module, s, qt.shape)
        bits = args["bits"]
        out_f, in_f = qt.shape
        half = 1 << (bits - 1)
        q = qt.int_codes()[:, :in_f]  # [out, in], signed
        scales = qt.scale_values().reshape(out_f, -1)  # fp16 values held in float32: exact
        groups = scales.shape[1]
        size = in_f if args["group_size"] == -1 else args["group_size"]
        return {
            f"{module}.qweight": pack_int32(q + half, bits).t().contiguous(),  # packed along the inputs
            f"{module}.qzeros": pack_int32(torch.full((groups, out_f), half - 1, dtype=torch.int64), bits),
            f"{module}.scales": scales.t().to(torch.float16).contiguous(),
            f"{module}.g_idx": (torch.arange(in_f, dtype=torch.int32) // size).contiguous(),
        }

    def quantization_config(self, plan: Mapping[str, QuantScheme], ignore=()) -> dict:
        """The one scheme's bits and group_size (see layout_problem), symmetric, no act-order."""
        from .._version import __version__

        args = {(a["bits"], a["group_size"]) for a in map(self.scheme_args, plan.values())}
        if len(args) != 1:
            raise ValueError(f"a GPTQ checkpoint holds one scheme, got {len(args)}")
        (bits, group_size), = args
        return {"quant_method": QUANT_METHOD, "checkpoint_format": "gptq", "bits": bits, "group_size": group_size,
                "sym": True, "desc_act": False, "static_groups": False, "true_sequential": True, "lm_head": False,
                "pack_dtype": "int32", "meta": {"quantizer": [f"fewbits:{__version__}"]}}


    # -- reading ---------------------------------------------------------------------------------
    def read_plan(self, path, qc, linears, head, info) -> dict[str, QuantScheme]:
        """Every Linear layer under the decoder blocks (and the output layer with `lm_head:
        true`), in the one scheme of `bits` and `group_size`: what transformers' GPTQ loader
        builds. Symmetric version-1 or -2 checkpoints without per-module overrides."""
        def bad(why):
            return FileFormatError(path, f"quantization_config (gptq): {why}")
        bits, group = qc.get("bits"), qc.get("group_size")
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in _BITS:
            raise bad(f"bits {bits!r}: fewbits reads 4- and 8-bit GPTQ")
        if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
            raise bad(f"group_size {group!r} is not -1 or a positive integer")
        if qc.get("sym", True) is not True:
            raise bad("an asymmetric checkpoint (sym false): fewbits reads symmetric GPTQ")
        form = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if not isinstance(form, str) or form not in ("gptq", "gptq_v2"):
            raise bad(f"checkpoint_format {form!r} (fewbits reads gptq and gptq_v2)")
        if qc.get("dynamic"):
            raise bad("per-module `dynamic` overrides are not read")
        fmt = f"int{bits}"
        scheme = next((get_scheme(p) for p in ("w4a16", "w4a16_g32", "w8a16")
                       if self.scheme_args(p) == {"bits": bits, "group_size": group}), None)
        if scheme is None:
            scheme = (QuantScheme(fmt, "channel", scale_format="fp16") if group == -1 else
                      QuantScheme(fmt, "group", group_size=group, scale_format="fp16"))
        prefix = block_prefix(linears)
        plan = {}
        for module, shape in linears.items():
            inside = prefix is not None and module.startswith(prefix + ".")
            if not inside and not (module == head and qc.get("lm_head") is True):
                continue
            why = self.shape_problem(scheme, shape)
            if why is not None:
                raise bad(f"{module}: {why}")
            plan[module] = scheme
        return plan

    def leaf_specs(self, scheme, shape) -> dict:
        bits = scheme.format.bits
        per = 32 // bits
        out_f, in_f = shape
        groups = 1 if scheme.granularity == "channel" else in_f // scheme.group_size
        return {"qweight": ((in_f // per, out_f), (torch.int32,)), "qzeros": ((groups, out_f // per), (torch.int32,)),
                "scales": ((groups, out_f), (torch.float16,)), "g_idx": ((in_f,), (torch.int32,))}

    def read_module(self, module, entries, scheme, shape, dtype, qc) -> QuantizedTensor:
        bits = scheme.format.bits
        half = 1 << (bits - 1)
        out_f, in_f = shape
        size = in_f if scheme.granularity == "channel" else scheme.group_size
        if not torch.equal(entries["g_idx"].to(torch.int64), torch.arange(in_f) // size):
            raise ValueError("g_idx is not the inputs' groups in order (act-order checkpoints are not read)")
        zeros = unpack_int32(entries["qzeros"], bits, out_f) + (1 if _version_1(qc) else 0)
        if not torch.all(zeros == half):
            raise ValueError(f"zero points other than {half}: not a symmetric checkpoint")
        values = unpack_int32(entries["qweight"].t(), bits, in_f) - half  # [out, in]
        return QuantizedTensor.from_int_codes(scheme, shape, dtype, values, entries["scales"].t().to(torch.float32))


def _version_1(qc: dict) -> bool:
    """Whether a GPTQ quantization_config states version 1 (zero points stored minus one; the
    default), else version 2 ("gptq_v2")."""
    return qc.get("checkpoint_format", qc.get("format", "gptq")) == "gptq"


FORMAT = GPTQ()
write_gptq = FORMAT.write

__all__ = ["write_gptq"]
