"""fewbits: reduced numeric precision made practical for PyTorch users."""
from .formats import (
    MODES, OVERFLOW_POLICIES, FloatFormat, Format, IntFormat, LookupFormat, get_format, list_formats,
)
from .formats.explain import explain
from .kernels import decode, encode, pack, round, unpack, use_backend

__version__ = "0.1.0"

__all__ = [
    "Format", "FloatFormat", "IntFormat", "LookupFormat", "MODES", "OVERFLOW_POLICIES",
    "get_format", "list_formats", "explain", "round", "encode", "decode", "pack", "unpack", "use_backend",
]
