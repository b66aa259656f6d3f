"""fewbits: reduced numeric precision made practical for PyTorch users."""
# numpy before torch: torch's C extension imports numpy while it initializes and swallows any
# exception that import raises, a KeyboardInterrupt included, so a Ctrl-C at start-up went
# unnoticed (or failed later as numpy's "cannot load module more than once per process").
import numpy  # noqa: F401

from ._version import __version__  # noqa: F401
from .formats import (
    MODES, OVERFLOW_POLICIES, FloatFormat, Format, IntFormat, LookupFormat, explain, get_format, list_formats,
)
from .kernels import decode, encode, pack, round, unpack, use_backend
from .quant import (
    QuantEmbedding, QuantizedTensor, QuantLinear, QuantScheme, allocate_bits, apply_allocation, convert_qat,
    get_scheme, layer_sensitivity, list_schemes, model_nbytes, prepare_qat, quantize, quantize_model,
)
from .train import Engine, LossScaler, Policy
from .memory import estimate_memory
from .files import from_pretrained, load, save, save_pretrained

__all__ = [
    # formats and kernels
    "Format", "FloatFormat", "IntFormat", "LookupFormat", "MODES", "OVERFLOW_POLICIES",
    "get_format", "list_formats", "explain", "round", "encode", "decode", "pack", "unpack", "use_backend",
    # quantization
    "QuantScheme", "QuantizedTensor", "get_scheme", "list_schemes", "quantize", "quantize_model",
    "model_nbytes", "save", "load", "from_pretrained", "save_pretrained", "QuantLinear", "QuantEmbedding",
    "prepare_qat", "convert_qat",
    "layer_sensitivity", "allocate_bits", "apply_allocation",
    # training, memory
    "Policy", "Engine", "LossScaler", "estimate_memory",
]
