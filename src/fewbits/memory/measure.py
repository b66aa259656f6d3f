"""The measurement: the peak memory of a call as the allocator records it (torch's CPU allocator
through the profiler, CUDA's peak counter), and of a real forward or training step of a model under
the precision the estimator predicts."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from ..formats import get_format, torch_dtype
from ..train import Engine
from .architecture import describe_model
from .estimate import RUNTIMES
from .peak import measure_peak_memory
from .precision import Precision, resolve_precision


def _default_loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    first = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
    return first.float().pow(2).mean()


def _native_dtype(fmt: str) -> torch.dtype:
    """The torch dtype a measured run holds a format in: its own, and float32 for tf32 (fp32
    storage whose matmul inputs are narrower)."""
    name = get_format(fmt).name
    if name == "tf32":
        return torch.float32
    dtype = torch_dtype(name)
    if dtype is None:
        raise ValueError(f"{name} is not a torch dtype: a measured run needs fp32, bf16 or fp16")
    return dtype


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

