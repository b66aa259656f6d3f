"""GGUF files that llama.cpp and transformers load: write_gguf() and the llama.cpp type recipes.

write_gguf(path, tensors, config, tokenizer) writes a model given as a tensor mapping (Hugging Face
parameter names -> float torch.Tensor or QuantizedTensor, possibly lazy) with the `gguf` package's
GGUFWriter, the tensor names of `gguf.get_tensor_name_map`, the metadata keys llama.cpp reads
(`gguf.Keys`) and the tokenizer as `tokenizer.ggml.*` metadata. The architectures:

- LlamaForCausalLM (SmolLM2, Llama-family configs), GGUF arch "llama". Written keys:
  general.architecture, general.type, general.name (when the config names the model),
  general.file_type, general.quantization_version (when a tensor is quantized), llama.vocab_size,
  llama.context_length, llama.embedding_length, llama.block_count, llama.feed_forward_length,
  llama.attention.head_count, llama.attention.head_count_kv, llama.rope.freq_base,
  llama.rope.dimension_count, llama.attention.layer_norm_rms_epsilon (llama.attention.key_length /
  value_length only where head_dim differs from hidden_size / heads; llama.rope.scaling.type =
  linear and llama.rope.scaling.factor for a linear rope scaling, the one scaling written).
  q_proj / k_proj rows are permuted as llama.cpp's converter does (its rotary embedding pairs
  neighbouring rows, transformers' pairs the two halves of each head); transformers' GGUF loader
  permutes them back. Tied
  embeddings: token_embd.weight serves as the output too, and no output.weight is written
  (an lm_head.weight in the mapping is skipped).
- The other decoders, under their own GGUF arch, with llama's keys and these differences:
  MistralForCausalLM as "llama"; Qwen2ForCausalLM "qwen2" (q/k/v biases), Qwen3ForCausalLM
  "qwen3" (attn_q_norm / attn_k_norm), both with rows as transformers holds them; Phi3ForCausalLM
  "phi3" (attn_qkv, and ffn_up of gate and up's rows; a sliding window warns: llama.cpp turns it
  off); Gemma3ForCausalLM "gemma3" (attn_q_norm / attn_k_norm, post_attention_norm,
  post_ffw_norm; every norm written as 1 + weight in float32, the factor Gemma multiplies by;
  key_length / value_length always; attention.sliding_window, attention.sliding_window_pattern
  (n when every n-th layer is full, else one bool per layer) and rope.freq_base_swa where some
  layer slides; final_logit_softcapping where set); Gemma2ForCausalLM "gemma2" (as gemma3 without
  q/k norms and with one RoPE base, attn_logit_softcapping and final_logit_softcapping always,
  the embedding always tied, as llama.cpp's gemma2 reads them). The llama.cpp these files are checked with
  (llama-cpp-python 0.3.36's) reads all of these keys; older builds took Gemma 3's pattern as 6
  and its sliding RoPE base as 10000, Gemma's own values.
- BertModel (all-MiniLM-L6-v2), GGUF arch "bert": token_embd, token_types, position_embd,
  token_embd_norm, per block attn_q/k/v, attn_output, attn_output_norm, ffn_up, ffn_down,
  layer_output_norm, every one with its bias. Keys: general.*, bert.vocab_size,
  bert.context_length, bert.embedding_length, bert.block_count, bert.feed_forward_length,
  bert.attention.head_count, bert.attention.layer_norm_epsilon, bert.attention.causal = false,
  bert.pooling_type = MEAN (the pooling of sentence-transformers' all-MiniLM-L6-v2). The pooler
  (pooler.dense) is not written, as in llama.cpp's converter ("only using BERT for embeddings").

Tokenizer (`tokenizer=`: a transformers fast tokenizer, or a directory with tokenizer files):
tokenizer.ggml.model "gpt2" (byte-level BPE: tokens, token_type, merges, tokenizer.ggml.pre) for
the decoders and "bert" (WordPiece: the vocabulary in llama.cpp's "phantom space" spelling, "##x" -> "x",
other non-control tokens "\u2581x"; token_type_count) for BERT; the special token ids, the
add_bos/add_eos/add_sep flags and the chat template come from `gguf.SpecialVocab` (the rules of
llama.cpp's converter), add_bos/add_eos not set by those from what the tokenizer does (whether it
puts the bos/eos token around "a"). Or a GGUF file: its tokenizer.* keys are written as they are,
once checked as the reader checks a vocabulary (a model read from a GGUF keeps its own, Gemma's
SentencePiece one included). Without a tokenizer, tokenizer.ggml.model is "none" (llama.cpp's
vocabulary-less model: it loads, but cannot turn text into tokens), with the config's bos / eos /
pad ids, from which transformers' GGUF loader builds its config.

Tensor types: a QuantizedTensor in a GGUF block scheme (fewbits.files.gguf_blocks: q8_0, q4_0, q4_1,
q5_0, q5_1 and the k-quants) is written as those blocks, bit for bit; float tensors as F32 when
1-D (norms, biases) and for position_embd / token_types (as llama.cpp's converter: they are read
with get_rows in F32), otherwise in their dtype (float32 -> F32, float16 -> F16, bfloat16 -> BF16;
float64 -> F32, rounded). The tensors are read in two passes (names, shapes and types; then the
data one tensor at a time) and the data is written tensor by tensor, so memory stays at about one
tensor. Everything is checked before the file is opened: an unsupported architecture, tokenizer
or rope type, a tensor that does not belong to the architecture or a missing one, a scheme with
no GGUF type (nf4, mxfp4, int4 with groups of 128, ...), a row length the block type cannot hold:
a ValueError naming the tensor, the problem and the supported choices. The write is atomic
(fewbits.atomic.replacing); an existing path is refused unless overwrite=True.

Deliberate differences from llama.cpp's convert_hf_to_gguf.py:
- tokenizer.ggml.pre is chosen from the structure of the tokenizer's pre-tokenizer
  (ByteLevel with its regex -> "gpt-2"; Digits(individual) + ByteLevel -> "smollm"; the Llama-3
  split regex + ByteLevel -> "llama-bpe"), not from a hash of a sample text's tokens; any other
  pre-tokenizer is refused. So SmolLM2's own tokenizer gives "smollm", as the converter does, but
  the tokenizer fewbits caches for the packaged SmolLM2 (rebuilt by transformers from the GGUF,
  without the digit split) gives "gpt-2": that is how that tokenizer splits text; on SmolLM2's
  vocabulary, which merges no ASCII digits, both give the same tokens for ASCII text.
- Added tokens: CONTROL when special or spelled <|...|>, else USER_DEFINED; the converter also
  renormalizes non-normalized added tokens and knows a few more special-looking spellings.
- BERT: tokenizer.ggml.pre is not written (llama.cpp uses none for WordPiece); the pooling type is
  always MEAN (the converter reads sentence-transformers' modules.json); the head count of keys
  and values is written only for llama (llama.cpp takes the head count for BERT).
- general.file_type is `file_type=` (a recipe name such as "q4_k_m", or "f32"/"f16"/"bf16") or,
  without it, inferred from the tensors: the GGUF type of the most 2-D weights (Q4_K/Q5_K count
  as Q4_K_M/Q5_K_M when Q6_K tensors are present, else as the _S mixes; Q3_K as Q3_K_M with Q4_K
  tensors, Q3_K_L with Q5_K ones, else Q3_K_S; Q2_K as llama.cpp's Q2_K mix with Q3_K tensors,
  else Q2_K_S). llama.cpp writes the
  file type it was asked for; the value is informative for llama.cpp.
- general.* descriptions (license, tags, base models, ...) and the sampling keys are not written:
  a config does not hold them; general.name is the basename of the config's name_or_path.

gguf_recipe(name, config) -> {module name: scheme name or None}: which GGUF type each Linear and
the token embedding gets, llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) rules:
- uniform "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k": every
  tensor in that type,
  as `llama-quantize --pure` (plain `llama-quantize Q4_0` also puts the output matrix, or the tied
  embedding, in Q6_K);
- "q4_k_m", "q5_k_m": Q4_K / Q5_K, with attn_v and ffn_down in Q6_K on the layers
  `use_more_bits` picks (the first and last eighth, and every third layer between), the output
  matrix (or the tied embedding, and BERT's embedding, which llama.cpp treats as tied since the
  file has no output.weight) in Q6_K, or in Q8_0 when its rows are not a multiple of 256;
- "q4_k_s": Q4_K, with attn_v of the first 4 layers and ffn_down of the first eighth in Q5_K, the
  output (tied embedding) as above;
- "q3_k_s": Q3_K, the output as above; "q3_k_m": Q3_K with attn_v in Q5_K on the first 2 layers
  and Q4_K after, ffn_down in Q5_K on the first sixteenth of the layers and Q4_K after,
  attn_output in Q4_K; "q3_k_l": Q3_K with attn_v, ffn_down and attn_output in Q5_K;
- "q2_k_m" (what llama-quantize calls Q2_K, file type MOSTLY_Q2_K; fewbits' "q2_k" is every
  tensor in Q2_K): Q2_K with ffn_down and attn_output in Q3_K, attn_v in Q3_K (Q4_K when the
  model has 4 or more query heads per key-value head); "q2_k_s": Q2_K with ffn_down of the first
  eighth in Q4_K and attn_v in Q4_K at 4 or more query heads per key-value head;
- then llama.cpp's fallback for rows that are not a multiple of the block: Q2_K, Q3_K -> Q4_0,
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (the llama.cpp of llama-cpp-python 0.3.36; older ones
  took IQ4_NL for Q2_K/Q3_K); a row that is not a multiple of 32 either stays in float (None).
Differences: llama.cpp refuses a legacy type on rows that are not a multiple of 32 (no fallback is
defined); here that tensor stays in float. The expert (MoE) and Falcon rules do not apply to these
architectures; the 70B rule is not reproduced: llama.cpp raises attn_v from Q3_K or Q4_K to Q5_K
on a model it types as 70B (80 layers: Llama with grouped-query attention, Qwen2), so on such a
model fewbits' q2_k_s / q2_k_m / q3_k_s / q3_k_m / q4_k_s give attn_v another type than llama.cpp.
BERT's pooler.dense is None (not written).
For a tied model the embedding's entry is the one matrix llama.cpp uses for input and output.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import typing
import warnings
from collections import Counter
from collections.abc import Mapping

import numpy as np
import torch

from ..atomic import replacing
from ..progress import counter
from ..quant.tensor import QuantizedTensor
from .gguf_blocks import GGUF_BLOCK_TYPES, encode_blocks, gguf_block_type

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                 "Phi3ForCausalLM": "phi3",
                 "BertModel": "bert"}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "phi3": "Phi3ForCausalLM",
                "bert": "BertModel"}
# the decoders: Llama's blocks (RMSNorm, rotary attention with grouped keys and values, SwiGLU);
# Qwen2 adds biases to q/k/v, Qwen3 RMSNorms of q and k per head; Gemma 3 (text) q/k norms, norms
# after attention and after the MLP, GELU (tanh), scaled embeddings and sliding-window layers; Phi-3
# Llama's blocks with q/k/v in one matrix (attn_qkv) and gate/up in one (ffn_up, 2 x ffn rows)
DECODERS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "Phi3ForCausalLM")
# Gemma 2 and 3: (1 + weight) norms, post norms, GELU (tanh), scaled embeddings, sliding windows;
# Gemma 2 also caps attention scores and logits (tanh), has no q/k norms and one RoPE base
GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# llama.cpp takes the query scale 1/sqrt(hidden / heads) for this many layers (the 27B models)
_GEMMA_27B_LAYERS = {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}
FUSED = ("Phi3ForCausalLM",)
# per block, the tensors each decoder's GGUF must have besides Llama's
_EXTRA_PER_BLOCK = {"Qwen2ForCausalLM": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                    "Qwen3ForCausalLM": ("attn_q_norm.weight", "attn_k_norm.weight"),
                    "Gemma3ForCausalLM": ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
                                          "post_ffw_norm.weight"),
                    "Gemma2ForCausalLM": ("post_attention_norm.weight", "post_ffw_norm.weight")}
# Gemma's RMSNorms multiply by (1 + weight); llama.cpp's converter stores 1 + weight (in float32
# here, as transformers computes it), so llama.cpp multiplies by the stored value
NORM_SHIFTED = ("gemma2", "gemma3")
# the transformers config class of each model_type the GGUF reader builds
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config"}


def _decoder(arch: str) -> bool:
    return arch in DECODERS


def rows_permuted(gguf_arch: str) -> bool:
    """Whether a GGUF architecture's q/k rows are permuted from transformers' order: llama.cpp's
    "llama" rotates neighbouring pairs of a head (RoPE type NORM) where transformers rotates its two
    halves; "qwen2" / "qwen3" rotate halves as transformers does (NEOX), so their rows are as they are."""
    return gguf_arch == "llama"


def _rotary_permuted(arch: str) -> bool:
    return rows_permuted(ARCHITECTURES[arch])


def norm_shifted(gguf_arch: str, gguf_name: str) -> bool:
    """Whether the GGUF tensor holds 1 + the Hugging Face weight (a Gemma RMSNorm's)."""
    return gguf_arch in NORM_SHIFTED and gguf_name.endswith("norm.weight")


# the transformers class each GGUF decoder architecture is read as (Mistral's files are "llama": Llama)
READ_CLASSES = {ARCHITECTURES[a]: a for a in reversed(DECODERS)}
UNIFORM_RECIPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
MIXED_RECIPES = {"q2_k_s": "Q2_K", "q2_k_m": "Q2_K", "q3_k_s": "Q3_K", "q3_k_m": "Q3_K", "q3_k_l": "Q3_K",
                 "q4_k_m": "Q4_K", "q4_k_s": "Q4_K", "q5_k_m": "Q5_K"}
RECIPES = UNIFORM_RECIPES + tuple(MIXED_RECIPES)
# llama.cpp's tensor_type_fallback for rows that are not a multiple of the block
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_CHUNK_VALUES = 1 << 22  # values encoded at a time (encode_blocks' int64 intermediates: 32 MiB)


@dataclasses.dataclass(frozen=True)
class GGUFSummary:
    """What write_gguf wrote: tensor count, the GGML types used with their tensor counts, the
    parameters, the bytes of tensor data and of the whole file, and bits per parameter (tensor
    data bits over parameters)."""
    path: str
    architecture: str
    tensors: int
    types: dict
    parameters: int
    tensor_bytes: int
    file_bytes: int
    bits_per_parameter: float


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency of the GGUF files
        raise ImportError("writing GGUF needs the gguf package: pip install gguf") from e
    return gguf


# ---------------------------------------------------------------------------------------------
# the model description: config, architecture, the quantizable modules
# ---------------------------------------------------------------------------------------------
def _config_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(f"config must be a transformers PretrainedConfig or a config.json dict, got "
                    f"{type(config).__name__}")


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    name = archs[0] if isinstance(archs, (list, tuple)) and archs else _MODEL_TYPES.get(cfg.get("model_type"))
    if name not in ARCHITECTURES:
        shown = name if name is not None else f"model_type {cfg.get('model_type')!r}"
        raise ValueError(f"GGUF export does not support the architecture {shown}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return name


def _need(cfg: dict, key: str, kind=int):
    value = cfg.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value <= 0):
        raise ValueError(f"config {key} must be a positive {kind.__name__}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class _Module:
    name: str        # the Hugging Face module name ("model.layers.0.self_attn.q_proj")
    category: str    # llama.cpp's tensor category: attn_q, attn_v, ffn_down, token_embd, output, ...
    layer: int       # block index, -1 outside the blocks
    row: int         # the row length (in_features; the hidden size for embeddings)


def _dims(cfg: dict, arch: str) -> dict:
    d = {k: _need(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "vocab_size", "max_position_embeddings")}
    if _decoder(arch):
        d["num_key_value_heads"] = cfg.get("num_key_value_heads") or d["num_attention_heads"]
        head_dim = cfg.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        d["head_dim"] = head_dim
        d["tied"] = bool(cfg.get("tie_word_embeddings", False))
    else:
        d["tied"] = True  # llama.cpp: no output.weight, so the embedding counts as tied
    return d


def _modules(cfg: dict, arch: str) -> list[_Module]:
    """The quantizable modules (Linears and the token embedding) in llama.cpp's order."""
    d = _dims(cfg, arch)
    h, ff, n = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    if _decoder(arch):
        mods = [_Module("model.embed_tokens", "token_embd", -1, h)]
        o_in = d["num_attention_heads"] * d["head_dim"]
        for i in range(n):
            p = f"model.layers.{i}."
            if arch in FUSED:  # Phi-3: q/k/v and gate/up each one matrix
                mods += [_Module(p + "self_attn.qkv_proj", "attn_qkv", i, h),
                         _Module(p + "self_attn.o_proj", "attn_output", i, o_in),
                         _Module(p + "mlp.gate_up_proj", "ffn_up", i, h), _Module(p + "mlp.down_proj", "ffn_down", i, ff)]
                continue
            mods += [_Module(p + "self_attn.q_proj", "attn_q", i, h), _Module(p + "self_attn.k_proj", "attn_k", i, h),
                     _Module(p + "self_attn.v_proj", "attn_v", i, h),
                     _Module(p + "self_attn.o_proj", "attn_output", i, o_in),
                     _Module(p + "mlp.gate_proj", "ffn_gate", i, h), _Module(p + "mlp.up_proj", "ffn_up", i, h),
                     _Module(p + "mlp.down_proj", "ffn_down", i, ff)]
        if not d["tied"]:
            mods.append(_Module("lm_head", "output", -1, h))
        return mods
    mods = [_Module("embeddings.word_embeddings", "token_embd", -1, h)]
    for i in range(n):
        p = f"encoder.layer.{i}."
        mods += [_Module(p + "attention.self.query", "attn_q", i, h), _Module(p + "attention.self.key", "attn_k", i, h),
                 _Module(p + "attention.self.value", "attn_v", i, h),
                 _Module(p + "attention.output.dense", "attn_output", i, h),
                 _Module(p + "intermediate.dense", "ffn_up", i, h), _Module(p + "output.dense", "ffn_down", i, ff)]
    mods.append(_Module("pooler.dense", "pooler", -1, h))
    return mods


# ---------------------------------------------------------------------------------------------
# gguf_recipe
# ---------------------------------------------------------------------------------------------
def _block(type_name: str) -> int:
    gguf = _gguf()
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class RecipeChoice(typing.NamedTuple):
    """One module's type under a llama.cpp recipe (gguf_recipe_types): the GGML type written (None:
    kept in float, or not written); the mix's rule that chose a type other than the recipe's own
    (None: no rule); the type the row length did not fit (None: it fitted) -- llama.cpp then falls
    back (Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) or the tensor stays in float -- with that
    type's block, and the row length."""
    type: str | None
    rule: str | None
    unfit: str | None
    unfit_block: int | None
    row: int


def _mix_rule(recipe: str, m: _Module, n_layers: int, gqa: float) -> tuple[str | None, str | None]:
    """(the type, the rule's words) a llama.cpp mix gives attn_v, ffn_down or attn_output of
    layer m.layer instead of its base type; (None, None) where no rule applies."""
    i, cat = m.layer, m.category
    if cat == "attn_v":
        if recipe == "q2_k_m":
            return ("Q4_K" if gqa >= 4 else "Q3_K"), f"{recipe}'s attn_v (grouped-query ratio {gqa:g})"
        if recipe == "q2_k_s" and gqa >= 4:
            return "Q4_K", f"{recipe}'s attn_v (grouped-query ratio {gqa:g})"
        if recipe == "q3_k_m":
            return ("Q5_K" if i < 2 else "Q4_K"), f"{recipe}'s more bits for attn_v"
        if recipe == "q3_k_l":
            return "Q5_K", f"{recipe}'s more bits for attn_v"
        if recipe in ("q4_k_m", "q5_k_m") and _use_more_bits(i, n_layers):
            return "Q6_K", f"{recipe}'s more bits for attn_v and ffn_down of some layers"
        if recipe == "q4_k_s" and i < 4:
            return "Q5_K", f"{recipe}'s more bits for attn_v of the first 4 layers"
    elif cat == "ffn_down":
        if recipe == "q2_k_m":
            return "Q3_K", f"{recipe}'s ffn_down"
        if recipe == "q2_k_s" and i < n_layers // 8:
            return "Q4_K", f"{recipe}'s more bits for ffn_down of the first eighth of the layers"
        if recipe == "q3_k_m":
            return ("Q5_K" if i < n_layers // 16 else "Q4_K"), f"{recipe}'s more bits for ffn_down"
        if recipe == "q3_k_l":
            return "Q5_K", f"{recipe}'s more bits for ffn_down"
        if recipe in ("q4_k_m", "q5_k_m") and _use_more_bits(i, n_layers):
            return "Q6_K", f"{recipe}'s more bits for attn_v and ffn_down of some layers"
        if recipe == "q4_k_s" and i < n_layers // 8:
            return "Q5_K", f"{recipe}'s more bits for ffn_down of the first eighth of the layers"
    elif cat == "attn_output":
        more = {"q2_k_m": "Q3_K", "q3_k_m": "Q4_K", "q3_k_l": "Q5_K"}.get(recipe)
        if more is not None:
            return more, f"{recipe}'s more bits for attn_output"
    elif cat == "attn_qkv":  # a fused q/k/v (Phi-3)
        more = {"q3_k_m": "Q4_K", "q3_k_l": "Q4_K", "q4_k_m": "Q5_K", "q5_k_m": "Q6_K"}.get(recipe)
        if more is not None:
            return more, f"{recipe}'s more bits for attn_qkv"
    return None, None


def _recipe_type(recipe: str, m: _Module, n_layers: int, tied: bool, gqa: float) -> RecipeChoice:
    rule = None
    if recipe in UNIFORM_RECIPES:
        t = recipe.upper()
    else:
        t = MIXED_RECIPES[recipe]
        if m.category == "output" or (m.category == "token_embd" and tied):
            t, rule = "Q6_K", f"{recipe}'s output layer"  # llama.cpp: Q8_0 where the row does not fit Q6_K
        else:
            more, why = _mix_rule(recipe, m, n_layers, gqa)
            if more is not None:
                t, rule = more, why
    if m.row % _block(t):
        wanted, t = t, _FALLBACK.get(t)
        if t is not None and m.row % _block(t):
            t = None
        return RecipeChoice(t, rule, wanted, _block(wanted), m.row)
    return RecipeChoice(t, rule, None, None, m.row)


def _scheme_of(type_name: str) -> str:
    if type_name not in GGUF_BLOCK_TYPES:
        raise ValueError(f"GGUF type {type_name} has no fewbits scheme in this version; the GGUF block "
                         f"schemes are {', '.join(p for p, _, _ in GGUF_BLOCK_TYPES.values())}")
    return GGUF_BLOCK_TYPES[type_name][0]


def gguf_recipe(name: str, config) -> dict[str, str | None]:
    """{module name: fewbits scheme name, or None for float} for llama.cpp's type recipe `name`
    (one of RECIPES: "q8_0", "q4_0", ..., "q3_k_m", "q4_k_m", ...) on a model with this config
    (a decoder or BertModel): every Linear and the token embedding (for a tied model the
    embedding stands for the output too). See the module
    docstring for the rules and their differences from llama.cpp."""
    return {m: None if c.type is None else _scheme_of(c.type) for m, c in gguf_recipe_types(name, config).items()}


def gguf_recipe_types(name: str, config) -> dict[str, RecipeChoice]:
    """gguf_recipe with its reasons: {module name: RecipeChoice} -- the GGML type (None for float),
    the mix's rule and the row length that chose it where it is not the recipe's own."""
    if not isinstance(name, str) or name.lower() not in RECIPES:
        raise ValueError(f"unknown GGUF recipe {name!r}; recipes: {', '.join(RECIPES)}")
    recipe = name.lower()
    cfg = _config_dict(config)
    arch = _architecture(cfg)
    d = _dims(cfg, arch)
    gqa = d["num_attention_heads"] / d.get("num_key_value_heads", d["num_attention_heads"])  # query heads per kv head
    out = {}
    for m in _modules(cfg, arch):
        if m.category == "pooler":
            out[m.name] = RecipeChoice(None, "BERT's pooler is not written", None, None, m.row)
        else:
            out[m.name] = _recipe_type(recipe, m, d["num_hidden_layers"], d["tied"], gqa)
    return out


# ---------------------------------------------------------------------------------------------
# the tensors: plan (pass 1) and data (pass 2)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Entry:
    name: str            # key in the mapping
    gguf_name: str
    shape: tuple         # torch shape
    ggml: str            # GGML type name
    quantized: bool
    nbytes: int
    heads: int | None    # q/k row permutation over this many heads (llama), else None
    shift: bool = False  # written as 1 + the value (a Gemma norm), in float32


def _skipped(name: str, arch: str, tied: bool) -> bool:
    """Tensors a state dict holds that the GGUF does not: rotary buffers, BERT's position ids and
    pooler, a tied lm_head."""
    if name.endswith("rotary_emb.inv_freq") or name == "embeddings.position_ids":
        return True
    if arch == "BertModel":
        return name.startswith("pooler.")
    return tied and name == "lm_head.weight"


_FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F32"}
_ALWAYS_F32 = ("position_embd.weight", "token_types.weight")


def _required(cfg: dict, arch: str) -> list[str]:
    d = _dims(cfg, arch)
    n = d["num_hidden_layers"]
    if _decoder(arch):
        names = ["token_embd.weight", "output_norm.weight"] + ([] if d["tied"] else ["output.weight"])
        per = ["attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
               "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
               *_EXTRA_PER_BLOCK.get(arch, ())]
        if arch in FUSED:
            per = ["attn_norm.weight", "ffn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                   "ffn_down.weight"]
    else:
        names = [f"{t}.{s}" for t in ("token_embd_norm",) for s in ("weight", "bias")]
        names += ["token_embd.weight", "token_types.weight", "position_embd.weight"]
        per = [f"{t}.{s}" for t in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_output_norm", "ffn_up",
                                    "ffn_down", "layer_output_norm") for s in ("weight", "bias")]
    return names + [f"blk.{i}.{p}" for i in range(n) for p in per]


def _plan(tensors: Mapping, cfg: dict, arch: str) -> list[_Entry]:
    gguf = _gguf()
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of parameter names to tensors, got {type(tensors).__name__}")
    d = _dims(cfg, arch)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCHITECTURES[arch].upper()], d["num_hidden_layers"])
    schemes = ", ".join(p for p, _, _ in GGUF_BLOCK_TYPES.values())
    entries, problems, seen = [], [], {}
    for name in tensors:
        if not isinstance(name, str):
            problems.append(f"tensor name {name!r} is not a string")
            continue
        if _skipped(name, arch, d["tied"]):
            continue
        gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            problems.append(f"{name}: not a tensor of {arch} in GGUF")
            continue
        if gname in seen:
            problems.append(f"{name}: maps to {gname} as {seen[gname]} does")
            continue
        seen[gname] = name
        value = tensors[name]
        heads = None
        if _rotary_permuted(arch) and ".attn_q." in gname:
            heads = d["num_attention_heads"]
        elif _rotary_permuted(arch) and ".attn_k." in gname:
            heads = d["num_key_value_heads"]
        if isinstance(value, QuantizedTensor):
            shape = tuple(value.shape)
            try:
                ggml = gguf_block_type(value.scheme)
            except ValueError:
                problems.append(f"{name}: scheme {value.scheme.label!r} has no GGUF type; the GGUF block "
                                f"schemes are {schemes}")
                continue
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml]]
            if len(shape) != 2:
                problems.append(f"{name}: a quantized GGUF tensor is a matrix; this one has shape {shape}")
                continue
            if shape[1] % block:
                hint = f"; llama.cpp falls back to {_FALLBACK[ggml].lower()}" if ggml in _FALLBACK else ""
                problems.append(f"{name}: GGUF {ggml} holds rows of a multiple of {block} values, these rows "
                                f"have {shape[1]}{hint}")
                continue
            nbytes = shape[0] * (shape[1] // block) * type_size
            quantized = True
        elif isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            if value.dtype not in _FLOAT_TYPES:
                problems.append(f"{name}: dtype {value.dtype} is not a float dtype GGUF takes "
                                "(float32, float16, bfloat16, float64)")
                continue
            if len(shape) not in (1, 2):
                problems.append(f"{name}: shape {shape}; GGUF tensors here are vectors or matrices")
                continue
            ggml = "F32" if len(shape) == 1 or gname in _ALWAYS_F32 else _FLOAT_TYPES[value.dtype]
            nbytes = math.prod(shape) * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml]][1]
            quantized = False
        else:
            problems.append(f"{name}: a {type(value).__name__}, not a torch.Tensor or QuantizedTensor")
            continue
        del value
        if heads is not None and shape[0] % (2 * heads):
            problems.append(f"{name}: {shape[0]} rows do not split into {heads} heads of rotary pairs")
            continue
        shift = norm_shifted(ARCHITECTURES[arch], gname)
        if shift and quantized:
            problems.append(f"{name}: a quantized norm; GGUF stores Gemma's norms as 1 + weight in F32")
            continue
        if shift and ggml != "F32":
            ggml, nbytes = "F32", math.prod(shape) * 4
        entries.append(_Entry(name, gname, shape, ggml, quantized, nbytes, heads, shift))
    missing = [n for n in _required(cfg, arch) if n not in seen]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        problems.append(f"missing for {arch} with {d['num_hidden_layers']} layers: {shown}")
    emb = next((e for e in entries if e.gguf_name == "token_embd.weight"), None)
    if emb is not None and emb.shape != (d["vocab_size"], d["hidden_size"]):
        problems.append(f"{emb.name}: shape {emb.shape}, the config says ({d['vocab_size']}, {d['hidden_size']})")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError("cannot write this model as GGUF: " + "; ".join(problems[:10]) + more)
    return entries


