"""Greedy generation for Llama-architecture causal LMs without transformers' forward.

`LlamaDecoder(model).generate(input_ids, n)` runs the same greedy loop as
`generation.greedy_generate` (batch 1, argmax of the last logits each step, the same timing
definition, a `GenerationResult`), but each forward is written out here in torch ops over the
model's own modules -- its embedding, norms' weights, linear layers (nn.Linear, fewbits'
QuantLinear, anything called as a module) and rotary embedding -- with a KV cache allocated once
per generate(). What it leaves out is transformers' per-layer machinery: the Cache object and its
`cat` per step, mask construction, attention-interface dispatch, output dataclasses and kwargs
plumbing, which cost a small model more than its layers' arithmetic (SmolLM2-135M int4 at one
thread on a Xeon: ~18 ms a token through transformers, of which ~8 ms are the linear layers).

Exactness: every step is the operation transformers' Llama / Mistral / Qwen2 modules compute with
the "sdpa" attention implementation, in the same order and dtypes (RMSNorm in float32 then the
weight's product, rotate-half RoPE from the model's own rotary module, scaled_dot_product_attention
with enable_gqa, act(gate) * up), so the logits of each step equal `model(...)`'s bit for bit
(tests/models/test_decoder.py compares them, and the tokens, on SmolLM2 and tiny random models).
The cache is a preallocated [layers, 1, kv_heads, positions, head_dim] pair read through a
slice of the positions filled so far, where transformers' DynamicCache concatenates.

The native path (path="auto" where it can run, "native" to insist): the prompt as above, then
each new token in one C call, kernels/csrc/decode.c through native.DecodeStep, the linear layers
by their own one-row kernels (QuantLinear.row_kernel()). It needs a float32 model on the CPU
whose every projection has such a kernel and a SiLU MLP; native_reason() says what is missing.
Its reductions have their own order and precision, so its logits are the torch path's within a
few float32 roundings (tests/models/test_decoder.py: 64 ulps of the largest logit) -- except
that where activations are quantized (w8a8, w4a8) such a difference can move an int8 code, and
the logits then move as much as between transformers' own attention implementations.

Supported: `model.config.model_type` in SUPPORTED, the layer structure of transformers'
LlamaForCausalLM (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj and act_fn,
input_layernorm, post_attention_layernorm, model.norm, model.rotary_emb, lm_head), a rotary
embedding whose frequencies do not depend on the sequence length, and no sliding window within
the generated length. Anything else raises ValueError naming what is missing, before any work.
The modules are looked up anew at each generate(), so a model changed in place (re-quantized,
new weights) is always run as it is now.
"""
from __future__ import annotations

import operator
import threading

import torch
import torch.nn.functional as F

from ..kernels import native
from ._deps import TRANSFORMERS_HINT, require_modules
from .generation import GenerationResult, _check, _loop, check_cache_fits

__all__ = ["LlamaDecoder"]

# "torch": every step in torch ops (transformers' logits bit for bit); "native": the decode steps
# (one token) in one C call, kernels/csrc/decode.c, the prompt still in torch ops; "auto": native
# where it can run (see native_reason), else torch
PATHS = ("auto", "native", "torch")
_SILU = ("SiLUActivation", "SiLU")

SUPPORTED = ("llama", "mistral", "qwen2")
# transformers' RMSNorm classes whose forward is the one written out in _rms_norm
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
# rotary embeddings whose cos/sin for a position do not depend on how long the sequence is
# ("dynamic" and "longrope" rescale their frequencies with the length)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "input_layernorm",
                "post_attention_layernorm")


