"""Greedy generation with a transformers causal LM, timed per phase, eager or compiled.

Two ways to run the same greedy loop at batch 1 (one prompt, argmax of the last logits each
step, `max_new_tokens` new tokens):

- `greedy_generate(model, input_ids, n)`: eager, transformers' DynamicCache (or `cache="static"`),
  the model called as it is. Its tokens equal `model.generate(input_ids, do_sample=False,
  max_new_tokens=n)`'s.
- `CompiledGenerator(model, max_cache_len)`: the fast decode path: a StaticCache allocated once
  (fixed shapes, so one graph serves every decode step) and the model's forward compiled with
  `torch.compile` (by default the decode step only; `compile_prefill=True` compiles the prompt's
  forward too, a second graph for the prompt length). The first `generate` compiles; later ones
  reuse the graphs. Whatever dynamo cannot trace (a ctypes call, torch.set_num_threads, a
  data-dependent branch) splits the graph there and runs eagerly: `graph_breaks` lists each
  reason and count seen while compiling (torch._dynamo's counters), so a caller can see how
  much of the model really ran compiled. `fullgraph=True` makes a break an error instead.

Guards. Before each call of a compiled function dynamo checks its guards: for a model, the
dtype, device, shape and strides of every parameter and buffer and the module attributes the
forward read -- about 1.2 ms per decode step on SmolLM2-135M at one thread, ~7% of a w4a8 token.
`CompiledGenerator(..., guards="generate")` (the default, where torch has
torch.compiler.skip_guard_on_all_nn_modules_unsafe) leaves the module guards out of dynamo's
per-call check and checks the same things itself once per `generate()`: the model's fingerprint
(every parameter and buffer's identity, dtype, device, shape and strides; every module's
identity, class and class forward, training flag, plain attributes and functions and forward
hooks, and each QuantLinear's kernel; torch's global module hooks; the model's config and
attention implementation; about 5 ms on SmolLM2-135M, outside the timed phases) must equal the
one taken when the generator was built, else `generate()` raises ValueError (build a new
generator for a changed model) rather than run a stale graph; the globals a forward reads keep
dynamo's own guards. Each such generator compiles a code object of its own, so no graph is
shared between generators (the model's identity was one of the guards left out).
`guards="dynamo"` keeps dynamo's checks per call.

Timing (the same definition as the benchmarks use for llama.cpp): `prefill_seconds` is the wall
time of the prompt's forward and the choice of the first new token; `decode_seconds` the wall
time of the remaining `n - 1` single-token forwards (each ending in its argmax, so nothing is
left queued). prefill tokens/s = prompt length / prefill_seconds; decode tokens/s = (n - 1) /
decode_seconds.
"""
from __future__ import annotations

import gc
import itertools
import os
import time
import types
from dataclasses import dataclass, field

import torch
from torch.nn.modules import module as torch_module

from ._deps import TRANSFORMERS_HINT, require_modules

__all__ = ["GenerationResult", "greedy_generate", "CompiledGenerator", "dynamo_graph_breaks", "kv_cache_bytes",
           "available_memory", "check_cache_fits"]


