"""Memory of a model in a given precision: predicted before running, measured while running.

    est = fb.estimate_memory("7B", mode="training", policy="bf16-mixed")
    est = fb.estimate_memory(model, mode="inference", scheme="nf4_dq", batch=4, seq_len=1024)
    est = fb.estimate_memory("path/to/config.json", mode="training", policy="bf16-pure")
    est.total, est.peak_phase, est.components, est.at_peak

What is predicted (bytes; decimal units in the tables, GB = 10^9 bytes):
  weights           the stored weights in their format, scales and zero points included
  master_weights    a separate higher-precision copy the optimizer updates (when the policy has one)
  gradients         one gradient per parameter
  optimizer_states  the optimizer's per-parameter state (AdamW: two), step counters included
  activations       training: the tensors autograd saves for the backward pass;
                    inference: the live intermediate tensors at the forward's busiest point
  kv_cache          keys and values cached by a causal LM's forward (inference)
  workspace         short-lived buffers alive at the peak: the loss gradients over the vocabulary,
                    optimizer temporaries, low-precision copies of the weights made by autocast,
                    dequantized weights of a quantized layer
and `total`, the peak: the largest sum of what is alive at once, over the phases of the step
(forward, loss gradient, lm-head backward, optimizer step). `at_peak` gives each component's
share of that peak and `peak_phase` names the phase.

Where the numbers come from: parameter counts and shapes from the module itself, from a
Hugging Face config.json (llama-like and bert-like models), or from a bare count ("7B"). The
activation terms are per-token byte counts of what the Hugging Face implementations of these two
families save for backward (sdpa attention, a causal-LM loss over the vocabulary), in the three
ways PyTorch runs a precision policy: all in one dtype (fp32, or bf16 "pure"), or fp32 parameters
under torch.autocast ("mixed"). They were derived op by op and are checked against measurement:
`measure_peak_memory` reads the CPU allocator's own running total through torch's profiler
(every allocation and free made by torch's CPU allocator, not an estimate) or CUDA's peak-memory
counter; tests/test_memory.py and benchmarks/bench_memory.py compare the two.

Runtimes: runtime="torch" (the default) predicts stock PyTorch: a policy whose working weights
are narrower than its fp32 master runs as fp32 parameters under autocast (the master is the
parameter, the working copy is autocast's weight cache); a policy without master stores the
parameters in its weight format, and torch.optim keeps optimizer states in the parameter dtype.
runtime="fewbits" predicts fewbits.train.Engine, which keeps low-precision working weights beside
fp32 masters, fp32 gradient buffers that persist between steps, norms in fp32, outputs returned in
fp32, and states in the policy's format (its int8_blockwise packing temporaries are not modelled).

Validated on a CPU (tests and benchmarks/bench_memory.py): llama-like and bert-like models,
inference in fp32, bf16 and under autocast, training steps under fp32, bf16-mixed and bf16-pure
(both runtimes). device="cuda" changes the attention kernels and the optimizer's temporaries
(foreach) by derivation, not by measurement.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..formats import get_format

COMPONENTS = ("weights", "master_weights", "gradients", "optimizer_states", "activations", "kv_cache",
              "workspace")
MODES = ("inference", "training")
RUNTIMES = ("torch", "fewbits")
DEVICES = ("cpu", "cuda")
DEFAULT_SEQ_LEN = 512

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


def format_bytes(n: float) -> str:
    """Decimal units, three significant digits: 1.00 GB, 750 MB, 12.3 kB; 0 for nothing."""
    if n is None:
        return "—"
    n = float(n)
    if n == 0:
        return "0"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:#.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


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

    def parameter_count(self) -> int:
        return sum(x.numel for x in self.tensors())


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
    stored = sum(_storages([module]).values())
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


# ---------------------------------------------------------------------------------------------
# precision: a storage format, a quantization scheme, or a training policy
# ---------------------------------------------------------------------------------------------
def _format_bytes(name: str) -> float:
    """Bytes of one value held in a tensor of this format: a float format of 16 bits or more is
    its own container (tf32 lives in fp32 containers); narrower formats are their bits / 8."""
    fmt = get_format(name)
    if fmt.name == "tf32":
        return 4.0
    return fmt.bits / 8


def _compute_bytes(name: str) -> int:
    """Bytes of an activation computed in this format on hardware that has it natively; formats of
    8 bits or fewer compute in bf16 unless they are fp8 (1 byte)."""
    fmt = get_format(name)
    if fmt.name == "tf32":
        return 4
    if fmt.bits >= 16:
        return fmt.bits // 8
    if fmt.bits == 8 and fmt.name.startswith("fp8"):
        return 1
    return 2


@dataclass(frozen=True)
class Precision:
    """How each tensor role is stored, resolved from a scheme, a policy or the module itself."""
    name: str
    kind: str                            # "format" | "scheme" | "policy" | "loaded" (a module as it is)
    weight_format: str | None = None     # plain storage of every parameter (kind format/policy)
    scheme: Any = None                   # a QuantScheme for linear weights (kind scheme)
    rest_format: str = "bf16"            # other parameters under a scheme
    activation_bytes: int = 4
    autocast: bool = False               # fp32 parameters, matmuls in activation_bytes (torch.autocast)
    copy_bytes: int = 2                  # autocast's cached weight copies (fp8 matmuls: 1)
    compute_format: str = "fp32"         # the format activations are computed in (autocast's dtype)
    master_format: str | None = None     # separate master copy (fewbits runtime)
    grad_bytes: float = 4
    state_format: str = "fp32"           # per state value: a format name or "int8_blockwise"
    compensation_bytes: float = 0.0      # Kahan compensation buffer per parameter
    update_rounding: str = "nearest"     # how a no-master update lands in the stored weights
    notes: tuple[str, ...] = ()


# policies when fewbits.train is not importable: (weights, master, activations, forward, optimizer_states, update)
_FALLBACK_POLICIES = {
    "fp32": ("fp32", None, "fp32", "fp32", "fp32", "nearest"),
    "tf32": ("fp32", None, "fp32", "tf32", "fp32", "nearest"),
    "bf16-mixed": ("bf16", "fp32", "bf16", "bf16", "fp32", "nearest"),
    "fp16-mixed": ("fp16", "fp32", "fp16", "fp16", "fp32", "nearest"),
    "fp8-hybrid": ("bf16", "fp32", "bf16", "fp8_e4m3", "fp32", "nearest"),
    "mxfp8": ("bf16", "fp32", "bf16", "fp8_e4m3", "fp32", "nearest"),
    "bf16-pure": ("bf16", None, "bf16", "bf16", "fp32", "nearest"),
    "bf16-pure-sr": ("bf16", None, "bf16", "bf16", "fp32", "stochastic"),
    "bf16-pure-kahan": ("bf16", None, "bf16", "bf16", "fp32", "kahan"),
    "bf16-mixed-8bit-adam": ("bf16", "fp32", "bf16", "bf16", "int8_blockwise", "nearest"),
}
BLOCKWISE_BLOCK = 256  # int8_blockwise optimizer states: one fp32 scale per 256 values


@dataclass(frozen=True)
class _PolicyFields:
    name: str
    weights: str
    master: str | None
    activations: str
    forward: str
    optimizer_states: str
    update_rounding: str
    keep_fp32: tuple[str, ...] = ()


def _policy_fields(policy) -> _PolicyFields:
    try:
        from ..train import Policy
    except ImportError:  # train not built yet: the preset table above
        Policy = None
    if Policy is not None and isinstance(policy, str):
        policy = Policy.preset(policy)
    if isinstance(policy, str):
        key = policy.strip().lower().replace("_", "-")
        if key not in _FALLBACK_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(_FALLBACK_POLICIES)}")
        w, m, a, f, s, u = _FALLBACK_POLICIES[key]
        return _PolicyFields(key, w, m, a, f, s, u, ("*norm*",) if m or w != "fp32" else ())
    needed = ("name", "weights", "master", "forward", "optimizer_states")
    if not all(hasattr(policy, k) for k in needed):
        raise TypeError(f"policy must be a preset name or a Policy, got {type(policy).__name__}")
    return _PolicyFields(policy.name, policy.weights, policy.master, getattr(policy, "activations", policy.forward),
                         policy.forward, policy.optimizer_states, getattr(policy, "update_rounding", "nearest"),
                         tuple(getattr(policy, "keep_fp32", ())))


def _state_bytes(fmt: str) -> float:
    if fmt == "int8_blockwise":
        return 1 + 4 / BLOCKWISE_BLOCK
    return _format_bytes(fmt)


def resolve_precision(*, scheme=None, policy=None, mode: str = "inference", runtime: str = "torch",
                      spec: ModelSpec | None = None, rest_format: str = "bf16", device: str = "cpu") -> Precision:
    """The storage of every tensor role for a scheme (a format name or quantization preset) or a
    training policy; neither: the module's own dtypes (or fp32 for a count or a config)."""
    if scheme is not None and policy is not None:
        raise ValueError("give a scheme (how weights are stored) or a policy (how training runs), not both")
    if scheme is not None:
        return _scheme_precision(scheme, mode, rest_format)
    if policy is not None:
        return _policy_precision(_policy_fields(policy), runtime, device)
    if spec is not None and spec.stored_bytes is not None:
        names = {_DTYPE_NAMES.get(d) for d in spec.dtypes if d.is_floating_point}
        names.discard(None)
        if len(names) == 1 and not spec.quantized:
            (fmt,) = names
            return _scheme_precision(fmt, mode, rest_format, name=f"{fmt} (as loaded)")
        if mode == "training":
            raise ValueError("the module holds mixed or quantized weights: give a --policy to estimate training")
        act = 4 if names <= {"fp32", "fp64"} and not spec.quantized else 2
        return Precision("as loaded", "loaded", activation_bytes=act,
                         notes=("weights: the bytes the module holds now (parameters, buffers, quantized layers)",))
    return _scheme_precision("fp32", mode, rest_format)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _scheme_precision(scheme, mode: str, rest_format: str, name: str | None = None) -> Precision:
    """Storage for a scheme, in fewbits.quant's vocabulary: a quantization preset (or any spelling
    of the format a preset is named after, or a QuantScheme) means what `quantize` stores, scales
    included: int4 is 4.25 bits (groups of 128, fp32 scales), nf4 4.5. A preset that is a plain
    cast (bf16, fp16) and a float format without a preset (fp32, tf32, fp64, e3m2) are plain
    storage of every parameter. Integer and codebook formats always come with scales."""
    from ..formats import FloatFormat

    try:
        from ..quant import get_scheme
    except ImportError as exc:
        raise ValueError(f"{scheme!r}: quantization schemes need fewbits.quant ({exc})") from None
    fmt = qs = None
    try:
        qs = get_scheme(scheme)
    except ValueError as exc:
        try:
            fmt = get_format(scheme) if isinstance(scheme, str) else None
        except ValueError:
            fmt = None
        if fmt is None:
            raise ValueError(f"{scheme!r} is neither a format nor a quantization preset: {exc}") from None
        if not isinstance(fmt, FloatFormat):
            raise ValueError(f"{scheme!r}: {exc} (integer and codebook formats are stored with scales: "
                             "a preset says how)") from None
    if qs is not None and qs.scale_format == "none":  # bf16, fp16: a plain cast of every parameter
        fmt, name = qs.format, name or qs.name
    if fmt is not None:
        act = _compute_bytes(fmt.name)
        if mode == "training":
            if fmt.bits < 16 or not fmt.name.startswith(("fp", "bf", "tf")):
                raise ValueError(f"training with {fmt.name} storage is not estimated (gradients and optimizer "
                                 "states need a float format): choose a --policy such as bf16-mixed or bf16-pure")
            store = "fp32" if fmt.name == "tf32" else fmt.name
            return Precision(name or fmt.name, "format", weight_format=store, activation_bytes=act,
                             grad_bytes=_format_bytes(store), state_format=store)
        return Precision(name or fmt.name, "format", weight_format=fmt.name, activation_bytes=act)
    if mode == "training":
        raise ValueError(f"training a model quantized with {qs.name or scheme!r} (QLoRA-style adapters) is not "
                         "estimated: choose a --policy such as bf16-mixed or bf16-pure")
    elem = qs.format
    act = _compute_bytes(elem.name) if elem.bits >= 16 else _compute_bytes(rest_format)
    return Precision(qs.name or str(scheme), "scheme", scheme=qs, rest_format=get_format(rest_format).name,
                     activation_bytes=act)


