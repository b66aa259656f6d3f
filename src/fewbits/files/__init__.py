"""File formats: the fewbits safetensors format (fb.save / fb.load). Sits above quant and train;
nothing below imports it."""
from .safetensors_format import FileFormatError, load, save
from .gguf_file import gguf_recipe, write_gguf
from .gguf_header import GGUFHeader, GGUFTensorInfo, GGUFValue, read_header
from .gguf_reader import check_gguf, gguf_to_float_pretrained, gguf_to_pretrained, llama_config, read_gguf
from .hf_dir import ShardWriter, read_tensors, save_pretrained
from .streaming import ConversionSummary, model_skeleton, quantize_pretrained
from .conversion import FORMATS, convert, float_matrices, formats_for
from .standard_formats import STANDARD_FORMATS
from .standard_dir import StandardFormat
from .compressed_tensors import write_compressed_tensors
from .gptq_format import write_gptq
from .bnb_format import write_bitsandbytes
from .hf_quantizer import from_pretrained, install as _install_transformers_quantizer

_install_transformers_quantizer()  # lazily: registers when transformers' quantizers are imported

__all__ = ["save", "load", "FileFormatError", "write_gguf", "gguf_recipe", "from_pretrained", "save_pretrained",
           "ShardWriter", "read_tensors", "quantize_pretrained", "model_skeleton", "ConversionSummary", "convert",
           "FORMATS", "read_gguf", "gguf_to_pretrained", "gguf_to_float_pretrained", "check_gguf", "llama_config",
           "read_header", "GGUFHeader", "GGUFTensorInfo", "GGUFValue", "float_matrices", "formats_for",
           "write_compressed_tensors", "write_gptq", "write_bitsandbytes", "StandardFormat", "STANDARD_FORMATS"]