def rotary_permutation(rows: int, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives q_proj / k_proj: row j of the GGUF tensor is row
    perm[j] of the Hugging Face one (within each head, rows h*d + 2i and h*d + 2i + 1 of the GGUF
    tensor come from rows i and i + d/2 of the head)."""
    idx = torch.arange(rows).reshape(heads, 2, rows // heads // 2)
    return idx.transpose(1, 2).reshape(-1)


def _sliceable(qt: QuantizedTensor) -> bool:
    """Whether every tensor of qt's state is laid out row by row (flat codes of the same length
    per row, or a leading dimension of rows), so that a slice of rows is a QuantizedTensor too."""
    rows = qt.shape[0]
    state = qt.state_dict()
    codes = state.get("codes")
    return (codes is not None and codes.dim() == 1 and rows > 0 and codes.numel() % rows == 0
            and all(k == "codes" or (t.dim() >= 1 and t.shape[0] == rows) for k, t in state.items()))


def _row_chunks(qt: QuantizedTensor):
    """The QuantizedTensor in row slices of about _CHUNK_VALUES values (one piece when its state
    is not laid out row by row), so that encoding keeps its intermediates small."""
    rows, cols = qt.shape
    step = max(1, _CHUNK_VALUES // max(cols, 1))
    if rows <= step or not _sliceable(qt):
        yield qt
        return
    state = qt.state_dict()
    per = state["codes"].numel() // rows
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        part = {k: (t[r0 * per:r1 * per] if k == "codes" else t[r0:r1]) for k, t in state.items()}
        yield QuantizedTensor.from_state_dict(qt.scheme, (r1 - r0, cols), qt.dtype, part)


def gguf_blocks_of(qt: QuantizedTensor) -> np.ndarray:
    """encode_blocks(qt), encoded a slice of rows at a time (same bytes)."""
    parts = [encode_blocks(c) for c in _row_chunks(qt)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _data(value, e: _Entry) -> np.ndarray:
    if e.quantized:
        if not isinstance(value, QuantizedTensor) or tuple(value.shape) != e.shape:
            raise ValueError(f"{e.name} changed between the two reads of the mapping")
        arr = gguf_blocks_of(value)
    else:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != e.shape:
            raise ValueError(f"{e.name} changed between the two reads of the mapping")
        t = value.detach().to("cpu")
        if e.shift:  # 1 + w in float32: the factor transformers' Gemma RMSNorm multiplies by
            t = 1.0 + t.to(torch.float32)
        if e.ggml == "F32":
            arr = t.to(torch.float32).contiguous().numpy()
        elif e.ggml == "F16":
            arr = t.contiguous().numpy()
        else:  # BF16: its bit patterns
            arr = t.contiguous().view(torch.int16).numpy()
    if e.heads is not None:
        arr = arr[rotary_permutation(e.shape[0], e.heads).numpy()]
    arr = np.ascontiguousarray(arr)
    if arr.nbytes != e.nbytes:
        raise ValueError(f"{e.name}: {arr.nbytes} bytes of data, {e.nbytes} expected")
    return arr


def _add_tensor_info(w, e: _Entry) -> None:
    gguf = _gguf()
    t = gguf.GGMLQuantizationType[e.ggml]
    if e.quantized:
        block, type_size = gguf.GGML_QUANT_SIZES[t]
        byte_shape = (*e.shape[:-1], e.shape[-1] // block * type_size)
        w.add_tensor_info(e.gguf_name, byte_shape, np.dtype(np.uint8), e.nbytes, raw_dtype=t)
    else:
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[e.ggml]
        w.add_tensor_info(e.gguf_name, e.shape, np.dtype(np_dtype), e.nbytes, raw_dtype=t)


# ---------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Vocab:
    model: str
    pre: str | None = None
    tokens: list = dataclasses.field(default_factory=list)
    token_types: list = dataclasses.field(default_factory=list)
    merges: list = dataclasses.field(default_factory=list)
    special_ids: dict = dataclasses.field(default_factory=dict)
    add_flags: dict = dataclasses.field(default_factory=dict)
    chat_template: object = None
    add_space_prefix: bool | None = None
    token_type_count: int | None = None
    scores: list | None = None  # a SentencePiece vocabulary's piece scores
    copied: dict | None = None  # {key: GGUFValue} of another GGUF file's tokenizer.*, written as they are
    name: str | None = None     # that file's general.name (its model's name goes with its vocabulary)


# tokenizer.ggml.pre names of split regexes (llama.cpp's names; transformers' GGUF reader holds the
# regex of each), the first that matches is written
_SPLIT_NAMES = ("llama-bpe", "qwen2", "tekken")


def split_regex(name: str) -> str | None:
    """The split regex transformers' GGUF reader applies to a tokenizer.ggml.pre `name` (None where
    it has none, or transformers is not installed)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return None
    return GGUF_PRE_TOKENIZER_SPLITS.get(name)


