"""File formats: the fewbits safetensors format (fb.save / fb.load). Sits above quant and train;
nothing below imports it."""
from .safetensors_format import FileFormatError, load, save

__all__ = ["save", "load", "FileFormatError"]
