"""File formats: the fewbits safetensors format (fb.save / fb.load). Sits above quant and train;
nothing below imports it."""
from .safetensors_format import FileFormatError, load, save
from .gguf_file import gguf_recipe, write_gguf

__all__ = ["save", "load", "FileFormatError", "write_gguf", "gguf_recipe"]
