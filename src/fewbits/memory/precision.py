"""Precision: how each tensor role of a model is stored, resolved from a storage format, a
quantization scheme (what fewbits.quant stores, scales included) or a training policy (fewbits.train's
presets, as stock PyTorch or fewbits' Engine runs them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..formats import FLOAT_DTYPES, FloatFormat, get_format
from ..quant import get_scheme
from ..train import Policy
from ..train.engine import native_on
from ..train.optim import BLOCK
from .architecture import ModelSpec


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


@dataclass(frozen=True)
class _PolicyFields:
    name: str
    weights: str
    master: str | None
    activations: str
    forward: str
    optimizer_states: str
    update_rounding: str


def _policy_fields(policy) -> _PolicyFields:
    if isinstance(policy, str):
        policy = Policy.preset(policy)
    needed = ("name", "weights", "master", "forward", "optimizer_states")
    if not all(hasattr(policy, k) for k in needed):
        raise TypeError(f"policy must be a preset name or a Policy, got {type(policy).__name__}")
    return _PolicyFields(policy.name, policy.weights, policy.master, getattr(policy, "activations", policy.forward),
                         policy.forward, policy.optimizer_states, getattr(policy, "update_rounding", "nearest"))


def _state_bytes(fmt: str) -> float:
    if fmt == "int8_blockwise":
        return 1 + 4 / BLOCK  # one fp32 scale per block of values
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
        names = {get_format(d).name for d in spec.dtypes if d in FLOAT_DTYPES}
        if len(names) == 1 and not spec.quantized:
            (fmt,) = names
            return _scheme_precision(fmt, mode, rest_format, name=f"{fmt} (as loaded)")
        if mode == "training":
            raise ValueError("the module holds mixed or quantized weights: give a --policy to estimate training")
        act = 4 if names <= {"fp32", "fp64"} and not spec.quantized else 2
        return Precision("as loaded", "loaded", activation_bytes=act,
                         notes=("weights: the bytes the module holds now (parameters, buffers, quantized layers)",))
    return _scheme_precision("fp32", mode, rest_format)


def _scheme_precision(scheme, mode: str, rest_format: str, name: str | None = None) -> Precision:
    """Storage for a scheme, in fewbits.quant's vocabulary: a quantization preset (or any spelling
    of the format a preset is named after, or a QuantScheme) means what `quantize` stores, scales
    included: int4 is 4.25 bits (groups of 128, fp32 scales), nf4 4.5. A preset that is a plain
    cast (bf16, fp16) and a float format without a preset (fp32, tf32, fp64, e3m2) are plain
    storage of every parameter. Integer and codebook formats always come with scales."""
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
    dev = torch.device(device)
    store = p.weights if native_on(dev, p.weights) is not None else "fp32"
    act = _compute_bytes(p.activations) if native_on(dev, p.activations) is not None else 4
    comp = _format_bytes(store) if (p.master is None and p.update_rounding == "kahan") else 0.0
    return Precision(p.name, "policy", weight_format=store, activation_bytes=act, master_format=p.master,
                     grad_bytes=_format_bytes(store), state_format=p.optimizer_states, compensation_bytes=comp,
                     update_rounding=p.update_rounding,
                     notes=("fewbits runtime: working weights beside fp32 masters and fp32 gradient buffers",))