def _split_name(regex: str) -> str | None:
    """The tokenizer.ggml.pre name whose split regex is `regex`: Llama 3's ("llama-bpe"), Qwen2's
    and Qwen3's ("qwen2"), Mistral's Tekken's."""
    return next((n for n in _SPLIT_NAMES if split_regex(n) == regex), None)


BPE_PRE_TOKENIZERS = ("gpt-2 (ByteLevel with its regex)", "smollm (Digits(individual_digits) + ByteLevel)",
                      "llama-bpe, qwen2 or tekken (Split(Llama-3's, Qwen2's or Tekken's regex) + ByteLevel without "
                      "regex)")


def _bpe_pre(pre: dict | None) -> tuple[str, bool]:
    """(tokenizer.ggml.pre, the ByteLevel's add_prefix_space) for a byte-level BPE pre-tokenizer."""
    parts = (pre.get("pretokenizers") or []) if pre and pre.get("type") == "Sequence" else ([pre] if pre else [])
    kinds = [p.get("type") for p in parts]
    last = parts[-1] if parts else {}
    prefix = bool(last.get("add_prefix_space", False))
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return "gpt-2", prefix
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and last.get("use_regex", True):
        return "smollm", prefix
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        split = parts[0]
        regex = (split.get("pattern") or {}).get("Regex")
        name = _split_name(regex) if regex is not None else None
        if name is not None and split.get("behavior") == "Isolated" and not split.get("invert", False):
            return name, prefix
    raise ValueError(f"the tokenizer's pre-tokenizer {json.dumps(pre)[:300]} is not one this GGUF writer "
                     f"knows how to name for llama.cpp; supported: {'; '.join(BPE_PRE_TOKENIZERS)}")


