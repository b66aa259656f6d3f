"""fewbits as a transformers quantization method: `transformers.AutoModel*.from_pretrained(dir)`
loads a fewbits Hugging Face directory (fewbits.files.hf_dir) once fewbits is imported.

It goes through transformers' own extension point for third-party methods
(transformers.quantizers.register_quantization_config / register_quantizer): FewbitsConfig reads
config.json's quantization_config (validated by hf_dir.parse_quantization_config), and
FewbitsHfQuantizer, on the model transformers builds on the meta device, first checks the
directory (hf_dir.read_tensors: index, shard headers, every quantized entry's shape and dtype),
then swaps each listed Linear / Embedding for an empty quantized module (hf_dir.
empty_quantized_modules). transformers then reads the shards (memory-mapped) and hands each
module's `m.qweight.<key>` tensors, gathered by one WeightConverter, to FewbitsDeserialize, which
loads them into the module (QuantLinear.load_state_dict with assign=True: validated, codes
checked, kernel chosen). No float weight of a quantized layer exists at any point.
`model.save_pretrained(dir)` of such a model writes the same layout back (model.state_dict()
holds the quantized entries; the converter's reverse is the identity).

Registration is lazy (install()): importing transformers costs seconds, more than all of
fewbits, so `import fewbits` does not import it. If transformers.quantizers.auto is already
imported, fewbits registers at once; otherwise an import hook registers right after that module
is first imported (which every from_pretrained does).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

import torch
from torch import nn

from ..model_building import building
from .hf_dir import CONFIG_NAME, model_class, read_tensors
from .safetensors_format import FileFormatError

_TARGET = "transformers.quantizers.auto"
_registered = False


def install() -> None:
    """Register with transformers now if its quantizers are imported, else when they are."""
    if _TARGET in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterHook())


class _RegisterHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for transformers.quantizers.auto it returns the normal spec with a
    loader that registers fewbits once the module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterHook)]
        sys.modules[module.__name__] = module
        try:
            register()
        except Exception as e:  # never break transformers' own import
            warnings.warn(f"fewbits could not register its transformers quantizer: {e}", stacklevel=2)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def register() -> None:
    """Register FewbitsConfig and FewbitsHfQuantizer under quant_method "fewbits" (once): the
    module defining them registers them when it is imported (so importing it directly, before
    transformers' quantizers, registers too)."""
    global _registered
    if not _registered:
        importlib.import_module(f"{__package__}._hf_quantizer_impl")
        _registered = True


def from_pretrained(directory, *, device="cpu", dtype=None) -> nn.Module:
    """A quantized model straight from a fewbits Hugging Face directory, from a compressed-tensors
    or GPTQ directory (their integer codes and scales kept as they are:
    fewbits.files.standard_dir), or from a llama GGUF file (its block tensors kept as they are:
    fewbits.files.gguf_reader), fp32 weights of the quantized layers never materialized.

    The directory is checked first (read_tensors: nothing is loaded from a bad one). The model
    is then built by transformers from config.json -- the class its `architectures` names,
    else AutoModelForCausalLM for a *ForCausalLM and AutoModel otherwise -- through fewbits'
    registered quantizer (fewbits.files.hf_quantizer): transformers builds it on the meta
    device, the quantizer swaps in empty quantized modules, and the tensors go from the
    memory-mapped shards into them. One loading path, the same as
    transformers.AutoModel*.from_pretrained(dir). device: where the model goes ("cpu", "cuda",
    ...); dtype: the float parameters' dtype (default: config.json's)."""
    if os.path.isfile(directory) and os.fspath(directory).lower().endswith(".gguf"):
        return _from_gguf(directory, device=device, dtype=dtype)
    standard = _standard_format(directory)
    if standard is not None:
        return _from_standard(standard, directory, device=device, dtype=dtype)
    tensors = read_tensors(directory)
    config = tensors.config
    if config is None:
        raise FileFormatError(os.path.join(os.fspath(directory), CONFIG_NAME), "no config.json: transformers "
                              "needs it to build the model")
    tensors.close()
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("from_pretrained() builds the model with transformers: pip install transformers")
    register()
    try:
        cls = model_class(config.get("architectures"))
    except ValueError as e:
        raise FileFormatError(os.path.join(os.fspath(directory), CONFIG_NAME), str(e)) from None
    device_map = {"": str(torch.device(device))}
    with building():  # transformers' construction changes process-wide state: one at a time
        try:
            model, info = cls.from_pretrained(os.fspath(directory), dtype=dtype if dtype is not None else "auto",
                                              device_map=device_map, output_loading_info=True)
        except (FileFormatError, ImportError, OSError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - what transformers makes of a config it cannot build
            if not _config_error(e):
                raise
            raise FileFormatError(os.path.join(os.fspath(directory), CONFIG_NAME),
                                  f"transformers cannot build the model it describes: {type(e).__name__}: {e}") from None
    missing = sorted(set(info.get("missing_keys") or ()) | {k[0] if isinstance(k, tuple) else k
                                                            for k in info.get("mismatched_keys") or ()})
    if missing:  # transformers would have filled them at random
        raise FileFormatError(os.path.join(os.fspath(directory), CONFIG_NAME),
                              f"the model it describes has weights the directory does not hold: "
                              f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    return model.eval()


def _config_error(e: Exception) -> bool:
    """Whether an exception from transformers' from_pretrained is its reaction to config.json's
    values (a wrong type, a size of 0, an unknown name) rather than a failure of fewbits' own."""
    kinds = (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError, OverflowError,
             IndexError)
    return isinstance(e, kinds) or type(e).__name__.startswith("StrictDataclass")


def _standard_format(directory):
    """The StandardFormat fewbits reads (compressed-tensors, GPTQ) that a directory's config.json
    names, else None."""
    from .standard_formats import STANDARD_FORMATS

    config_path = os.path.join(os.fspath(directory), CONFIG_NAME)
    if not os.path.isfile(config_path):
        return None
    from .hf_dir import _read_json
    config = _read_json(config_path, "config.json")
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    standard = STANDARD_FORMATS.get(method) if isinstance(method, str) else None
    return standard if standard is not None and standard.reads else None


def _from_standard(standard, directory, *, device, dtype) -> nn.Module:
    """A compressed-tensors or GPTQ directory as a fewbits model: its codes and scales become
    QuantizedTensors as they are (StandardFormat.to_fewbits, which checks the directory first),
    written to a temporary fewbits directory and loaded from it."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="fewbits-standard-")
    try:
        converted = standard.to_fewbits(directory, os.path.join(work, "model"))
        try:
            return from_pretrained(converted, device=device, dtype=dtype)
        except FileFormatError as e:  # name the user's directory, not the temporary one
            raise FileFormatError(os.fspath(directory), e.problem) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _from_gguf(path, *, device, dtype) -> nn.Module:
    """A llama GGUF file as a quantized model: its block tensors become QuantizedTensors as they
    are (fewbits.files.gguf_reader, which checks the file first), written to a temporary fewbits
    directory and loaded from it. Float parameters default to float32: a GGUF's F32 norms and
    float layers keep their precision, and an F16 one is widened exactly."""
    import shutil
    import tempfile

    from .gguf_reader import gguf_to_pretrained

    path = os.fspath(path)
    work = tempfile.mkdtemp(prefix="fewbits-gguf-")
    try:
        directory = gguf_to_pretrained(path, os.path.join(work, "model"))
        try:
            # tensors memory-mapped from the files stay valid once the files are unlinked (POSIX)
            return from_pretrained(directory, device=device, dtype=dtype if dtype is not None else torch.float32)
        except FileFormatError as e:  # name the user's file, not the temporary directory
            raise FileFormatError(path, e.problem) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["from_pretrained"]