@dataclass
class GenerationResult:
    """New token ids (1, n) and the phases' wall times; see the module's timing definition."""

    tokens: torch.Tensor
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    graph_breaks: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _check(model, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("input_ids must be a (1, prompt length) tensor of token ids (batch 1)")
    if input_ids.shape[1] < 1:
        raise ValueError("the prompt must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if model.training:
        raise ValueError("the model is in training mode; call model.eval() first")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) and garbage: None


def available_memory() -> int | None:
    """Bytes of memory this process can still take, or None where it cannot be told: the
    kernel's MemAvailable (/proc/meminfo), lowered by the cgroup's limit less its usage (cgroup
    v2 memory.max / memory.current) where one is set; without /proc, the physical memory
    (sysconf)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            avail = None
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = max(0, limit - used) if avail is None else min(avail, max(0, limit - used))
    return avail if avail is None or avail > 0 else None


def _head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def kv_cache_bytes(config, positions: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of `positions` positions for a decoder of `config` (a transformers
    config): layers x 2 (keys, values) x kv heads x head_dim x positions x the element size."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.empty(0, dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * kv_heads * _head_dim(config) * positions * element


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def check_cache_fits(need: int, positions: int, max_new_tokens: int | None = None) -> None:
    """ValueError unless `need` bytes (a KV cache of `positions` positions and what goes with it)
    fit in the memory available now (available_memory; nothing is refused where that is
    unknown). Called before the cache is allocated, so an absurd max_new_tokens is a clear error
    rather than an allocation of hundreds of gigabytes."""
    avail = available_memory()
    if avail is None or need <= avail:
        return
    asked = f" (the prompt + max_new_tokens={max_new_tokens})" if max_new_tokens is not None else ""
    raise ValueError(f"a KV cache of {positions} positions{asked} needs {_gigabytes(need)} of memory, more than "
                     f"the {_gigabytes(avail)} available: ask for fewer new tokens")


def _positions(start: int, length: int, device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device).unsqueeze(0)


def _next_token(logits: torch.Tensor) -> torch.Tensor:
    # argmax's index (the first of equal maxima, a NaN's where there is one) through max(dim),
    # whose CPU reduction took 23 us for SmolLM2's 49152 logits where argmax took 65 us
    return logits[:, -1, :].max(dim=-1, keepdim=True).indices


_FIRST_TOKENS = 1024


def _loop(forward, input_ids, max_new_tokens, cache, prefill=None, stop=None) -> GenerationResult:
    """The greedy loop; forward(ids, position_ids, cache) -> logits of the last position(s).
    stop: token ids that end the generation once generated (kept as its last token).

    Python's cyclic garbage collector stays off during the loop (back on after it, as it was):
    the objects each step makes set off its collections, each walking every object of the model
    -- 3-4% of a SmolLM2 int4 token on the native path. Reference counting still frees what each
    step leaves; only reference cycles wait for the end of the loop."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _timed_loop(forward, prefill or forward, input_ids, max_new_tokens, cache, stop)
    finally:
        if collecting:
            gc.enable()


def _timed_loop(forward, prefill, input_ids, max_new_tokens, cache, stop) -> GenerationResult:
    n = input_ids.shape[1]
    # the new tokens' buffer grows (doubling) with what is generated: a large max_new_tokens
    # that a stop token ends early allocates nothing for the rest
    out = torch.empty(1, min(max_new_tokens, _FIRST_TOKENS), dtype=input_ids.dtype, device=input_ids.device)
    made = max_new_tokens
    with torch.inference_mode():
        t0 = time.perf_counter()
        token = _next_token(prefill(input_ids, _positions(0, n, input_ids.device), cache))
        out[:, 0:1] = token
        t1 = time.perf_counter()
        if stop and int(token) in stop:
            made = 1
        for i in range(1, made):
            token = _next_token(forward(token, _positions(n + i - 1, 1, input_ids.device), cache))
            if i == out.shape[1]:
                more = torch.empty(1, min(i, max_new_tokens - i), dtype=out.dtype, device=out.device)
                out = torch.cat((out, more), dim=1)
            out[:, i:i + 1] = token
            if stop and int(token) in stop:
                made = i + 1
                break
        t2 = time.perf_counter()
    return GenerationResult(out[:, :made], n, t1 - t0, t2 - t1, made - 1)


def _eager_forward(model):
    def forward(ids, position_ids, cache):
        return model(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True,
                     logits_to_keep=1).logits
    return forward


GUARDS = ("generate", "dynamo")
_GENERATORS = itertools.count()  # numbers each CompiledGenerator's own code object


def _module_guards_skippable() -> bool:
    return hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")


_PLAIN = (bool, int, float, str, type(None))


def _attributes(m) -> tuple:
    """A module's own plain attributes (numbers, strings, flags) by value and its functions by
    identity: what a forward's control flow reads (head counts, scaling, an activation)."""
    return tuple(sorted((k, v if isinstance(v, _PLAIN) else id(v)) for k, v in vars(m).items()
                        if isinstance(v, _PLAIN) or (callable(v) and not isinstance(v, (torch.nn.Module, torch.Tensor)))))


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs")


def _hooks(obj, names=_HOOK_DICTS) -> tuple:
    """The hooks in obj's hook dicts (a module's, or torch.nn.modules.module's global ones), by
    identity."""
    return tuple((n, tuple((k, id(v)) for k, v in d.items())) for n in names
                 if isinstance(d := getattr(obj, n, None), dict) and d)


def model_fingerprint(model) -> tuple:
    """What dynamo's module guards would check and more, taken once: every parameter and buffer
    (its identity, dtype, device, shape, strides); every module (its identity, class and the
    class's forward, training flag, plain attributes and functions, forward hooks, and for a
    fewbits QuantLinear its kernel and weight, which are no parameters); torch's global module
    hooks; the model's config (transformers' config where there is one, with its attention
    implementation, which to_dict() leaves out)."""
    tensors = tuple((name, id(t), t.dtype, t.device, tuple(t.shape), t.stride())
                    for name, t in (*model.named_parameters(), *model.named_buffers()))
    modules = tuple((name, id(m), type(m), id(getattr(type(m), "forward", None)), m.training, _attributes(m),
                     _hooks(m), getattr(m, "kernel", None), id(getattr(m, "_qweight", None)))
                    for name, m in model.named_modules())
    config = getattr(model, "config", None)
    config_state = ((repr(config.to_dict()), getattr(config, "_attn_implementation", None))
                    if hasattr(config, "to_dict") else None)
    global_hooks = _hooks(torch_module, ("_global_forward_hooks", "_global_forward_pre_hooks",
                                         "_global_forward_hooks_always_called", "_global_module_registration_hooks"))
    return tensors, modules, config_state, global_hooks


def _static_cache(model, max_cache_len: int, max_new_tokens: int | None = None):
    from transformers import StaticCache

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        need = kv_cache_bytes(model.config, max_cache_len, dtype)
    except (AttributeError, TypeError, ZeroDivisionError):
        need = None  # not a decoder config this estimate knows: StaticCache says what is wrong
    if need is not None:
        check_cache_fits(need, max_cache_len, max_new_tokens)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, cache: str = "dynamic") -> GenerationResult:
    """Greedy generation, eager, timed per phase. cache: "dynamic" (transformers' default) or
    "static" (a StaticCache of prompt + max_new_tokens positions)."""
    require_modules("greedy generation", ("transformers",), TRANSFORMERS_HINT)
    from transformers import DynamicCache

    _check(model, input_ids, max_new_tokens)
    if cache == "dynamic":
        kv = DynamicCache(config=model.config)
    elif cache == "static":
        kv = _static_cache(model, input_ids.shape[1] + max_new_tokens, max_new_tokens)
    else:
        raise ValueError(f"cache must be 'dynamic' or 'static', got {cache!r}")
    return _loop(_eager_forward(model), input_ids, max_new_tokens, kv)


