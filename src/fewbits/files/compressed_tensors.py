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

fewbits reads compressed-tensors directories back, its own and other tools' such as
llm-compressor's (read_plan, leaf_specs, read_module; StandardFormat.to_fewbits): weight-only
integers ("pack-quantized"), targeted by name, "re:" regex or "Linear" less `ignore`, with scales
in float32, float16 or bfloat16. Quantized activations and float codes are not read yet.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..formats import FloatFormat, IntFormat
from ..quant.scheme import QuantScheme, get_scheme
from ..quant.tensor import QuantizedTensor
from .safetensors_format import FileFormatError
from .standard_dir import StandardFormat, pack_int32, unpack_int32

QUANT_METHOD = "compressed-tensors"
# the presets that map onto compressed-tensors exactly (any group size that divides the width)
FITTING_PRESETS = ("int4", "int4_g32", "int4_asym", "int4_asym_g32", "int4_channel", "q4_0", "w4a16",
                   "w4a16_g32", "int8", "int8_asym", "q8_0", "w8a16", "w8a8", "fp8", "fp8_channel", "w8a8_fp8", "mxfp4")
_PACKED_BITS = (4, 8)
_TOKEN_ACTIVATIONS = {"strategy": "token", "dynamic": True, "symmetric": True, "group_size": None,
                      "block_structure": None, "observer": None, "actorder": None}