def _policy_precision(p: _PolicyFields, runtime: str, device: str) -> Precision:
    w, m = _format_bytes(p.weights), (_format_bytes(p.master) if p.master else 0.0)
    act = _compute_bytes(p.activations)
    notes = []
    if runtime == "torch":
        if p.master is not None and m > w:
            # torch.autocast: the fp32 master is the parameter, the working copy is autocast's cache
            store = p.master
            grads = m
            states = p.optimizer_states if p.optimizer_states == "int8_blockwise" else store
            fwd = get_format(p.forward)
            if fwd.bits < 16:
                notes.append(f"{fwd.name} matmul inputs as on hardware that has them natively; weight copies "
                             f"cached in {fwd.name}")
            return Precision(p.name, "policy", weight_format=store, activation_bytes=act, autocast=True,
                             compute_format=get_format(p.activations).name,
                             copy_bytes=min(act, _compute_bytes(fwd.name)), grad_bytes=grads, state_format=states,
                             notes=tuple(notes) + ("torch runtime: fp32 parameters under torch.autocast "
                                                   f"({p.activations}); the master weights are the parameters",))
        store = p.weights
        states = p.optimizer_states
        if p.optimizer_states != "int8_blockwise" and _state_bytes(states) != w:
            notes.append(f"torch.optim keeps the optimizer states in the parameter dtype ({store}), not "
                         f"{p.optimizer_states}; runtime='fewbits' keeps the policy's")
            states = store
        comp = w if p.update_rounding == "kahan" else 0.0
        return Precision(p.name, "policy", weight_format=store, activation_bytes=act, grad_bytes=w,
                         state_format=states, compensation_bytes=comp, notes=tuple(notes))
    # fewbits.train.Engine
    native = {"bf16": True, "fp32": True, "fp16": device == "cuda"}
    store = p.weights if native.get(get_format(p.weights).name, False) else "fp32"
    act_fmt = get_format(p.activations).name
    act = _compute_bytes(act_fmt) if native.get(act_fmt, False) else 4
    comp = _format_bytes(store) if (p.master is None and p.update_rounding == "kahan") else 0.0
    return Precision(p.name, "policy", weight_format=store, activation_bytes=act, master_format=p.master,
                     grad_bytes=_format_bytes(store), state_format=p.optimizer_states, compensation_bytes=comp,
                     update_rounding=p.update_rounding,
                     notes=("fewbits runtime: working weights beside fp32 masters and fp32 gradient buffers",))


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------
OPTIMIZERS = {"adamw": 2, "adam": 2, "adamw8bit": 2, "lion": 1, "sgd": 0, "sgd_momentum": 1, "adafactor": 0}


