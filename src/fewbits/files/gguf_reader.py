"""Reading a GGUF decoder file (fewbits' own, or llama.cpp's) as a quantized fewbits model, without
ever building its float weights: `fb.from_pretrained("model.gguf")`.

read_gguf(path) gives the transformers config and a tensor mapping in Hugging Face names: every
tensor in a GGUF block type fewbits has (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K ... Q6_K) becomes a
QuantizedTensor of the matching preset (fewbits.files.gguf_blocks.decode_blocks: its dequantize()
equals gguf.quants.dequantize of the bytes, bit for bit), F32 / F16 / BF16 tensors float tensors
of their own dtype; the q/k rows llama.cpp's converter permuted are put back in transformers' order
(whole block rows move, so nothing is re-rounded). A tied embedding stored in a block type is used
for the output head too: the head gets the same QuantizedTensor (tie_word_embeddings is then False
in the config, as fewbits' modules hold their weights themselves).

The file is untrusted. Before anything is built, fewbits.files.gguf_header reads the header with
every count bounded by the file's size and the tensor table held to llama.cpp's layout, and
llama_config() checks every llama key that changes the numbers, as llama.cpp reads it:

- integer keys (block_count, context_length, embedding_length, feed_forward_length, head_count,
  head_count_kv, key_length / value_length, rope.dimension_count, vocab_size) must be integers
  >= 1; float keys (layer_norm_rms_epsilon, rope.freq_base, rope.scaling.factor) finite and > 0;
- block_count must be the number of blocks the tensors hold; embedding_length and vocab_size the
  token embedding's shape; head_count a multiple of head_count_kv; rope.dimension_count the head
  size (fewbits rotates whole heads) and even;
- RoPE scaling is honoured as llama.cpp applies it: `rope.scaling.type` "linear" (llama.cpp's
  default when the key is absent) with `rope.scaling.factor` (or the older `rope.scale_linear`)
  becomes transformers' linear rope_scaling; "none" turns scaling off; other types (yarn,
  longrope) are refused;
- the architectures are llama, qwen2, qwen3, phi3, gemma2 and gemma3 (keys under their own prefix).
  phi3: attn_qkv's rows (heads + 2 kv heads) x the head size, ffn_up's 2 x feed_forward_length;
  its attention.sliding_window is read and left off, as llama.cpp turns it off. gemma3:
  attention.sliding_window (0: none), attention.sliding_window_pattern (n: every n-th layer full,
  0 all sliding, 6 where absent; or one bool per layer), rope.freq_base_swa (10000 where absent),
  final_logit_softcapping; gemma2 as gemma3 without q/k norms, with attn_logit_softcapping, one
  RoPE base and llama.cpp's defaults (window 4096, every other layer sliding, caps 50 and 30);
  Gemma's norms are read as the stored value - 1 (it multiplies by 1 + weight) and its queries
  scaled as llama.cpp scales them;
- any other key under the architecture's prefix is refused unless it is one known not to change
  this model's numbers (expert counts of 0, the original context length of linear scaling, ...):
  a key fewbits does not apply is never silently ignored;
- the vocabulary (tokenizer.ggml.*) must be arrays of the types llama.cpp writes, no longer than
  the embedding, and its special token ids inside it;
- every float tensor and every block scale must be finite.

Each problem is a FileFormatError naming the file; the config gets dtype float32 (the model's
float layers and norms keep their precision: an F32 norm is not rounded to fp16).

gguf_to_pretrained(path, out_dir) writes that as a fewbits Hugging Face directory (with the
tokenizer transformers builds from the GGUF, read only once the file has passed the checks), which
from_pretrained loads; gguf_to_float_pretrained(path, out_dir) writes it dequantized, as a plain
float32 Hugging Face directory (what `fewbits quantize x.gguf` starts from: the same checks and
the same config, its RoPE scaling included, which transformers' own GGUF loader drops).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..quant.tensor import QuantizedTensor, stored_problem
from .gguf_blocks import GGUF_BLOCK_TYPES, decode_blocks
from .gguf_file import (ARCHITECTURES, CONFIG_CLASSES, READ_CLASSES, gemma_attention_scalar, norm_shifted,
                        rotary_permutation, rows_permuted)
from .gguf_header import INTEGER_TYPES, GGUFHeader, Keys, check_vocabulary, read_header, shown
from .safetensors_format import FileFormatError

__all__ = ["read_gguf", "gguf_to_pretrained", "gguf_to_float_pretrained", "llama_config", "check_gguf"]

_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}
# llama.* keys read into the config (below), and keys known to leave a dense llama's numbers as they are
_READ = {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
         "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
         "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size", "rope.scaling.type",
         "rope.scaling.factor", "rope.scale_linear"}
# keys only some architectures read (besides _READ)
_READ_ALSO = {"gemma3": {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                         "final_logit_softcapping"},
              "gemma2": {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                         "attn_logit_softcapping", "final_logit_softcapping"},
              # llama.cpp turns Phi-3's sliding window off: read, and left off in the config too
              "phi3": {"attention.sliding_window"}}
_NEUTRAL = {"rope.scaling.original_context_length": None, "rope.scaling.finetuned": None,
            "expert_count": 0, "expert_used_count": 0, "attention.layer_norm_epsilon": None,
            "tensor_data_layout": None}  # early converters' "Meta AI original pth": llama.cpp never reads it



def _blocks_present(header: GGUFHeader) -> set[int]:
    present = set()
    for t in header.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isascii() and parts[1].isdigit():
            present.add(int(parts[1]))
    return present


def _rope_scaling(k: Keys) -> dict | None:
    """transformers' rope_scaling for the file's RoPE scaling, as llama.cpp applies it."""
    kind = k.string("rope.scaling.type", "linear")  # llama.cpp's default when the key is absent
    factor = k.float("rope.scaling.factor", 0.0, zero_ok=True)
    if factor == 0.0:
        factor = k.float("rope.scale_linear", 0.0, zero_ok=True)
    if kind == "none" or factor in (0.0, 1.0) and kind == "linear":
        return None
    if kind != "linear":
        k.fail(f"{k.prefix}rope.scaling.type {kind!r}: fewbits applies linear RoPE scaling (or none); "
               f"{kind} is not supported")
    return {"rope_type": "linear", "factor": factor}


def _check_other_keys(k: Keys) -> None:
    for full, v in k.h.metadata.items():
        if not full.startswith(k.prefix):
            continue
        key = full[len(k.prefix):]
        if key in _READ or key in _READ_ALSO.get(k.prefix[:-1], ()):
            continue
        if key not in _NEUTRAL:
            k.fail(f"{full} is not a key fewbits applies (it reads {', '.join(sorted(_READ))}); "
                   "refusing rather than ignoring it")
        if _NEUTRAL[key] is not None and (v.type not in INTEGER_TYPES or v.value != _NEUTRAL[key]):
            k.fail(f"{full} = {shown(v.value)}: fewbits runs dense models only ({key} {_NEUTRAL[key]})")


def _gemma_config(k: Keys, cfg: dict, gguf_arch: str) -> None:
    """Gemma 2's and 3's fields, as llama.cpp's gemma2 / gemma3 compute: sliding-window layers by
    attention.sliding_window_pattern (one bool per layer, or n: every n-th layer full; 2 for
    gemma2 and 6 for gemma3 where absent) over attention.sliding_window positions (gemma2: 4096
    where absent; gemma3: none where absent); gemma3's sliding layers on their own RoPE base
    rope.freq_base_swa (10000 where absent; gemma2 has one base, so a different one is refused);
    queries scaled by 1/sqrt(head size) (hidden / heads for the 27B models); GELU (tanh); gemma2's
    attention scores and logits capped by attn_logit_softcapping / final_logit_softcapping (50
    and 30 where absent), gemma3's logits where final_logit_softcapping is given."""
    p, n = k.prefix, cfg["num_hidden_layers"]
    gemma2 = gguf_arch == "gemma2"
    window = k.int("attention.sliding_window", 4096 if gemma2 else 0, minimum=0)
    if window >= 2 ** 31:  # llama.cpp reads a u32; transformers' caches take an int64
        k.fail(f"{p}attention.sliding_window {window} is beyond any context (2^31 positions)")
    if window > 0:
        v = k.h.metadata.get(p + "attention.sliding_window_pattern")
        if v is None or v.type in INTEGER_TYPES:  # llama.cpp: 0, every layer sliding
            pattern = k.int("attention.sliding_window_pattern", 2 if gemma2 else 6, minimum=0)
            types = ["sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention"
                     for i in range(n)]
        elif v.type == "array[bool]" and len(v.value) == n:
            types = ["sliding_attention" if b else "full_attention" for b in v.value]
        else:
            k.fail(f"{p}attention.sliding_window_pattern must be an integer or {n} bools (one per layer), got "
                   f"{v.type} {shown(v.value)}")
        cfg["sliding_window"] = window
    else:
        types = ["full_attention"] * n
    arch = "Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"
    cfg.update(layer_types=types, hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=gemma_attention_scalar(cfg, arch))
    if gemma2:
        swa = k.float("rope.freq_base_swa", cfg["rope_theta"])
        if swa != cfg["rope_theta"]:
            k.fail(f"{p}rope.freq_base_swa {swa} differs from rope.freq_base {cfg['rope_theta']}: transformers' "
                   "Gemma 2 has one RoPE base")
        cfg.update(model_type="gemma2", attn_logit_softcapping=k.float("attn_logit_softcapping", 50.0),
                   final_logit_softcapping=k.float("final_logit_softcapping", 30.0))
        return
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if "rope_scaling" in cfg:
        full.update(cfg.pop("rope_scaling"))
    sliding = {"rope_type": "default", "rope_theta": k.float("rope.freq_base_swa", 10000.0)}
    cap = k.float("final_logit_softcapping", 0.0, zero_ok=True)
    cfg.update(model_type="gemma3_text", rope_parameters={"full_attention": full, "sliding_attention": sliding},
               final_logit_softcapping=cap if cap > 0 else None)


