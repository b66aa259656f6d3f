"""Quantized inference modules: QuantLinear and QuantEmbedding.

A QuantLinear holds its weight as a QuantizedTensor (`.qweight`, packed codes for real) and runs
the fastest path this device offers for the scheme, chosen once at construction (`.kernel`). The
kernels live in fewbits.quant.linear_kernels, one module per family (dequant and dequant_fp32,
int4pack, int8pack, w8a8_amx / w8a8_vnni, w8a8_onednn / w8a8_int_mm, w8a8_fp8, w4a8, bf16: each
module's docstring gives its schemes and arithmetic); linear_kernels.registry holds the order
kernel="auto" tries them in, and docs/architecture.md the table of what each scheme gets. A
QuantLinear asks the registry for its kernel, has it prepare the weight once
(LinearKernel.prepare -> PreparedWeight) and calls it; it holds nothing kernel-specific.

On CUDA (the module moved with .to("cuda"), or built from a weight there) the kernels are
w8a8_int_mm (cuBLASLt's int8 GEMM; fewer than 17 rows are padded), w8a8_fp8 (compute capability
8.9+), bf16 (cuBLAS) and dequant;
`available_kernels(scheme, shape, device)` lists them, and moving the module back to the CPU
picks the CPU's kernel again.

Every kernel is checked in tests against the slow reference `reference_forward(x)` =
`F.linear(x, qweight.dequantize(x.dtype), bias)` (for w8a8, with the activations quantized and
dequantized by fewbits.quant.quantize). Where a kernel keeps the codes in its own layout
(int4pack, w8a8_onednn), `.qweight` holds no second copy: its `codes` are derived from that
layout when read, bit-identical to the codes quantize() produced. `.nbytes` counts every byte
the module holds for its weight, kernel-side extras included (e.g. the bfloat16 scale pairs).

State: `module.state_dict()` holds the quantized weight as `qweight.<key>` for each key of its
QuantizedTensor.state_dict() (codes, scales, zero_points, ...), plus `bias`; `load_state_dict()`
restores it exactly (validated first, the kernel layout rebuilt). `QuantLinear.empty(scheme,
shape, dtype, bias=...)` / `QuantEmbedding.empty(...)` build a module with no data on the meta
device, for a model skeleton that load_state_dict() fills.

The modules are for inference: their weights are not parameters. With gradients wanted for
the input (x.requires_grad under grad mode) a QuantLinear runs the reference path, which is
differentiable in x.
"""
from __future__ import annotations

import itertools
import math
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from .linear_kernels import registry
from .linear_kernels.base import (  # noqa: F401 - the kernels' public names, where they were
    DOT_MAX_VALUES, LUT4_MAX_BATCH, TILE_MAX_VALUES, W4A8_MAX_BATCH, KernelQuantizedTensor, bf16_blocks, tile_batch,
    tile_limit, with_bias,
)
from .linear_kernels.registry import KERNELS, available_kernels
from .linear_kernels.rows import RowDecoder
from .linear_kernels.w8a8_gemm import cpu_int8_gemm_exact  # noqa: F401
from .linear_kernels.w8a8_panels import PANEL_KERNELS  # noqa: F401
from .scheme import QuantScheme, get_scheme
from .tensor import QuantizedTensor, expected_keys, quantize, stored_problem

QWEIGHT = "qweight"  # state-dict entries of the quantized weight: <module>.qweight.<QuantizedTensor key>