@dataclass
class MemoryEstimate:
    """Bytes per component (full size), bytes of each component alive at the peak, the peak
    (`total`) and the phase it occurs in."""
    model: str
    mode: str
    precision: str
    parameters: int
    components: dict[str, int]
    at_peak: dict[str, int]
    total: int
    peak_phase: str
    phases: dict[str, int]
    batch: int
    seq_len: int
    optimizer: str | None
    weight_bits: float
    architecture: str | None
    notes: list[str] = field(default_factory=list)
    workspace_parts: dict[str, int] = field(default_factory=dict)

    def __getattr__(self, name):  # est.weights, est.gradients, ... read the components
        comps = self.__dict__.get("components")
        if comps is not None and name in comps:
            return comps[name]
        raise AttributeError(name)

    def as_dict(self) -> dict:
        d = {k: int(self.components[k]) for k in COMPONENTS}
        d["total"] = int(self.total)
        d.update({
            "peak_phase": self.peak_phase, "at_peak": {k: int(v) for k, v in self.at_peak.items()},
            "phases": {k: int(v) for k, v in self.phases.items()},
            "workspace_parts": {k: int(v) for k, v in self.workspace_parts.items()},
            "model": self.model, "mode": self.mode, "precision": self.precision, "parameters": self.parameters,
            "weight_bits": self.weight_bits, "batch": self.batch, "seq_len": self.seq_len,
            "optimizer": self.optimizer, "architecture": self.architecture, "notes": list(self.notes),
        })
        return d


