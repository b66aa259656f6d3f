"""The transformers classes of fewbits' quantization method (see fewbits.files.hf_quantizer);
imported only once transformers' quantizers are."""
from __future__ import annotations

import os
import re

from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .._version import __version__
from ..quant.plan import is_quantized
from ..quant.tensor import STATE_KEYS, expected_keys
from .hf_dir import (
    QUANT_FORMAT_VERSION, QUANT_METHOD, QWEIGHT, check_fits, empty_quantized_modules, guard_tensor,
    parse_quantization_config, read_tensors,
)
from .safetensors_format import FileFormatError

def checkpoint_directory(checkpoint_files) -> str | None:
    """The directory of transformers' resolved checkpoint files, when they are safetensors files
    of one local directory."""
    if not checkpoint_files:
        return None
    dirs = {os.path.dirname(os.fspath(f)) for f in checkpoint_files}
    if len(dirs) != 1 or not all(os.fspath(f).endswith(".safetensors") for f in checkpoint_files):
        return None
    return dirs.pop()


_FIELDS = ("quant_method", "format_version", "fewbits_version", "schemes", "modules")
_TARGET = f"{QWEIGHT}.codes"


class FewbitsConfig(QuantizationConfigMixin):
    """config.json's quantization_config of a fewbits directory (schema: fewbits.files.hf_dir),
    validated when built."""

    def __init__(self, quant_method=QUANT_METHOD, format_version=QUANT_FORMAT_VERSION, fewbits_version=__version__,
                 schemes=None, modules=None, **unknown):
        self.quant_method = quant_method
        self.format_version = format_version
        self.fewbits_version = fewbits_version
        self.schemes = {} if schemes is None else schemes
        self.modules = {} if modules is None else modules
        fields = {k: getattr(self, k) for k in _FIELDS}
        self.plan = parse_quantization_config("config.json", {**fields, **unknown})

    def to_dict(self) -> dict:
        import copy
        return copy.deepcopy({k: getattr(self, k) for k in _FIELDS})

    def __iter__(self):
        yield from self.to_dict().items()


class FewbitsDeserialize(ConversionOps):
    """Loads one quantized module's `qweight.<key>` tensors into it (the module was swapped in
    empty before loading); returns nothing for transformers to set."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, model=None,
                missing_keys=None, **kwargs):
        module_name = full_layer_name.removesuffix(f".{_TARGET}")
        module = model.get_submodule(module_name)
        state = {k: (v[0] if isinstance(v, list) else v) for k, v in input_dict.items()}
        result = module.load_state_dict(state, strict=False, assign=True)
        lost = [k for k in result.missing_keys if k != "bias"] + list(result.unexpected_keys)
        if lost:
            raise ValueError(f"{module_name}: quantized entries missing or unexpected: {', '.join(lost)}")
        if missing_keys is not None:
            for k in expected_keys(module.scheme):
                missing_keys.discard(f"{module_name}.{QWEIGHT}.{k}")
        return {}

    @property
    def reverse_op(self) -> ConversionOps:
        return _Identity()


class _Identity(ConversionOps):
    """Saving: the quantized entries are written as model.state_dict() holds them."""

    def convert(self, input_dict, **kwargs):
        return input_dict


class FewbitsHfQuantizer(HfQuantizer):
    """Loads fewbits-quantized directories (pre-quantized only: quantizing while loading is
    fb.quantize_model's job, or `fewbits quantize`)."""

    requires_calibration = True
    serialized_names = {_TARGET: [f"{QWEIGHT}.{k}" for k in STATE_KEYS]}

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        plan = self.quantization_config.plan
        directory = checkpoint_directory(checkpoint_files)
        if directory is not None:
            tensors = read_tensors(directory)  # every header checked before anything is loaded
            if tensors.quantized != plan:
                raise FileFormatError(directory, "config.json's quantization_config changed while loading")
            check_fits(model, tensors)  # a stored shape config.json does not give: named here, not as
            tensors.close()             # transformers' "ignore_mismatched_sizes" error after its report
        empty_quantized_modules(model, plan, where=directory or "quantization_config")
        # each quantized module's guard ("m.weight", hf_dir.GUARD_DTYPE) is no parameter of the
        # quantized module: not an unexpected key to report
        guards = {rf"^{re.escape(name)}\.weight$" for name in plan}
        model._keys_to_ignore_on_load_unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                                       or ()) | guards
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        left = [n for n in self.quantization_config.plan if model.get_submodule(n).qweight.device.type == "meta"]
        if left:
            raise ValueError(f"quantized weights were not in the checkpoint: {', '.join(left[:8])}")
        for _, m in model.named_modules():
            if is_quantized(m) and getattr(m, "bias", None) is not None:
                m.bias.requires_grad_(False)  # as a QuantLinear holds it
        return model

    def get_state_dict_and_metadata(self, model):
        """transformers' save_pretrained: the state dict with each quantized module's guard added
        (hf_dir.GUARD_DTYPE), as fewbits' own writer stores it."""
        state = model.state_dict()
        for name in self.quantization_config.plan:
            state.setdefault(f"{name}.weight", guard_tensor())
        return state, {}

    def get_load_operations(self):
        return {"deserialize": FewbitsDeserialize}

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def _register() -> None:
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer,
    )
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(FewbitsConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(FewbitsHfQuantizer)


_register()