def _load_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer {path!r} is not a directory with tokenizer files")
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to read is the same error for the caller
            raise ValueError(f"cannot read a tokenizer from {path!r}: {e}") from e
    if getattr(tokenizer, "backend_tokenizer", None) is None or not callable(getattr(tokenizer, "get_vocab", None)):
        raise TypeError(f"tokenizer must be a transformers fast tokenizer or a directory, got {type(tokenizer).__name__}")
    return tokenizer


def _looks_control(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


def is_gguf_file(path) -> bool:
    """Whether `path` names a GGUF file (a file whose name ends in .gguf)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(".gguf") and os.path.isfile(path)


def _gguf_vocabulary(path, cfg: dict) -> _Vocab:
    """The vocabulary of the GGUF file at `path`: its tokenizer.* keys, to be written as they are
    (a SentencePiece vocabulary, Gemma's, included), once the file's header (fewbits' bounded
    reader) and its vocabulary (gguf_header.check_vocabulary, as the GGUF reader checks it, against
    this model's vocab_size) have passed the checks."""
    from .gguf_header import check_vocabulary, read_header

    header = read_header(path)
    keys = {k: v for k, v in header.metadata.items() if k.startswith("tokenizer.")}
    model = keys.get("tokenizer.ggml.model")
    if model is None or model.type != "string":
        raise ValueError(f"{path} has no vocabulary to copy (tokenizer.ggml.model is missing or not a string)")
    tokens = keys.get("tokenizer.ggml.tokens")
    if model.value != "none" and tokens is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens is missing")
    vocab_size = _need(cfg, "vocab_size")
    check_vocabulary(header, vocab_size, "tokens of this model's vocab_size")
    if tokens is not None and len(tokens.value) != vocab_size:  # llama.cpp sizes the embedding by the vocabulary
        raise ValueError(f"{path}'s vocabulary has {len(tokens.value)} tokens, this model's vocab_size is {vocab_size}: "
                         "llama.cpp would refuse the embedding's shape")
    name = header.get("general.name")
    return _Vocab(model=model.value, copied=keys, name=name if isinstance(name, str) and name.strip() else None)


def _vocabulary(tokenizer, cfg: dict, arch: str) -> _Vocab:
    gguf = _gguf()
    if tokenizer is None:
        return _Vocab(model="none")
    if is_gguf_file(tokenizer):
        return _gguf_vocabulary(os.fspath(tokenizer), cfg)
    if _decoder(arch) and isinstance(tokenizer, (str, os.PathLike)) and os.path.isdir(tokenizer) \
            and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")) \
            and os.path.isfile(os.path.join(tokenizer, "tokenizer.model")):  # a SentencePiece model alone
        vocab_size = _need(cfg, "vocab_size")
        spm = os.path.join(os.fspath(tokenizer), "tokenizer.model")
        return _special(_spm_vocabulary(spm, None, vocab_size), None, cfg, vocab_size, os.fspath(tokenizer))
    tok = _load_tokenizer(tokenizer)
    backend = json.loads(tok.backend_tokenizer.to_str())
    kind = (backend.get("model") or {}).get("type")
    vocab_size = _need(cfg, "vocab_size")
    if _decoder(arch):
        if kind != "BPE" or (backend.get("model") or {}).get("byte_fallback"):
            spm = _sentencepiece_file(tokenizer, tok)
            if spm is not None:
                return _special(_spm_vocabulary(spm, tok, vocab_size), tok, cfg, vocab_size)
            raise ValueError(f"a {arch} GGUF is written with a byte-level BPE tokenizer (llama.cpp's gpt2 "
                             f"vocabulary) or a SentencePiece one (its tokenizer.model beside it); this tokenizer "
                             f"is {kind}{' with byte fallback (sentencepiece)' if kind == 'BPE' else ''}, without "
                             "a tokenizer.model")
        pre, prefix = _bpe_pre(backend.get("pre_tokenizer"))
        v = _Vocab(model="gpt2", pre=pre, add_space_prefix=prefix)
    else:
        if kind != "WordPiece":
            raise ValueError(f"a BertModel GGUF is written with a WordPiece tokenizer; this one is {kind}")
        v = _Vocab(model="bert", token_type_count=_need(cfg, "type_vocab_size"))
    ids = tok.get_vocab()
    if ids and max(ids.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has token id {max(ids.values())}, beyond the model's vocab_size {vocab_size}")
    by_id = {i: t for t, i in ids.items()}
    added = {i: a for i, a in getattr(tok, "added_tokens_decoder", {}).items()}
    T = gguf.TokenType
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            v.tokens.append(f"[PAD{i}]")
            v.token_types.append(T.UNUSED)
            continue
        if i in added:
            kind_i = T.CONTROL if added[i].special or _looks_control(token) else T.USER_DEFINED
        else:
            kind_i = T.NORMAL
        if v.model == "bert" and kind_i != T.CONTROL:
            token = token[2:] if token.startswith("##") else "\u2581" + token
        v.tokens.append(token)
        v.token_types.append(kind_i)
    return _special(v, tok, cfg, vocab_size)


def _sentencepiece_file(tokenizer, tok) -> str | None:
    """The SentencePiece model (tokenizer.model) of a tokenizer directory or a loaded tokenizer."""
    for where in ((os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None),
                  getattr(tok, "name_or_path", None)):
        if isinstance(where, str) and os.path.isdir(where) and os.path.isfile(os.path.join(where, "tokenizer.model")):
            return os.path.join(where, "tokenizer.model")
    f = getattr(tok, "vocab_file", None)
    return f if isinstance(f, str) and os.path.isfile(f) else None


_MAX_SPM_BYTES = 256 << 20


def _spm_vocabulary(model_file: str, tok, vocab_size: int) -> _Vocab:
    """llama.cpp's "llama" (SentencePiece) vocabulary of a tokenizer.model, as its converter writes
    it (_create_vocab_sentencepiece): every piece with its score and kind (NORMAL, UNKNOWN,
    CONTROL, UNUSED, BYTE) in id order, the tokenizer's added tokens beyond them (CONTROL when
    special, else USER_DEFINED, score -1000), [PADi] up to vocab_size; add_space_prefix as the
    model adds its dummy prefix ("a" encoded with a leading "▁")."""
    gguf = _gguf()
    try:
        import sentencepiece
    except ImportError:
        raise ValueError("writing a SentencePiece vocabulary (tokenizer.model) needs the sentencepiece package: "
                         "pip install sentencepiece") from None
    sp = sentencepiece.SentencePieceProcessor()
    try:
        if os.path.getsize(model_file) > _MAX_SPM_BYTES:  # real ones are a few MB; read whole below
            raise ValueError(f"{os.path.getsize(model_file)} bytes, more than a SentencePiece model holds "
                             f"({_MAX_SPM_BYTES >> 20} MiB at most here)")
        with open(model_file, "rb") as f:
            sp.LoadFromSerializedProto(f.read())
    except Exception as e:  # noqa: BLE001 - sentencepiece raises plain RuntimeError / OSError
        raise ValueError(f"cannot read the SentencePiece model {model_file}: {type(e).__name__}: {e}") from None
    n = sp.GetPieceSize()
    if n > vocab_size:
        raise ValueError(f"{model_file} has {n} pieces, more than the model's vocab_size {vocab_size}")
    T = gguf.TokenType
    v = _Vocab(model="llama", pre="default", scores=[])
    for i in range(n):
        kind = (T.UNKNOWN if sp.IsUnknown(i) else T.CONTROL if sp.IsControl(i) else T.UNUSED if sp.IsUnused(i)
                else T.BYTE if sp.IsByte(i) else T.NORMAL)
        v.tokens.append(sp.IdToPiece(i))
        v.scores.append(float(sp.GetScore(i)))
        v.token_types.append(kind)
    added = dict(getattr(tok, "added_tokens_decoder", {}) or {})
    for i in range(n, vocab_size):
        a = added.get(i)
        if a is None:
            v.tokens.append(f"[PAD{i}]")
            v.token_types.append(T.UNUSED)
        else:
            v.tokens.append(str(a.content if hasattr(a, "content") else a))
            v.token_types.append(T.CONTROL if getattr(a, "special", False) else T.USER_DEFINED)
        v.scores.append(-1000.0)
    pieces = sp.EncodeAsPieces("a")
    v.add_space_prefix = bool(pieces) and pieces[0].startswith("\u2581")
    # the model's own special ids, where the tokenizer's files and the config name none (llama.cpp
    # would take id 0 as the unknown token)
    v.special_ids = {k: i for k, i in (("unk", sp.unk_id()), ("bos", sp.bos_id()), ("eos", sp.eos_id()),
                                       ("pad", sp.pad_id())) if 0 <= i < n}
    return v


def _special(v: _Vocab, tok, cfg: dict, vocab_size: int, directory: str | None = None) -> _Vocab:
    """v with the special token ids, the add_bos/add_eos flags and the chat template (gguf's
    SpecialVocab over the tokenizer's files and the config's ids; tok None: the files of
    `directory` as they are, the flags as its tokenizer_config.json says)."""
    gguf = _gguf()
    with tempfile.TemporaryDirectory(prefix="fewbits-gguf-vocab-") as tmp:
        if tok is not None:
            tok.save_pretrained(tmp)
        else:
            for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
                if os.path.isfile(os.path.join(directory, name)):
                    shutil.copyfile(os.path.join(directory, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump({k: val for k, val in cfg.items() if k.endswith("_token_id") and isinstance(val, int)}, f)
        special = gguf.SpecialVocab(tmp, load_merges=v.model == "gpt2", n_vocab=vocab_size)
    if v.model == "gpt2" and not special.merges:
        raise ValueError("the BPE tokenizer has no merges")
    v.merges = list(special.merges)
    v.special_ids = {**v.special_ids, **special.special_token_ids}
    v.add_flags = dict(special.add_special_token)
    v.chat_template = special.chat_template
    if tok is None:
        return v
    with_special = tok("a")["input_ids"]
    without = tok("a", add_special_tokens=False)["input_ids"]
    if "bos" not in v.add_flags and "bos" in v.special_ids:
        v.add_flags["bos"] = len(with_special) > len(without) and with_special[0] == v.special_ids["bos"]
    if "eos" not in v.add_flags and "eos" in v.special_ids:
        v.add_flags["eos"] = len(with_special) > len(without) and with_special[-1] == v.special_ids["eos"]
    return v


# fewbits.files.gguf_header's value types: the gguf package's
_VALUE_TYPES = {"u8": "UINT8", "i8": "INT8", "u16": "UINT16", "i16": "INT16", "u32": "UINT32", "i32": "INT32",
                "f32": "FLOAT32", "bool": "BOOL", "string": "STRING", "u64": "UINT64", "i64": "INT64",
                "f64": "FLOAT64"}


def _add_copied(w, keys: dict) -> None:
    T = _gguf().GGUFValueType
    for key, v in keys.items():
        if v.type.startswith("array["):
            items = v.value.tolist() if isinstance(v.value, np.ndarray) else list(v.value)
            if items:  # GGUF has no empty arrays (the writer refuses them)
                w.add_key_value(key, items, T.ARRAY, sub_type=T[_VALUE_TYPES[v.type[6:-1]]])
        else:
            w.add_key_value(key, v.value, T[_VALUE_TYPES[v.type]])


def _add_vocab(w, v: _Vocab, cfg: dict) -> None:
    if v.copied is not None:
        _add_copied(w, v.copied)
        return
    w.add_tokenizer_model(v.model)
    if v.model == "none":  # no vocabulary, but the config's special ids (readers build configs from them)
        for key, adder in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                           ("pad_token_id", w.add_pad_token_id)):
            tid = cfg.get(key)
            if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < _need(cfg, "vocab_size"):
                adder(tid)
        return
    if v.pre is not None:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.merges:
        w.add_token_merges(v.merges)
    if v.token_type_count is not None:
        w.add_token_type_count(v.token_type_count)
    if v.add_space_prefix is not None:
        w.add_add_space_prefix(v.add_space_prefix)
    for typ, tid in v.special_ids.items():
        adder = getattr(w, f"add_{typ}_token_id", None)
        if adder is not None:  # gguf has no key for cls (llama.cpp takes bos)
            adder(tid)
    for typ, flag in v.add_flags.items():
        adder = getattr(w, f"add_add_{typ}_token", None)
        if adder is not None:
            adder(bool(flag))
    if v.chat_template:
        w.add_chat_template(v.chat_template)


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------
def _rope(cfg: dict, layer_type: str | None = None) -> tuple[float, float | None]:
    """(rope theta, the linear scaling factor or None): the RoPE llama.cpp's keys can say;
    another rope type is a ValueError. layer_type: that kind of layer's ("full_attention",
    "sliding_attention") where the config has RoPE parameters per kind (Gemma 3)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if layer_type is not None and isinstance(rope, Mapping) and isinstance(rope.get(layer_type), Mapping):
        rope = rope[layer_type]
        if rope.get("rope_theta") is not None:
            cfg = {k: v for k, v in cfg.items() if k != "rope_theta"}  # the kind's own theta
    elif layer_type == "sliding_attention":  # a config.json of Gemma 3 as saved before per-kind RoPE
        return float(cfg.get("rope_local_base_freq", 10000.0)), None
    elif layer_type == "full_attention" and cfg.get("rope_theta") is None:
        cfg = {**cfg, "rope_theta": 1_000_000.0}  # Gemma 3's default for its full layers
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else None
    factor = None
    if rope_type == "linear":
        factor = rope.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor <= 0:
            raise ValueError(f"linear rope scaling needs a finite factor > 0, got {factor!r}")
        factor = float(factor)
    elif rope_type not in (None, "default"):
        raise ValueError(f"rope_type {rope_type!r} is not supported by this GGUF writer; supported: default, linear")
    theta = cfg.get("rope_theta", rope.get("rope_theta") if isinstance(rope, Mapping) else None)
    if theta is None:
        theta = 10000.0  # transformers' LlamaConfig default
    return float(theta), factor


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
               "iq4_nl": "MOSTLY_IQ4_NL",
               "q2_k": "MOSTLY_Q2_K_S", "q3_k": "MOSTLY_Q3_K_S", "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S",
               "q6_k": "MOSTLY_Q6_K", "q2_k_m": "MOSTLY_Q2_K", "q2_k_s": "MOSTLY_Q2_K_S", "q3_k_s": "MOSTLY_Q3_K_S",
               "q3_k_m": "MOSTLY_Q3_K_M", "q3_k_l": "MOSTLY_Q3_K_L",
               "q4_k_m": "MOSTLY_Q4_K_M", "q4_k_s": "MOSTLY_Q4_K_S", "q5_k_m": "MOSTLY_Q5_K_M",
               "q5_k_s": "MOSTLY_Q5_K_S"}


def _file_type(file_type, entries: list[_Entry]) -> int:
    gguf = _gguf()
    if file_type is not None:
        key = str(file_type).lower()
        if key not in _FILE_TYPES:
            raise ValueError(f"unknown file_type {file_type!r}; choices: {', '.join(_FILE_TYPES)}")
        return int(gguf.LlamaFileType[_FILE_TYPES[key]])
    weights = Counter(e.ggml for e in entries if len(e.shape) == 2)
    quant = Counter({t: c for t, c in weights.items() if t not in ("F32", "F16", "BF16")})
    if not quant:
        top = weights.most_common(1)[0][0] if weights else "F32"
        return int(gguf.LlamaFileType[_FILE_TYPES[top.lower()]])
    top = quant.most_common(1)[0][0]
    if top in ("Q4_K", "Q5_K"):
        key = top.lower() + ("_m" if "Q6_K" in quant else "_s")
    elif top == "Q3_K":
        key = "q3_k_m" if "Q4_K" in quant else "q3_k_l" if "Q5_K" in quant else "q3_k_s"
    elif top == "Q2_K":
        key = "q2_k_m" if "Q3_K" in quant else "q2_k_s"
    else:
        key = top.lower()
    return int(gguf.LlamaFileType[_FILE_TYPES[key]])


# llama.cpp sets attributes of these tokens by name when general.name holds "phi3" or "phi-3", and
# fails to load a vocabulary without them
_PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def _model_name(cfg: dict, vocab: _Vocab) -> str | None:
    """general.name: the model directory's name; left out (with a warning) where llama.cpp's
    Phi-3 fix-ups, keyed on the name, would look for tokens this vocabulary does not have."""
    if vocab.copied is not None:  # a model read from a GGUF keeps that file's name (or none)
        name = vocab.name
    else:
        name = cfg.get("_name_or_path") or cfg.get("name_or_path")
        if not isinstance(name, str) or not name.strip():
            return None
        name = os.path.basename(name.rstrip("/\\")) or name
    if name is None:
        return None
    if vocab.model == "none" or not any(k in name.lower() for k in ("phi3", "phi-3")):
        return name
    listed = vocab.copied.get("tokenizer.ggml.tokens") if vocab.copied is not None else None
    tokens = set(vocab.tokens) if vocab.copied is None else set(listed.value) if listed is not None else set()
    if not set(_PHI3_TOKENS) <= tokens:
        warnings.warn(f"general.name {name!r} left out: llama.cpp would look for Phi-3's tokens "
                      f"({', '.join(_PHI3_TOKENS)}) in a vocabulary without them and fail to load it",
                      UserWarning, stacklevel=4)
        return None
    return name


def _add_metadata(w, cfg: dict, arch: str, entries: list[_Entry], file_type, vocab: _Vocab) -> None:
    gguf = _gguf()
    d = _dims(cfg, arch)
    w.add_type(gguf.GGUFType.MODEL)
    name = _model_name(cfg, vocab)
    if name is not None:
        w.add_name(name)
    w.add_vocab_size(d["vocab_size"])
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["num_hidden_layers"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    if _decoder(arch):
        gemma = arch in GEMMAS
        w.add_head_count_kv(d["num_key_value_heads"])
        theta, factor = _rope(cfg, "full_attention" if arch == "Gemma3ForCausalLM" else None)
        w.add_rope_freq_base(theta)
        if factor is not None:  # llama.cpp: rope.scaling.type linear, freq_scale = 1 / factor
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        w.add_rope_dimension_count(d["head_dim"])
        if gemma or d["head_dim"] != d["hidden_size"] // d["num_attention_heads"]:
            w.add_key_length(d["head_dim"])  # transformers' Gemma 3 reader takes head_dim from it
            w.add_value_length(d["head_dim"])
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        if gemma:
            _add_gemma_metadata(w, cfg, arch)
    else:
        w.add_layer_norm_eps(float(cfg.get("layer_norm_eps", 1e-12)))
        w.add_causal_attention(False)
        w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_file_type(_file_type(file_type, entries))
    if any(e.quantized for e in entries):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gemma_layer_types(cfg: dict, arch: str = "Gemma3ForCausalLM") -> list[str]:
    """A Gemma config's kind of each layer ("sliding_attention" or "full_attention"): its
    layer_types, or transformers' default (every sixth layer full for Gemma 3, every other one for
    Gemma 2); a ValueError if malformed."""
    n = _need(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 6 if arch == "Gemma3ForCausalLM" else 2)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern must be a positive int, got {pattern!r}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(types, (list, tuple)) or len(types) != n \
            or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {n} layers")
    return list(types)


def gemma_attention_scalar(d: dict, arch: str = "Gemma3ForCausalLM") -> int:
    """The query_pre_attn_scalar llama.cpp's gemma2 / gemma3 compute with: the head size, but
    hidden_size / heads for the 27B models (46 and 62 layers), as Google's reference does."""
    if d["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:  # llama.cpp: float(n_embd / n_head), an integer division
        return d["hidden_size"] // d["num_attention_heads"]
    return int(d["head_dim"])


def _swa_pattern(types: list[str]):
    """llama.cpp's attention.sliding_window_pattern of these layer kinds: n where every n-th layer
    is full (llama.cpp's set_swa_pattern), else one bool per layer (True: sliding)."""
    sliding = [t == "sliding_attention" for t in types]
    for n in range(1, len(types) + 2):  # len + 1: every layer sliding
        if sliding == [(i % n) < n - 1 for i in range(len(types))]:
            return n
    return sliding


def _add_gemma_metadata(w, cfg: dict, arch: str) -> None:
    types = gemma_layer_types(cfg, arch)
    if "sliding_attention" in types:
        w.add_sliding_window(int(cfg["sliding_window"]))
    if "sliding_attention" in types or arch == "Gemma2ForCausalLM":  # gemma2 slides every other layer unless told
        w.add_sliding_window_pattern(_swa_pattern(types))
    if "sliding_attention" in types and arch == "Gemma3ForCausalLM":
        w.add_rope_freq_base_swa(_rope(cfg, "sliding_attention")[0])
    if arch == "Gemma2ForCausalLM":
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    cap = cfg.get("final_logit_softcapping")
    if cap is not None:
        w.add_final_logit_softcapping(float(cap))


def _positive_cap(cfg: dict, key: str, required: bool) -> None:
    cap = cfg.get(key)
    if cap is None and not required:
        return
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"{key} must be a finite number > 0{'' if required else ' or None'}, got {cap!r}"
                         + (" (llama.cpp's gemma2 always caps: 50 and 30 where the file says nothing)"
                            if required else ""))


def _check_gemma(cfg: dict, d: dict, arch: str) -> None:
    """What llama.cpp's gemma2 / gemma3 cannot compute as transformers' Gemma2ForCausalLM /
    Gemma3ForCausalLM does: a ValueError."""
    name = ARCHITECTURES[arch]
    types = gemma_layer_types(cfg, arch)
    if cfg.get("attention_bias"):
        raise ValueError(f"attention_bias: llama.cpp's {name} has no attention biases")
    if arch == "Gemma3ForCausalLM" and cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping: llama.cpp's gemma3 does not cap attention scores")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention: llama.cpp's {name} is causal")
    if arch == "Gemma2ForCausalLM":
        _positive_cap(cfg, "attn_logit_softcapping", True)
        if not d["tied"]:
            raise ValueError("tie_word_embeddings False: llama.cpp's gemma2 reads its output layer from the token "
                             "embedding")
    _positive_cap(cfg, "final_logit_softcapping", arch == "Gemma2ForCausalLM")
    scalar, want = cfg.get("query_pre_attn_scalar", 256), gemma_attention_scalar(d, arch)
    if scalar != want:
        raise ValueError(f"query_pre_attn_scalar {scalar!r}: llama.cpp's {name} scales queries by 1/sqrt({want:g}) "
                         f"for this model ({d['num_hidden_layers']} layers, head_dim {d['head_dim']})")
    if "sliding_attention" in types and arch == "Gemma3ForCausalLM":
        if _rope(cfg, "sliding_attention")[1] is not None:
            raise ValueError("linear RoPE scaling of the sliding layers: llama.cpp's gemma3 scales only the full "
                             "attention layers' RoPE")
    if "sliding_attention" in types:
        window = cfg.get("sliding_window")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2 ** 31:
            raise ValueError(f"sliding_window must be an int from 1 to 2^31 - 1 for the sliding layers, got {window!r}")


def _check_config(cfg: dict, arch: str) -> None:
    d = _dims(cfg, arch)
    if arch in GEMMAS:
        act, want, key = cfg.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh", "hidden_activation"
    else:
        act, want, key = cfg.get("hidden_act", "silu" if _decoder(arch) else "gelu"), \
            "silu" if _decoder(arch) else "gelu", "hidden_act"
    if act != want:
        raise ValueError(f"llama.cpp's {ARCHITECTURES[arch]} architecture computes {want}; this config has "
                         f"{key} {act!r}")
    if arch in GEMMAS:
        _check_gemma(cfg, d, arch)
    if _decoder(arch):
        _rope(cfg, "full_attention" if arch == "Gemma3ForCausalLM" else None)
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
            types = cfg.get("layer_types")
            if not isinstance(types, (list, tuple)) or "sliding_attention" in types:
                raise ValueError(f"use_sliding_window: llama.cpp's {ARCHITECTURES[arch]} attends over the whole "
                                 "context; this config limits some layers' attention to a sliding window")
        if arch == "Qwen3ForCausalLM" and cfg.get("attention_bias"):
            raise ValueError("attention_bias: llama.cpp's qwen3 has no attention biases")
        window = cfg.get("sliding_window")
        if arch in ("MistralForCausalLM", "Phi3ForCausalLM") and isinstance(window, int) \
                and window < d["max_position_embeddings"]:
            how = ("llama.cpp's llama architecture (which Mistral is written as, as llama.cpp's converter writes it)"
                   if arch == "MistralForCausalLM" else "llama.cpp's phi3 (its sliding window is turned off)")
            warnings.warn(f"sliding_window {window}: {how} attends over the whole context, so beyond "
                          f"{window} tokens it computes otherwise than transformers", UserWarning, stacklevel=4)
        if arch == "Phi3ForCausalLM":
            rope = cfg.get("rope_parameters") or {}
            partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)
                              if isinstance(rope, Mapping) else 1.0)
            if partial not in (None, 1, 1.0):
                raise ValueError(f"partial_rotary_factor {partial!r}: fewbits writes Phi-3 models that rotate whole "
                                 "heads")
    elif cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {cfg.get('position_embedding_type')!r}: llama.cpp's BERT "
                         "has absolute position embeddings only")


# ---------------------------------------------------------------------------------------------
# write_gguf
# ---------------------------------------------------------------------------------------------
def _target(config, tokenizer) -> tuple[dict, str, _Vocab]:
    cfg = _config_dict(config)
    arch = _architecture(cfg)
    _check_config(cfg, arch)
    return cfg, arch, _vocabulary(tokenizer, cfg, arch)


def check_model(config, tokenizer=None) -> None:
    """What write_gguf checks before it reads a tensor -- the architecture, the config (activation,
    rope type, sizes) and the tokenizer -- for checking before the work of quantizing: a
    ValueError naming the problem and the supported choices."""
    _target(config, tokenizer)


def write_gguf(path, tensors: Mapping, config, tokenizer=None, *, overwrite: bool = False, progress=None,
               file_type=None) -> GGUFSummary:
    """Write a GGUF file at `path` that llama.cpp and transformers load (see the module docstring).

    tensors: {Hugging Face parameter name: float torch.Tensor or QuantizedTensor}, read twice (once
        for names, shapes and types, once for the data, one tensor at a time); may be lazy.
    config: the model's transformers PretrainedConfig or its config.json dict (one of
        ARCHITECTURES).
    tokenizer: a transformers fast tokenizer or a directory with its files (a byte-level BPE
        for the decoders, WordPiece for BERT); or a GGUF file, whose tokenizer.* keys are written
        as they are (any vocabulary llama.cpp has: a model read from a GGUF keeps its own); None
        writes no vocabulary (tokenizer.ggml.model "none").
    overwrite: replace an existing file (otherwise FileExistsError).
    progress: True for a bar on stderr, or a callable(done, total, name); per tensor written.
    file_type: general.file_type as a recipe name ("q4_k_m", "q4_0", "f16", ...); inferred when None.

    Returns a GGUFSummary (tensors, types with their counts, bytes, bits per parameter).
    """
    gguf = _gguf()
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give the GGUF file's path")
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    cfg, arch, vocab = _target(config, tokenizer)
    entries = _plan(tensors, cfg, arch)
    if file_type is not None:
        _file_type(file_type, entries)
    report = counter(progress, len(entries), "writing GGUF")
    try:
        _write(gguf, path, tensors, cfg, arch, vocab, entries, file_type, report)
    except OSError as e:  # a full disk: name the file (nothing of it is left, as replacing() removes it)
        if e.filename is not None or path in str(e):
            raise
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from None
    parameters = sum(math.prod(e.shape) for e in entries)
    tensor_bytes = sum(e.nbytes for e in entries)
    return GGUFSummary(path=path, architecture=ARCHITECTURES[arch], tensors=len(entries),
                       types=dict(Counter(e.ggml for e in entries)), parameters=parameters,
                       tensor_bytes=tensor_bytes, file_bytes=os.path.getsize(path),
                       bits_per_parameter=tensor_bytes * 8 / parameters if parameters else float("nan"))


def _write(gguf, path, tensors, cfg, arch, vocab, entries, file_type, report) -> None:
    with replacing(path) as tmp:
        w = gguf.GGUFWriter(tmp, ARCHITECTURES[arch])
        try:
            _add_metadata(w, cfg, arch, entries, file_type, vocab)
            _add_vocab(w, vocab, cfg)
            for e in entries:
                _add_tensor_info(w, e)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for done, e in enumerate(entries, 1):
                arr = _data(tensors[e.name], e)
                w.write_tensor_data(arr)
                del arr
                report(done, e.gguf_name)
        finally:
            w.close()
