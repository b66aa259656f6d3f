"""Reading a llama GGUF file (fewbits' own, or llama.cpp's) as a quantized fewbits model, without
ever building its float weights: `fb.from_pretrained("model.gguf")`.

read_gguf(path) gives the transformers config (transformers' own GGUF metadata reader) and a
tensor mapping in Hugging Face names: every tensor in a GGUF block type fewbits has (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) becomes a QuantizedTensor of the matching preset
(fewbits.files.gguf_blocks.decode_blocks: its dequantize() equals gguf.quants.dequantize of the
bytes, bit for bit), F32 / F16 / BF16 tensors float tensors; the q/k rows llama.cpp's converter
permuted are put back in transformers' order (whole block rows move, so nothing is re-rounded).
A tied embedding stored in a block type is used for the output head too: the head gets the same
QuantizedTensor (tie_word_embeddings is then False in the config, as fewbits' modules hold their
weights themselves).

gguf_to_pretrained(path, out_dir) writes that as a fewbits Hugging Face directory (with the
tokenizer transformers builds from the GGUF), which from_pretrained loads. Everything is read
from the memory-mapped file and checked first: an architecture other than llama, a tensor of an
unknown name, type or shape, or a missing one, is a FileFormatError naming the file.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..quant.tensor import QuantizedTensor
from .gguf_blocks import GGUF_BLOCK_TYPES, decode_blocks
from .gguf_file import rotary_permutation
from .safetensors_format import FileFormatError

__all__ = ["read_gguf", "gguf_to_pretrained"]

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _config(path: str) -> dict:
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError:
        raise ImportError("reading a GGUF file needs transformers and gguf: pip install transformers gguf") from None
    try:
        cfg = load_gguf_checkpoint(path, return_tensors=False)["config"]
    except (ValueError, KeyError, OSError, IndexError, TypeError) as e:
        raise FileFormatError(path, f"not a GGUF model transformers can describe: {e}") from None
    if cfg.get("model_type") != "llama":
        raise FileFormatError(path, f"fb.from_pretrained reads llama GGUF files; this one is "
                                    f"{cfg.get('model_type')!r}")
    cfg.pop("_model_name_or_path", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    return cfg


def _expected_names(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{GGUF name: (Hugging Face name, torch shape)} of every tensor the config's model saves."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is not None:
            out[gname] = (name, tuple(t.shape))
    return out


def _reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise FileFormatError(path, f"not a readable GGUF file: {e}") from None


def read_gguf(path, reader=None) -> tuple[dict, dict]:
    """(config dict, {Hugging Face name: QuantizedTensor or float tensor}) of a llama GGUF file
    (see the module docstring). reader: a gguf.GGUFReader of it already made (parsing a large
    vocabulary takes a while)."""
    path = os.fspath(path)
    cfg = _config(path)
    reader = reader if reader is not None else _reader(path)
    expected = _expected_names(cfg)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg.get("num_key_value_heads") or cfg["num_attention_heads"]}
    tensors, problems = {}, []
    for t in reader.tensors:
        if t.name not in expected:
            problems.append(f"{t.name}: not a tensor of a llama model with {cfg['num_hidden_layers']} layers")
            continue
        name, shape = expected.pop(t.name)
        ggml = t.tensor_type.name
        given = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dimensions innermost first
        if given != shape:
            problems.append(f"{t.name}: shape {given}, the config says {shape}")
            continue
        data = np.asarray(t.data)
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else None
        if kind in heads:  # rows back into transformers' rotary order
            data = data.reshape(shape[0], -1)[torch.argsort(rotary_permutation(shape[0], heads[kind])).numpy()]
        if ggml in GGUF_BLOCK_TYPES:
            try:
                tensors[name] = decode_blocks(data, ggml, shape)
            except ValueError as e:
                problems.append(f"{t.name}: {e}")
        elif ggml in _FLOATS:
            raw = np.ascontiguousarray(data).reshape(-1)
            if ggml == "BF16":
                value = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
            else:
                value = torch.from_numpy(raw.copy())
            if value.numel() != int(np.prod(shape)):
                problems.append(f"{t.name}: {value.numel()} values for shape {shape}")
                continue
            tensors[name] = value.reshape(shape)
        else:
            problems.append(f"{t.name}: GGUF type {ggml} is not one fewbits reads (block types "
                            f"{', '.join(GGUF_BLOCK_TYPES)}, F32, F16, BF16)")
    if expected:
        problems.append(f"missing: {', '.join(sorted(expected)[:6])}")
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise FileFormatError(path, "; ".join(problems[:6]) + more)
    embedding = tensors.get("model.embed_tokens.weight")
    if cfg.get("tie_word_embeddings") and isinstance(embedding, QuantizedTensor):
        tensors["lm_head.weight"] = embedding
        cfg["tie_word_embeddings"] = False
    return cfg, tensors


def gguf_to_pretrained(path, out_dir, *, overwrite: bool = False) -> str:
    """Write the llama GGUF file `path` as a fewbits Hugging Face directory (quantized tensors
    kept as they are in the file) with its tokenizer; returns out_dir."""
    from transformers import AutoTokenizer, LlamaConfig

    from .hf_dir import ShardWriter

    path = os.fspath(path)
    reader = _reader(path)
    cfg, tensors = read_gguf(path, reader)
    field = reader.get_field("tokenizer.ggml.model")
    del reader
    tokenizer = None
    if field is not None and field.contents() != "none":  # "none": llama.cpp's model without a vocabulary
        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                      gguf_file=os.path.basename(path))
        except (ValueError, KeyError, OSError) as e:
            raise FileFormatError(path, f"its tokenizer cannot be read: {e}") from None
    with ShardWriter(out_dir, overwrite=overwrite) as writer:
        for name, value in tensors.items():
            writer.add(name, value)
        return writer.finish(LlamaConfig(**cfg), tokenizer)
