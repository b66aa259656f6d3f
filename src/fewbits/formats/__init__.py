"""Number formats as data: descriptors, the named registry, the exact scalar reference, and what
a number becomes in each format (explanation.py: the data behind `fewbits explain` and `fewbits formats`)."""
from .base import OVERFLOW_POLICIES, OVERFLOW_PRESETS, Format
from .floats import SPECIALS, FloatFormat
from .integers import IntFormat
from .lookup import IQ4_NL_VALUES, NF4_VALUES, LookupFormat
from .reference import MODE_PRESETS, MODES, check_mode, decode_value, encode_value, round_value
from .names import normalize_name, register
from .registry import FLOAT_DTYPES, aliases_of, describe, get_format, list_formats, torch_dtype
from .explanation import binade_table, code_table, explain, format_summary

__all__ = [
    "Format", "FloatFormat", "IntFormat", "LookupFormat", "NF4_VALUES", "IQ4_NL_VALUES", "SPECIALS", "MODES", "MODE_PRESETS",
    "OVERFLOW_POLICIES", "OVERFLOW_PRESETS", "get_format", "list_formats", "register", "torch_dtype", "normalize_name", "FLOAT_DTYPES", "describe", "aliases_of",
    "round_value", "encode_value", "decode_value", "check_mode",
    "explain", "format_summary", "code_table", "binade_table",
]
