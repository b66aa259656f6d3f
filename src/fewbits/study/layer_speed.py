"""Speed of quantized Linear layers beside the tools a user would pick instead, in one run.

The one place that builds the peers (bitsandbytes, torchao, torch's quantize_dynamic) and
fewbits' variants over the same float layers, and times them round-robin, so that every variant
sees the same machine load. benchmarks/bench_linear.py, `fewbits bench` and the study's speed
part all call it.

    stack = linear_stack(4096, layers=1)
    res = layer_speed(stack, batches=(1, 64), fewbits=BENCH_FEWBITS, peers=BENCH_PEERS)
    res["batches"]["1"]["rows"]        # label, kind, kernel, median_ms, x_fp32, rel_err, ...
    res["not_run"]                     # [{"label", "reason"}]: not installed, or fails here

Each peer runs at its documented fast path for inference on a CPU:
  bitsandbytes  Linear4bit (nf4, fp4) and Linear8bitLt (threshold 6.0) in eval mode under
                torch.inference_mode(): Linear4bit then repacks its weight for bitsandbytes' fused
                AVX512-BF16 CPU kernel (in training mode, or with gradients, it dequantizes the
                whole weight on every call instead)
  torchao       quantize_(model in bfloat16, config), then torch.compile, as torchao documents it
                (its CPU kernels take bfloat16 activations); every config in TORCHAO_CONFIGS is
                tried, and one that does not build or run on this machine is reported with the
                first line of its error
  torch         torch.ao.quantization.quantize_dynamic(qint8) (fbgemm), in float32
Inputs are float32 for every variant; a variant that computes in bfloat16 converts inside its
timed call (and returns float32), as it would inside a float32 model.

Columns: median and minimum ms per forward of the whole stack; `x_fp32` is fp32's time over the
variant's (from `stat`); `bytes` counts the weights as held (codes, scales, kernel-side tensors;
biases excluded); `rel_err` is ||y - y_fp32|| / ||y_fp32||; `ref_err` (fewbits' variants) is the
same against QuantLinear.reference_forward, F.linear(x, qweight.dequantize(), bias) (for w8a8,
the activations quantized and dequantized too): what the fast path computes against what it
claims to equal.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels import native
from ..quant.modules import PANEL_KERNELS, QuantLinear, available_kernels
from ..quant.scheme import get_scheme


# ---------------------------------------------------------------------------------------------
# the float layers
# ---------------------------------------------------------------------------------------------
class _Block(nn.Module):
    """The seven Linears of one Llama decoder block, in the order a forward runs them (attention
    and the MLP's nonlinearity left out: only the matmuls' shapes matter here)."""

    def __init__(self, hidden: int, intermediate: int, kv: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, kv), nn.Linear(hidden, kv)
        self.o_proj = nn.Linear(hidden, hidden)
        self.gate_proj, self.up_proj = nn.Linear(hidden, intermediate), nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)

    def forward(self, h):
        k, v = self.k_proj(h), self.v_proj(h)
        h = h + self.o_proj(self.q_proj(h))
        h = h + self.down_proj(self.gate_proj(h) + self.up_proj(h))
        return torch.cat([h, k, v], dim=-1)


class _Blocks(nn.Module):
    def __init__(self, blocks: int, hidden: int, intermediate: int, kv: int):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(hidden, intermediate, kv) for _ in range(blocks))
        self.hidden = hidden

    def forward(self, h):
        for b in self.blocks[:-1]:
            h = b(h)[..., :self.hidden]
        return self.blocks[-1](h)


@dataclass(frozen=True)
class Stack:
    """Float layers to quantize and time: `module` maps [batch, in_features] float32 inputs."""
    name: str
    description: str
    module: nn.Module
    in_features: int

    @property
    def linears(self) -> list[nn.Linear]:
        return [m for m in self.module.modules() if isinstance(m, nn.Linear)]

    @property
    def fp32_bytes(self) -> int:
        return sum(m.weight.nbytes for m in self.linears)


def linear_stack(dim: int = 4096, layers: int = 4, seed: int = 0) -> Stack:
    """`layers` x Linear(dim, dim), one after the other."""
    torch.manual_seed(seed)
    mod = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)]).eval()
    return Stack(f"{layers}x{dim}", f"{layers} x Linear({dim}, {dim})", mod, dim)


SMOLLM2_SHAPES = {"hidden": 576, "intermediate": 1536, "kv": 192}  # SmolLM2-135M's config.json


def smollm2_stack(blocks: int = 8, seed: int = 0) -> Stack:
    """`blocks` of SmolLM2-135M's decoder Linears (q/o 576x576, k/v 192x576, gate/up 1536x576,
    down 576x1536): 14 MB of float32 weights a block, so that 8 of them come from memory, not
    from a cache, as in the model's 30."""
    torch.manual_seed(seed)
    s = SMOLLM2_SHAPES
    mod = _Blocks(blocks, s["hidden"], s["intermediate"], s["kv"]).eval()
    return Stack(f"smollm2x{blocks}", f"{blocks} x SmolLM2-135M decoder block Linears "
                 f"(hidden {s['hidden']}, intermediate {s['intermediate']}, k/v {s['kv']})", mod, s["hidden"])


