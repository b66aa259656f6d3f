"""Importance of each linear layer's input columns, from calibration data: the "importance
matrix" of importance-weighted rounding (method "imatrix").

A linear layer y = W x makes the output error (W - Q) x; over calibration inputs its mean square
is sum_ij (W - Q)_ij (W - Q)_ik E[x_j x_k]. Kept to the diagonal, every weight's error costs
E[x_j^2], the mean square of its input column: what llama.cpp's `llama-imatrix` collects, and the
diagonal of GPTQ's Hessian. quantize(W, scheme, importance=...) then searches each group's scales
on the error weighted so (fewbits.quant.tensor.quantize, kquant_search.importance_weights).

ImportanceHooks gathers it with forward pre-hooks (sum of squares and token count per layer, in
float64), from one pass of the float model over the calibration batches; importance() damps it
like GPTQ's Hessian: E[x^2] + damp * mean(E[x^2]), so that a column the calibration never
excited keeps a little weight (a zero weight would leave its group's scale unconstrained).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .plan import calibration_batches, model_device, run_batch

DAMP = 0.01  # of the mean, added to every column (GPTQ's default damping of its Hessian)


class InputHooks:
    """Forward pre-hooks on named modules, registered for the time of a `with` block: each
    module's input goes to self._hook(name)(module, args, kwargs), which subclasses define
    (ImportanceHooks here, GPTQ's Hessian hooks)."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = dict(modules)
        self._handles = []

    def __enter__(self):
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _hook(self, name):
        raise NotImplementedError


class ImportanceHooks(InputHooks):
    """Forward pre-hooks summing the squares of each watched nn.Linear's input, per column
    (float64), and counting its rows (tokens). Use as a context manager around forward passes."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        super().__init__(modules)
        self.sums: dict[str, torch.Tensor | None] = {n: None for n in self.modules}
        self.counts = {n: 0 for n in self.modules}
        self.active = True  # False: the hooks let inputs pass uncounted

    def _hook(self, name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("input")
            if not self.active or not isinstance(x, torch.Tensor):
                return None
            X = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            s = X.square().sum(0)
            total = self.sums[name]
            self.sums[name] = s if total is None else total.add_(s)
            self.counts[name] += X.shape[0]
            return None
        return hook

    def importance(self, damp: float = DAMP) -> dict[str, torch.Tensor]:
        """{layer name: float32 [in_features]}: each input column's mean square, damped (see the
        module docstring). A layer that saw no input gets equal importance everywhere (plain
        weighted rounding), with a warning."""
        out = {}
        for name, module in self.modules.items():
            n = self.counts[name]
            if not n:
                warnings.warn(f"imatrix: layer {name!r} saw no calibration input; its columns are weighed equally",
                              RuntimeWarning, stacklevel=2)
                out[name] = torch.ones(module.weight.shape[-1], dtype=torch.float32)
                continue
            out[name] = damped(self.sums[name] / n, damp)
        return out


def damped(mean_square: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """mean_square + damp * its mean, as float32 (all ones where it is all zero)."""
    if not 0 <= damp:
        raise ValueError(f"damp must be >= 0, got {damp}")
    ms = mean_square.to(torch.float64)
    mean = ms.mean()
    if not bool(mean > 0):
        return torch.ones_like(ms, dtype=torch.float32)
    return (ms + damp * mean).to(torch.float32)


def importance_sources(model: nn.Module, plan) -> dict[str, str]:
    """{planned layer: the nn.Linear whose input columns weigh its weight's columns}, for every
    planned layer whose scheme takes importance (fewbits.quant.tensor.takes_importance): an
    nn.Linear, its own input; an nn.Embedding whose weight an nn.Linear shares (a tied output
    head, which llama.cpp computes the logits with too), that Linear's input, the hidden state
    its columns multiply."""
    from .tensor import takes_importance

    sources = {}
    for name, scheme in plan.items():
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        if weight is None or not takes_importance(scheme, weight.shape):
            continue
        if isinstance(module, nn.Linear):
            sources[name] = name
        elif isinstance(module, nn.Embedding):
            head = next((n for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) and m.weight is weight), None)
            if head is not None:
                sources[name] = head
    return sources


def collect_importance(model: nn.Module, layers: Iterable[str], calibration, damp: float = DAMP,
                       progress=None) -> dict[str, torch.Tensor]:
    """{layer name: float32 [in_features]}: the damped mean square input of each named nn.Linear of
    `model`, over one pass of the float model on `calibration` (model inputs, as quantize_model's).
    progress: a callable(done, total) called after each batch, or None."""
    batches = calibration_batches(calibration)
    modules = {}
    for name in layers:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"imatrix weighs the input columns of nn.Linear layers; {name!r} is a "
                            f"{type(module).__name__}")
        modules[name] = module
    device = model_device(model)
    training = model.training
    model.eval()  # no dropout
    try:
        with ImportanceHooks(modules) as hooks, torch.no_grad():
            for i, batch in enumerate(batches):
                run_batch(model, batch, device)
                if progress is not None:
                    progress(i + 1, len(batches))
    finally:
        model.train(training)
    return hooks.importance(damp)

