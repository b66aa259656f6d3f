"""The plan of a model's quantization: which layers get which scheme, and putting modules in place.

Everything that quantizes a model (quantize_model, GPTQ, QAT, sensitivity, the fewbits file
format) shares these pieces, so they sit below all of them.

A plan maps module names to schemes. It comes from one scheme for every nn.Linear (and, if asked,
nn.Embedding), or from rules {pattern: scheme}: fnmatch patterns on the module's qualified
name, the first matching rule wins, and a rule whose scheme is None keeps that layer in float.
`skip` patterns always keep layers in float.

Tied weights: a layer whose weight is shared with another module (a language model's lm_head
tied to its token embedding) is kept in float by default (tied="keep"), because quantizing it
would untie the pair: the model would hold the matrix twice, once quantized and once in float,
and grow (SmolLM2: 134.5 M -> 162.8 M parameters). Under "keep", a rule that names such a layer
explicitly (its exact name, no wildcard * ? [) is an error: the user asked for that layer; a
wildcard rule that merely matches it ("*", "*head*", "*proj*") keeps it in float, as the
default does, and the layer is then simply absent from the plan (quantize_model's "no layer
matched" message lists the tied layers it kept). tied="untie" quantizes it anyway. This default lives here, in
resolve_plan(), so quantize_model, sensitivity, QAT and the command line all share it.

Calibration data (GPTQ, sensitivity) is a list of model inputs: calibration_batches() reads it
from whatever was passed, call_model() runs the model on one input.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
from torch import nn

from .modules import QuantEmbedding, QuantLinear
from .scheme import QuantScheme, get_scheme
from .tensor import QuantizedTensor

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


def _is_explicit(pattern: str) -> bool:
    """Whether a rule's pattern is a plain layer name rather than a wildcard (fnmatch's special
    characters are * ? and [): only a plain name asks for one layer on purpose."""
    return not any(c in pattern for c in "*?[")


def resolve_plan(model: nn.Module, scheme_or_rules, skip=(), embeddings: bool = False,
                 tied: str = "keep") -> dict[str, QuantScheme]:
    """{module name: scheme} for the layers to quantize (see the module docstring).

    tied: "keep" (default) leaves layers whose weight another module shares in float when the
    first rule matching them is a wildcard pattern, and raises when it is the layer's exact name
    (a pattern without * ? [, see _is_explicit); "untie" quantizes them, giving them a weight of
    their own."""
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
                    if _is_explicit(pattern):
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
    """The quantized replacement of an nn.Linear / nn.Embedding holding `qweight`, in the
    module's mode (train / eval), so that a model in eval mode stays all in eval mode."""
    if isinstance(module, nn.Linear):
        return QuantLinear.from_quantized(qweight, module.bias).train(module.training)
    if isinstance(module, nn.Embedding):
        return QuantEmbedding.from_quantized(qweight, module).train(module.training)
    raise TypeError(f"cannot quantize a {type(module).__name__}")


def calibration_batches(calibration) -> list:
    """The calibration data as a list of model inputs (each a tensor, a tuple/list of positional
    args or a dict of keyword args): a single tensor or dict is one input, any other iterable
    (a list, a tuple, a generator) is read into a list of its items."""
    if calibration is None:
        raise ValueError("calibration data is needed: an iterable of model inputs (tensors, tuples of "
                         "positional args, dicts of keyword args)")
    if isinstance(calibration, (torch.Tensor, Mapping)):
        batches = [calibration]
    else:
        batches = list(calibration)
    if not batches:
        raise ValueError("calibration data is empty")
    return batches


def call_model(model: nn.Module, batch):
    """model(batch) for a tensor, model(*batch) for a tuple/list, model(**batch) for a dict."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def to_device(obj, device):
    """A model input (a tensor, or tensors in dicts, tuples and lists) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def run_batch(model: nn.Module, batch, device):
    """Call the model on one calibration batch (a tensor, a tuple/list of positional args, or a
    dict of keyword args), moved to `device`."""
    if not isinstance(batch, (Mapping, tuple, list, torch.Tensor)):
        raise TypeError(f"a calibration batch must be a tensor, a tuple/list of positional arguments or a "
                        f"dict of keyword arguments, got {type(batch).__name__}")
    return call_model(model, to_device(batch, device))