def llama_config(header: GGUFHeader) -> dict:
    """The transformers config fields (LlamaConfig, Qwen2Config, Qwen3Config, Phi3Config,
    Gemma2Config or Gemma3TextConfig) of a validated GGUF header (see the module docstring); a FileFormatError
    naming the file and the key for anything fewbits would not run as llama.cpp."""
    arch = header.metadata.get("general.architecture")
    if arch is None or arch.type != "string":
        raise FileFormatError(header.path, "general.architecture is missing or not a string")
    if arch.value not in READ_CLASSES:
        raise FileFormatError(header.path, f"fb.from_pretrained reads GGUF files of the architectures "
                                           f"{', '.join(sorted(READ_CLASSES))}; this one is {arch.value!r}")
    p = arch.value + "."
    k = Keys(header, p)
    _check_other_keys(k)
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.dims) != 2:
        k.fail("token_embd.weight is missing or not a matrix")
    hidden, rows = embed.dims
    layers = k.int("block_count")
    present = _blocks_present(header)
    if len(present) != layers or max(present, default=-1) != layers - 1:  # never set(range(layers)): 2^32
        k.fail(f"{p}block_count is {layers}, but the file's tensors are of "
               f"{len(present)} block(s) numbered {min(present, default=0)}..{max(present, default=-1)}")
    if k.int("embedding_length") != hidden:
        k.fail(f"{p}embedding_length is {k.int('embedding_length')}, token_embd.weight's rows have {hidden}")
    vocab = k.int("vocab_size", rows)
    if vocab != rows:
        k.fail(f"{p}vocab_size is {vocab}, token_embd.weight has {rows} rows")
    heads = k.int("attention.head_count")
    kv_heads = k.int("attention.head_count_kv", heads)
    if heads % kv_heads:
        k.fail(f"{p}attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if p + "attention.key_length" in header.metadata:
        head_dim = k.int("attention.key_length")
    elif hidden % heads:
        k.fail(f"{p}embedding_length {hidden} is not a multiple of attention.head_count {heads}")
    else:
        head_dim = hidden // heads
    if k.int("attention.value_length", head_dim) != head_dim:
        k.fail(f"{p}attention.value_length {k.int('attention.value_length')} differs from key_length {head_dim}")
    if head_dim < 2 or head_dim % 2:
        k.fail(f"heads of {head_dim} dimensions ({p}embedding_length {hidden}, attention.head_count {heads}, "
               "key_length): the rotary embedding needs an even count")
    rope_dims = k.int("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        k.fail(f"{p}rope.dimension_count {rope_dims}: fewbits rotates whole heads, of {head_dim} dimensions "
               "(partial rotary is not supported)")
    ffn = k.int("feed_forward_length")
    # the sizes the model is built with must be the tensors' own, checked before it is built
    # (a feed_forward_length of 2^63 overflowed inside torch)
    shapes = (("blk.0.attn_q.weight", heads * head_dim, "attention.head_count x the head size"),
              ("blk.0.attn_k.weight", kv_heads * head_dim, "attention.head_count_kv x the head size"),
              ("blk.0.ffn_up.weight", ffn, "feed_forward_length"))
    if arch.value == "phi3":  # q/k/v in one matrix, gate and up in one
        shapes = (("blk.0.attn_qkv.weight", (heads + 2 * kv_heads) * head_dim,
                   "(attention.head_count + 2 x head_count_kv) x the head size"),
                  ("blk.0.ffn_up.weight", 2 * ffn, "2 x feed_forward_length"))
    for name, size, what in shapes:
        t = next((t for t in header.tensors if t.name == name), None)
        if t is None:
            k.fail(f"{name} is missing")
        if len(t.dims) != 2 or t.dims[-1] != size:
            k.fail(f"{name} has {t.dims[-1]} rows, but {p}{what} is {size}")
    cfg = {"model_type": arch.value, "architectures": [READ_CLASSES[arch.value]], "vocab_size": rows,
           "max_position_embeddings": k.int("context_length"), "hidden_size": hidden,
           "num_hidden_layers": layers, "intermediate_size": ffn,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "rope_theta": k.float("rope.freq_base", 10000.0), "rms_norm_eps": k.float("attention.layer_norm_rms_epsilon"),
           "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors), "dtype": "float32"}
    scaling = _rope_scaling(k)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if arch.value in ("gemma2", "gemma3"):
        _gemma_config(k, cfg, arch.value)
    if arch.value == "phi3":  # its defaults (pad 32000, ...) would lie outside a smaller vocabulary
        cfg.update(sliding_window=None, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg.update(check_vocabulary(header, rows))
    return cfg


def _config(cfg: dict):
    """The transformers config object of llama_config's fields (its architecture's class)."""
    import transformers

    return getattr(transformers, CONFIG_CLASSES[cfg["model_type"]])(**cfg)


def _gguf_arch(cfg: dict) -> str:
    """The GGUF architecture name of llama_config's fields."""
    return ARCHITECTURES[cfg["architectures"][0]]


def _expected_names(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{GGUF name: (Hugging Face name, torch shape)} of every tensor the config's model saves."""
    import gguf
    import transformers

    config = _config(cfg)
    with torch.device("meta"):  # sizes checked against the tensors before (llama_config)
        model = getattr(transformers, READ_CLASSES[_gguf_arch(cfg)])(config)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_gguf_arch(cfg).upper()], config.num_hidden_layers)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is not None:
            out[gname] = (name, tuple(t.shape))
    return out


def check_gguf(path) -> tuple[GGUFHeader, dict]:
    """(header, config) of the llama GGUF file at `path` once its header and metadata have passed
    the checks (see the module docstring); reads no tensor data. Run it before anything else
    (transformers' GGUF loader, the tokenizer) reads the file."""
    header = read_header(path)
    return header, llama_config(header)


def read_gguf(path, checked: tuple[GGUFHeader, dict] | None = None) -> tuple[dict, dict]:
    """(config dict, {Hugging Face name: QuantizedTensor or float tensor}) of a llama GGUF file
    (see the module docstring). checked: check_gguf(path) of it already made (not read twice)."""
    header, cfg = checked if checked is not None else check_gguf(os.fspath(path))
    cfg = dict(cfg)
    path = header.path
    try:
        expected = _expected_names(cfg)
    except (ValueError, TypeError, RuntimeError, OverflowError, ZeroDivisionError) as e:
        raise FileFormatError(path, f"transformers cannot build the {cfg['model_type']} it describes: {e}") from None
    except Exception as e:  # noqa: BLE001 - huggingface_hub's strict dataclass errors have no common base
        if not type(e).__name__.startswith("StrictDataclass"):
            raise
        raise FileFormatError(path, f"transformers cannot build the {cfg['model_type']} it describes: {e}") from None
    # llama.cpp's "llama" rows of q / k permuted (rotary pairs); qwen2 / qwen3 as transformers holds them
    arch = _gguf_arch(cfg)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]} \
        if rows_permuted(arch) else {}
    data = np.memmap(path, dtype=np.uint8, mode="r") if header.tensors else None
    tensors, problems = {}, []
    for t in header.tensors:
        if t.name == "rope_freqs.weight":
            problems.append(f"{t.name}: per-dimension RoPE frequency factors (Llama 3.1's llama3 scaling), which "
                            "fewbits does not apply")
            continue
        if t.name not in expected:
            problems.append(f"{t.name}: not a tensor of a {cfg['model_type']} model with {cfg['num_hidden_layers']} layers")
            continue
        name, shape = expected.pop(t.name)
        if t.shape != shape:
            problems.append(f"{t.name}: shape {t.shape}, the config says {shape}")
            continue
        raw = data[t.start:t.start + t.nbytes]
        if t.ggml_type in GGUF_BLOCK_TYPES and len(shape) != 2:
            problems.append(f"{t.name}: a {len(shape)}-D tensor in {t.ggml_type}; fewbits reads block types for "
                            "matrices only (vectors are F32, F16 or BF16)")
            continue
        if t.ggml_type in _FLOATS:
            raw = raw.view(_FLOATS[t.ggml_type])
        elif t.ggml_type not in GGUF_BLOCK_TYPES:
            problems.append(f"{t.name}: GGUF type {t.ggml_type} is not one fewbits reads (block types "
                            f"{', '.join(GGUF_BLOCK_TYPES)}, F32, F16, BF16)")
            continue
        raw = raw.reshape(shape[0], -1)
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else None
        if kind in heads:  # rows back into transformers' rotary order
            raw = raw[torch.argsort(rotary_permutation(shape[0], heads[kind])).numpy()]
        if t.ggml_type in GGUF_BLOCK_TYPES:
            try:
                value = decode_blocks(raw, t.ggml_type, shape)
            except ValueError as e:
                problems.append(f"{t.name}: {e}")
                continue
            bad = stored_problem(value)
        else:
            value = torch.from_numpy(np.array(raw)).reshape(shape)
            if t.ggml_type == "BF16":
                value = value.view(torch.bfloat16)
            bad = None if bool(torch.isfinite(value).all()) else "holds NaN or infinite values"
            if bad is None and norm_shifted(arch, t.name):  # the file holds 1 + Gemma's weight
                value = value.to(torch.float32) - 1.0
        if bad is not None:
            problems.append(f"{t.name}: {bad}")
            continue
        tensors[name] = value
    del data
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


