"""bitsandbytes 4-bit directories: fewbits' NF4 models in the layout transformers saves and loads
with `BitsAndBytesConfig(load_in_4bit=True)` (bitsandbytes' Linear4bit; on CPU too).

A Hugging Face directory whose config.json holds a `quantization_config` with `quant_method:
"bitsandbytes"`, `load_in_4bit`, `bnb_4bit_quant_type: "nf4"`, and the Linear layers left in float
in `llm_int8_skip_modules`. Per quantized Linear `m` (n = out x in values, flattened row by row):

- `m.weight`: uint8 [n / 2, 1], two codes a byte, the first in the high nibble;
- `m.weight.absmax`: float32 [n / blocksize], the scale of each block of `blocksize` values;
- `m.weight.quant_map`: float32 [16], the NF4 codebook (fewbits' NF4_VALUES are bitsandbytes' own);
- `m.weight.quant_state.bitsandbytes__nf4`: uint8, the JSON {"quant_type", "blocksize", "dtype",
  "shape"} bitsandbytes packs its QuantState into;

so that bitsandbytes' dequantization quant_map[code] x absmax (float32, then `dtype`) is fewbits'
own. A fewbits group is a block when the width is a whole number of groups (the blocks of
bitsandbytes run over the flattened weight). fewbits' double quantization (nf4_dq: block scales
in int8) is not bitsandbytes' (an 8-bit dynamic code around the scales' mean), so nf4_dq is refused:
write nf4.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from ..formats import LookupFormat
from ..formats.lookup import NF4_VALUES
from ..quant.scheme import QuantScheme, get_scheme
from ..quant.tensor import QuantizedTensor
from .standard_dir import StandardFormat

QUANT_METHOD = "bitsandbytes"
FITTING_PRESETS = ("nf4",)
_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' CPU and GPU kernels take


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BitsAndBytes4bit(StandardFormat):
    name = QUANT_METHOD
    fitting_presets = FITTING_PRESETS
    budget_candidates = ()  # one scheme: nothing to choose among

    def scheme_args(self, scheme) -> dict:
        """{"quant_type", "blocksize"} of a fewbits scheme in bitsandbytes' 4-bit layout, or a
        ValueError saying why it has no exact form there."""
        s: QuantScheme = get_scheme(scheme)
        fmt = s.format
        why = None
        if not (isinstance(fmt, LookupFormat) and tuple(fmt.table) == NF4_VALUES):
            why = (f"bitsandbytes' 4-bit layers hold NF4 (or its own FP4 code, which fewbits' fp4 is not), "
                   f"not {fmt.name}")
        elif s.double_quant:
            why = ("fewbits double-quantizes the block scales in int8, bitsandbytes with an 8-bit dynamic code "
                   "around their mean; the same weights do not fit both (write nf4)")
        elif s.activations is not None:
            why = "bitsandbytes' 4-bit layers quantize weights only"
        elif s.granularity != "group" or s.group_size not in _BLOCKSIZES:
            why = f"bitsandbytes takes blocks of {', '.join(map(str, _BLOCKSIZES))} values"
        elif s.scale_format != "fp32":
            why = f"bitsandbytes keeps each block's absmax in fp32, not {s.scale_format}"
        if why is not None:
            raise ValueError(f"{s.label} does not fit bitsandbytes: {why}; {self.fits_hint()}")
        return {"quant_type": "nf4", "blocksize": s.group_size}

    def module_tensors(self, module: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The bitsandbytes entries of quantized Linear `module` (see the module docstring)."""
        args = self.check_module(module, qt.scheme, qt.shape)
        out_f, in_f = qt.shape
        codes = qt.element_codes().reshape(out_f, -1)[:, :in_f].reshape(-1)  # row by row: bnb's flattening
        packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).reshape(-1, 1)
        state = {"quant_type": "nf4", "blocksize": args["blocksize"], "dtype": _dtype_name(qt.dtype),
                 "shape": [out_f, in_f]}
        key = f"{module}.weight"
        return {key: packed,
                f"{key}.absmax": qt.scale_values().reshape(-1).to(torch.float32).contiguous(),
                f"{key}.quant_map": torch.tensor(NF4_VALUES, dtype=torch.float32),
                f"{key}.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(state).encode()),
                                                                     dtype=torch.uint8)}

    def quantization_config(self, plan: Mapping[str, QuantScheme], ignore=()) -> dict:
        """transformers' BitsAndBytesConfig for 4-bit NF4, the float Linear layers skipped by
        their full names."""
        if not plan:
            raise ValueError("a bitsandbytes checkpoint needs at least one quantized Linear layer")
        for s in plan.values():
            self.scheme_args(s)
        return {"quant_method": QUANT_METHOD, "load_in_4bit": True, "load_in_8bit": False,
                "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
                "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
                "llm_int8_skip_modules": sorted(ignore), "llm_int8_threshold": 6.0,
                "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}


FORMAT = BitsAndBytes4bit()
write_bitsandbytes = FORMAT.write

__all__ = ["write_bitsandbytes"]
