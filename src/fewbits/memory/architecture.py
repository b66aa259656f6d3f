"""What the estimator knows about a model: its parameter tensors (shapes and roles) and, when
known, its transformer architecture, from an nn.Module, a Hugging Face config.json (llama-like and
bert-like models) or a bare parameter count ("7B")."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from .storage import tensor_bytes

# ---------------------------------------------------------------------------------------------
# model sizes: "7B", "135M", 7_000_000_000
# ---------------------------------------------------------------------------------------------
_SIZE_SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9, "T": 10 ** 12}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def parse_parameter_count(value) -> int:
    """A parameter count from an int or a string such as "7B", "1.5b", "135M", "350K", "7e9"
    (K = 10^3, M = 10^6, B = G = 10^9, T = 10^12). Raises ValueError for anything else."""
    if isinstance(value, bool):
        raise TypeError("a parameter count must be a number or a string such as 7B, not a bool")
    if isinstance(value, int):
        count = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"parameter count must be a whole number, got {value!r}")
        count = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"bad model size {value!r}: write a parameter count such as 7B, 1.5B, 135M, "
                             "350K or 7000000000")
        number = float(m.group(1).replace("_", "").replace(",", "")) * _SIZE_SUFFIX[m.group(2).upper()]
        if number != round(number):
            raise ValueError(f"bad model size {value!r}: it is not a whole number of parameters")
        count = int(round(number))
    else:
        raise TypeError(f"a parameter count must be an int or a string such as 7B, got {type(value).__name__}")
    if count <= 0:
        raise ValueError(f"bad model size {value!r}: the parameter count must be positive")
    return count



# ---------------------------------------------------------------------------------------------
# architecture: the shapes the activation and KV terms need
# ---------------------------------------------------------------------------------------------
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "phi3")
BERT_LIKE = ("bert", "roberta", "xlm-roberta", "camembert")


@dataclass(frozen=True)
class Tensors:
    """`count` tensors of one shape and role. role: "linear" (a matmul weight: quantized by a
    scheme, cast by autocast), "head" (the LM head's weight), "embedding", "other" (norms, biases)."""
    name: str
    shape: tuple[int, ...]
    count: int = 1
    role: str = "other"

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count


@dataclass(frozen=True)
class Architecture:
    """A transformer described by its config: family "llama" (decoder, RMSNorm, gated MLP, rotary)
    or "bert" (encoder, LayerNorm, GELU MLP, learned positions)."""
    family: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int | None = None
    tied_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias_only: bool = False       # qwen2: biases on q, k, v but not o
    mlp_bias: bool = False
    qk_norm: bool = False             # qwen3
    fused_qkv: bool = False           # phi3: one qkv and one gate_up matrix
    type_vocab: int = 0               # bert: token-type embeddings
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    head: str = "lm"                  # lm | pooler | mlm | classifier
    num_labels: int = 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def causal(self) -> bool:
        return self.family == "llama"

    def tensors(self) -> list[Tensors]:
        """Every parameter tensor, with its shape, grouped by kind."""
        H, L, Q, KV, I, V = self.hidden, self.layers, self.q_dim, self.kv_dim, self.intermediate, self.vocab
        t: list[Tensors] = []
        if self.family == "llama":
            t.append(Tensors("embed_tokens.weight", (V, H), 1, "embedding"))
            if self.fused_qkv:
                t.append(Tensors("layers.*.self_attn.qkv_proj.weight", (Q + 2 * KV, H), L, "linear"))
            else:
                t += [Tensors("layers.*.self_attn.q_proj.weight", (Q, H), L, "linear"),
                      Tensors("layers.*.self_attn.k_proj.weight", (KV, H), L, "linear"),
                      Tensors("layers.*.self_attn.v_proj.weight", (KV, H), L, "linear")]
            t.append(Tensors("layers.*.self_attn.o_proj.weight", (H, Q), L, "linear"))
            if self.attention_bias or self.qkv_bias_only:
                t += [Tensors("layers.*.self_attn.q_proj.bias", (Q,), L), Tensors("layers.*.self_attn.k_proj.bias", (KV,), L),
                      Tensors("layers.*.self_attn.v_proj.bias", (KV,), L)]
                if self.attention_bias and not self.qkv_bias_only:
                    t.append(Tensors("layers.*.self_attn.o_proj.bias", (H,), L))
            if self.qk_norm:
                t += [Tensors("layers.*.self_attn.q_norm.weight", (self.head_dim,), L),
                      Tensors("layers.*.self_attn.k_norm.weight", (self.head_dim,), L)]
            if self.fused_qkv:
                t.append(Tensors("layers.*.mlp.gate_up_proj.weight", (2 * I, H), L, "linear"))
            else:
                t += [Tensors("layers.*.mlp.gate_proj.weight", (I, H), L, "linear"),
                      Tensors("layers.*.mlp.up_proj.weight", (I, H), L, "linear")]
            t.append(Tensors("layers.*.mlp.down_proj.weight", (H, I), L, "linear"))
            if self.mlp_bias:
                t += [Tensors("layers.*.mlp.gate_proj.bias", (I,), L), Tensors("layers.*.mlp.up_proj.bias", (I,), L),
                      Tensors("layers.*.mlp.down_proj.bias", (H,), L)]
            t += [Tensors("layers.*.input_layernorm.weight", (H,), L),
                  Tensors("layers.*.post_attention_layernorm.weight", (H,), L),
                  Tensors("norm.weight", (H,), 1)]
            if not self.tied_embeddings:
                t.append(Tensors("lm_head.weight", (V, H), 1, "head"))
            return t
        # bert-like
        t += [Tensors("embeddings.word_embeddings.weight", (V, H), 1, "embedding"),
              Tensors("embeddings.position_embeddings.weight", (self.max_positions or 512, H), 1, "embedding")]
        if self.type_vocab:
            t.append(Tensors("embeddings.token_type_embeddings.weight", (self.type_vocab, H), 1, "embedding"))
        t.append(Tensors("embeddings.LayerNorm.*", (H,), 2))
        for name in ("query", "key", "value"):
            t.append(Tensors(f"encoder.layer.*.attention.self.{name}.weight", (H, H), L, "linear"))
        t += [Tensors("encoder.layer.*.attention.output.dense.weight", (H, H), L, "linear"),
              Tensors("encoder.layer.*.intermediate.dense.weight", (I, H), L, "linear"),
              Tensors("encoder.layer.*.output.dense.weight", (H, I), L, "linear"),
              Tensors("encoder.layer.*.biases", (H,), 5 * L), Tensors("encoder.layer.*.intermediate.dense.bias", (I,), L),
              Tensors("encoder.layer.*.LayerNorm.*", (H,), 4 * L)]
        if self.head in ("pooler", "classifier"):
            t += [Tensors("pooler.dense.weight", (H, H), 1, "linear"), Tensors("pooler.dense.bias", (H,), 1)]
        if self.head == "classifier":
            t += [Tensors("classifier.weight", (self.num_labels, H), 1, "linear"),
                  Tensors("classifier.bias", (self.num_labels,), 1)]
        if self.head == "mlm":  # transform dense + LayerNorm; the decoder shares the word embeddings
            t += [Tensors("cls.predictions.transform.dense.weight", (H, H), 1, "linear"),
                  Tensors("cls.predictions.transform.*", (H,), 3), Tensors("cls.predictions.bias", (V,), 1)]
        return t


def load_config(path) -> dict:
    """The dict of a Hugging Face config.json (a file, or a directory holding one)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no such config file: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read config {p}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config {p} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config {p} is not a JSON object")
    return cfg


def architecture_from_config(cfg: dict) -> Architecture:
    """An Architecture from a Hugging Face config dict of a llama-like or bert-like model."""
    if not isinstance(cfg, dict):
        raise TypeError(f"a config must be a dict, got {type(cfg).__name__}")
    mt = str(cfg.get("model_type", "")).lower().replace("_", "-")
    if mt not in LLAMA_LIKE and mt not in BERT_LIKE:
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not supported: the estimator knows llama-like "
                         f"({', '.join(LLAMA_LIKE)}) and bert-like ({', '.join(BERT_LIKE)}) configs")

    def need(key, *alts):
        for k in (key,) + alts:
            v = cfg.get(k)
            if v is not None:
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"config field {k!r} must be a positive integer, got {v!r}")
                return v
        raise ValueError(f"config of model_type {mt!r} lacks {key!r}")

    H, L, nh = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    I, V = need("intermediate_size"), need("vocab_size")
    archs = [str(a) for a in (cfg.get("architectures") or [])]
    if mt in LLAMA_LIKE:
        kv = cfg.get("num_key_value_heads") or nh
        hd = cfg.get("head_dim") or H // nh
        tied = bool(cfg.get("tie_word_embeddings", mt == "gemma"))
        return Architecture(
            "llama", mt, H, L, nh, int(kv), int(hd), I, V, cfg.get("max_position_embeddings"),
            tied_embeddings=tied, attention_bias=bool(cfg.get("attention_bias", False)),
            qkv_bias_only=(mt == "qwen2"), mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=(mt == "qwen3"),
            fused_qkv=(mt == "phi3"), attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
            head="lm")
    head = "pooler"
    if any(a.endswith("ForMaskedLM") for a in archs):
        head = "mlm"
    elif any(a.endswith("ForSequenceClassification") for a in archs):
        head = "classifier"
    n_labels = len(cfg.get("id2label") or {}) or 2
    return Architecture(
        "bert", mt, H, L, nh, nh, H // nh, I, V, need("max_position_embeddings"),
        type_vocab=int(cfg.get("type_vocab_size", 2) or 0), hidden_dropout=float(cfg.get("hidden_dropout_prob", 0.1)),
        attention_dropout=float(cfg.get("attention_probs_dropout_prob", 0.1)), head=head, num_labels=n_labels)


# ---------------------------------------------------------------------------------------------
# what the estimator knows about a model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """Parameters (as tensor groups; one anonymous group for a bare count), the architecture when
    known, and where it came from."""
    name: str
    tensors: tuple[Tensors, ...]
    architecture: Architecture | None = None
    dtypes: tuple[torch.dtype, ...] = ()   # a module's parameter dtypes, as it is now
    stored_bytes: int | None = None        # a module's parameters, buffers and quantized weights, as held now
    quantized: bool = False                # the module holds fewbits-quantized layers

    @property
    def parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def structured(self) -> bool:
        return not (len(self.tensors) == 1 and self.tensors[0].role == "all")

    @property
    def tensor_count(self) -> int:
        return sum(t.count for t in self.tensors) if self.structured else 0

    @property
    def largest(self) -> int:
        return max(math.prod(t.shape) for t in self.tensors) if self.structured else 0


def describe_model(model) -> ModelSpec:
    """A ModelSpec from an nn.Module, a parameter count (int or "7B"), a path to a config.json
    (or its directory), or a config dict."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        return _spec_of_module(model)
    if isinstance(model, dict):
        arch = architecture_from_config(model)
        return ModelSpec(model.get("_name_or_path") or arch.model_type, tuple(arch.tensors()), arch)
    if isinstance(model, (str, os.PathLike)) and not isinstance(model, bool):
        text = os.fspath(model)
        if isinstance(model, str) and _SIZE_RE.match(text):
            n = parse_parameter_count(text)
            return ModelSpec(text.strip(), (Tensors("parameters", (n,), 1, "all"),))
        if isinstance(model, os.PathLike) or os.sep in text or text.endswith(".json") or os.path.exists(text):
            arch = architecture_from_config(load_config(text))
            return ModelSpec(text, tuple(arch.tensors()), arch)
        raise ValueError(f"{text!r} is neither a parameter count (7B, 1.5B, 135M, 7000000000) nor the path of a "
                         "config.json or of a directory holding one")
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        n = parse_parameter_count(model)
        return ModelSpec(f"{n:,} parameters", (Tensors("parameters", (n,), 1, "all"),))
    raise TypeError("model must be an nn.Module, a parameter count (7_000_000_000 or '7B'), a path to a "
                    f"config.json or a config dict; got {type(model).__name__}")


def _spec_of_module(module: nn.Module) -> ModelSpec:
    arch = None
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
        if not d.get("architectures"):
            d["architectures"] = [type(module).__name__]
        try:
            arch = architecture_from_config(d)
        except (ValueError, TypeError):
            arch = None
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    out, seen, dtypes = [], set(), []
    stored = tensor_bytes(module)
    quantized = False
    for name, m in module.named_modules():
        qw = getattr(m, "_qweight", None)  # fewbits.quant's QuantLinear / QuantEmbedding
        if qw is not None and hasattr(qw, "nbytes") and hasattr(qw, "shape"):
            role = "embedding" if hasattr(m, "num_embeddings") else "linear"
            out.append(Tensors(f"{name}.weight", tuple(int(d) for d in qw.shape), 1, role))
            stored += int(qw.nbytes)
            quantized = True
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights are stored once
            continue
        seen.add(id(p))
        role = "embedding" if id(p) in embeddings else ("linear" if id(p) in linear_weights else "other")
        if role == "linear" and name.split(".")[-2:-1] == ["lm_head"]:
            role = "head"
        out.append(Tensors(name, tuple(p.shape), 1, role))
        dtypes.append(p.dtype)
    if not out:
        raise ValueError("the module has no parameters")
    return ModelSpec(type(module).__name__, tuple(out), arch, tuple(dtypes), stored, quantized)

