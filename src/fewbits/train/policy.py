"""Precision policies: which number format each tensor role of training uses, and how it rounds.

A Policy is plain data. The engine (engine.py) reads it to decide what runs natively, what is
emulated through fb.round, where master weights live and how the optimizer states are stored;
the memory estimator reads the same attributes to predict bytes.

Roles:
  forward          matmul inputs in the forward pass (activations and weights as the GEMM sees them)
  backward         gradients entering the backward GEMMs (the gradient of each matmul output)
  activations      tensors between ops (matmul outputs, module outputs); also the compute dtype
  weights          the stored (working) copy of the parameters that the forward pass reads
  master           the copy the optimizer updates (None: updates go straight into `weights`)
  optimizer_states the optimizer's per-parameter state tensors ("int8_blockwise": 8-bit codes
                   with one fp32 scale per block of 256)
  grad_accum       where gradients are summed across micro-batches before the update
  comm             what gradients travel in between processes
  grad_weight      the format of the weight-gradient GEMM's inputs (None: forward's for the
                   activations, backward's for the gradients, as for the other GEMMs; a format
                   equal to `activations`: that GEMM runs in the compute dtype)

`matmuls` says which matmuls take the forward / backward formats: "all" (every matmul the model
calls, attention included) or "linear" (F.linear only, i.e. nn.Linear layers; the others run in
the activations' format). Linear layers whose formats have GEMMs of their own (int8; FP8 on
hardware that has FP8 GEMMs, or always with row-wise scaling) run their three GEMMs in
train/gemm.py, natively where the hardware does it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

from ..formats import MODES, get_format, normalize_name

LOSS_SCALING = ("none", "static", "dynamic")
FP8_RECIPES = ("none", "current", "delayed", "mx", "rowwise")
MATMULS = ("all", "linear")
ROWWISE_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
UPDATE_MODES = ("nearest", "stochastic", "kahan")
BLOCKWISE_STATE_FORMATS = ("int8_blockwise",)
DEFAULT_KEEP_FP32 = ("*norm", "*norm?d", "*softmax", "*loss")


@dataclass(frozen=True)
class Policy:
    """Formats and rounding for each tensor role of a training step (see the module docstring).

    Format fields hold fewbits format names (anything `fb.get_format` accepts); the constructor
    normalises them to canonical names ("e4m3" -> "fp8_e4m3") and rejects unknown ones.
    """

    name: str = "custom"
    forward: str = "fp32"
    backward: str = "fp32"
    activations: str = "fp32"
    weights: str = "fp32"
    master: str | None = None
    optimizer_states: str = "fp32"
    grad_accum: str = "fp32"
    comm: str = "fp32"
    # rounding per role: a fewbits mode (nearest_even, stochastic, ...)
    forward_rounding: str = "nearest_even"
    backward_rounding: str = "nearest_even"
    state_rounding: str = "nearest_even"
    # how an update lands in the stored weights when there is no master copy:
    # nearest (plain rounding), stochastic (unbiased rounding), kahan (compensated summation)
    update_rounding: str = "nearest"
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    # FP8-style scaling of the forward and backward casts: none, current (per tensor, from this
    # tensor's amax), delayed (per tensor, from an amax history), mx (per block of mx_block values
    # along the last dimension, with a power-of-two E8M0 scale), rowwise (each GEMM operand per
    # row along its reduction dimension: linear layers only; the scaling int8 formats take)
    fp8_recipe: str = "none"
    matmuls: str = "all"
    grad_weight: str | None = None
    amax_history_len: int = 16
    fp8_margin: int = 0
    mx_block: int = 32
    loss_scaling: str = "none"
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    skip_nonfinite: bool = True

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        for role in ("forward", "backward", "activations", "weights", "grad_accum", "comm"):
            set_(role, _canonical(getattr(self, role), role))
        if self.master is not None:
            set_("master", _canonical(self.master, "master"))
        if self.grad_weight is not None:
            set_("grad_weight", _canonical(self.grad_weight, "grad_weight"))
        if self.optimizer_states not in BLOCKWISE_STATE_FORMATS:
            set_("optimizer_states", _canonical(self.optimizer_states, "optimizer_states"))
        for role in ("forward_rounding", "backward_rounding", "state_rounding"):
            if getattr(self, role) not in MODES:
                raise ValueError(f"{role}={getattr(self, role)!r}: choose one of {', '.join(MODES)}")
        _choice("update_rounding", self.update_rounding, UPDATE_MODES)
        _choice("loss_scaling", self.loss_scaling, LOSS_SCALING)
        _choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _choice("matmuls", self.matmuls, MATMULS)
        self._check_gemm_formats()
        if isinstance(self.keep_fp32, str):
            set_("keep_fp32", (self.keep_fp32,))
        set_("keep_fp32", tuple(self.keep_fp32))
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.mx_block < 1:
            raise ValueError(f"mx_block must be >= 1, got {self.mx_block}")
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError("loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             "and growth_interval >= 1")
        if self.master is None and self.update_rounding != "nearest" and self.weights == "fp32":
            raise ValueError("stochastic or kahan updates need low-precision weights (weights='fp32' here)")

    def _check_gemm_formats(self) -> None:
        ints = [r for r in ("forward", "backward") if get_format(getattr(self, r)).kind == "int"]
        if ints and (len(ints) < 2 or self.forward != "int8" or self.backward != "int8"):
            raise ValueError("integer GEMMs are int8 in both the forward and the backward pass "
                             f"(forward={self.forward!r}, backward={self.backward!r})")
        if ints and self.fp8_recipe != "rowwise":
            raise ValueError("int8 GEMMs take row-wise scales: fp8_recipe='rowwise'")
        if self.fp8_recipe == "rowwise":
            if self.matmuls != "linear":
                raise ValueError("row-wise scaling is defined for the linear layers' GEMMs: matmuls='linear'")
            bad = [r for r in ("forward", "backward") if getattr(self, r) not in ROWWISE_FORMATS]
            if bad:
                raise ValueError(f"row-wise scaling takes {', '.join(ROWWISE_FORMATS)}; "
                                 f"{bad[0]}={getattr(self, bad[0])!r}")
        if self.grad_weight is not None and self.fp8_recipe != "rowwise":
            raise ValueError("grad_weight is a choice of the linear layers' own GEMMs (fp8_recipe='rowwise', int8); "
                             "per-tensor and MX recipes round the GEMM inputs once for all three GEMMs")
        if self.grad_weight is not None and self.grad_weight != self.activations:
            raise ValueError(f"grad_weight is None (the GEMM formats) or the activations' format "
                             f"{self.activations!r}, got {self.grad_weight!r}")

    # -----------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Policy:
        """A named policy: fp32, tf32, bf16-mixed, fp16-mixed, fp8-hybrid, fp8-hybrid-current,
        fp8-rowwise, fp8-hybrid-unscaled, mxfp8, int8-mixed, int8-mixed-gw8, bf16-pure,
        bf16-pure-sr, bf16-pure-kahan, fp16-mixed-unscaled, bf16-mixed-8bit-adam. Spelled as format
        names are (fewbits.formats.normalize_name: case, spaces, '_', '-' and '.' do not count)."""
        key = {normalize_name(n): n for n in PRESETS}.get(normalize_name(name.strip()))
        if key is None:
            raise ValueError(f"unknown policy preset {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[key]

    @staticmethod
    def presets() -> list[str]:
        return list(PRESETS)

    def replace(self, **changes) -> Policy:
        """A copy with some fields changed (name becomes '<name>+custom' unless given)."""
        changes.setdefault("name", self.name if not changes else f"{self.name}+custom")
        return dataclasses.replace(self, **changes)

    def keeps_fp32(self, qualified_name: str, module_type: str) -> bool:
        """Whether a module (by its qualified name or class name) runs in fp32 under this policy."""
        names = (qualified_name.lower(), module_type.lower())
        return any(fnmatch.fnmatchcase(n, p.lower()) for p in self.keep_fp32 for n in names)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["keep_fp32"] = list(self.keep_fp32)
        return d


def _canonical(name, role: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{role} must be a format name (str), got {type(name).__name__}")
    try:
        return get_format(name).name
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{role}: {exc}") from None


def _choice(role, value, allowed):
    if value not in allowed:
        raise ValueError(f"{role}={value!r}: choose one of {', '.join(allowed)}")


def _presets() -> dict[str, Policy]:
    p: dict[str, Policy] = {}
    p["fp32"] = Policy("fp32", keep_fp32=())
    # TF32: matmul inputs carry 10 mantissa bits (emulated on CPU), everything else fp32
    p["tf32"] = Policy("tf32", forward="tf32", backward="tf32", keep_fp32=())
    p["bf16-mixed"] = Policy("bf16-mixed", forward="bf16", backward="bf16", activations="bf16",
                             weights="bf16", master="fp32")
    p["fp16-mixed"] = Policy("fp16-mixed", forward="fp16", backward="fp16", activations="fp16",
                             weights="fp16", master="fp32", loss_scaling="dynamic")
    p["fp16-mixed-unscaled"] = p["fp16-mixed"].replace(name="fp16-mixed-unscaled", loss_scaling="none")
    p["fp8-hybrid"] = Policy("fp8-hybrid", forward="fp8_e4m3", backward="fp8_e5m2", activations="bf16",
                             weights="bf16", master="fp32", fp8_recipe="delayed")
    p["fp8-hybrid-current"] = p["fp8-hybrid"].replace(name="fp8-hybrid-current", fp8_recipe="current")
    p["fp8-hybrid-unscaled"] = p["fp8-hybrid"].replace(name="fp8-hybrid-unscaled", fp8_recipe="none")
    p["fp8-rowwise"] = p["fp8-hybrid"].replace(name="fp8-rowwise", fp8_recipe="rowwise", matmuls="linear")
    # SwitchBack / torchao-style int8 training: the linear layers' forward and grad-input GEMMs
    # in int8 with row-wise scales, grad-weight in bf16 (-gw8: in int8 as well)
    p["int8-mixed"] = p["bf16-mixed"].replace(name="int8-mixed", forward="int8", backward="int8",
                                              fp8_recipe="rowwise", matmuls="linear", grad_weight="bf16")
    p["int8-mixed-gw8"] = p["int8-mixed"].replace(name="int8-mixed-gw8", grad_weight=None)
    p["mxfp8"] = Policy("mxfp8", forward="fp8_e4m3", backward="fp8_e5m2", activations="bf16",
                        weights="bf16", master="fp32", fp8_recipe="mx")
    p["bf16-pure"] = Policy("bf16-pure", forward="bf16", backward="bf16", activations="bf16",
                            weights="bf16", master=None, grad_accum="bf16", update_rounding="nearest")
    p["bf16-pure-sr"] = p["bf16-pure"].replace(name="bf16-pure-sr", update_rounding="stochastic")
    p["bf16-pure-kahan"] = p["bf16-pure"].replace(name="bf16-pure-kahan", update_rounding="kahan")
    p["bf16-mixed-8bit-adam"] = p["bf16-mixed"].replace(name="bf16-mixed-8bit-adam",
                                                        optimizer_states="int8_blockwise")
    return p


PRESETS = _presets()
