"""Whole-model quantization: which layers get which scheme, replacing them in place, sizes.

A plan maps module names to schemes. It comes from one scheme for every nn.Linear (and, if asked,
nn.Embedding), or from rules {pattern: scheme}: fnmatch patterns on the module's qualified
name, the first matching rule wins, and a rule whose scheme is None keeps that layer in float.
`skip` patterns always keep layers in float.

Tied weights: a layer whose weight is shared with another module (a language model's lm_head
tied to its token embedding) is kept in float by default (tied="keep"), because quantizing it
would untie the pair: the model would hold the matrix twice, once quantized and once in float,
and grow (SmolLM2: 134.5 M -> 162.8 M parameters). A rule that names such a layer explicitly is
an error under "keep"; tied="untie" quantizes it anyway. This default lives here, in
resolve_plan(), so quantize_model, sensitivity, QAT and the command line all share it.

Quantized modules expose `.qweight` (a QuantizedTensor) and `.bias`; quantized_module() builds
the fastest one for a scheme (see fewbits.quant.modules).
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .scheme import QuantScheme, get_scheme
from .tensor import QuantizedTensor, quantize

METHODS = ("rtn", "gptq")
TIED = ("keep", "untie")  # what resolve_plan does with a layer whose weight another module shares


def is_quantized(module: nn.Module) -> bool:
    return isinstance(getattr(module, "qweight", None), QuantizedTensor)


def quantizable_modules(model: nn.Module, embeddings: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, module) of every nn.Linear (and nn.Embedding if asked), in model order."""
    kinds = (nn.Linear, nn.Embedding) if embeddings else (nn.Linear,)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds) and not is_quantized(m)]


def _patterns(p) -> tuple[str, ...]:
    if p is None:
        return ()
    if isinstance(p, str):
        return (p,)
    return tuple(p)


def tied_weights(model: nn.Module, embeddings: bool = False) -> dict[str, list[str]]:
    """{name of a quantizable module: the other places its weight is held} for every nn.Linear
    (and nn.Embedding if asked) whose weight Parameter is shared, e.g. {'lm_head':
    ['model.embed_tokens.weight']} for a language model with tied embeddings."""
    holders: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name)
    tied = {}
    for name, m in quantizable_modules(model, embeddings):
        own = f"{name}.weight" if name else "weight"
        others = [n for n in holders.get(id(getattr(m, "weight", None)), []) if n != own]
        if others:
            tied[name] = others
    return tied


def resolve_plan(model: nn.Module, scheme_or_rules, skip=(), embeddings: bool = False,
                 tied: str = "keep") -> dict[str, QuantScheme]:
    """{module name: scheme} for the layers to quantize (see the module docstring).

    tied: "keep" (default) leaves layers whose weight another module shares in float, and raises
    if a rule other than "*" names one; "untie" quantizes them, giving them a weight of their own."""
    if tied not in TIED:
        raise ValueError(f"tied must be one of {', '.join(TIED)}, got {tied!r}")
    skip = _patterns(skip)
    if isinstance(scheme_or_rules, Mapping):
        rules = [(str(k), None if v is None else get_scheme(v)) for k, v in scheme_or_rules.items()]
    else:
        rules = [("*", get_scheme(scheme_or_rules))]
    shared = tied_weights(model, embeddings) if tied == "keep" else {}
    plan = {}
    for name, _ in quantizable_modules(model, embeddings):
        if any(fnmatch.fnmatchcase(name, p) for p in skip):
            continue
        for pattern, scheme in rules:
            if fnmatch.fnmatchcase(name, pattern):
                if scheme is not None and name in shared:
                    if pattern != "*":
                        raise ValueError(
                            f"rule {pattern!r} quantizes {name!r}, whose weight is tied to "
                            f"{', '.join(shared[name])}: quantizing it would untie them and store the matrix "
                            "twice. Pass tied='untie' to do that, or leave the layer out of the rules")
                elif scheme is not None:
                    plan[name] = scheme
                break
    return plan


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantized_module(module: nn.Module, qweight: QuantizedTensor) -> nn.Module:
    """The quantized replacement of an nn.Linear / nn.Embedding holding `qweight`."""
    from .modules import QuantEmbedding, QuantLinear  # modules sits beside model; imported lazily
    if isinstance(module, nn.Linear):
        return QuantLinear.from_quantized(qweight, module.bias)
    if isinstance(module, nn.Embedding):
        return QuantEmbedding.from_quantized(qweight, module)
    raise TypeError(f"cannot quantize a {type(module).__name__}")


