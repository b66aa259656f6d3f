"""fewbits: reduced numeric precision made practical for PyTorch users."""
# numpy before torch: torch's C extension imports numpy while it initializes and swallows any
# exception that import raises, a KeyboardInterrupt included, so a Ctrl-C at start-up went
# unnoticed (or failed later as numpy's "cannot load module more than once per process").
import numpy  # noqa: F401

from ._version import __version__  # noqa: F401
from .formats import (
    MODES, OVERFLOW_POLICIES, FloatFormat, Format, IntFormat, LookupFormat, get_format, list_formats,
)
from .formats.explain import explain
from .kernels import decode, encode, pack, round, unpack, use_backend
from .quant import QuantizedTensor, QuantScheme, get_scheme, list_schemes, quantize
from .quant.model import model_nbytes, quantize_model
from .quant.modules import QuantEmbedding, QuantLinear
from .quant.qat import convert_qat, prepare_qat
from .quant.sensitivity import allocate_bits, apply_allocation, layer_sensitivity
from .train import Engine, LossScaler, Policy
from .memory import estimate_memory
from .files import load, save

__all__ = [
    # formats and kernels
    "Format", "FloatFormat", "IntFormat", "LookupFormat", "MODES", "OVERFLOW_POLICIES",
    "get_format", "list_formats", "explain", "round", "encode", "decode", "pack", "unpack", "use_backend",
    # quantization
    "QuantScheme", "QuantizedTensor", "get_scheme", "list_schemes", "quantize", "quantize_model",
    "model_nbytes", "save", "load", "QuantLinear", "QuantEmbedding", "prepare_qat", "convert_qat",
    "layer_sensitivity", "allocate_bits", "apply_allocation",
    # training, memory
    "Policy", "Engine", "LossScaler", "estimate_memory",
]