def estimate_memory(model, mode: str = "inference", *, scheme=None, policy=None, optimizer: str = "adamw",
                    batch: int = 1, seq_len: int | None = None, runtime: str = "torch", device: str = "cpu",
                    rest_format: str = "bf16", kv_cache: bool | None = None, logits: str = "all") -> MemoryEstimate:
    """Predicted memory of `model` (an nn.Module, a parameter count such as 7_000_000_000 or "7B",
    a path to a Hugging Face config.json, or a config dict).

    mode: "inference" (a forward pass under no_grad over batch x seq_len tokens, with the KV cache
    of a causal LM) or "training" (one steady-state step: forward, loss, backward, optimizer step).
    scheme: a quantization preset, as fewbits.quant.get_scheme names them (int8, int4, nf4, nf4_dq,
    mxfp4, nvfp4, int4_g32, ...: the linear layers quantized with their scale overhead, exactly as
    `quantize` stores them, the other parameters in `rest_format`), or a float format held plainly
    (fp32, bf16, fp16, tf32: every parameter in it, no scales). policy: a fewbits.train Policy or its
    preset name (fp32, bf16-mixed, bf16-pure, ...). optimizer: adamw | adam | adamw8bit | lion | sgd |
    sgd_momentum | adafactor. runtime: "torch" or "fewbits" (see the module docstring). device:
    "cpu" or "cuda" (attention kernels and optimizer implementation differ). kv_cache: keep a KV
    cache in inference (default: yes for causal LMs). logits: "all" (a forward that scores every
    position, as model(input_ids) does) or "last" (generation: the LM head on the last position).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    opt = str(optimizer).lower().replace("-", "_")
    if opt not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for label, v in (("batch", batch), ("seq_len", seq_len)):
        if (v is not None or label == "batch") and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"{label} must be a positive integer, got {v!r}")
    spec = describe_model(model)
    arch = spec.architecture
    S = seq_len if seq_len is not None else DEFAULT_SEQ_LEN
    if arch is not None and arch.family == "bert" and arch.max_positions and seq_len is None:
        S = min(S, arch.max_positions)
    if arch is not None and arch.family == "bert" and arch.max_positions and S > arch.max_positions:
        raise ValueError(f"seq_len {S} exceeds the model's {arch.max_positions} learned positions")
    if mode == "training" and scheme is None and policy is None and not spec.dtypes:
        policy = "fp32"
    prec = resolve_precision(scheme=scheme, policy=policy, mode=mode, runtime=runtime, spec=spec,
                             rest_format=rest_format, device=device)
    if opt == "adamw8bit":
        prec = dataclasses.replace(prec, state_format="int8_blockwise")
    ctx = _Context(spec, prec, mode, opt, batch, S, runtime, device,
                   kv_cache if kv_cache is not None else (arch is not None and arch.causal), logits)
    return ctx.estimate()


@dataclass
class _Context:
    spec: ModelSpec
    prec: Precision
    mode: str
    optimizer: str
    batch: int
    seq_len: int
    runtime: str
    device: str
    kv_cache: bool
    logits: str = "all"

    # --- parameters ------------------------------------------------------------------------
    def _fp32_kept(self, t: Tensors) -> bool:
        """fewbits' Engine keeps norm parameters (and their modules) in fp32."""
        return self.runtime == "fewbits" and t.role == "other" and "norm" in t.name.lower()

    def weight_bytes(self) -> int:
        p = self.prec
        if p.kind == "loaded":
            return int(self.spec.stored_bytes)
        total = 0.0
        for t in self.spec.tensors:
            if p.kind == "scheme":
                if t.role in ("linear", "head", "all"):
                    total += self._scheme_bytes(t)
                else:
                    total += t.numel * _format_bytes(p.rest_format)
            else:
                fmt = "fp32" if self._fp32_kept(t) else p.weight_format
                total += t.numel * _format_bytes(fmt)
        return int(round(total))

    def _scheme_bytes(self, t: Tensors) -> float:
        qs = self.prec.scheme
        if t.role == "all" or not hasattr(qs, "nbytes"):
            return t.numel * qs.bits_per_value() / 8
        return qs.nbytes(t.shape) * t.count

    def linear_numel(self) -> int:
        return sum(t.numel for t in self.spec.tensors if t.role in ("linear", "head"))

    def autocast_copies(self) -> int:
        """autocast caches a low-precision copy of every matmul weight for the whole forward and
        backward; a tied LM head casts the shared embedding matrix too."""
        p, a = self.prec, self.spec.architecture
        if not p.autocast:
            return 0
        n = self.linear_numel()
        if a is not None and a.family == "llama" and a.tied_embeddings:
            n += a.vocab * a.hidden
        return int(n * p.copy_bytes)

    def master_bytes(self) -> int:
        p = self.prec
        if self.mode != "training" or self.runtime != "fewbits" or p.master_format is None:
            return 0
        return int(sum(t.numel for t in self.spec.tensors if not self._fp32_kept(t)) * _format_bytes(p.master_format))

    def gradient_bytes(self) -> int:
        if self.mode != "training":
            return 0
        if self.runtime == "fewbits" and self._engine_wraps():
            # fp32 gradient buffers for the wrapped parameters, plain fp32 grads for norms
            return int(self.spec.parameters * 4)
        return int(sum(t.numel * (4 if self._fp32_kept(t) else self.prec.grad_bytes) for t in self.spec.tensors))

    def _engine_wraps(self) -> bool:
        p = self.prec
        return p.master_format is not None or p.weight_format != "fp32"

    def state_bytes(self) -> int:
        if self.mode != "training":
            return 0
        n_states = OPTIMIZERS[self.optimizer]
        p = self.prec
        per_value = _state_bytes(p.state_format)
        if self.runtime == "fewbits" and p.state_format != "int8_blockwise":
            # train.optim.pack_state: torch dtypes as themselves, formats of 8 bits or fewer as one
            # code per byte, other emulated formats as fp32 values
            fmt = get_format(p.state_format)
            per_value = fmt.bits / 8 if fmt.name in ("fp32", "bf16", "fp16") else (1 if fmt.bits <= 8 else 4)
        if self.optimizer == "adafactor":
            total = 0.0
            for t in self.spec.tensors:
                if len(t.shape) >= 2:
                    total += (t.shape[0] + math.prod(t.shape[1:])) * t.count * 4
                else:
                    total += t.numel * 4
            states = total
        else:
            states = self.spec.parameters * n_states * per_value
        steps = 4 * self.spec.tensor_count if self.optimizer in ("adamw", "adam", "adamw8bit") else 0
        return int(round(states + steps + self.spec.parameters * p.compensation_bytes))

    def optimizer_temporaries(self) -> int:
        if self.optimizer in ("sgd", "sgd_momentum"):
            return 0
        p = self.prec
        param_bytes = 4 if (self.runtime == "fewbits" or p.autocast) else _format_bytes(p.weight_format)
        if self.device == "cuda":  # foreach: one temporary per parameter at once
            return int(self.spec.parameters * param_bytes)
        # single-tensor AdamW on CPU: sqrt(v) and its quotient, one parameter at a time
        largest = self.spec.largest or 0
        return int((2 if self.optimizer in ("adamw", "adam", "adamw8bit") else 1) * largest * param_bytes)

    def wrapped_parameters(self) -> int:
        """Parameters fewbits' Engine gives a working copy (all but the fp32-kept norms)."""
        if self.runtime != "fewbits" or not self._engine_wraps():
            return 0
        return sum(t.numel for t in self.spec.tensors if not self._fp32_kept(t))

    # --- the estimate ----------------------------------------------------------------------
    def estimate(self) -> MemoryEstimate:
        spec, p = self.spec, self.prec
        weights = self.weight_bytes()
        notes = list(p.notes)
        arch = spec.architecture
        T = self.batch * self.seq_len
        if p.kind == "scheme":
            notes.append(f"linear layers in {p.name}, embeddings, norms and biases in {p.rest_format}"
                         if spec.structured else f"every parameter in {p.name} (a bare count has no layers to "
                                                 "tell apart)")
        if arch is None:
            notes.append("no architecture known (a bare parameter count or a module without a Hugging Face "
                         "config): activations and KV cache are not estimated")
        if self.mode == "inference":
            acts, kv, parts, phase_name = self._inference_terms(T) if arch is not None else (0, 0, {}, "forward")
            if p.kind == "scheme" and spec.structured:
                lin = [t for t in spec.tensors if t.role in ("linear", "head")]
                if lin:
                    parts["dequantized_weight"] = max(math.prod(t.shape) for t in lin) * p.activation_bytes
            ws = sum(parts.values())
            components = dict.fromkeys(COMPONENTS, 0)
            components.update(weights=weights, activations=acts, kv_cache=kv, workspace=ws)
            phases = {phase_name: {"weights": weights, "activations": acts, "kv_cache": kv, "workspace": ws}}
            workspace_parts = parts
        else:
            components, phases, workspace_parts = self._training_phases(T, weights)
            if self.runtime == "fewbits" and p.state_format == "int8_blockwise":
                notes.append("fewbits runtime with int8_blockwise states: the Engine unpacks every state to "
                             "fp32 for the step, and its packing temporaries are not modelled (under-predicts)")
        totals = {k: sum(v.values()) for k, v in phases.items()}
        peak_phase = max(totals, key=totals.get)
        at_peak = {k: int(phases[peak_phase].get(k, 0)) for k in COMPONENTS}
        n = spec.parameters
        return MemoryEstimate(
            model=spec.name, mode=self.mode, precision=p.name, parameters=n,
            components={k: int(v) for k, v in components.items()}, at_peak=at_peak, total=int(totals[peak_phase]),
            peak_phase=peak_phase, phases={k: int(v) for k, v in totals.items()}, batch=self.batch,
            seq_len=self.seq_len, optimizer=self.optimizer if self.mode == "training" else None,
            weight_bits=weights * 8 / n, architecture=_arch_text(arch), notes=notes,
            workspace_parts={k: int(v) for k, v in workspace_parts.items() if v})

    def _training_phases(self, T: int, weights: int):
        """Components, the candidate peaks (what is alive in each phase of a steady-state step) and
        the workspace's parts. Steady state: the optimizer states exist; torch's gradients were
        freed by zero_grad(set_to_none=True), fewbits' fp32 gradient buffers persist."""
        p, arch = self.prec, self.spec.architecture
        master, grads, states = self.master_bytes(), self.gradient_bytes(), self.state_bytes()
        fewbits = self.runtime == "fewbits"
        wrapped = self.wrapped_parameters()
        kept_grads = wrapped * 4                     # the Engine's fp32 gradient buffers
        base = {"weights": weights, "master_weights": master, "optimizer_states": states, "gradients": kept_grads}
        opt_tmp = self.optimizer_temporaries()
        step_extra = 0
        if fewbits and wrapped:
            if p.master_format is None:  # the optimizer steps a float32 view of every stored weight
                step_extra += wrapped * 4
            if p.state_format == "int8_blockwise" or get_format(p.state_format).name != "fp32":
                step_extra += self.spec.parameters * OPTIMIZERS[self.optimizer] * 4  # states unpacked to fp32
        components = {"weights": weights, "master_weights": master, "gradients": grads, "optimizer_states": states,
                      "activations": 0, "kv_cache": 0, "workspace": opt_tmp + step_extra}
        if arch is None:
            phases = {"optimizer step": {**base, "gradients": grads, "workspace": opt_tmp + step_extra}}
            return components, phases, {"optimizer_temporaries": opt_tmp + step_extra}
        t = self._training_terms(T)
        working_grads = int(wrapped * _format_bytes(p.weight_format)) if fewbits else 0
        phases = {"backward: loss gradient": {**base, "activations": t["saved"],
                                              "workspace": t["copies"] + t["loss"]}}
        if t.get("lm_head") is not None:
            extra_act, lm_grad, lm_ws = t["lm_head"]
            phases["backward: lm head"] = {**base, "activations": t["saved"] + extra_act,
                                           "gradients": kept_grads + lm_grad, "workspace": t["copies"] + lm_ws}
        phases["backward: end"] = {**base, "gradients": grads + working_grads, "workspace": t["logits"]}
        phases["optimizer step"] = {**base, "gradients": grads, "workspace": t["logits"] + opt_tmp + step_extra}
        if fewbits and wrapped and p.master_format is None:
            # landing the fp32 result in the stored weights, one tensor at a time (train.optim.land_update):
            # nearest/stochastic round a copy (fp32) and cast it; kahan also holds the old value, the update,
            # the rounded sum and the lost part in fp32
            per_value = 18 if p.update_rounding == "kahan" else 4 + _format_bytes(p.weight_format)
            landing = int(per_value * self.spec.largest)
            phases["weight update"] = {**base, "gradients": grads, "workspace": t["logits"] + step_extra + landing}
        components["activations"] = t["saved"]
        components["workspace"] = max(ph.get("workspace", 0) for ph in phases.values())
        parts = {"autocast_weight_copies": t["copies"], "loss_buffers": t["loss"], "logits": t["logits"],
                 "optimizer_temporaries": opt_tmp + step_extra}
        return components, phases, parts

    # --- activations ---------------------------------------------------------------------------
    def _inference_terms(self, T: int):
        """(activations, kv cache, workspace parts, phase) of a no_grad forward over T tokens."""
        a, p = self.spec.architecture, self.prec
        c = p.activation_bytes
        f = 4 if p.autocast else c           # the residual stream's dtype
        parts = {}
        if p.autocast:
            parts["autocast_weight_copies"] = self.autocast_copies()
        kv = 0
        if a.family == "llama":
            if self.kv_cache:
                k_bytes = 4 if p.autocast else c  # rotary embedding in fp32 under autocast
                kv = a.layers * T * a.kv_dim * (k_bytes + c)
            mlp = T * (4 * a.hidden * f + 3 * a.intermediate * c)
            scored = T if self.logits == "all" else self.batch
            head = T * 3 * a.hidden * f + scored * a.vocab * c
            if head > mlp:
                return head, kv, parts, "forward: lm head"
            return mlp, kv, parts, "forward: last MLP"
        # the busiest point of an encoder layer: the MLP's GELU (its input and output beside the
        # residual stream), or the LayerNorm after it when the MLP is narrow
        per_token = max(3 * a.hidden * f + 2 * a.intermediate * c, 5 * a.hidden * f + a.intermediate * c) + 8
        return T * per_token, kv, parts, "forward: last MLP"

    def _training_terms(self, T: int) -> dict:
        """Bytes over T tokens: "saved" (what autograd keeps for backward), "copies" (autocast's
        weight cache), "loss" (buffers of the loss gradient over the vocabulary, beyond the saved
        log-softmax), "logits" (the model's output, alive until the step ends), "lm_head" (the
        phase after the loss gradient: activations freed/added, gradients, workspace) or None.

        Per token and layer, as the Hugging Face implementations save them (c: activation bytes,
        w: parameter bytes; autocast keeps the residual stream and norms in fp32 and casts every
        matmul input to c separately)."""
        a, p, S = self.spec.architecture, self.prec, self.seq_len
        c = p.activation_bytes
        auto = p.autocast
        fewbits = self.runtime == "fewbits"
        w = 4 if auto else _format_bytes(p.weight_format)
        H, I, Q, KV, V, nh = a.hidden, a.intermediate, a.q_dim, a.kv_dim, a.vocab, a.heads
        cpu = self.device == "cpu"
        copies = self.autocast_copies()
        if a.family == "llama":
            if auto:  # x and x*rsqrt in fp32, then one c-copy per consuming matmul (q, k, v | gate, up | head)
                norm_attn, norm_mlp, norm_final = H * (8 + 3 * c), H * (8 + 2 * c), H * (8 + c)
            elif fewbits and c < 4:  # an fp32 module: its fp32 input, x*rsqrt, and the output cast to c
                norm_attn = norm_mlp = norm_final = H * (8 + c)
            else:  # x in fp32 (a copy unless already fp32), normalised x, and weight * normalised x
                norm_attn = norm_mlp = norm_final = H * (4 + 2 * w)
            if a.attention_dropout > 0 and cpu:  # the math kernel: q, k, v in fp32, scores, mask, probs
                attn = (Q + 2 * KV) * 4 + Q * c + 3 * nh * S * 4
            else:  # the fused kernel saves q, k, v, its output and the log-sum-exp
                attn = (2 * Q + 2 * KV) * c + 4 * nh
            layer = norm_attn + norm_mlp + 2 * 4 + attn + 4 * I * c   # + two rsqrt; gate, silu, up, product
            per_token = a.layers * layer + norm_final + 4 + 16 + V * 4  # ids, labels, log-softmax output
            saved = T * per_token + 2 * S * a.head_dim * (4 if auto else w)  # rotary cos, sin
            logits_bytes = 4 if fewbits else c   # the Engine hands outputs back in fp32
            logits = T * V * logits_bytes
            loss = T * V * (logits_bytes + 8)    # logits, d(log-softmax), d(logits) in fp32
            g = 4 if auto else (_format_bytes(p.weight_format) if not fewbits else c)
            lm_head = (T * V * (c - 4), V * H * g, T * V * c + (V * H * c if auto else 0))
            return {"saved": int(saved), "copies": copies, "loss": int(loss), "logits": int(logits),
                    "lm_head": tuple(int(x) for x in lm_head)}
        f = 4 if (auto or (fewbits and c < 4)) else w  # LayerNorm inputs: fp32 under autocast and the Engine
        lin3 = 3 * c if auto else c
        drop = c if a.hidden_dropout > 0 else 0
        if a.attention_dropout > 0 and cpu:
            # a CPU runs attention dropout in the math kernel: q, k, v (in fp32), softmax output,
            # dropout mask and dropped probabilities, and the re-laid-out context
            up = 4 if c < 4 else c
            attn = 3 * Q * up + 3 * nh * S * up + Q * c
        else:  # the fused kernels (CUDA's take dropout too): q, k, v, output, log-sum-exp
            attn = 4 * Q * c + 4 * nh
        layer = H * lin3 + attn + H * drop + H * f + 2 * f + H * c + 2 * I * c + H * drop + H * f + 2 * f
        per_token = a.layers * layer + H * (f + drop) + 2 * f + 24
        return {"saved": int(T * per_token), "copies": copies, "loss": int(T * H * 8), "logits": int(T * H * f),
                "lm_head": None}