def _get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _rms_norm(h: torch.Tensor, norm) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, op for op."""
    dtype = h.dtype
    h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _token_ids(stop) -> list[int]:
    """Token ids from an int, a tensor, a numpy integer or (nested) lists of them; None (a
    tokenizer without an end-of-sequence token) and empty lists give none."""
    if stop is None:
        return []
    if isinstance(stop, torch.Tensor):
        return [int(t) for t in stop.reshape(-1).tolist()]
    if isinstance(stop, bool):
        raise TypeError("stop takes token ids, not a bool")
    if hasattr(stop, "__index__"):
        return [operator.index(stop)]
    if isinstance(stop, (str, bytes)):
        raise TypeError(f"stop takes token ids, not text: {stop!r}")
    try:
        items = list(stop)
    except TypeError:
        raise TypeError(f"stop takes token ids (ints, tensors or lists of them), got {type(stop).__name__}") from None
    return [t for item in items for t in _token_ids(item)]


def _device_of(module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaDecoder:
    """Greedy generation through a written-out forward and a preallocated KV cache (see the module).

    model: a transformers causal LM of a SUPPORTED architecture, in eval mode (fewbits-quantized
    or not). The cache grows to the longest generation asked for and is kept between calls; a
    generation whose cache (prompt + max_new_tokens positions) would not fit in the memory
    available is refused with a ValueError before anything is allocated.

    Threads: one decoder runs one generation at a time. generate() and step_logits() hold a lock
    for the whole call, so calls from several threads are serialized (each waits for the one
    before to finish, and gets the tokens a serial run gives; its timing starts once it runs).
    For generations that run at the same time, give each thread a LlamaDecoder of its own over
    the same model: each has its own cache. `last_path` is the path of the last call to finish.
    """

    def __init__(self, model, path: str = "auto"):
        require_modules("LlamaDecoder", ("transformers",), TRANSFORMERS_HINT)
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        self.model = model
        self.path = path
        self._parts()  # refuse an unsupported model now, not at the first generate()
        self._k = self._v = None
        self._lock = threading.Lock()  # one generation at a time over the one cache
        self.last_path: str | None = None  # the path the last generate() decoded with

    # --- the model's parts, looked up at each generate() ----------------------------------------
    def _parts(self):
        model = self.model
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED:
            raise ValueError(f"LlamaDecoder runs {', '.join(SUPPORTED)} models; this one's model_type is {kind!r}")
        try:
            base, head = model.model, model.lm_head
            embed, layers, norm, rotary = base.embed_tokens, base.layers, base.norm, base.rotary_emb
            parts = [tuple(_get(layer, p) for p in _LAYER_PARTS) for layer in layers]
        except AttributeError as e:
            raise ValueError(f"LlamaDecoder needs transformers' Llama layer structure: {e}") from None
        if len(parts) == 0:
            raise ValueError("the model has no decoder layers")
        for p in parts:
            for n in (p[8], p[9]):
                if type(n).__name__ not in _RMS_NORMS:
                    raise ValueError(f"LlamaDecoder computes transformers' RMSNorm; this model has {type(n).__name__}")
        if type(norm).__name__ not in _RMS_NORMS:
            raise ValueError(f"LlamaDecoder computes transformers' RMSNorm; this model has {type(norm).__name__}")
        rope = getattr(rotary, "rope_type", "default")
        if rope not in _STATIC_ROPE:
            raise ValueError(f"LlamaDecoder needs a rotary embedding fixed per position ({', '.join(_STATIC_ROPE)}); "
                             f"this model's is {rope!r}")
        attn = layers[0].self_attn
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        return embed, parts, norm, rotary, head, heads, kv_heads, attn.head_dim, attn.scaling

    def _window(self) -> int | None:
        """The sliding window that applies to some layer, or None."""
        config = self.model.config
        window = getattr(config, "sliding_window", None)
        if window is None:
            return None
        types = getattr(config, "layer_types", None)
        if types is not None and all(t == "full_attention" for t in types):
            return None
        if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            return None
        return int(window)

    # --- generation --------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, max_new_tokens: int):
        """forward(ids, position_ids, cache) -> the last position's logits, for _loop, over a
        cache of prompt + max_new_tokens positions; the arguments checked first."""
        _check(self.model, input_ids, max_new_tokens)
        embed, parts, norm, rotary, head, heads, kv_heads, head_dim, scaling = self._parts()
        total = input_ids.shape[1] + max_new_tokens
        window = self._window()
        if window is not None and total > window:
            raise ValueError(f"prompt + new tokens ({total}) exceed the model's sliding window ({window}), "
                             f"which LlamaDecoder does not apply")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and total > limit:
            raise ValueError(f"prompt + new tokens ({total}) exceed max_position_embeddings={limit}")
        dtype, device = self._stream(embed)
        native_layers, reason = self._native_layers(parts, dtype, device, norm, (heads, kv_heads, head_dim))
        if self.path == "native" and native_layers is None:
            raise ValueError(f"path='native' cannot run this model: {reason}")
        with torch.inference_mode():
            shape = (len(parts), 1, kv_heads, total, head_dim)
            k = self._k
            if (k is None or k.shape[3] < total or k.shape[:3] != shape[:3] or k.shape[4] != head_dim
                    or k.dtype != dtype or k.device != device):
                self._k = self._v = k = None  # the old cache's memory counts as available
                element = torch.empty(0, dtype=dtype).element_size()
                # the keys and values, and the rotary embedding of every position (positions as
                # int64, its float32 frequencies, cos and sin and their copies)
                need = 2 * len(parts) * kv_heads * head_dim * total * element + total * (8 + 24 * head_dim)
                check_cache_fits(need, total, max_new_tokens)
                # empty, not zeros: no position is read before it is written, and untouched pages
                # cost no memory, so a generation that stops early uses what it generated
                self._k = torch.empty(shape, dtype=dtype, device=device)
                self._v = torch.empty(shape, dtype=dtype, device=device)
            capacity = self._k.shape[3]
            positions = torch.arange(capacity, device=device).unsqueeze(0)
            cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), positions)
            cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [capacity, head_dim]
        k_cache, v_cache = self._k, self._v

        def forward(ids, position_ids, cache):
            start = int(position_ids[0, 0])
            t = ids.shape[1]
            end = start + t
            c = cos[start:end][None, None]
            s = sin[start:end][None, None]
            causal = t > 1
            h = embed(ids)
            for i, (q_proj, k_proj, v_proj, o_proj, gate, up, down, act, norm1, norm2) in enumerate(parts):
                x = _rms_norm(h, norm1)
                q = q_proj(x).view(1, t, heads, head_dim).transpose(1, 2)
                k = k_proj(x).view(1, t, kv_heads, head_dim).transpose(1, 2)
                v = v_proj(x).view(1, t, kv_heads, head_dim).transpose(1, 2)
                q = q * c + _rotate_half(q) * s
                k = k * c + _rotate_half(k) * s
                k_all, v_all = k_cache[i], v_cache[i]
                k_all[:, :, start:end] = k
                v_all[:, :, start:end] = v
                a = F.scaled_dot_product_attention(q, k_all[:, :, :end], v_all[:, :, :end], scale=scaling,
                                                   is_causal=causal, enable_gqa=heads != kv_heads)
                h = h + o_proj(a.transpose(1, 2).reshape(1, t, heads * head_dim))
                x = _rms_norm(h, norm2)
                h = h + down(act(gate(x)) * up(x))
            return head(_rms_norm(h[:, -1:], norm))

        self.last_path = "torch"
        if native_layers is None:
            return forward
        step = native.DecodeStep(native.library(), native_layers, norm.weight.detach().to(torch.float32),
                                 norm.variance_epsilon, k_cache, v_cache, cos, sin, heads, kv_heads, head_dim,
                                 scaling)
        d = step.d

        def native_forward(ids, position_ids, cache):
            if ids.shape[1] != 1:  # the prompt: torch ops (its batched layers are the tile kernels)
                return forward(ids, position_ids, cache)
            self.last_path = "native"
            h = embed(ids).reshape(d).to(torch.float32).contiguous()
            return head(step(h, int(position_ids[0, 0])).view(1, 1, d))

        return native_forward

    def native_reason(self) -> str | None:
        """Why the native decode step cannot run this model now, or None where it can."""
        embed, parts, norm, _, _, heads, kv_heads, head_dim, _ = self._parts()
        return self._native_layers(parts, *self._stream(embed), norm, (heads, kv_heads, head_dim))[1]

    @staticmethod
    def _stream(embed):
        """The residual stream's dtype and device: what the embedding gives (a quantized one has no
        float weight; norms' weights may be of another dtype, which their product promotes)."""
        with torch.inference_mode():
            probe = embed(torch.zeros(1, 1, dtype=torch.long, device=_device_of(embed)))
        return probe.dtype, probe.device

    def _native_layers(self, parts, dtype, device, final_norm, attention):
        """(the layers' specs for native.DecodeStep, None) or (None, why not)."""
        if self.path == "torch":
            return None, "path='torch'"
        if native.library() is None:
            return None, f"the native library is not loaded ({native.status()['reason'] or 'turned off'})"
        if dtype != torch.float32 or device.type != "cpu":
            return None, f"the native step runs float32 models on the CPU, this one is {dtype} on {device}"
        heads, kv_heads, head_dim = attention
        if not native.decode_heads_ok(heads, kv_heads, head_dim):
            return None, (f"the native step takes an even head_dim up to {native.DECODE_MAX_HEAD_DIM} and heads a "
                          f"multiple of kv heads; this model has head_dim {head_dim}, {heads} heads, {kv_heads} kv heads")
        if not final_norm.weight.is_floating_point() or final_norm.weight.dtype == torch.float64:
            return None, f"the final norm's weight is {final_norm.weight.dtype}"
        layers = []
        names = ("q", "k", "v", "o", "gate", "up", "down")
        for i, (*linears, act, norm1, norm2) in enumerate(parts):
            if type(act).__name__ not in _SILU:
                return None, f"layer {i}'s activation is {type(act).__name__}, not SiLU"
            spec = {}
            for name, m in zip(names, linears):
                get = getattr(m, "row_kernel", None)
                rk = get() if callable(get) else None
                if rk is None:
                    return None, (f"layer {i}'s {name} projection ({type(m).__name__}) has no one-row C kernel "
                                  f"(fewbits-quantized layers with a weight-only 4- or 8-bit, w4a8 or w8a8 kernel have)")
                spec[name] = rk
            for key, n in (("norm1", norm1), ("norm2", norm2)):
                if not n.weight.is_floating_point() or n.weight.dtype == torch.float64:
                    return None, f"layer {i}'s {key} weight is {n.weight.dtype}"
                spec[key] = n.weight.detach().to(torch.float32)  # exact: what the product promotes it to
            spec["eps1"], spec["eps2"] = norm1.variance_epsilon, norm2.variance_epsilon
            layers.append(spec)
        return layers, None

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, stop=()) -> GenerationResult:
        """Greedy generation of max_new_tokens tokens after input_ids (1, prompt length), timed as
        generation.greedy_generate times it; on the torch path the tokens are greedy_generate's
        (on the native path see the module). stop: token ids (e.g. the tokenizer's end of
        sequence) that end it early, kept as the last token. `last_path` then says which path ran."""
        stop = frozenset(_token_ids(stop))
        with self._lock:
            forward = self._forward(input_ids, max_new_tokens)
            return _loop(forward, input_ids, max_new_tokens, None, stop=stop)

    def step_logits(self, input_ids: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The logits (1, 1, vocab) of the prompt's last position, then of each of tokens (1, n)
        but the last fed after it in turn (teacher forcing): what generate() computes at each
        step when it picks tokens."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError("tokens must be a (1, n) tensor of token ids")
        n = input_ids.shape[1]
        with self._lock, torch.inference_mode():
            forward = self._forward(input_ids, tokens.shape[1])
            out = [forward(input_ids, torch.tensor([[0]]), None)]
            for i in range(tokens.shape[1] - 1):
                out.append(forward(tokens[:, i:i + 1], torch.tensor([[n + i]]), None))
        return out
