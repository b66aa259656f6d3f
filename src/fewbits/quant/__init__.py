"""Quantization: schemes, quantized tensors, quantized modules, model-level tools (files are in fewbits.files)."""
from .scheme import QuantScheme, get_scheme, list_schemes
from .tensor import QuantizedTensor, quantize

__all__ = ["QuantScheme", "QuantizedTensor", "get_scheme", "list_schemes", "quantize"]
