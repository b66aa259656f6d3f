"""Whole-model quantization: replacing a model's layers by quantized ones in place, and sizes.

Which layers get which scheme (rules, skip patterns, the tied-weights default) is the plan, in
fewbits.quant.plan; quantize_model() resolves it and computes the weights with one of METHODS.

Quantized modules expose `.qweight` (a QuantizedTensor) and `.bias`; plan.quantized_module()
builds the fastest one for a scheme (see fewbits.quant.modules).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..progress import counter
from .gptq import gptq_quantize_model
from .importance import DAMP, collect_importance, importance_sources
from .plan import is_quantized, quantized_module, resolve_plan, set_submodule, tied_weights
from .tensor import quantize


def _round_to_nearest(model, plan, calibration, progress, **options):
    if options:
        raise TypeError(f"unexpected options for rtn: {', '.join(options)}")
    return lambda name, module: quantize(module.weight.detach(), plan[name])


def _imatrix(model, plan, calibration, progress, damp: float = DAMP, **options):
    if options:
        raise TypeError(f"unexpected options for imatrix: {', '.join(options)}")
    if calibration is None:
        raise ValueError("method='imatrix' needs calibration data (an iterable of model inputs)")
    sources = importance_sources(model, plan)
    measured = collect_importance(model, sorted(set(sources.values())), calibration, damp) if sources else {}
    importance = {name: measured[source] for name, source in sources.items()}

    def weight(name, module):
        return quantize(module.weight.detach(), plan[name], importance=importance.get(name))
    return weight


def _gptq(model, plan, calibration, progress, **options):
    if calibration is None:
        raise ValueError("method='gptq' needs calibration data (an iterable of model inputs)")
    qweights = gptq_quantize_model(model, plan, calibration, progress=progress, **options)
    return lambda name, module: qweights[name]


# method -> (model, plan, calibration, progress, **options) -> weight(name, module): the
# QuantizedTensor that replaces the module's weight
METHODS = {"rtn": _round_to_nearest, "imatrix": _imatrix, "gptq": _gptq}


def quantize_model(model: nn.Module, scheme_or_rules, skip=(), method: str = "rtn",
                   calibration: Iterable | None = None, embeddings: bool = False,
                   progress: bool | Callable | None = None, tied: str = "keep", **gptq_options) -> nn.Module:
    """Replace the model's nn.Linear (and nn.Embedding if asked) layers by quantized ones, in place.

    scheme_or_rules: a QuantScheme or preset name for every layer, or {pattern: scheme or None}.
    skip: name patterns kept in float (e.g. "lm_head", "*.classifier").
    method: "rtn" (round to nearest, or the scheme's mode), "imatrix" (round to nearest under
        scales searched on the error weighted by each input column's mean square on the
        calibration, as llama.cpp's importance matrix: fewbits.quant.importance; a tied embedding
        is weighed by its output head's input; layers whose scales are fixed by their recipe (MX,
        NVFP4, plain casts) and untied embeddings are rounded to nearest; option damp) or "gptq"
        (fewbits.quant.gptq; a tied embedding rounded as imatrix rounds it; options block_size,
        damp, act_order, static_groups, weighted_scales, shrink) (both need `calibration`: an
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
    weight = METHODS[method](model, plan, calibration, progress, **gptq_options)
    report = counter(progress, len(plan), "quantize")
    for i, name in enumerate(plan):
        module = model.get_submodule(name)
        with torch.no_grad():
            qw = weight(name, module)
        set_submodule(model, name, quantized_module(module, qw))
        report(i + 1, name)
    return model


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