def gguf_tokenizer(path, header: GGUFHeader):
    """transformers' tokenizer of a checked GGUF file, or None for llama.cpp's vocabulary-less
    model (tokenizer.ggml.model "none" or absent)."""
    from transformers import AutoTokenizer

    model = header.get("tokenizer.ggml.model")
    if model in (None, "none"):
        return None
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception on bad vocabularies
        raise FileFormatError(path, f"its tokenizer cannot be read: {type(e).__name__}: {e}") from None


def gguf_to_pretrained(path, out_dir, *, overwrite: bool = False) -> str:
    """Write the llama GGUF file `path` as a fewbits Hugging Face directory (quantized tensors
    kept as they are in the file) with its tokenizer; returns out_dir."""
    from .hf_dir import ShardWriter

    path = os.fspath(path)
    checked = check_gguf(path)
    header = checked[0]
    cfg, tensors = read_gguf(path, checked)
    tokenizer = gguf_tokenizer(path, header)
    with ShardWriter(out_dir, overwrite=overwrite) as writer:
        for name, value in tensors.items():
            writer.add(name, value)
        return writer.finish(_config(cfg), tokenizer)


def gguf_to_float_pretrained(path, out_dir, *, overwrite: bool = False) -> str:
    """Write the llama GGUF file `path` dequantized, as a plain float32 Hugging Face directory
    (no quantization_config; a tied embedding tied again) with its tokenizer; returns out_dir."""
    from .hf_dir import ShardWriter

    path = os.fspath(path)
    checked = check_gguf(path)
    header = checked[0]
    cfg, tensors = read_gguf(path, checked)
    head = tensors.get("lm_head.weight")
    if head is not None and head is tensors.get("model.embed_tokens.weight"):
        del tensors["lm_head.weight"]
        cfg["tie_word_embeddings"] = True
    tokenizer = gguf_tokenizer(path, header)
    with ShardWriter(out_dir, overwrite=overwrite) as writer:
        for name in list(tensors):
            value = tensors.pop(name)
            writer.add(name, value.dequantize(torch.float32) if isinstance(value, QuantizedTensor)
                       else value.to(torch.float32))
        return writer.finish(_config(cfg), tokenizer)