def _offset_codes(values: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """fewbits integer values -> compressed-tensors' signed values: unsigned (asymmetric)
    formats are shifted down by 2^(bits-1), as compressed-tensors stores codes and zero points."""
    return values if fmt.signed else values - (1 << (fmt.bits - 1))


class CompressedTensors(StandardFormat):
    name = QUANT_METHOD
    fitting_presets = FITTING_PRESETS
    reads = True
    budget_candidates = ("int8", "int4_g32", "int4")

    def scheme_args(self, scheme) -> dict:
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
        elif s.granularity == "mx" and not (fmt.name == "fp4_e2m1" and s.activations is None):
            why = f"MX blocks of {fmt.name} are not written by this exporter yet (MXFP4 weights are)"
        elif s.granularity not in ("tensor", "channel", "group", "mx"):
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
        elif why is None and not (isinstance(fmt, FloatFormat) and (fmt.name == "fp8_e4m3" or s.granularity == "mx")):
            why = f"{fmt.name} codes have no compressed-tensors form here"
        act = s.activations
        if why is None and act is not None:
            ok = act.granularity == "channel" and act.axis == 0 and act.format == fmt and fmt.bits == 8
            if not ok:
                why = f"activations quantized as {act.label} are not dynamic per-token {fmt.name}"
        if why is not None:
            raise ValueError(f"{s.label} does not fit compressed-tensors: {why}; {self.fits_hint()}")
        is_int = isinstance(fmt, IntFormat)
        if s.granularity == "mx":  # MXFP4: E2M1 codes in blocks of 32 under an E8M0 scale (its biased exponent)
            weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                       "dynamic": False, "scale_dtype": "torch.uint8", "block_structure": None, "observer": None,
                       "actorder": None}
            return {"weights": weights, "input_activations": None, "output_activations": None,
                    "format": "mxfp4-pack-quantized"}
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

    def shape_problem(self, s: QuantScheme, shape) -> str | None:
        if s.granularity == "mx" and shape[1] % s.group_size:
            return f"{shape[1]} columns are not a whole number of MX blocks of {s.group_size}"
        return super().shape_problem(s, shape)

    def module_tensors(self, module: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The compressed-tensors entries of quantized Linear `module` (see the module docstring)."""
        s = qt.scheme
        args = self.check_module(module, s, qt.shape)
        out_f, in_f = qt.shape
        fmt = s.format
        if s.granularity == "mx":  # two E2M1 codes a byte, the first in the low nibble; E8M0 codes as stored
            codes = qt.element_codes().reshape(out_f, -1)[:, :in_f].to(torch.uint8)
            return {f"{module}.weight_packed": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
                    f"{module}.weight_scale": qt.scales.reshape(out_f, -1).contiguous()}
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
                entries[f"{module}.weight_packed"] = pack_int32(q + half, fmt.bits)
                entries[f"{module}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int64)
                zp = qt.zero_point_values()
                if zp is not None:
                    z = _offset_codes(zp, fmt).reshape(out_f, -1)
                    entries[f"{module}.weight_zero_point"] = pack_int32((z + half).t(), fmt.bits).t().contiguous()
        else:
            codes = qt.element_codes().reshape(out_f, -1)[:, :in_f].to(torch.uint8)
            entries[f"{module}.weight"] = codes.contiguous().view(torch.float8_e4m3fn)
        return entries

    def quantization_config(self, plan: Mapping[str, QuantScheme], ignore=()) -> dict:
        """One config group per scheme, targeting its modules by name; `ignore` the Linear layers
        in float."""
        from .._version import __version__

        groups: dict[str, dict] = {}
        by_scheme: dict[str, list[str]] = {}
        for module, scheme in plan.items():
            s = get_scheme(scheme)
            key = s.label
            if key not in groups:
                groups[key] = self.scheme_args(s)
            by_scheme.setdefault(key, []).append(module)
        config_groups = {f"group_{i}": {"targets": sorted(by_scheme[key]), **groups[key]}
                         for i, key in enumerate(sorted(groups))}
        forms = {g["format"] for g in config_groups.values()}
        return {"quant_method": QUANT_METHOD, "format": forms.pop() if len(forms) == 1 else "mixed-precision",
                "quantization_status": "compressed", "config_groups": config_groups, "ignore": sorted(ignore),
                "kv_cache_scheme": None, "producer": {"name": "fewbits", "version": __version__}}


    # -- reading ---------------------------------------------------------------------------------
    def read_plan(self, path, qc, linears, head, info) -> dict[str, QuantScheme]:
        """The Linear layers each config group targets (exact names, "re:" regexes, or the class
        name "Linear", as compressed-tensors matches them), less `ignore`. Weight-only integers
        ("pack-quantized", 4 or 8 bits, symmetric or with zero points, per channel or in groups
        that divide the width), their scales in the dtype stored; activation quantization and
        float codes are not read yet."""
        def bad(why):
            return FileFormatError(path, f"quantization_config (compressed-tensors): {why}")
        groups, ignore = qc.get("config_groups"), qc.get("ignore") or []
        if not isinstance(groups, dict) or not groups or not isinstance(ignore, list):
            raise bad("config_groups must be a non-empty object and ignore a list")
        ignore = _patterns(path, ignore, "ignore")
        plan: dict[str, QuantScheme] = {}
        for key, group in groups.items():
            if not isinstance(group, dict):
                raise bad(f"config group {key!r} is not an object")
            w, form = group.get("weights"), group.get("format") or qc.get("format")
            if group.get("input_activations") or group.get("output_activations"):
                raise bad(f"{key}: quantized activations (w8a8) are not read yet; weight-only integers are")
            if form != "pack-quantized" or not isinstance(w, dict) or w.get("type") != "int":
                raise bad(f"{key}: format {form!r}: fewbits reads pack-quantized integer weights")
            bits, strategy, size = w.get("num_bits"), w.get("strategy"), w.get("group_size")
            if bits not in _PACKED_BITS or strategy not in ("channel", "group") or w.get("dynamic") \
                    or w.get("actorder") or w.get("block_structure"):
                raise bad(f"{key}: {bits}-bit {strategy} weights (fewbits reads 4 and 8 bits per channel or "
                          "group, static, without act-order)")
            if strategy == "group" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise bad(f"{key}: group_size {size!r}")
            targets = group.get("targets")
            if not isinstance(targets, list) or not targets:
                raise bad(f"{key}: targets must be a non-empty list")
            targets = _patterns(path, targets, f"{key}'s targets")
            symmetric = w.get("symmetric", True) is not False
            for module, shape in linears.items():
                if module in plan or not _matches(module, targets) or _matches(module, ignore):
                    continue
                got = info(f"{module}.weight_scale")
                stored = got[1] if got is not None else None
                scale = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(stored)
                if scale is None:
                    raise bad(f"{module}.weight_scale is missing or not a float tensor ({stored})")
                fmt = f"int{bits}" if symmetric else f"uint{bits}"
                scheme = (QuantScheme(fmt, "channel", symmetric=symmetric, scale_format=scale) if strategy == "channel"
                          else QuantScheme(fmt, "group", group_size=size, symmetric=symmetric, scale_format=scale))
                why = self.shape_problem(scheme, shape)
                if why is not None:
                    raise bad(f"{module}: {why}")
                plan[module] = _preset_or(scheme)
        if not plan:
            raise bad("no Linear layer of the model is targeted")
        return plan

    def leaf_specs(self, scheme, shape) -> dict:
        bits = scheme.format.bits
        out_f, in_f = shape
        groups = 1 if scheme.granularity == "channel" else in_f // scheme.group_size
        specs = {"weight_packed": ((out_f, -(-in_f * bits // 32)), (torch.int32,)),
                 "weight_scale": ((out_f, groups), (torch.float32, torch.float16, torch.bfloat16)),
                 "weight_shape": ((2,), (torch.int64, torch.int32))}
        if not scheme.symmetric:
            specs["weight_zero_point"] = ((-(-out_f * bits // 32), groups), (torch.int32,))
        return specs

    def read_module(self, module, entries, scheme, shape, dtype, qc) -> QuantizedTensor:
        bits = scheme.format.bits
        out_f, in_f = shape
        if entries["weight_shape"].tolist() != [out_f, in_f]:
            raise ValueError(f"weight_shape {entries['weight_shape'].tolist()} is not the layer's {[out_f, in_f]}")
        values = unpack_int32(entries["weight_packed"], bits, in_f)  # unsigned: compressed-tensors' value + half
        zero = None
        if scheme.symmetric:
            values = values - (1 << (bits - 1))
        else:  # packed along the outputs: fewbits' unsigned zero points
            zero = unpack_int32(entries["weight_zero_point"].t(), bits, out_f).t()
        return QuantizedTensor.from_int_codes(scheme, shape, dtype, values, entries["weight_scale"].to(torch.float32),
                                              zero)


_MAX_PATTERN = 256
# a quantified group that holds a quantifier, as in (a+)+ or (.*)*: backtracking that can take
# exponential time on a name that fails to match
_NESTED = re.compile(r"\((?:[^()\\]|\\.)*[*+}](?:[^()\\]|\\.)*\)[*+{]")


def _patterns(path: str, entries, what: str) -> list:
    """compressed-tensors' targets or ignore list as matchers: the class name "Linear" (every
    module matched here is a Linear), a "re:" regex, or a module's name. A FileFormatError
    naming `path` for an entry that is not a string, a regex that does not compile, is longer
    than _MAX_PATTERN or nests quantifiers (which could make matching take forever)."""
    found = []
    for t in entries:
        if not isinstance(t, str):
            raise FileFormatError(path, f"quantization_config (compressed-tensors): {what} entry {t!r} is not a string")
        if t.startswith("re:"):
            pattern = t[3:]
            if len(pattern) > _MAX_PATTERN or _NESTED.search(pattern):
                raise FileFormatError(path, f"quantization_config (compressed-tensors): {what} regex {pattern[:60]!r} "
                                      f"is longer than {_MAX_PATTERN} characters or nests quantifiers; fewbits does "
                                      "not match it")
            try:
                found.append(re.compile(pattern))
            except re.error as e:
                raise FileFormatError(path, f"quantization_config (compressed-tensors): {what} regex {pattern[:60]!r} "
                                      f"does not compile: {e}") from None
        else:
            found.append(t)
    return found


def _matches(module: str, patterns) -> bool:
    """compressed-tensors' matching of a Linear layer's name against _patterns' matchers."""
    return any((p == module or p == "Linear") if isinstance(p, str) else p.match(module) is not None
               for p in patterns)


def _preset_or(scheme: QuantScheme) -> QuantScheme:
    """The preset that stores exactly like `scheme` (same format, granularity, group, symmetry,
    scale format), else `scheme` itself: a read directory's layers carry the names users know."""
    for name in FITTING_PRESETS:
        p = get_scheme(name)
        if p.scale_method != "absmax":  # how codes were chosen is not stored: the plain presets name them
            continue
        if (p.format, p.granularity, p.group_size if p.granularity == "group" else None, p.symmetric, p.scale_format,
                p.activations, p.zero_point) == (scheme.format, scheme.granularity,
                                                 scheme.group_size if scheme.granularity == "group" else None,
                                                 scheme.symmetric, scheme.scale_format, None, scheme.zero_point):
            return p
    return scheme


FORMAT = CompressedTensors()
scheme_args = FORMAT.scheme_args
fits = FORMAT.fits
write_compressed_tensors = FORMAT.write

__all__ = ["write_compressed_tensors"]