def quantize_model(model: nn.Module, scheme_or_rules, skip=(), method: str = "rtn",
                   calibration: Iterable | None = None, embeddings: bool = False,
                   progress: bool | Callable | None = None, tied: str = "keep", **gptq_options) -> nn.Module:
    """Replace the model's nn.Linear (and nn.Embedding if asked) layers by quantized ones, in place.

    scheme_or_rules: a QuantScheme or preset name for every layer, or {pattern: scheme or None}.
    skip: name patterns kept in float (e.g. "lm_head", "*.classifier").
    method: "rtn" (round to nearest, or the scheme's mode) or "gptq" (needs `calibration`: an
        iterable of model inputs — tensors, tuples of positional args or dicts of keyword args).
    progress: True for a progress bar on stderr, or a callable(done, total, name).
    tied: "keep" (default): a layer whose weight another module shares (a tied lm_head) stays in
        float, so the tie and the parameter count survive; "untie": quantize it anyway.
    Returns the model.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model() takes an nn.Module, got {type(model).__name__}")
    plan = resolve_plan(model, scheme_or_rules, skip, embeddings, tied=tied)
    if "" in plan:
        raise ValueError(f"the model itself is an {type(model).__name__}: it cannot be replaced in place; "
                         "use QuantLinear.from_linear(layer, scheme), or wrap it in an nn.Sequential")
    if not plan:
        kept = sorted(tied_weights(model, embeddings)) if tied == "keep" else []
        why = f"; kept in float because their weights are tied: {', '.join(kept)}" if kept else ""
        raise ValueError(f"no layer matched: nothing to quantize (check the rules and skip patterns){why}")
    if method == "gptq":
        if calibration is None:
            raise ValueError("method='gptq' needs calibration data (an iterable of model inputs)")
        from .gptq import gptq_quantize_model
        qweights = gptq_quantize_model(model, plan, calibration, progress=progress, **gptq_options)
    else:
        if gptq_options:
            raise TypeError(f"unexpected options for rtn: {', '.join(gptq_options)}")
        qweights = None
    report = _progress(progress, len(plan), "quantize")
    for i, (name, scheme) in enumerate(plan.items()):
        module = model.get_submodule(name)
        with torch.no_grad():
            qw = qweights[name] if qweights is not None else quantize(module.weight.detach(), scheme)
        set_submodule(model, name, quantized_module(module, qw))
        report(i + 1, name)
    return model


def _progress(progress, total: int, what: str):
    """A reporter(done, name): a tqdm-style bar on stderr, a user callback, or nothing."""
    if callable(progress) and progress is not True:
        return lambda done, name: progress(done, total, name)
    if not progress:
        return lambda done, name: None
    import sys

    def bar(done, name):
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return bar


def model_nbytes(model: nn.Module) -> dict:
    """Bytes the model's weights take: quantized layers as held (codes + scales), every other
    parameter and buffer at its dtype. Returns {'quantized', 'float', 'total', 'params',
    'bits_per_param'} (params counts quantized weights by their element count)."""
    q_bytes = f_bytes = 0
    n_params = 0
    seen = set()
    for m in model.modules():
        if is_quantized(m):
            q_bytes += m.qweight.nbytes
            n_params += m.qweight.numel
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if id(t) in seen:
                continue
            seen.add(id(t))
            f_bytes += t.numel() * t.element_size()
            if isinstance(t, nn.Parameter):
                n_params += t.numel()
    total = q_bytes + f_bytes
    return {"quantized": q_bytes, "float": f_bytes, "total": total, "params": n_params,
            "bits_per_param": total * 8 / n_params if n_params else float("nan")}
