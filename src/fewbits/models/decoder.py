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

Exactness: every step is the operation transformers' Llama / Mistral / Qwen / Phi-3 / Gemma modules compute with
the "sdpa" attention implementation, in the same order and dtypes (RMSNorm in float32 then the
weight's product, rotate-half RoPE from the model's own rotary module, scaled_dot_product_attention
with enable_gqa, act(gate) * up), so the logits of each step equal `model(...)`'s bit for bit
(tests/models/test_decoder.py compares them, and the tokens, on SmolLM2 and tiny random models).
The cache is a preallocated [layers, 1, kv_heads, positions, head_dim] pair read through a
slice of the positions filled so far, where transformers' DynamicCache concatenates.

The native path (path="auto" where it can run, "native" to insist): the prompt as above, then
each new token in one C call, kernels/csrc/decode.c through native.DecodeStep, the linear layers
by their own one-row kernels (QuantLinear.row_kernel()). It needs a float32 model on the CPU
whose every projection has such a kernel and a SiLU or GELU (tanh) MLP; native_reason() says
what is missing.
Its reductions have their own order and precision, so its logits are the torch path's within a
few float32 roundings (tests/models/test_decoder.py: 64 ulps of the largest logit) -- except
that where activations are quantized (w8a8, w4a8) such a difference can move an int8 code, and
the logits then move as much as between transformers' own attention implementations.

Supported: `model.config.model_type` in SUPPORTED, the layer structure of transformers'
LlamaForCausalLM (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj and act_fn,
input_layernorm, post_attention_layernorm, model.norm, model.rotary_emb, lm_head; Qwen3's
self_attn.q_norm / k_norm, an RMSNorm of each head of q and k before the rotation; Phi-3's fused
self_attn.qkv_proj and mlp.gate_up_proj; Gemma 3's (1 + weight) norms, post-attention and
post-MLP norms, a RoPE base per kind of layer, sliding-window layers and final soft-capping;
Gemma 2's the same with one RoPE base and capped attention scores, computed as transformers'
eager attention computes them), a
rotary embedding whose frequencies do not depend on the sequence length, and no sliding window
within the generated length but Gemma's (which it applies). Anything else raises ValueError
naming what is missing, before any work. The native step runs them all (Gemma 3's GELU as
x / (1 + e^(-2y)), its norms' 1 + weight precomputed in float32, Phi-3's fused projections one
kernel each).
The modules are looked up anew at each generate(), so a model changed in place (re-quantized,
new weights) is always run as it is now.
"""
from __future__ import annotations

import contextlib
import operator
import os
import statistics
import threading
import time
from collections import Counter, deque

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
_GELU_TANH = ("GELUTanh",)  # transformers' gelu_pytorch_tanh (Gemma 3)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
# transformers' RMSNorm classes whose forward is the one written out in _rms_norm
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")
# Gemma's: the product with (1 + weight) in float32, then the input's dtype (_gemma_rms_norm)
_GEMMA_NORMS = ("Gemma2RMSNorm", "Gemma3RMSNorm")
# rotary embeddings whose cos/sin for a position do not depend on how long the sequence is
# ("dynamic" and "longrope" rescale their frequencies with the length)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "input_layernorm",
                "post_attention_layernorm")
# Gemma 3: the norm before the MLP is pre_feedforward_layernorm; post_attention_layernorm and
# post_feedforward_layernorm normalize the attention's and the MLP's outputs before the residual
_GEMMA_LAYER_PARTS = _LAYER_PARTS[:-1] + ("pre_feedforward_layernorm",)
_GEMMA_POST = ("post_attention_layernorm", "post_feedforward_layernorm")
# Phi-3: q/k/v in one Linear (split after it), gate and up in one (chunked in two); the parts
# tuple holds the fused Linear in q_proj's and gate_proj's places and None in the others'
_PHI3_LAYER_PARTS = ("self_attn.qkv_proj", None, None, "self_attn.o_proj", "mlp.gate_up_proj", None,
                     "mlp.down_proj", "mlp.activation_fn", "input_layernorm", "post_attention_layernorm")


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


def _gemma_rms_norm(h: torch.Tensor, norm) -> torch.Tensor:
    """transformers' Gemma3RMSNorm.forward, op for op."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (x * (1.0 + norm.weight.float())).type_as(h)


