"""The standard directory formats fewbits writes (and, where `reads`, reads), by --format name:
compressed-tensors, gptq, bitsandbytes (fewbits.files.standard_dir.StandardFormat instances)."""
from __future__ import annotations

from . import bnb_format, compressed_tensors, gptq_format

STANDARD_FORMATS = {f.name: f for f in (compressed_tensors.FORMAT, gptq_format.FORMAT, bnb_format.FORMAT)}

__all__ = ["STANDARD_FORMATS"]
