"""Synthetic Llama-architecture models written as Hugging Face directories, for scale tests.

No model hub is reachable here, so models larger than the packaged ones are made up: the shapes
of real Llama-family models (SmolLM2-135M, Llama-3.2-1B and -3B, Llama-3.1-8B) with random
weights (normal, std 0.02; norms 1), written tensor by tensor as safetensors shards with an index
and a config.json, the way `save_pretrained` writes them. The writer holds one shard's tensors at
a time, so a model larger than memory can be written. Their outputs mean nothing; what they
measure is time and memory of the work done on them (quantization, loading).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from ._deps import TRANSFORMERS_HINT, require_modules

__all__ = ["LLAMA_SHAPES", "synthetic_llama_config", "write_synthetic_llama"]

# name -> (hidden, intermediate, layers, attention heads, key/value heads, vocabulary, tied embeddings)
LLAMA_SHAPES = {
    "135m": (576, 1536, 30, 9, 3, 49152, True),     # SmolLM2-135M
    "1b": (2048, 8192, 16, 32, 8, 128256, True),    # Llama-3.2-1B
    "3b": (3072, 8192, 28, 24, 8, 128256, True),    # Llama-3.2-3B
    "8b": (4096, 14336, 32, 32, 8, 128256, False),  # Llama-3.1-8B
}


def synthetic_llama_config(size: str, **changes):
    """A transformers LlamaConfig with the shapes of LLAMA_SHAPES[size] ("135m", "1b", "3b",
    "8b"); keyword arguments override fields (num_hidden_layers=2 for a short model)."""
    require_modules("a synthetic Llama model", ("transformers",), TRANSFORMERS_HINT)
    from transformers import LlamaConfig

    if size not in LLAMA_SHAPES:
        raise ValueError(f"unknown synthetic model size {size!r}; sizes: {', '.join(LLAMA_SHAPES)}")
    hidden, inter, layers, heads, kv, vocab, tied = LLAMA_SHAPES[size]
    fields = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=500000.0, architectures=["LlamaForCausalLM"])
    fields.update(changes)
    return LlamaConfig(**fields)


def _parameter_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every saved parameter, in the model's order, from a meta-device build."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items()
            if not (config.tie_word_embeddings and n == "lm_head.weight")]


def write_synthetic_llama(path, config, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                          shard_bytes: int = 1 << 30, overwrite: bool = False,
                          norm_range: tuple[float, float] | None = None) -> dict:
    """Write a random model of `config` (a LlamaConfig, or a size name of LLAMA_SHAPES) to the
    directory `path`: config.json, model-XXXXX-of-YYYYY.safetensors shards of at most about
    `shard_bytes`, model.safetensors.index.json. Returns {"parameters", "bytes", "shards"}.
    The directory is built beside `path` and renamed when complete. norm_range (low, high):
    the norms' weights drawn uniformly from it (a test that a norm is read at its own
    precision needs them unlike 1.0); None: all ones."""
    from safetensors.torch import save_file

    if isinstance(config, str):
        config = synthetic_llama_config(config)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    building = path.with_name(f".{path.name}.building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = _parameter_shapes(config)
    element = torch.empty((), dtype=dtype).element_size()
    groups, current, size = [], [], 0
    for name, shape in shapes:
        n = math.prod(shape) * element
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += n
    groups.append(current)
    weight_map, total, params = {}, 0, 0
    try:
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for name, shape in group:
                if name.endswith("norm.weight") and norm_range is not None:
                    low, high = norm_range
                    t = (low + (high - low) * torch.rand(shape, generator=generator)).to(dtype)
                elif name.endswith("norm.weight"):
                    t = torch.ones(shape, dtype=dtype)
                else:
                    t = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
                tensors[name] = t
                weight_map[name] = file
                total += t.nbytes
                params += t.numel()
            save_file(tensors, str(building / file), metadata={"format": "pt"})
            del tensors
        with open(building / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        config.dtype = dtype
        config.to_json_file(str(building / "config.json"))
        if path.exists():
            shutil.rmtree(path)
        os.replace(building, path)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return {"parameters": params, "bytes": total, "shards": len(groups)}