def dynamo_graph_breaks() -> dict:
    """{reason: count} of the graph breaks torch._dynamo has counted since its counters were
    last cleared (torch._dynamo.utils.counters["graph_break"])."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


class CompiledGenerator:
    """Greedy generation through a StaticCache and a torch.compile'd forward (see the module).

    model: a causal LM in eval mode (any fewbits-quantized one too). max_cache_len: the most
    positions a generation holds (prompt + new tokens). mode, fullgraph, dynamic: passed to
    torch.compile (dynamic=False: one graph per input shape, which static shapes make two at
    most). compile_prefill: compile the prompt's forward too (else it runs eagerly, into the
    same static cache). guards: "generate" (the model's fingerprint checked once per generate()
    instead of dynamo's module guards per forward, see the module) or "dynamo".

    `.graph_breaks` ({reason: count}) and `.graphs` (the number of graphs dynamo made) are
    recorded during the first generate(), when the compiling happens; `.compile_seconds` is that
    first call's wall time. Build it after setting torch's thread count: inductor's CPU code is
    specialized on it.
    """

    def __init__(self, model, max_cache_len: int, mode: str | None = None, fullgraph: bool = False,
                 dynamic: bool = False, compile_prefill: bool = False, guards: str = "generate"):
        require_modules("compiled generation", ("transformers",), TRANSFORMERS_HINT)
        if model.training:
            raise ValueError("the model is in training mode; call model.eval() first")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an int >= 2, got {max_cache_len!r}")
        if guards not in GUARDS:
            raise ValueError(f"guards must be one of {', '.join(GUARDS)}, got {guards!r}")
        self.model = model
        self.max_cache_len = max_cache_len
        self.mode, self.fullgraph, self.compile_prefill = mode, fullgraph, compile_prefill
        # where this torch cannot leave the module guards out, dynamo keeps them
        self.guards = guards if guards == "dynamo" or _module_guards_skippable() else "dynamo"
        self._fingerprint = model_fingerprint(model) if self.guards == "generate" else None
        self.cache = _static_cache(model, max_cache_len)
        eager = _eager_forward(model)
        self._eager = eager
        options = None
        if self.guards == "generate":
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            # a code object of its own: dynamo keeps compiled graphs per code object, and without
            # the module guards (which include the model's identity) a graph compiled for another
            # generator's model would match this one's calls
            eager = types.FunctionType(eager.__code__.replace(co_name=f"forward_{next(_GENERATORS)}"),
                                       eager.__globals__, eager.__name__, eager.__defaults__, eager.__closure__)
        self._compiled = torch.compile(eager, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options)
        self.graph_breaks: dict | None = None
        self.graphs: int | None = None
        self.compile_seconds: float | None = None

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> GenerationResult:
        _check(self.model, input_ids, max_new_tokens)
        if self._fingerprint is not None and model_fingerprint(self.model) != self._fingerprint:
            raise ValueError("the model changed since this CompiledGenerator was built (a parameter, buffer, "
                             "module mode or quantized weight): its compiled graphs skip dynamo's module guards "
                             "(guards='generate'), so build a new CompiledGenerator for the changed model")
        if input_ids.shape[1] + max_new_tokens > self.max_cache_len:
            raise ValueError(f"prompt ({input_ids.shape[1]}) + new tokens ({max_new_tokens}) exceed "
                             f"max_cache_len={self.max_cache_len}")
        with torch.inference_mode():  # the cache's tensors are inference tensors
            self.cache.reset()
        first = self.graph_breaks is None
        if first:
            from torch._dynamo.utils import counters

            counters.clear()
            t0 = time.perf_counter()
        prefill = self._compiled if self.compile_prefill else self._eager
        result = _loop(self._compiled, input_ids, max_new_tokens, self.cache, prefill=prefill)
        if first:
            self.compile_seconds = time.perf_counter() - t0
            self.graph_breaks = dynamo_graph_breaks()
            self.graphs = int(counters["stats"]["unique_graphs"])
        result.graph_breaks = dict(self.graph_breaks)
        return result

    def warm_up(self, input_ids: torch.Tensor, max_new_tokens: int = 3) -> GenerationResult:
        """One short generation, which compiles the graphs (prefill's too, if compiled)."""
        return self.generate(input_ids, min(max_new_tokens, self.max_cache_len - input_ids.shape[1]))
