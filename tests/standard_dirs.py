"""Helpers shared by the tests of the standard directory formats (compressed-tensors, GPTQ,
bitsandbytes): a tiny random Llama, and a fewbits-quantized model written in one of the formats."""
from __future__ import annotations

import warnings

import torch

import fewbits as fb
from fewbits.files.hf_dir import read_tensors


def tiny_llama(seed: int = 0, **config):
    """A 1-layer LlamaForCausalLM (hidden 128, intermediate 256, 4 heads, 2 KV heads, vocabulary
    128; `config` overrides), random weights from `seed`, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128), **config})
    return transformers.LlamaForCausalLM(cfg).eval()


def export(model, tmp_path, fmt, quiet: bool = False):
    """`model` (fewbits-quantized) saved as a fewbits directory, then written by StandardFormat
    `fmt` to tmp_path / fmt.name; quiet: without the warning a mixed plan gives for vLLM."""
    src, out = tmp_path / "fewbits", tmp_path / fmt.name
    fb.save_pretrained(model, src)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        fmt.write(out, read_tensors(src))
    return out


def quantized_modules(model) -> dict:
    return {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}


def narrow_llama_dir(tmp_path, monkeypatch):
    """A 96-wide Llama saved in float as tmp_path / "src" (no group of 64 or 128 divides its
    width), with hf_dir's ShardWriter removed so that writing anything fails: a conversion of it
    must refuse before any work. monkeypatch.undo() restores the writer."""
    from fewbits.files import hf_dir

    src = tmp_path / "src"
    tiny_llama(hidden_size=96, intermediate_size=192, vocab_size=64).save_pretrained(src)
    monkeypatch.setattr(hf_dir, "ShardWriter", None)  # nothing may be written before the checks
    return src