def _arch_text(a: Architecture | None) -> str | None:
    if a is None:
        return None
    s = (f"{a.model_type} ({a.family}-like): {a.layers} layers, hidden {a.hidden}, {a.heads} heads"
         f"{f' ({a.kv_heads} kv)' if a.kv_heads != a.heads else ''}, head dim {a.head_dim}, "
         f"intermediate {a.intermediate}, vocab {a.vocab}")
    if a.tied_embeddings:
        s += ", tied embeddings"
    return s


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeasuredMemory:
    """peak = baseline + increase. baseline: bytes of the distinct storages held before the
    measured call (the `held` objects; on CUDA without `held`, everything allocated on the
    device); increase: the highest total of bytes allocated during the call and still alive;
    retained: of those, what was still alive at its end; peak_op: the operator whose allocation
    reached the peak (CPU only)."""
    peak: int
    baseline: int
    increase: int
    retained: int
    peak_op: str
    method: str


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages behind tensors, modules (parameters, buffers, gradients),
    optimizers (parameters, gradients, state) and containers or plain objects holding them."""
    return sum(_storages(objs).values())


def _storages(objs) -> dict[int, int]:
    found: dict[int, int] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor):
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st.nbytes():
            found[st.data_ptr()] = st.nbytes()
        if t.grad is not None:
            add(t.grad)

    def walk(o, depth: int):
        if o is None or id(o) in seen or depth > 6:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            add(o)
        elif isinstance(o, nn.Module):
            for t in o.parameters():
                add(t)
            for t in o.buffers():
                add(t)
        elif isinstance(o, torch.optim.Optimizer):
            for g in o.param_groups:
                for t in g["params"]:
                    add(t)
            walk(list(o.state.values()), depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                walk(v, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o):
            walk(vars(o), depth + 1)  # plain objects holding tensors (fewbits' Engine and its entries)

    for o in objs:
        walk(o, 0)
    return found


def _allocator_bytes(held) -> int:
    """Bytes of the distinct storages of `held` as the CUDA caching allocator counts them
    (blocks of 512 bytes)."""
    return sum(-(-nbytes // 512) * 512 for nbytes in _storages(tuple(held)).values())


def measure_peak_memory(fn: Callable[[], Any], held: Iterable = (), device: str | torch.device = "cpu"):
    """Run fn() and return (its result, MeasuredMemory).

    On a CPU the measurement is the CPU allocator's own record: torch's profiler reports every
    allocation and free made through it while fn runs (profile_memory=True); the peak of the bytes
    allocated during fn and still alive, plus the bytes of the distinct storages of `held` (the
    model, optimizer, ... alive before fn), is the peak. Frees of memory that existed before fn are
    not seen, so pass objects whose tensors fn does not free (call zero_grad(set_to_none=True)
    before measuring a training step). On CUDA: torch.cuda.max_memory_allocated during fn above
    what was allocated before it, plus the bytes of `held` (everything allocated before fn if
    `held` is empty)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        # as on the CPU: the baseline is what `held` holds before fn (not whatever else the
        # process keeps on the device); without `held`, everything allocated before fn
        baseline = _allocator_bytes(held) if held else start
        result = fn()
        torch.cuda.synchronize(dev)
        increase = torch.cuda.max_memory_allocated(dev) - start
        retained = torch.cuda.memory_allocated(dev) - start
        return result, MeasuredMemory(baseline + increase, baseline, increase, retained, "", "cuda allocator")
    if dev.type != "cpu":
        raise ValueError(f"memory is measured on cpu or cuda, not {dev.type}")
    from torch.profiler import ProfilerActivity, profile

    baseline = tensor_bytes(*held) if held else 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []
    stack = [(node, "") for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, parent = stack.pop()
        extra = node.extra_fields
        if type(extra).__name__.endswith("Allocation"):
            if extra.device.type == "cpu":
                events.append((node.start_time_ns, extra.id, extra.alloc_size, extra.ptr, parent))
        else:
            parent = node.name
        stack.extend((child, parent) for child in node.children)
    events.sort(key=lambda e: (e[0], e[1]))
    live: dict[int, int] = {}
    total = peak = 0
    peak_op = ""
    for _, _, size, ptr, op in events:
        if size > 0:
            live[ptr] = size
            total += size
            if total > peak:
                peak, peak_op = total, op
        elif ptr in live:  # memory allocated before fn: its free is invisible, see the docstring
            total -= live.pop(ptr)
    return result, MeasuredMemory(baseline + peak, baseline, peak, total, peak_op, "cpu allocator (torch profiler)")


def _default_loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    first = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
    return first.float().pow(2).mean()


_NATIVE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _native_dtype(fmt: str) -> torch.dtype:
    name = get_format(fmt).name
    if name == "tf32":
        return torch.float32
    if name not in _NATIVE:
        raise ValueError(f"{name} is not a torch dtype: a measured run needs fp32, bf16 or fp16")
    return _NATIVE[name]


def measure_training_step(model: nn.Module, inputs: dict, policy="fp32", *, optimizer: str = "adamw",
                          loss_fn: Callable | None = None, runtime: str = "torch", lr: float = 1e-5):
    """Measured peak memory of one steady-state training step of `model` on `inputs` (keyword
    arguments of its forward) under `policy`, as `estimate_memory(..., mode="training")` predicts it.

    The model is converted in place (pure policies cast it to their weight dtype). One warm-up step
    creates the optimizer states; the second step (zero_grad, forward, loss, backward,
    optimizer.step) is measured. runtime="torch": AdamW (or SGD) from torch.optim, torch.autocast
    for mixed policies; runtime="fewbits": fewbits.train.Engine. Returns MeasuredMemory."""
    loss_fn = loss_fn or _default_loss
    dev = next(model.parameters()).device
    opt_name = str(optimizer).lower()
    if runtime == "fewbits":
        from ..train import Engine

        model.train()
        opt = _make_optimizer(opt_name, model.parameters(), lr)
        engine = Engine(model, opt, policy)

        def step():
            engine.zero_grad()
            out = model(**inputs)
            engine.backward(loss_fn(out))
            engine.step()
            return out

        step()
        engine.zero_grad()
        _, measured = measure_peak_memory(step, held=(engine, model, opt), device=dev)
        return measured
    if runtime != "torch":
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    prec = resolve_precision(policy=policy, mode="training", runtime="torch") if not isinstance(policy, Precision) \
        else policy
    autocast = _place_for_precision(model, prec, dev)
    model.train()
    opt = _make_optimizer(opt_name, model.parameters(), lr)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            out = model(**inputs)
            loss = loss_fn(out)
        loss.backward()
        opt.step()
        return out

    step()
    opt.zero_grad(set_to_none=True)
    _, measured = measure_peak_memory(step, held=(model, opt), device=dev)
    return measured


def _place_for_precision(model: nn.Module, prec, dev):
    """Cast the model's weights as the precision runs them (fp32 under autocast for mixed
    policies, else the weight format) and return the context factory its forward runs in."""
    if prec.autocast:
        model.to(torch.float32)
        ac_dtype = _native_dtype(prec.compute_format)
        return lambda: torch.autocast(dev.type, dtype=ac_dtype)
    model.to(_native_dtype(prec.weight_format))
    return contextlib.nullcontext


def measure_inference(model: nn.Module, inputs: dict, scheme=None, policy=None):
    """Measured peak memory of a no_grad forward of `model` on `inputs` with its weights in a
    native format (`scheme` fp32/bf16/fp16) or under a policy (mixed: autocast). Returns
    MeasuredMemory."""
    prec = resolve_precision(scheme=scheme, policy=policy, mode="inference",
                             spec=describe_model(model) if scheme is None and policy is None else None)
    dev = next(model.parameters()).device
    if prec.kind == "scheme":
        raise ValueError("measure_inference runs native dtypes only (fp32, bf16, fp16); quantized models "
                         "are measured with measure_peak_memory around their own forward")
    model.eval()
    autocast = _place_for_precision(model, prec, dev)

    def forward():
        with torch.no_grad(), autocast():
            return model(**inputs)

    _, measured = measure_peak_memory(forward, held=(model,), device=dev)
    return measured


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name in ("adamw", "adam"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"measured steps support adamw, adam, sgd, sgd_momentum; not {name!r}")
