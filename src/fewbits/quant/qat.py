"""Quantization-aware training: fake-quant layers with a straight-through estimator.

prepare_qat(model, scheme or rules) swaps nn.Linear layers for FakeQuantLinear, whose forward
uses the weight as the scheme would store it (quantize, then dequantize) while the gradient flows
to the float weight as if the rounding were not there (the straight-through estimator). Train as
usual, then convert_qat(model) replaces each FakeQuantLinear by the real quantized module built
from the same quantized weight, so the trained model's outputs carry over (up to the quantized
kernel's own arithmetic).

fake_quantize(x, scheme) is the fast path of `quantize(x, scheme).dequantize()`: the same scale
choice and element rounding, without encoding the codes into bit patterns, packing them into
bytes and decoding them again. It equals the reference bit for bit (tests compare them for every
preset); schemes it does not cover go through the reference.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..formats import FLOAT_DTYPES
from ..kernels import round as fb_round
from . import scales as sc
from .plan import is_quantized, quantized_module, resolve_plan, set_submodule
from .scheme import QuantScheme, get_scheme
from .tensor import from_groups, quantize, rounding_generator, to_groups

STE_MODES = ("identity", "clipped")


# ---------------------------------------------------------------------------------------------
# quantize -> dequantize, fast
# ---------------------------------------------------------------------------------------------
def fake_quantize_reference(x: torch.Tensor, scheme) -> torch.Tensor:
    """quantize(x, scheme).dequantize(): the definition fake_quantize must match."""
    return quantize(x, scheme).dequantize()


def _fake_quantize_with_mask(x: torch.Tensor, scheme: QuantScheme, want_mask: bool):
    """(quantize-dequantize of x in x's dtype, mask of the values inside the representable range
    before rounding, or None). quantize()'s steps: the same scales (scales.choose), the same
    element rounding (scales.round_elements is quantize()'s encoding, without the codes)."""
    fmt = scheme.format
    gen = rounding_generator(scheme, x.device)
    x = x.detach()
    if scheme.scale_format == "none":  # a plain cast: no scale, the format's own overflow rule
        out = fb_round(x, fmt, mode=scheme.mode, generator=gen)
        mask = ((x >= fmt.lowest) & (x <= fmt.max)) if want_mask else None
        return out, mask
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or inf, which a scaled quantization cannot represent")
    g, valid = to_groups(x, scheme)
    scaling = sc.choose(g, valid, scheme)
    y = scaling.scaled(g)
    scale = scaling.scale
    if scheme.double_quant:  # the elements were scaled by the exact scales, stored ones are approximate
        scale = sc.double_dequantize(*sc.double_quantize(scale.to(torch.float32))).reshape(scale.shape)
    mask = None
    if want_mask:
        inside = (y >= fmt.lowest) & (y <= fmt.max)
        mask = from_groups(inside, scheme, x.shape)
    r = sc.round_elements(y, fmt, scheme.mode, gen)
    if scaling.zero_point is not None:
        r = r - scaling.zero_point.to(torch.float32).unsqueeze(-1)
    v = r * scale.unsqueeze(-1)
    if scaling.minimum is not None:
        v = v + scaling.minimum.unsqueeze(-1)
    return from_groups(v, scheme, x.shape).to(x.dtype), mask


def fake_quantize(x: torch.Tensor, scheme) -> torch.Tensor:
    """The values `quantize(x, scheme).dequantize()` gives, computed without packing codes.

    Bit-identical to the reference (same scales, same element rounding, stochastic included).
    """
    scheme = get_scheme(scheme)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fake_quantize() takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"fake_quantize() takes a float tensor, got {x.dtype}")
    with torch.no_grad():
        return _fake_quantize_with_mask(x, scheme, want_mask=False)[0]


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized tensor. Backward: the gradient unchanged (identity STE), or
    zeroed where the value lay outside the representable range and was clipped (clipped STE)."""

    @staticmethod
    def forward(ctx, x, scheme, clipped):
        with torch.no_grad():
            out, mask = _fake_quantize_with_mask(x, scheme, want_mask=clipped)
        ctx.save_for_backward(mask if clipped else None)
        ctx.clipped = clipped
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.clipped:
            return grad, None, None
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype), None, None


def fake_quantize_ste(x: torch.Tensor, scheme, ste: str = "identity") -> torch.Tensor:
    """fake_quantize(x, scheme) in the forward pass; straight-through gradient in the backward.

    ste: "identity" passes the gradient unchanged; "clipped" zeroes it for the values that were
    outside the element grid's range after scaling (saturated by the quantization: only
    possible with clipping scale choices such as percentile or mse, or for plain casts).
    """
    if ste not in STE_MODES:
        raise ValueError(f"ste must be one of {', '.join(STE_MODES)}, got {ste!r}")
    return _StraightThrough.apply(x, get_scheme(scheme), ste == "clipped")


# ---------------------------------------------------------------------------------------------
# the fake-quant layer
# ---------------------------------------------------------------------------------------------
class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward uses its weight quantized-dequantized under `scheme`
    (and, for schemes with an activation scheme such as w8a8, its input too, per token), with a
    straight-through gradient. It holds the same float weight and bias Parameters it was built
    from, so optimizers and tied weights keep working."""

    def __init__(self, in_features: int, out_features: int, scheme, bias: bool = True, ste: str = "identity",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if ste not in STE_MODES:
            raise ValueError(f"ste must be one of {', '.join(STE_MODES)}, got {ste!r}")
        self.scheme = get_scheme(scheme)
        self.ste = ste
        self._eval_cache = None  # (weight version, data pointer, fake-quantized weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme, ste: str = "identity") -> FakeQuantLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear() takes an nn.Linear, got {type(linear).__name__}")
        # built on the meta device (no allocation, no init), then given the original Parameters
        fq = cls(linear.in_features, linear.out_features, scheme, bias=False, ste=ste, device="meta")
        fq.weight = linear.weight
        fq.bias = linear.bias
        fq.train(linear.training)
        return fq

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the forward uses it (a fake-quantized float tensor, no gradient)."""
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, w.device)
        if self._eval_cache is None or self._eval_cache[0] != key:
            self._eval_cache = (key, fake_quantize(w, self.scheme))
        return self._eval_cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            self._eval_cache = None
            w = fake_quantize_ste(self.weight, self.scheme, self.ste)
        else:  # inference: the fake-quantized weight is reused while the weight is unchanged
            w = self.quantized_weight()
        act = self.scheme.activations
        if act is not None:
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            x = fake_quantize_ste(x2, act, self.ste).reshape(shape)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme.label!r}, ste={self.ste!r}"


def is_fake_quantized(module: nn.Module) -> bool:
    return isinstance(module, FakeQuantLinear)


def prepare_qat(model: nn.Module, scheme_or_rules, skip=(), ste: str = "identity") -> nn.Module:
    """Replace the model's nn.Linear layers by FakeQuantLinear in place (see quantize_model for
    scheme_or_rules and skip). Returns the model. Train it, then call convert_qat()."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_qat() takes an nn.Module, got {type(model).__name__}")
    if ste not in STE_MODES:
        raise ValueError(f"ste must be one of {', '.join(STE_MODES)}, got {ste!r}")
    if any(is_fake_quantized(m) for m in model.modules()):
        raise ValueError("the model already holds FakeQuantLinear layers (prepare_qat was called already)")
    plan = resolve_plan(model, scheme_or_rules, skip)
    if not plan:
        raise ValueError("no layer matched: nothing to prepare (check the rules and skip patterns)")
    if "" in plan:
        raise ValueError("the model itself is an nn.Linear: wrap it (e.g. nn.Sequential(linear)) so that "
                         "the layer can be replaced")
    for name, scheme in plan.items():
        set_submodule(model, name, FakeQuantLinear.from_linear(model.get_submodule(name), scheme, ste))
    return model


def convert_qat(model: nn.Module) -> nn.Module:
    """Replace every FakeQuantLinear by the real quantized module of its current weight, in
    place; the weight stored is exactly the one the fake-quant forward used. Returns the model."""
    layers = [(n, m) for n, m in model.named_modules() if is_fake_quantized(m)]
    if not layers:
        raise ValueError("the model has no FakeQuantLinear layers (call prepare_qat first)")
    for name, m in layers:
        with torch.no_grad():
            qw = quantize(m.weight.detach(), m.scheme)
        new = quantized_module(m, qw)
        new.train(m.training)
        set_submodule(model, name, new)
    return model


__all__ = ["FakeQuantLinear", "fake_quantize", "fake_quantize_reference", "fake_quantize_ste", "prepare_qat",
           "convert_qat", "is_fake_quantized", "is_quantized", "STE_MODES"]