def _native_norm(norm) -> tuple[torch.Tensor, float] | None:
    """(the float32 weight the native step multiplies by, eps) of a supported norm: Gemma's
    1 + weight in float32 (the factor transformers computes), Llama's weight; None for a weight
    of another kind than float16/bfloat16/float32."""
    w = norm.weight
    if not w.is_floating_point() or w.dtype == torch.float64:
        return None
    if type(norm).__name__ in _GEMMA_NORMS:
        return (1.0 + w.detach().float()), norm.eps
    return w.detach().to(torch.float32), norm.variance_epsilon  # exact: what the product promotes it to


def _norm_of(norm):
    """The written-out forward of a supported norm module, or None."""
    name = type(norm).__name__
    return _rms_norm if name in _RMS_NORMS else _gemma_rms_norm if name in _GEMMA_NORMS else None


def _sliding_attention(q, k, v, start: int, window: int, scaling: float) -> torch.Tensor:
    """Attention of queries at positions start.. over keys 0..end-1 where each query sees the
    keys of the last `window` positions (transformers' sliding_window: key > query - window), as
    transformers' sdpa attention computes it with the mask it makes: one query over the window's
    keys, its heads packed onto their key/value head; several over every key with a boolean mask
    and the key/value heads repeated."""
    heads, t, end = q.shape[1], q.shape[2], k.shape[2]
    groups = heads // k.shape[1]
    if t == 1:
        k, v = k[:, :, end - window:], v[:, :, end - window:]
        mask = torch.ones(1, 1, 1, window, dtype=torch.bool, device=q.device)
        if groups > 1:
            q = q.reshape(1, heads // groups, groups, q.shape[-1])
    else:
        qpos = torch.arange(start, start + t, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None, :]
        mask = ((kpos <= qpos) & (kpos > qpos - window))[None, None]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return a.reshape(1, heads, t, v.shape[-1])


def _eager_attention(q, k, v, start: int, window: int | None, scaling: float, cap: float) -> torch.Tensor:
    """transformers' eager attention with capped scores (Gemma 2), op for op: the key/value heads
    repeated, q k^T * scaling, / cap, tanh, * cap, + the mask transformers makes (0, or float32's
    lowest where a key is after the query or, for a sliding layer, `window` or more before it),
    softmax in float32, the product with v. One query sees the keys a sliding layer's cache holds
    (the last `window`) and no mask (transformers' is all zeros then); several, every key."""
    heads, t, end = q.shape[1], q.shape[2], k.shape[2]
    groups = heads // k.shape[1]
    mask = None
    if t == 1:
        if window is not None and end > window:
            k, v = k[:, :, end - window:], v[:, :, end - window:]
    else:
        qpos = torch.arange(start, start + t, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed = allowed & (kpos > qpos - window)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    w = torch.tanh(w / cap) * cap
    if mask is not None:
        w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


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


def busy_elsewhere(window: float = 0.1) -> float | None:
    """How many CPUs' worth of work other processes did, over `window` seconds, on the CPUs this
    process may run on (/proc/stat's busy time of those CPUs less this process's own CPU time),
    or None where /proc/stat cannot tell (not Linux)."""
    try:
        cpus = os.sched_getaffinity(0)
        ticks = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return None

    def sample():
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    name, *fields = line.split()
                    if int(name[3:]) in cpus:
                        values = [int(v) for v in fields[:8]]
                        busy += sum(values) - values[3] - values[4]  # all but idle and iowait
        own = os.times()
        return busy, own.user + own.system, time.monotonic()

    try:
        b0, own0, t0 = sample()
        time.sleep(window)
        b1, own1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, ((b1 - b0) / ticks - (own1 - own0)) / (t1 - t0))


def threads_for_load(threads: int | None = None, window: float = 0.1) -> int:
    """The number of threads (at most `threads`, by default torch's count) that the CPUs left
    idle by other processes can run: the CPUs this process may use less the work of others
    measured over `window` seconds (busy_elsewhere), rounded, at least 1; `threads` where the
    load cannot be measured."""
    threads = torch.get_num_threads() if threads is None else threads
    others = busy_elsewhere(window)
    if others is None:
        return threads
    free = len(os.sched_getaffinity(0)) - others
    return max(1, min(threads, int(free + 0.5)))


class _ThreadChooser:
    """The thread count of each native decode step under threads="auto": the candidates are
    torch's count, 1 and (from 4 threads) half of it; it starts at the count the load allows
    (threads_for_load) and from time to time runs a few steps at another candidate (a probe),
    moving to it when its steps are clearly faster (SWITCH).

    When to probe: a count is probed once the time spent at the current count since its last
    probe is BUDGET times what a probe of it costs (its last measured step time x the probe's
    steps), so probing costs a few percent at most. Before it was ever measured, a count below
    the current one is probed at once (fewer threads cost at most a few steps), one above the
    start is taken to be as slow as the load said (CONTENDED x the current steps); and when the
    current count's steps become DEGRADED times slower than they were (other work came), the
    counts below it are probed at once. A probe step slower than twice the current steps ends the
    probe there, the first step after a change of count (a new team of threads) included.

    Steps of the same token give the same logits whatever the count (decode.c splits work across
    threads, never a reduction), so the choice changes speed only."""

    WARM, MEASURE, RECENT, BUDGET, SWITCH, CONTENDED, DEGRADED = 1, 3, 8, 20.0, 0.85, 10.0, 3.0

    def __init__(self, threads: int, start: int, clock=time.perf_counter):
        candidates = {threads, 1, start} | ({threads // 2} if threads >= 4 else set())
        self.candidates = sorted(candidates, reverse=True)
        self.current = self.active = self.start = start
        self.recent = {c: deque(maxlen=self.RECENT) for c in self.candidates}
        self.cost: dict[int, float] = {}  # the last measured seconds of a step of each candidate
        self.best: dict[int, float] = {}  # the fastest median step time seen at each count
        self.since = {c: 0.0 for c in self.candidates}  # seconds at the current count since c's last probe
        self.probe: int | None = None
        self.probe_times: list[float] = []
        self.fresh = True
        self.steps: Counter = Counter()
        self.clock = clock
        torch.set_num_threads(start)

    def _current_step(self) -> float | None:
        times = self.recent[self.current]
        return statistics.median(times) if len(times) >= 4 else None

    def _probe_cost(self, c: int, now: float) -> float:
        if c in self.cost:
            return (self.WARM + self.MEASURE) * self.cost[c]
        if c < self.current:
            return 0.0
        return (self.WARM + self.MEASURE) * now * (self.CONTENDED if c > self.start else 1.0)

    def next(self) -> int:
        """The thread count for the next step (set in torch)."""
        if self.probe is None:
            now = self._current_step()
            if now is not None:
                best = self.best[self.current] = min(now, self.best.get(self.current, now))
                degraded = now > self.DEGRADED * best
                for c in self.candidates:
                    if c != self.current and ((degraded and c < self.current)
                                              or self.since[c] >= self.BUDGET * self._probe_cost(c, now)):
                        self.probe, self.probe_times = c, []
                        break
        want = self.current if self.probe is None else self.probe
        if want != self.active:
            torch.set_num_threads(want)
            self.active, self.fresh = want, True
        return want

    def done(self, threads: int, seconds: float) -> None:
        """Record the step just run at `threads` threads, which took `seconds`."""
        self.steps[threads] += 1
        fresh, self.fresh = self.fresh, False
        if self.probe is None:
            if not fresh:
                self.recent[threads].append(seconds)
            for c in self.since:
                if c != threads:
                    self.since[c] += seconds
            return
        now = self._current_step()
        if fresh and seconds <= 2 * now:
            return
        self.probe_times.append(seconds)
        if len(self.probe_times) < self.MEASURE and seconds <= 2 * now:
            return
        took = statistics.median(self.probe_times)
        self.cost[threads] = took
        self.since[threads] = 0.0
        self.probe = None
        if took < self.SWITCH * now:
            self.cost[self.current] = now
            self.since[self.current] = 0.0
            self.current = threads
            self.recent[threads].clear()
            self.recent[threads].extend(self.probe_times)
        else:
            self.best[self.current] = now  # the current count stays: its speed now is the one to keep

    def wrap(self, forward):
        """forward, each single-token step of it run at the chosen count and timed."""
        def step(ids, position_ids, cache):
            if ids.shape[1] != 1:
                return forward(ids, position_ids, cache)
            threads = self.next()
            t0 = self.clock()
            logits = forward(ids, position_ids, cache)
            self.done(threads, self.clock() - t0)
            return logits
        return step


_THREAD_COUNT_LOCK = threading.Lock()  # held by a generate() that sets torch's thread count


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

    threads: the torch threads generate() runs with. None (the default): torch's count as it is
    (torch.set_num_threads). An int: that count, for the call only. "auto": the count that runs
    fastest now, for machines shared with other work, where a parallel region waits for a thread
    that another process holds off its core (on a busy 2-core machine SmolLM2 int4 decoded at
    0.4-3.7 tokens/s at 2 threads against 32-88 at 1). On the native path each decode step's
    count is chosen by measuring the steps as they run (see _ThreadChooser): its logits do not
    depend on the count, so only the speed changes. On the torch path, where torch's reductions
    may round differently at another count (and greedy tokens could then depend on the machine's
    load), "auto" leaves torch's count as it is. The count torch had is restored after the call;
    `last_threads` says which counts ran how many decode steps. torch's count is the process's
    (and a thread started while another had changed it starts from, and would put back, that
    count): only generate() calls from the main thread set it, one at a time across decoders;
    calls from other threads run at torch's count as it is.
    """

    def __init__(self, model, path: str = "auto", threads: int | str | None = None):
        require_modules("LlamaDecoder", ("transformers",), TRANSFORMERS_HINT)
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        if not (threads is None or threads == "auto"
                or (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1)):
            raise ValueError(f"threads must be None, 'auto' or a positive int, got {threads!r}")
        self.model = model
        self.path = path
        self.threads = threads
        self.last_threads: dict | None = None  # {thread count: decode steps run at it} of the last generate()
        self._parts()  # refuse an unsupported model now, not at the first generate()
        self._k = self._v = None
        self._native = False
        self._lock = threading.Lock()  # one generation at a time over the one cache
        self.last_path: str | None = None  # the path the last generate() decoded with

    # --- the model's parts, looked up at each generate() ----------------------------------------
    def _parts(self):
        model = self.model
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED:
            raise ValueError(f"LlamaDecoder runs {', '.join(SUPPORTED)} models; this one's model_type is {kind!r}")
        gemma = kind in ("gemma2", "gemma3_text")
        norms = _GEMMA_NORMS if gemma else _RMS_NORMS
        try:
            base, head = model.model, model.lm_head
            embed, layers, norm, rotary = base.embed_tokens, base.layers, base.norm, base.rotary_emb
            names = _GEMMA_LAYER_PARTS if gemma else _PHI3_LAYER_PARTS if kind == "phi3" else _LAYER_PARTS
            parts = [tuple(None if p is None else _get(layer, p) for p in names) for layer in layers]
            post = [tuple(_get(layer, p) for p in _GEMMA_POST) for layer in layers] if gemma else None
        except AttributeError as e:
            raise ValueError(f"LlamaDecoder needs transformers' Llama layer structure: {e}") from None
        if len(parts) == 0:
            raise ValueError("the model has no decoder layers")
        for n in [norm, *(n for p in parts for n in p[8:]), *(n for p in post or () for n in p)]:
            if type(n).__name__ not in norms:
                raise ValueError(f"LlamaDecoder computes transformers' RMSNorm ({', '.join(norms)}); this model has "
                                 f"{type(n).__name__}")
        # Qwen3 and Gemma 3: an RMSNorm of each head of q and k before the rotation
        qk = [(layer.self_attn.q_norm, layer.self_attn.k_norm) if kind in ("qwen3", "gemma3_text") else None
              for layer in layers]
        for pair in qk:
            if pair is not None and any(type(n).__name__ not in norms for n in pair):
                raise ValueError(f"LlamaDecoder computes transformers' RMSNorm; this model's q/k norms are "
                                 f"{type(pair[0]).__name__}")
        rope = getattr(rotary, "rope_type", "default")
        for r in (rope.values() if isinstance(rope, dict) else (rope,)):  # Gemma 3: one per kind of layer
            if r not in _STATIC_ROPE:
                raise ValueError(f"LlamaDecoder needs a rotary embedding fixed per position "
                                 f"({', '.join(_STATIC_ROPE)}); this model's is {r!r}")
        rp = getattr(config, "rope_parameters", None)
        partial = getattr(config, "partial_rotary_factor", None)
        if partial is None and isinstance(rp, dict):
            partial = rp.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0):
            raise ValueError(f"LlamaDecoder rotates whole heads; this model's partial_rotary_factor is {partial}")
        attn = layers[0].self_attn
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        extra = None
        if gemma:
            cap = getattr(config, "attn_logit_softcapping", None)
            if kind == "gemma3_text" and cap is not None:  # transformers' Gemma 3 sdpa attention refuses it
                raise ValueError("LlamaDecoder caps attention scores for Gemma 2 only (attn_logit_softcapping)")
            if getattr(config, "use_bidirectional_attention", False):
                raise ValueError("LlamaDecoder runs causal attention; this model's is bidirectional")
            window = getattr(config, "sliding_window", None)
            if "sliding_attention" in config.layer_types and (
                    isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ValueError(f"sliding layers need a sliding_window of at least 1 position; this model's is {window!r}")
            extra = {"post": post, "types": list(config.layer_types), "window": window,
                     "softcap": getattr(config, "final_logit_softcapping", None),
                     # Gemma 2: transformers' eager attention with capped scores, one RoPE base
                     "attn_cap": cap if kind == "gemma2" else None, "rope_per_kind": kind == "gemma3_text"}
        return embed, parts, qk, norm, rotary, head, heads, kv_heads, attn.head_dim, attn.scaling, extra

    def _window(self) -> int | None:
        """The sliding window that applies to some layer and that this decoder does not apply
        (Gemma 3's it does), or None."""
        config = self.model.config
        if config.model_type in ("gemma2", "gemma3_text"):
            return None
        window = getattr(config, "sliding_window", None)
        if window is None:
            return None
        types = getattr(config, "layer_types", None)
        if types is not None and all(t == "full_attention" for t in types):
            return None
        if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
            return None
        return int(window)

    # --- generation --------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, max_new_tokens: int):
        """forward(ids, position_ids, cache) -> the last position's logits, for _loop, over a
        cache of prompt + max_new_tokens positions; the arguments checked first."""
        _check(self.model, input_ids, max_new_tokens)
        embed, parts, qk_norms, norm, rotary, head, heads, kv_heads, head_dim, scaling, gemma = self._parts()
        total = input_ids.shape[1] + max_new_tokens
        window = self._window()
        if window is not None and total > window:
            raise ValueError(f"prompt + new tokens ({total}) exceed the model's sliding window ({window}), "
                             f"which LlamaDecoder does not apply")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and total > limit:
            raise ValueError(f"prompt + new tokens ({total}) exceed max_position_embeddings={limit}")
        dtype, device = self._stream(embed)
        native_layers, reason = self._native_layers(parts, qk_norms, dtype, device, norm, (heads, kv_heads, head_dim),
                                                    gemma)
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
            probe = torch.empty(0, dtype=dtype, device=device)
            kinds = sorted(set(gemma["types"])) if gemma and gemma["rope_per_kind"] else [None]
            rope = {}  # {kind of layer: (cos, sin)} (Gemma 3: a RoPE base per kind), [capacity, head_dim]
            for kind in kinds:
                cos, sin = rotary(probe, positions) if kind is None else rotary(probe, positions, kind)
                rope[kind] = (cos[0].contiguous(), sin[0].contiguous())
        k_cache, v_cache = self._k, self._v
        rms = _norm_of(norm)
        types = gemma["types"] if gemma else [None] * len(parts)
        rope_of = types if gemma and gemma["rope_per_kind"] else [None] * len(parts)
        window = gemma["window"] if gemma else None
        post = gemma["post"] if gemma else None
        softcap = gemma["softcap"] if gemma else None
        attn_cap = gemma["attn_cap"] if gemma else None

        def forward(ids, position_ids, cache):
            start = int(position_ids[0, 0])
            t = ids.shape[1]
            end = start + t
            cs = {kind: (c[start:end][None, None], s[start:end][None, None]) for kind, (c, s) in rope.items()}
            causal = t > 1
            h = embed(ids)
            for i, (q_proj, k_proj, v_proj, o_proj, gate, up, down, act, norm1, norm2) in enumerate(parts):
                x = rms(h, norm1)
                if k_proj is None:  # Phi-3: one matrix, split as transformers' Phi3Attention splits it
                    qkv = q_proj(x)
                    qs, ks = heads * head_dim, kv_heads * head_dim
                    q = qkv[..., :qs].view(1, t, heads, head_dim)
                    k = qkv[..., qs:qs + ks].view(1, t, kv_heads, head_dim)
                    v = qkv[..., qs + ks:].view(1, t, kv_heads, head_dim).transpose(1, 2)
                else:
                    q = q_proj(x).view(1, t, heads, head_dim)
                    k = k_proj(x).view(1, t, kv_heads, head_dim)
                    v = v_proj(x).view(1, t, kv_heads, head_dim).transpose(1, 2)
                if qk_norms[i] is not None:  # Qwen3, Gemma 3: each head normalized, then rotated
                    q, k = rms(q, qk_norms[i][0]), rms(k, qk_norms[i][1])
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                c, s = cs[rope_of[i]]
                q = q * c + _rotate_half(q) * s
                k = k * c + _rotate_half(k) * s
                k_all, v_all = k_cache[i], v_cache[i]
                k_all[:, :, start:end] = k
                v_all[:, :, start:end] = v
                if attn_cap is not None:  # Gemma 2
                    a = _eager_attention(q, k_all[:, :, :end], v_all[:, :, :end], start,
                                         window if types[i] == "sliding_attention" else None, scaling, attn_cap)
                elif types[i] == "sliding_attention" and end >= window:  # transformers masks from there on
                    a = _sliding_attention(q, k_all[:, :, :end], v_all[:, :, :end], start, window, scaling)
                else:
                    a = F.scaled_dot_product_attention(q, k_all[:, :, :end], v_all[:, :, :end], scale=scaling,
                                                       is_causal=causal, enable_gqa=heads != kv_heads)
                a = o_proj(a.transpose(1, 2).reshape(1, t, heads * head_dim))
                if post is not None:
                    a = rms(a, post[i][0])
                h = h + a
                x = rms(h, norm2)
                if up is None:  # Phi-3: gate and up from one matrix
                    g, u = gate(x).chunk(2, dim=-1)
                    m = down(u * act(g))
                else:
                    m = down(act(gate(x)) * up(x))
                if post is not None:
                    m = rms(m, post[i][1])
                h = h + m
            logits = head(rms(h[:, -1:], norm))
            if softcap is not None:  # Gemma's final soft-capping, as transformers computes it
                logits = torch.tanh(logits / softcap) * softcap
            return logits

        self.last_path = "torch"
        self._native = native_layers is not None
        if native_layers is None:
            return forward
        cos, sin = rope[None] if None in rope else rope[types[-1]]
        for spec in native_layers:  # Gemma 3: each layer's RoPE base
            kind = spec.pop("rope", None)
            if kind is not None:
                spec["cos"], spec["sin"] = rope[kind]
        step = native.DecodeStep(native.library(), native_layers, *_native_norm(norm), k_cache, v_cache, cos, sin,
                                 heads, kv_heads, head_dim, scaling)
        d = step.d

        def native_forward(ids, position_ids, cache):
            if ids.shape[1] != 1:  # the prompt: torch ops (its batched layers are the tile kernels)
                return forward(ids, position_ids, cache)
            self.last_path = "native"
            h = embed(ids).reshape(d).to(torch.float32).contiguous()
            logits = head(step(h, int(position_ids[0, 0])).view(1, 1, d))
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            return logits

        return native_forward

    def native_reason(self) -> str | None:
        """Why the native decode step cannot run this model now, or None where it can."""
        embed, parts, qk_norms, norm, _, _, heads, kv_heads, head_dim, _, gemma = self._parts()
        return self._native_layers(parts, qk_norms, *self._stream(embed), norm, (heads, kv_heads, head_dim),
                                   gemma)[1]

    @staticmethod
    def _stream(embed):
        """The residual stream's dtype and device: what the embedding gives (a quantized one has no
        float weight; norms' weights may be of another dtype, which their product promotes)."""
        with torch.inference_mode():
            probe = embed(torch.zeros(1, 1, dtype=torch.long, device=_device_of(embed)))
        return probe.dtype, probe.device

    def _native_layers(self, parts, qk_norms, dtype, device, final_norm, attention, gemma=None):
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
        if _native_norm(final_norm) is None:
            return None, f"the final norm's weight is {final_norm.weight.dtype}"
        layers = []
        names = ("q", "k", "v", "o", "gate", "up", "down")
        for i, (*linears, act, norm1, norm2) in enumerate(parts):
            kind = type(act).__name__
            if kind not in _SILU + _GELU_TANH:
                return None, f"layer {i}'s activation is {kind}, not SiLU or GELU (tanh)"
            spec = {"act": "silu" if kind in _SILU else "gelu_tanh"}
            for name, m in zip(names, linears):
                if m is None:  # Phi-3: in the fused projection's output
                    spec[name] = None
                    continue
                get = getattr(m, "row_kernel", None)
                rk = get() if callable(get) else None
                if rk is None:
                    return None, (f"layer {i}'s {name} projection ({type(m).__name__}) has no one-row C kernel "
                                  f"(fewbits-quantized layers with a weight-only 4- or 8-bit, w4a8 or w8a8 kernel have)")
                spec[name] = rk
            norms = [("norm1", "eps1", norm1), ("norm2", "eps2", norm2)]
            if qk_norms[i] is not None:
                norms += [("q_norm", "eps_q", qk_norms[i][0]), ("k_norm", "eps_k", qk_norms[i][1])]
            if gemma is not None:  # the norms of the attention's and the MLP's outputs
                norms += [("post1", "eps_p1", gemma["post"][i][0]), ("post2", "eps_p2", gemma["post"][i][1])]
                if gemma["types"][i] == "sliding_attention":
                    spec["window"] = int(gemma["window"])
                if gemma["rope_per_kind"]:
                    spec["rope"] = gemma["types"][i]  # its cos / sin, set once they are computed
                if gemma["attn_cap"] is not None:
                    spec["softcap"] = float(gemma["attn_cap"])
            for key, eps, n in norms:
                got = _native_norm(n)
                if got is None:
                    return None, f"layer {i}'s {key} weight is {n.weight.dtype}"
                spec[key], spec[eps] = got
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
            # torch's thread count is the process's (a thread started while another had set it
            # starts from that count, and would put it back): only the main thread sets it, and
            # one generation at a time
            sets_threads = (self.threads is not None and (self.threads != "auto" or self._native)
                            and threading.current_thread() is threading.main_thread())
            with _THREAD_COUNT_LOCK if sets_threads else contextlib.nullcontext():
                before = torch.get_num_threads()
                chooser = None
                try:
                    if self.threads == "auto" and self._native:
                        chooser = _ThreadChooser(before, threads_for_load(before))
                        forward = chooser.wrap(forward)
                    elif sets_threads:
                        torch.set_num_threads(self.threads)
                    threads = torch.get_num_threads()
                    result = _loop(forward, input_ids, max_new_tokens, None, stop=stop)
                finally:
                    if torch.get_num_threads() != before:
                        torch.set_num_threads(before)
            self.last_threads = (dict(chooser.steps) if chooser is not None
                                 else {threads: result.decode_steps} if result.decode_steps else {})
            return result

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