# ---------------------------------------------------------------------------------------------
# QuantLinear
# ---------------------------------------------------------------------------------------------
class _QuantizedWeightViews:
    """What both quantized modules expose of the QuantizedTensor they hold in `_qweight`."""

    @property
    def qweight(self) -> QuantizedTensor:
        return self._qweight

    @property
    def scheme(self) -> QuantScheme:
        return self._qweight.scheme

    @property
    def dtype(self) -> torch.dtype:
        return self._qweight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held for the weight (codes, scales, zero points, kernel-side tensors, parameters
        a kernel keeps derived); a float bias is not included."""
        return self._qweight.nbytes + getattr(self, "_kernel_extra_nbytes", 0)

    # --- state_dict / load_state_dict ---------------------------------------------------------
    # The quantized weight is no Parameter, so torch would leave it out of model.state_dict(). It
    # goes in as `<prefix>qweight.<key>` for each key of its QuantizedTensor.state_dict() (the
    # names fb.save uses), the codes as the QuantizedTensor holds them whatever the kernel's layout.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, t in self._qweight.state_dict().items():
            destination[f"{prefix}{QWEIGHT}.{key}"] = t if keep_vars else t.detach()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Restores the quantized weight from `<prefix>qweight.<key>` entries: a new QuantizedTensor
        of this module's scheme, shape and dtype, validated (tensor shapes and dtypes, element
        codes in their format) before anything changes; then the bias as torch loads it, then the
        kernel layout is rebuilt for the loaded weight. Missing entries and (strict) unexpected
        ones are reported as torch reports them. With assign=False the tensors are copied to the
        module's device, as torch copies into parameters; with assign=True, or into a module on
        the meta device (a skeleton, see empty()), the module takes the given tensors."""
        qprefix = f"{prefix}{QWEIGHT}."
        given = {k[len(qprefix):]: v for k, v in state_dict.items() if k.startswith(qprefix)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(qprefix)}
        want = expected_keys(self.scheme)
        missing = [k for k in want if k not in given]
        missing_keys.extend(qprefix + k for k in missing)
        if strict:
            unexpected_keys.extend(qprefix + k for k in given if k not in want)
        current = self._qweight
        meta = current.device.type == "meta"
        assign = bool(local_metadata.get("assign_to_params_buffers", False)) or meta
        loaded = None
        if not missing:
            loaded = _loaded_qweight(current, {k: given[k] for k in want}, assign, qprefix[:-1], error_msgs)
            if loaded is None:
                return
        errors_before = len(error_msgs)
        bias = getattr(self, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.is_meta:  # a skeleton's bias takes the given tensor
            local_metadata = {**local_metadata, "assign_to_params_buffers": True}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if loaded is not None and len(error_msgs) == errors_before:
            self._set_qweight(loaded)


def _loaded_qweight(current: QuantizedTensor, tensors: dict, assign: bool, where: str,
                    error_msgs: list) -> QuantizedTensor | None:
    """The QuantizedTensor that `tensors` make in `current`'s scheme, shape and dtype, or None
    with the reason appended to error_msgs (as torch reports a bad entry)."""
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        error_msgs.append(f"While loading {where}: {', '.join(bad)} must be tensors")
        return None
    if not assign:
        device = current.device
        tensors = {k: v.detach().to(device, copy=True) for k, v in tensors.items()}
    else:
        tensors = {k: v.detach() for k, v in tensors.items()}
    try:
        qt = QuantizedTensor.from_state_dict(current.scheme, current.shape, current.dtype, tensors)
    except (TypeError, ValueError) as e:
        error_msgs.append(f"While loading {where} ({current.scheme.label}, shape {tuple(current.shape)}): {e}")
        return None
    if qt.device.type != "meta":
        problem = stored_problem(qt)
        if problem:
            error_msgs.append(f"While loading {where}: {problem}")
            return None
    return qt


class QuantLinear(_QuantizedWeightViews, nn.Module):
    """nn.Linear with a quantized weight (see the module docstring for the kernels).

    QuantLinear.from_linear(linear, scheme) quantizes a float layer; QuantLinear(qweight, bias)
    or .from_quantized(qweight, bias) wraps an existing QuantizedTensor [out, in]. The bias
    stays in float. kernel="auto" picks the fastest exact-enough path; naming one forces it
    (ValueError if it cannot run this scheme and shape).
    """

    def __init__(self, qweight: QuantizedTensor, bias: torch.Tensor | None = None, kernel: str = "auto"):
        super().__init__()
        if not isinstance(qweight, QuantizedTensor):
            raise TypeError(f"qweight must be a QuantizedTensor, got {type(qweight).__name__}")
        if len(qweight.shape) != 2:
            raise ValueError(f"a linear weight is 2-d [out_features, in_features], got shape {tuple(qweight.shape)}")
        if isinstance(qweight, KernelQuantizedTensor):
            qweight = qweight.plain()
        self.out_features, self.in_features = (int(d) for d in qweight.shape)
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError("bias must be a float tensor or None")
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.bias = bias
        s = qweight.scheme
        self._requested_kernel = kernel
        possible = available_kernels(s, qweight.shape, qweight.device)
        if kernel == "auto":
            kernel = possible[0]
        elif kernel not in registry.names():
            raise ValueError(f"kernel must be 'auto' or one of {', '.join(registry.names())}, got {kernel!r}")
        elif kernel not in possible:
            raise ValueError(f"kernel {kernel!r} cannot run {s.label} with shape {tuple(qweight.shape)} here; "
                             f"possible: {', '.join(possible)}")
        self._install(qweight, kernel)

    def _install(self, qweight: QuantizedTensor, kernel: str) -> None:
        self._handle = _register(self)
        # the handle as a tensor: torch.compile passes it as an input instead of guarding on its
        # value, so identical layers share one compiled graph (a plain attribute, not a buffer: it
        # is no part of the model's state or size, and stays on the CPU)
        self._handle_tensor = torch.tensor(self._handle, dtype=torch.int64)
        self.kernel = kernel
        self._prepared = registry.kernel(kernel).prepare(qweight)
        self._qweight = self._prepared.qweight
        self._kernel_extra_nbytes = self._prepared.extra_nbytes
        self._row = self._row_path()
        self._tiles = self._tile_path(self._row)

    def _row_path(self):
        """Where one float32 row on the CPU runs one C call of the weight as its kernel holds it
        (PreparedWeight.row_call: the C function's name, its argument address, its return-code
        check, and the object that owns what the address points at -- held with the address, so
        that a call in flight keeps the tensors it reads alive while another thread replaces the
        weight), with the output shapes by input rank; else None. forward() then makes that call
        itself (the general path costs ~10 us of Python per call, more than a small layer's row):
        the same call with the same arguments, the same bits."""
        call = self._prepared.row_call() if self.out_features else None
        if call is None:
            return None
        name, args, check, owner = call
        return name, args, check, tuple((1,) * (d - 1) + (self.out_features,) for d in range(1, 5)), owner

    def _row_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """forward(x) through _row_path's C call, or None where it does not apply."""
        row = self._row
        if (row is not None and type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu
                and 1 <= x.dim() <= 4 and x.numel() == self.in_features and x.shape[-1] == self.in_features
                and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())):
            lib = native.library()  # None inside native.turned_off()
            if lib is not None:
                y = torch.empty(row[3][x.dim() - 1], dtype=torch.float32)  # not the default dtype
                row[2](getattr(lib, row[0])(row[1], x.data_ptr(), y.data_ptr()))
                return y if self.bias is None else with_bias(y, self.bias, torch.float32)
        return None

    def row_kernel(self) -> native.RowKernel | None:
        """The C call that forward() makes for one float32 row on the CPU (_row_path's), as a
        native.RowKernel for C code that calls it itself (models.decoder's decode step): the same
        function and arguments, so the same bits, with the float32 bias added after it as
        forward() adds it. None where there is no such call: no native library, a kernel or
        scheme without a one-row C path, or a bias that is not float32."""
        row = self._row
        bias = self.bias
        if row is None or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu")):
            return None
        lib = native.library()
        if lib is None:
            return None
        return native.RowKernel(native.function_address(lib, row[0]), row[1], row[2], None if bias is None else bias.detach(),
                                self.in_features, self.out_features, row[4])

    def _tile_path(self, row):
        """Where float32 batches of more than LUT4_MAX_BATCH rows that tile_batch sends to the AMX
        tiles run in one C call (PreparedWeight.tile_call: a weight-only lut4 or int8 layer):
        (the C function's name, its argument address -- _row's, the same weight's fixed arguments
        --, its return-code check, the prepared weight); else None. forward() makes that call
        itself where the tiles are there: the general path's call (tile_matmul with float32 x)
        with the same arguments, the same bits."""
        name = self._prepared.tile_call() if row is not None else None
        return None if name is None else (name, row[1], row[2], row[4])

    def _tile_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """forward(x) through _tile_path's C call, or None where it does not apply."""
        t = self._tiles
        if (t is not None and type(x) is torch.Tensor and x.dim() >= 2 and x.shape[-1] == self.in_features > 0
                and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())):
            x2d = x.view(-1, self.in_features)
            rows = x2d.shape[0]
            if bf16_blocks(x2d) and tile_batch(rows, self.in_features):  # the general path's rules
                lib = native.library()  # None inside native.turned_off()
                if lib is not None and native.tiles(lib):
                    y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
                    rc = getattr(lib, t[0])(t[1], x.data_ptr(), rows, y.data_ptr())
                    if rc == -3:  # the tiles refused after all: the general path
                        return None
                    t[2](rc)
                    return y if self.bias is None else with_bias(y, self.bias, torch.float32)
        return None

    def __getstate__(self):
        # a copy or pickle holds the plain QuantizedTensor; the kernel layout is rebuilt
        state = dict(super().__getstate__())
        qweight = state.pop("_qweight")
        state["_qweight"] = qweight.plain() if isinstance(qweight, KernelQuantizedTensor) else qweight
        for key in ("_prepared", "_row", "_tiles"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        state = dict(state)
        qweight = state.pop("_qweight")
        super().__setstate__(state)
        possible = available_kernels(qweight.scheme, qweight.shape, qweight.device)
        self._install(qweight, self.kernel if self.kernel in possible else possible[0])

    def _set_qweight(self, qweight: QuantizedTensor) -> None:
        """Hold `qweight` (same scheme and shape) with the kernel for its device: the one named at
        construction where it can run there, else the fastest."""
        if isinstance(qweight, KernelQuantizedTensor):
            qweight = qweight.plain()
        possible = available_kernels(qweight.scheme, qweight.shape, qweight.device)
        wanted = getattr(self, "_requested_kernel", "auto")
        self._install(qweight, wanted if wanted in possible else possible[0])

    def _apply(self, fn, *args, **kwargs):
        # .to(device) / .cuda() / .cpu(): the bias moves as a parameter; the quantized weight
        # moves with it and its kernel is chosen again for the new device (a kernel named at
        # construction is kept where it can run there). Dtype conversions (.half()) leave the
        # codes and scales alone: outputs follow the input's dtype.
        super()._apply(fn, *args, **kwargs)
        device = fn(torch.empty(0, device=self._qweight.device)).device
        if device != self._qweight.device:
            qweight = self._qweight
            if isinstance(qweight, KernelQuantizedTensor):
                qweight = qweight.plain()
            self._set_qweight(qweight.to(device))
        return self

    @classmethod
    def empty(cls, scheme, shape, dtype: torch.dtype = torch.float32, bias: bool = False,
              bias_dtype: torch.dtype | None = None, device="meta", kernel: str = "auto") -> QuantLinear:
        """A QuantLinear of this scheme, weight shape [out, in] and dtype whose tensors hold no data
        (on the meta device by default: for a model skeleton); its load_state_dict() fills it and
        picks the kernel for the loaded tensors' device."""
        qweight = QuantizedTensor.empty(scheme, shape, dtype, device=device)
        b = torch.empty(int(shape[0]), dtype=bias_dtype or dtype, device=device) if bias else None
        return cls(qweight, b, kernel=kernel)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme, kernel: str = "auto") -> QuantLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear() takes an nn.Linear, got {type(linear).__name__}")
        with torch.no_grad():
            qweight = quantize(linear.weight.detach(), get_scheme(scheme))
        return cls(qweight, linear.bias, kernel=kernel)

    @classmethod
    def from_quantized(cls, qweight: QuantizedTensor, bias: torch.Tensor | None = None,
                       kernel: str = "auto") -> QuantLinear:
        return cls(qweight, bias, kernel=kernel)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.label!r}, kernel={self.kernel!r}, nbytes={self.nbytes}")

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _compiling():
            if _exporting():
                raise NotImplementedError(
                    "torch.export of a QuantLinear is not supported: its kernel is a handle to this process's "
                    "module, which an exported program could not carry; export the float model, or use "
                    "torch.compile")
            if not (torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))):
                # under torch.compile the layer is one opaque op: no graph break around it
                return quant_linear_op(x, self._handle_tensor, self.out_features)
            return self._forward_eager(x)
        y = self._row_forward(x)
        if y is None:
            y = self._tile_forward(x)
        if y is not None:
            return y
        return self._forward_eager(x)

    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"QuantLinear takes a float tensor, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"input's last dimension must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            return self.reference_forward(x)
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] == 0 or self.out_features == 0:
            y = with_bias(x2d.new_zeros(x2d.shape[0], self.out_features), self.bias, x.dtype)
        else:
            # each kernel returns the finished output: in `dtype`, bias added; the steps around its
            # call are few and, for small inputs, single-threaded (see ops.one_thread_if_small)
            y = self._prepared.forward(x2d, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The slow, obviously-correct result: F.linear with the dequantized weight (and, for
        w8a8, the activations quantized and dequantized by quantize())."""
        act = self.scheme.activations
        if act is not None:
            x = quantize(x.reshape(-1, self.in_features), act).dequantize(x.dtype).reshape(x.shape)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self._qweight.dequantize(x.dtype), bias)


# ---------------------------------------------------------------------------------------------
# torch.compile: a QuantLinear is one custom op (torch.library), opaque to the compiler
# ---------------------------------------------------------------------------------------------
# The kernels are C calls, oneDNN's opaque tensors and per-call Python dispatch: dynamo would
# break the graph at each of them. Instead a compiled model calls fewbits::quant_linear(x, handle)
# for each layer, which runs the layer's eager forward; its fake implementation gives the output's
# shape and dtype, so the graph around the layers (attention, norms, the KV cache) compiles whole.
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def _register(module) -> int:
    handle = next(_next_handle)
    _LAYERS[handle] = module
    return handle


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _compiling() -> bool:
    return bool(_is_compiling is not None and _is_compiling())


def _layer(handle: int):
    module = _LAYERS.get(handle)
    if module is None:
        raise RuntimeError(f"fewbits::quant_linear: the QuantLinear of handle {handle} no longer exists")
    return module


def _exporting() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_exporting") and compiler.is_exporting())


# The op is defined with torch.library.Library rather than the custom_op decorator: that one's
# Python wrapper cost ~7 us per call (211 calls per SmolLM2 token), a plain kernel registration
# ~2.5 us. One implementation for every device (CompositeExplicitAutograd: the op is never
# differentiated, see QuantLinear.forward), a fake one for shapes. A namespace is defined once
# per process, so the registration lives in a module of its own in sys.modules and calls this
# module's implementation through it: a second execution of this file (importlib.reload, IPython
# autoreload) hands it its own implementation, with its own layer registry.
def _quant_linear_impl(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """The forward of x by the QuantLinear whose handle `handle` holds (its out_features given
    for the output's shape), as one op: what compiled models call."""
    m = _layer(int(handle))
    if m.out_features != out_features:
        raise RuntimeError(f"fewbits::quant_linear: handle {int(handle)} has {m.out_features} outputs, not {out_features}")
    y = m._row_forward(x)
    if y is None:
        y = m._tile_forward(x)
    if y is None:
        y = m._forward_eager(x).contiguous()  # the layout the fake promises
    return y.clone() if y.data_ptr() == x.data_ptr() else y  # an op's output never aliases its input


def _op_registration():
    name = "_fewbits_torch_ops"
    reg = sys.modules.get(name)
    if reg is None:
        reg = types.ModuleType(name, "fewbits' torch.library registrations (once per process)")
        reg.impl = None
        reg.lib = torch.library.Library("fewbits", "DEF")
        reg.lib.define("quant_linear(Tensor x, Tensor handle, int out_features) -> Tensor")
        reg.lib.impl("quant_linear", lambda x, handle, out_features: reg.impl(x, handle, out_features),
                     "CompositeExplicitAutograd")

        @torch.library.register_fake("fewbits::quant_linear", lib=reg.lib)
        def _(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], out_features)

        sys.modules[name] = reg
    return reg


_op_registration().impl = _quant_linear_impl
quant_linear_op = torch.ops.fewbits.quant_linear


# ---------------------------------------------------------------------------------------------
# QuantEmbedding
# ---------------------------------------------------------------------------------------------
class QuantEmbedding(_QuantizedWeightViews, nn.Module):
    """nn.Embedding with a quantized table: a lookup decodes only the rows it reads.

    QuantEmbedding.from_embedding(embedding, scheme) quantizes a float table;
    .from_quantized(qweight, embedding=None) wraps a QuantizedTensor [num_embeddings, dim]
    (padding_idx is taken from `embedding`). Rows come out in the table's original dtype,
    equal to F.embedding(ids, qweight.dequantize()).

    scale: a factor every row is multiplied by after the lookup, in the table's dtype, as
    transformers' scaled embeddings (Gemma's Gemma3TextScaledWordEmbedding: sqrt(hidden_size))
    compute it; from_quantized / from_embedding take it from the embedding they replace
    (embedding_scale), so that replacing one never drops its factor.
    """

    def __init__(self, qweight: QuantizedTensor, padding_idx: int | None = None, scale: float | None = None):
        super().__init__()
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale)):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        if not isinstance(qweight, QuantizedTensor):
            raise TypeError(f"qweight must be a QuantizedTensor, got {type(qweight).__name__}")
        if len(qweight.shape) != 2:
            raise ValueError(f"an embedding table is 2-d [num_embeddings, embedding_dim], got {tuple(qweight.shape)}")
        if isinstance(qweight, KernelQuantizedTensor):
            qweight = qweight.plain()
        self.num_embeddings, self.embedding_dim = (int(d) for d in qweight.shape)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} is out of range for {self.num_embeddings} embeddings")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self._set_qweight(qweight)

    def _set_qweight(self, qweight: QuantizedTensor) -> None:
        self._qweight = qweight
        self._decoder = RowDecoder(qweight) if RowDecoder.supports(qweight) else None

    def _apply(self, fn, *args, **kwargs):
        # .to(device) / .cuda() / .cpu() move the quantized table (see QuantLinear._apply)
        super()._apply(fn, *args, **kwargs)
        device = fn(torch.empty(0, device=self._qweight.device)).device
        if device != self._qweight.device:
            self._set_qweight(self._qweight.to(device))
        return self

    @classmethod
    def empty(cls, scheme, shape, dtype: torch.dtype = torch.float32, padding_idx: int | None = None,
              device="meta", scale: float | None = None) -> QuantEmbedding:
        """A QuantEmbedding of this scheme, table shape [num_embeddings, dim] and dtype whose
        tensors hold no data (meta by default), for load_state_dict() to fill."""
        return cls(QuantizedTensor.empty(scheme, shape, dtype, device=device), padding_idx, scale)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, scheme) -> QuantEmbedding:
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"from_embedding() takes an nn.Embedding, got {type(embedding).__name__}")
        with torch.no_grad():
            qweight = quantize(embedding.weight.detach(), get_scheme(scheme))
        return cls.from_quantized(qweight, embedding)

    @classmethod
    def from_quantized(cls, qweight: QuantizedTensor, embedding: nn.Embedding | None = None) -> QuantEmbedding:
        padding_idx = None
        if embedding is not None:
            if getattr(embedding, "max_norm", None) is not None:
                raise ValueError("an embedding with max_norm renormalizes its rows in place; a quantized table cannot")
            padding_idx = embedding.padding_idx
        return cls(qweight, padding_idx, embedding_scale(embedding) if embedding is not None else None)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        scale = f", scale={self.scale!r}" if self.scale is not None else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}{scale}, scheme={self.scheme.label!r}, "
                f"nbytes={self.nbytes}")

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return rows
        # transformers: embedding(ids) * embed_scale.to(weight.dtype), the buffer a float32 tensor
        return rows * torch.tensor(self.scale, dtype=torch.float32).to(rows.dtype)

    def _check(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                     torch.int8, torch.uint8):
            raise TypeError(f"QuantEmbedding takes an integer tensor of indices, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"index out of range: indices must lie in 0..{self.num_embeddings - 1}, "
                             f"got {int(flat.min())}..{int(flat.max())}")
        return flat

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = self._check(ids)
        if self._decoder is None:
            rows = self._qweight.dequantize(torch.float32)[flat]
        else:
            scales, zps = self._decoder.params()
            rows = self._decoder.gather(flat, scales, zps)
        return self._scaled(rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim))

    def reference_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The slow, obviously-correct result: F.embedding on the whole dequantized table (times
        the scale)."""
        self._check(ids)
        return self._scaled(F.embedding(ids.to(torch.int64), self._qweight.dequantize()))


def embedding_scale(embedding: nn.Module) -> float | None:
    """The factor a transformers embedding multiplies its rows by (Gemma's scaled embeddings:
    `scalar_embed_scale`, or the `embed_scale` buffer), None for a plain nn.Embedding."""
    scale = getattr(embedding, "scalar_embed_scale", None)
    if scale is None:
        buf = getattr(embedding, "embed_scale", None)
        if isinstance(buf, torch.Tensor) and buf.numel() == 1 and buf.device.type != "meta":
            scale = float(buf)
        elif isinstance(buf, (int, float)) and not isinstance(buf, bool):
            scale = float(buf)
    return None if scale is None or float(scale) == 1.0 else float(scale)


__all__ = ["QuantLinear", "QuantEmbedding", "KernelQuantizedTensor", "available_kernels", "KERNELS"]