def _replace_linears(module: nn.Module, convert: Callable[[str, nn.Linear], nn.Module]) -> nn.Module:
    """A deep copy of `module` with each nn.Linear (by its name in module) replaced by
    convert(name, linear)."""
    out = copy.deepcopy(module)
    for name, child in list(out.named_modules()):
        for cname, c in list(child.named_children()):
            if isinstance(c, nn.Linear):
                setattr(child, cname, convert(f"{name}.{cname}" if name else cname, c))
    return out


# ---------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------
@dataclass
class Variant:
    """A built variant: `module` maps float32 inputs to float32 outputs."""
    label: str
    kind: str           # "fewbits" or the peer's package
    what: str
    module: Callable
    nbytes: int
    kernel: str
    reference: Callable | None = None   # fewbits: the stack through QuantLinear.reference_forward


class _InDtype(nn.Module):
    """Runs `inner` on inputs cast to `dtype`; returns float32."""

    def __init__(self, inner, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        return self.inner(x.to(self.dtype)).float()


class _ReferencePath(nn.Module):
    def __init__(self, ql: QuantLinear):
        super().__init__()
        self.ql = ql

    def forward(self, x):
        return self.ql.reference_forward(x)


class _NativeOff(nn.Module):
    """fewbits' fused C kernels turned off (fewbits.kernels.native): the steps around the GEMM
    run as torch ops, as where no C compiler is found."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with native.turned_off():
            return self.inner(x)


# label -> (scheme, forced kernel or None); "fp32" is the float stack itself. What each scheme is
# comes from QuantScheme.describe().
FEWBITS_VARIANTS: dict[str, tuple[str | None, str | None]] = {
    "fp32": (None, None),
    "bf16": ("bf16", None),
    "w8a8": ("w8a8", None),
    "w8a8 oneDNN": ("w8a8", "w8a8_onednn"),    # oneDNN's prepacked int8 GEMM (auto's pick without VNNI panels)
    "w8a8 torch ops": ("w8a8", "torch-ops"),   # oneDNN's GEMM, the steps around it as torch ops, not C
    "w8a8 _int_mm": ("w8a8", "w8a8_int_mm"),
    "int8": ("int8", None),
    "int4 g128": ("int4", None),
    "int4 g32": ("int4_g32", None),
    "w4a8": ("w4a8", None),                    # Q4_0's weights x int8 activations per block of 32
    "nf4": ("nf4", None),
    "mxfp4": ("mxfp4", None),
    "nvfp4": ("nvfp4", None),
    "fp4": ("fp4", None),
    "fp8": ("fp8", None),
}
BENCH_FEWBITS = ("fp32", "bf16", "int8", "w8a8", "int4 g128", "w4a8", "nf4")
LOOKUP_4BIT = ("nf4", "mxfp4", "nvfp4", "fp4")  # the 4-bit lookup formats of issue 15
WEIGHT_ONLY_LOWBIT = ("int8", "int4 g128", "int4 g32", "nf4", "mxfp4", "nvfp4", "fp4")


def build_fewbits(stack: Stack, label: str) -> Variant:
    scheme, kernel = FEWBITS_VARIANTS[label]
    if scheme is None:
        return Variant(label, "fewbits", "the float layers (MKL sgemm / sgemv)", stack.module, stack.fp32_bytes,
                       "fp32 (mkl)")
    what = get_scheme(scheme).describe() + (", fused C kernels off" if kernel == "torch-ops" else "")
    qls: dict[str, QuantLinear] = {}

    def convert(name, m):
        forced = kernel if kernel not in (None, "torch-ops") else "auto"
        if kernel == "torch-ops":  # a kernel whose GEMM is torch's (the panel kernels have no torch-op form)
            forced = next(k for k in available_kernels(scheme, tuple(m.weight.shape)) if k not in PANEL_KERNELS)
        qls[name] = QuantLinear.from_linear(m, scheme, kernel=forced)
        return qls[name]

    mod = _replace_linears(stack.module, convert).eval()
    ref = _replace_linears(stack.module, lambda name, m: _ReferencePath(qls[name])).eval()  # the same QuantLinears
    if kernel == "torch-ops":
        mod = _NativeOff(mod)
    kernels = sorted({q.kernel for q in qls.values()})
    return Variant(label, "fewbits", what, mod, sum(q.nbytes for q in qls.values()), "+".join(kernels), ref)


@dataclass(frozen=True)
class Peer:
    """A tool a user would pick instead. build(stack) -> (module, weight bytes, kernel)."""
    label: str
    package: str      # the module to import; missing -> "not installed"
    pip: str          # what to install
    what: str
    build: Callable[[Stack], tuple[Callable, int, str]]
    default: bool = True  # False: runs here, but through an unfused reference path (slow); timed on request


@contextlib.contextmanager
def _quiet_imports():
    """torchao and bitsandbytes log, at import, each optional CUDA library they cannot load (and
    torch a deprecation about torchao's enums); which kernel runs is shown per variant instead."""
    loggers = [logging.getLogger(n) for n in ("torchao", "bitsandbytes", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _tensor_bytes(t) -> int:
    """Bytes of a tensor, summed over the inner tensors of a tensor subclass (torchao's)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _build_quantize_dynamic(stack: Stack):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(stack.module), {nn.Linear}, dtype=torch.qint8)
    # fbgemm holds one prepacked int8 copy of each weight (+ per-tensor scale and zero point)
    return q, sum(m.weight.numel() for m in stack.linears), f"{torch.backends.quantized.engine} (qint8)"


def _bnb_4bit_kernel() -> str:
    """Which CPU path Linear4bit's eval forward takes here."""
    try:
        from bitsandbytes.backends.cpu import ops as cpu_ops
    except ImportError:
        return "bnb cpu"
    if not hasattr(cpu_ops, "gemm_4bit_forward_kernel"):
        return "dequant + matmul (no AVX512-BF16)"
    if cpu_ops.gemm_4bit_forward_kernel is None:
        return "bnb C gemv_4bit (bf16)"
    return "kernels-community gemm_4bit"


def _bnb_4bit(quant_type: str):
    def build(stack: Stack):
        with _quiet_imports():
            import bitsandbytes as bnb

        def convert(name, m):
            q = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=m.bias is not None, quant_type=quant_type,
                                  compute_dtype=torch.bfloat16)
            q.load_state_dict(m.state_dict())
            return q.to("cpu").eval()

        mod = _replace_linears(stack.module, convert).eval()
        held = sum(q.weight.nbytes + q.weight.quant_state.absmax.nbytes
                   for q in mod.modules() if isinstance(q, bnb.nn.Linear4bit))
        return mod, held, _bnb_4bit_kernel()
    return build


class _CastNotice(logging.Filter):
    def filter(self, record):
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


def _build_bnb_int8(stack: Stack):
    with _quiet_imports():
        import bitsandbytes as bnb
    # logged on every call; the kernel column says it once
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _CastNotice) for f in logger.filters):
        logger.addFilter(_CastNotice())

    def convert(name, m):
        q = bnb.nn.Linear8bitLt(m.in_features, m.out_features, bias=m.bias is not None, has_fp16_weights=False,
                                threshold=6.0)
        q.load_state_dict(m.state_dict())
        return q.to("cpu").eval()

    mod = _replace_linears(stack.module, convert).eval()
    held = 0
    for q in mod.modules():
        if isinstance(q, bnb.nn.Linear8bitLt):
            scb = getattr(q.weight, "SCB", None)
            held += q.weight.nbytes + (scb.nbytes if scb is not None else 0)
    return mod, held, "bnb int8 matmul (fp16 act)"


def _torchao_config(name: str):
    """torchao's config by name; the CPU int4 one lives in torchao.prototype in 0.18."""
    with _quiet_imports():
        if name == "PrototypeInt4WeightOnlyConfig" or name == "Int8DynamicActivationInt4WeightConfig":
            mod = importlib.import_module("torchao.prototype.quantization.int4.inference_workflow")
        else:
            mod = importlib.import_module("torchao.quantization")
    return getattr(mod, name)


def _fitting_group(stack: Stack, wanted: int) -> int:
    """The largest group size <= wanted (a power of two, at least 32) that divides every layer's
    in_features: torchao leaves a layer whose width it does not divide unquantized."""
    g = wanted
    while g > 32 and any(m.in_features % g for m in stack.linears):
        g //= 2
    return g


def _torchao(config: str, kwargs: dict, compile_: bool = True):
    def build(stack: Stack):
        kw = dict(kwargs)
        note = ""
        if "group_size" in kw:
            g = _fitting_group(stack, kw["group_size"])
            if g != kw["group_size"]:
                note = f" g{g}"  # (not every in_features is a multiple of the configured group size)
            kw["group_size"] = g
        with _quiet_imports():
            from torchao.quantization import quantize_
            cfg = _torchao_config(config)(**kw)
            mod = copy.deepcopy(stack.module).to(torch.bfloat16)
            quantize_(mod, cfg)
        linears = [m for m in mod.modules() if isinstance(m, nn.Linear)]
        held = sum(_tensor_bytes(m.weight) for m in linears)
        plain = sum(type(m.weight) in (nn.Parameter, torch.Tensor) for m in linears)
        kernel = "+".join(sorted({type(m.weight).__name__ for m in linears
                                  if type(m.weight) not in (nn.Parameter, torch.Tensor)})) + note
        if plain:
            kernel += f", {plain} of {len(linears)} layers left in bf16"
        if compile_:
            # said once per tensor subclass when compiling: about caching compiled graphs across runs
            warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
            # one graph per variant and batch shape: more than dynamo's default limit in one run
            # (the names before torch 2.6: cache_size_limit, accumulated_cache_size_limit)
            dyn = torch._dynamo.config
            for name, at_least in (("recompile_limit", 64), ("cache_size_limit", 64),
                                   ("accumulated_recompile_limit", 1024), ("accumulated_cache_size_limit", 1024)):
                if hasattr(dyn, name):
                    setattr(dyn, name, max(getattr(dyn, name), at_least))
            mod = torch.compile(mod)
            kernel += ", compiled"
        return _InDtype(mod, torch.bfloat16), held, kernel
    return build


def _tao(label, config, what, compile_=True, default=True, **kwargs) -> Peer:
    return Peer(label, "torchao", "torchao", f"{config}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): {what}",
                _torchao(config, kwargs, compile_), default)


# Every torchao 0.18 config that could run a Linear on a CPU. One that does not build or run
# here says so (first line of its error) in the report; none is left out by hand.
TORCHAO_CONFIGS = (
    _tao("torchao int8 wo", "Int8WeightOnlyConfig", "int8 per-row weights, bf16 activations"),
    _tao("torchao int8 dyn", "Int8DynamicActivationInt8WeightConfig",
         "int8 per-row weights, dynamic per-token int8 activations (torch._int_mm)"),
    _tao("torchao int4 wo (cpu)", "PrototypeInt4WeightOnlyConfig",
         "int4 groups of 128, Int4OpaqueTensor (aten._weight_int4pack_mm_for_cpu)", group_size=128),
    _tao("torchao int4 wo (plain)", "Int4WeightOnlyConfig", "int4 groups of 128, default packing",
         group_size=128),
    _tao("torchao int4 wo (tile)", "Int4WeightOnlyConfig", "int4 groups of 128, tinygemm tile packing",
         group_size=128, int4_packing_format="tile_packed_to_4d"),
    _tao("torchao da8w4 (cpu)", "Int8DynamicActivationInt4WeightConfig",
         "int4 weights, dynamic int8 activations (torchao's da8w4 CPU kernel)"),
    _tao("torchao w4a8 intx (packed)", "Int8DynamicActivationIntxWeightConfig",
         "int4 groups of 32, dynamic int8 activations, torchao's packed lowbit kernels",
         weight_dtype=torch.int4, intx_packing_format="opaque_torchao_auto"),
    _tao("torchao w4a8 intx (unpacked)", "Int8DynamicActivationIntxWeightConfig",
         "int4 groups of 32 held as int8, dynamic int8 activations (torchao's reference path: dequantize, "
         "then matmul)", default=False, weight_dtype=torch.int4),
    _tao("torchao fp8 wo", "Float8WeightOnlyConfig", "fp8 e4m3 weights (dequantized to bf16 per call on a CPU)",
         default=False),
    _tao("torchao fp8 dyn", "Float8DynamicActivationFloat8WeightConfig", "fp8 e4m3 weights and activations"),
)

PEERS: tuple[Peer, ...] = (
    Peer("quantize_dynamic", "torch", "torch", "torch.ao.quantization.quantize_dynamic(qint8), float32",
         _build_quantize_dynamic),
    Peer("bnb nf4", "bitsandbytes", "bitsandbytes", "bnb.nn.Linear4bit(quant_type='nf4'), eval", _bnb_4bit("nf4")),
    Peer("bnb fp4", "bitsandbytes", "bitsandbytes", "bnb.nn.Linear4bit(quant_type='fp4'), eval", _bnb_4bit("fp4")),
    Peer("bnb int8", "bitsandbytes", "bitsandbytes", "bnb.nn.Linear8bitLt(has_fp16_weights=False, threshold=6.0), "
         "eval", _build_bnb_int8),
) + TORCHAO_CONFIGS
PEERS_BY_LABEL = {p.label: p for p in PEERS}
BENCH_PEERS = ("quantize_dynamic", "bnb nf4", "torchao int8 wo", "torchao int8 dyn", "torchao int4 wo (cpu)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def build_peer(stack: Stack, peer: Peer) -> Variant:
    """The peer over `stack`, or RuntimeError("not installed (...)") / RuntimeError("does not
    run here: <first line of its error>")."""
    if importlib.util.find_spec(peer.package) is None:
        raise RuntimeError(f"not installed (pip install {peer.pip})")
    try:
        mod, nbytes, kernel = peer.build(stack)
        with torch.inference_mode():
            mod(torch.zeros(1, stack.in_features))  # a build can succeed and the first call fail
    except Exception as exc:  # noqa: BLE001  (a peer's own failure, reported, never fatal)
        raise RuntimeError(f"does not run here: {_first_line(exc)}") from exc
    return Variant(peer.label, peer.package, peer.what, mod, nbytes, kernel)


def build_variants(stack: Stack, fewbits: Sequence[str] = BENCH_FEWBITS, peers: Sequence[str | Peer] = BENCH_PEERS,
                   progress: Callable[[str], None] | None = None) -> tuple[dict[str, Variant], list[dict]]:
    """({label: Variant}, not_run: [{"label", "kind", "reason"}]). fp32 always comes first."""
    say = progress or (lambda m: None)
    built: dict[str, Variant] = {}
    not_run: list[dict] = []
    for label in ["fp32"] + [f for f in fewbits if f != "fp32"]:
        if label not in FEWBITS_VARIANTS:
            raise ValueError(f"unknown fewbits variant {label!r}; choose from {', '.join(FEWBITS_VARIANTS)}")
        t = time.perf_counter()
        built[label] = build_fewbits(stack, label)
        say(f"built {label} ({built[label].kernel}) in {time.perf_counter() - t:.1f} s")
    for p in peers:
        peer = p if isinstance(p, Peer) else PEERS_BY_LABEL.get(p)
        if peer is None:
            raise ValueError(f"unknown peer {p!r}; choose from {', '.join(PEERS_BY_LABEL)}")
        t = time.perf_counter()
        try:
            built[peer.label] = build_peer(stack, peer)
        except RuntimeError as exc:
            not_run.append({"label": peer.label, "kind": peer.package, "what": peer.what, "reason": str(exc)})
            say(f"{peer.label}: {exc}")
            continue
        say(f"built {peer.label} ({built[peer.label].kernel}) in {time.perf_counter() - t:.1f} s")
    return built, not_run


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@dataclass
class Cell:
    """One batch size at one thread count: samples (seconds) per label, errors, failures."""
    batch: int
    threads: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    rel_err: dict[str, float] = field(default_factory=dict)
    ref_err: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def ms(self, label: str, stat: str = "median") -> float:
        s = self.samples[label]
        return (statistics.median(s) if stat == "median" else min(s)) * 1e3

    def ratio(self, label: str, over: str = "fp32", stat: str = "median") -> float:
        """How many times faster `label` runs than `over` (over's time / label's)."""
        return self.ms(over, stat) / self.ms(label, stat)


def errors(built: dict[str, Variant], x: torch.Tensor) -> tuple[dict, dict, dict]:
    """(rel_err vs fp32, ref_err vs the variant's reference, failed: {label: reason}) at x."""
    rel, ref_err, failed = {}, {}, {}
    with torch.inference_mode():
        y32 = built["fp32"].module(x).float()
        for label, v in built.items():
            try:
                rel[label] = _rel(v.module(x), y32)
                if v.reference is not None:
                    ref_err[label] = _rel(v.module(x), v.reference(x).float())
            except Exception as exc:  # noqa: BLE001
                failed[label] = f"fails at batch {x.shape[0]}: {_first_line(exc)}"
    return rel, ref_err, failed


def measure(built: dict[str, Variant], x: torch.Tensor, *, warmup: int = 2, min_rounds: int = 5,
            max_rounds: int = 15, budget_s: float = 10.0, errs=None) -> Cell:
    """Round-robin timing of every variant at input x: `warmup` rounds, then rounds (the order
    rotating by one each round) until min_rounds are done and budget_s has passed, at most
    max_rounds. errs: errors() already computed for this x (they do not depend on threads)."""
    rel, ref_err, failed = errs if errs is not None else errors(built, x)
    labels = [k for k in built if k not in failed]
    cell = Cell(int(x.shape[0]), torch.get_num_threads(), {k: [] for k in labels}, rel, ref_err, dict(failed))
    mods = [built[k].module for k in labels]
    with torch.inference_mode():
        for _ in range(warmup):
            for m in mods:
                m(x)
        start = time.perf_counter()
        r = 0
        while r < max_rounds and (r < min_rounds or time.perf_counter() - start < budget_s):
            for i in range(len(labels)):
                j = (i + r) % len(labels)
                t = time.perf_counter()
                mods[j](x)
                cell.samples[labels[j]].append(time.perf_counter() - t)
            r += 1
    return cell


def batch_input(batch: int, in_features: int) -> torch.Tensor:
    return torch.randn(batch, in_features, generator=torch.Generator().manual_seed(batch))


def cell_rows(built: dict[str, Variant], cell: Cell, stat: str = "median") -> list[dict]:
    fp32_bytes = built["fp32"].nbytes
    rows = []
    for label, v in built.items():
        row = {"label": label, "kind": v.kind, "kernel": v.kernel, "bytes": v.nbytes,
               "bytes_vs_fp32": v.nbytes / fp32_bytes, "rel_err": cell.rel_err.get(label),
               "ref_err": cell.ref_err.get(label)}
        if label in cell.failed:
            row.update(median_ms=None, min_ms=None, x_fp32=None, failed=cell.failed[label])
        else:
            row.update(median_ms=cell.ms(label), min_ms=cell.ms(label, "min"), x_fp32=cell.ratio(label, stat=stat),
                       rounds=len(cell.samples[label]))
        rows.append(row)
    return rows


def layer_speed(stack: Stack | None = None, batches: Sequence[int] = (1, 64), fewbits: Sequence[str] = BENCH_FEWBITS,
                peers: Sequence[str | Peer] = BENCH_PEERS, *, warmup: int = 2, min_rounds: int = 5,
                max_rounds: int = 15, budget_s: float = 2.0, stat: str = "median",
                progress: Callable[[str], None] | None = None) -> dict:
    """Layer speed of fewbits' variants beside the peers at each batch size, at the current
    thread count, in one interleaved run: {"stack", "threads", "stat", "variants", "not_run",
    "batches": {str(batch): {"rows": [...]}}, "seconds"}. Peers that are not installed or do
    not run here are listed in not_run with the reason; a variant that fails at one batch size
    has a row with `failed`."""
    t0 = time.perf_counter()
    stack = stack or linear_stack(4096, layers=1)
    built, not_run = build_variants(stack, fewbits, peers, progress)
    out = {"stack": stack.description, "threads": torch.get_num_threads(), "stat": stat,
           "variants": [{"label": v.label, "kind": v.kind, "what": v.what, "kernel": v.kernel, "bytes": v.nbytes}
                        for v in built.values()],
           "not_run": not_run, "batches": {}}
    for b in batches:
        if progress:
            progress(f"layer speed at batch {b}")
        cell = measure(built, batch_input(b, stack.in_features), warmup=warmup, min_rounds=min_rounds,
                       max_rounds=max_rounds, budget_s=budget_s)
        out["batches"][str(b)] = {"rows": cell_rows(built, cell, stat)}
    out["seconds"] = time.perf_counter() - t0
    return out


def layer_speed_rows(result: dict) -> list[dict]:
    """One flat row per (batch, variant), then one per peer that did not run: for a table."""
    rows = []
    for b, cell in result["batches"].items():
        for r in cell["rows"]:
            rows.append(dict(r, batch=int(b)))
    for n in result["not_run"]:
        rows.append({"label": n["label"], "kind": n["kind"], "batch": None, "kernel": n["reason"]})
    return rows


def layer_speed_text(result: dict, render_table: Callable) -> str:
    """The result as a table of ratios per batch, and the peers that did not run."""
    labels = [v["label"] for v in result["variants"]]
    kinds = {v["label"]: v["kind"] for v in result["variants"]}
    kernels = {v["label"]: v["kernel"] for v in result["variants"]}
    batches = list(result["batches"])
    by = {b: {r["label"]: r for r in result["batches"][b]["rows"]} for b in batches}
    rows = []
    for label in labels:
        row = [label, kinds[label], kernels[label]]
        for b in batches:
            r = by[b][label]
            row += ["fails" if r["median_ms"] is None else f"{r['median_ms']:.3g}",
                    "—" if r["x_fp32"] is None else f"{r['x_fp32']:.2f}"]
        r0 = by[batches[0]][label] if batches else {}
        row.append("—" if r0.get("rel_err") is None or label == "fp32" else f"{r0['rel_err']:.3g}")
        rows.append(row)
    headers = ["variant", "from", "kernel"] + [h for b in batches for h in (f"b{b} ms", f"b{b} x fp32")] + ["rel err"]
    lines = [f"layer speed: {result['stack']}, {result['threads']} threads, {result['stat']} ms per forward, "
             f"x fp32 = fp32's time / the variant's (one interleaved run):",
             render_table(headers, rows, right=set(range(3, 4 + 2 * len(batches))))]
    lines += [f"  {n['label']}: {n['reason']}" for n in result["not_run"]]
    return "\n".join(lines)


__all__ = ["Stack", "linear_stack", "smollm2_stack", "Variant", "Peer", "PEERS", "PEERS_BY_LABEL",
           "TORCHAO_CONFIGS", "FEWBITS_VARIANTS", "BENCH_FEWBITS", "BENCH_PEERS", "LOOKUP_4BIT",
           "WEIGHT_ONLY_LOWBIT", "build_fewbits", "build_peer", "build_variants", "Cell", "errors", "measure",
           "batch_input", "cell_rows", "layer_speed", "layer_speed_rows", "layer_speed_text"]
