"""The training engine: runs any nn.Module and any torch.optim optimizer under a Policy.

What it does to the model (once, at construction):
  * parameters outside fp32-kept modules get a low-precision working copy (a new nn.Parameter
    put into the module); the optimizer keeps the original fp32 Parameter objects, which become
    the master weights. Without a master (bf16-pure) the original objects still serve as the
    optimizer's float32 view of the weights, but hold data only during step(). Under FSDP2 with
    no master (fully_shard_with_policy) the sharded bf16 parameters stay in the module and the
    optimizer gets a float32 shadow of this rank's shard instead, in the same way.
  * hooks: fp32-kept modules (norms, softmax, losses by default) run in fp32; the model's floating
    outputs come back as fp32, so the loss is computed in fp32. A LayerNorm on a CPU takes its
    bf16 input as it is: torch's kernel computes in fp32 from the (exactly widened) input with
    its fp32 weights and rounds the output to bf16 once, as the casts around an fp32 LayerNorm
    would, but without the four casts per call (forward and backward; 3x faster per norm).
  * where the policy's formats are not this machine's native dtypes (fp8 anywhere, fp16 and tf32
    on a CPU), a TorchFunctionMode active during the model's forward casts the inputs of every
    matmul (F.linear, matmul/@, mm, bmm, addmm, baddbmm, conv, scaled_dot_product_attention) to the
    forward format and their outputs to the activation format, and the gradients of those outputs
    to the backward format, all through fb.round with the policy's scaling recipe.
Native execution: bf16 on CPU (oneDNN: AVX512-BF16/AMX) and bf16/fp16 on CUDA run as real dtypes,
with no casts per step beyond the fp32 modules'.
  * linear layers whose formats have GEMMs of their own (int8 policies; FP8 on GPUs with FP8
    tensor cores, or with row-wise scaling anywhere) run their three GEMMs through train/gemm.py
    instead: natively (fewbits' AMX int8 GEMM, torch._int_mm, torch._scaled_mm) or emulated with
    the same arithmetic, as `gemm=` says ("auto": native where the hardware does it);
    `gemm_path` tells which path a run took.

A step: engine.backward(loss) scales the loss, back-propagates, and accumulates the working
gradients into fp32 buffers (the masters' .grad); engine.step() unscales, checks for inf/NaN,
skips the step when found (the masters are never touched by a non-finite gradient), else runs
optimizer.step() on the masters and refreshes the working copy; engine.zero_grad() clears.
A saturating cast (FP8 recipes, formats without infinities) would turn an inf in an input,
activation or gradient into a finite value: what enters one is checked on the device as it is
cast, and the step is skipped as well (one read of all the checks, folded into the loss scaler's).
A forward pass's checks belong to the step only once its outputs are back-propagated: they ride
on its output tensors' autograd graph (a gradient hook moves them into the step's list when the
backward pass reaches them), so a forward that is never back-propagated (evaluation with grad
enabled, a stray call) neither counts for the next step nor piles up: its checks go with its graph.
A plain loss.backward() / optimizer.step() would leave the masters without gradients: with
parameters under the engine's care, both raise RuntimeError naming engine.backward/engine.step.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..formats import get_format
from .casts import cast, native_dtype, round_to, saturates
from .fp8 import ScaledCast
from .gemm import LinearCall, lowp_linear, plan_route
from .optim import StateStore, land_update
from .policy import Policy
from .scaler import LossScaler
from .shards import is_dtensor, local
from .telemetry import Telemetry

def _matmul_inputs() -> dict:
    table = {F.linear: (0, 1), torch.matmul: (0, 1), torch.Tensor.matmul: (0, 1),
             torch.Tensor.__matmul__: (0, 1), torch.Tensor.__rmatmul__: (0, 1), torch.mm: (0, 1),
             torch.Tensor.mm: (0, 1), torch.bmm: (0, 1), torch.Tensor.bmm: (0, 1), torch.addmm: (1, 2),
             torch.baddbmm: (1, 2), F.conv1d: (0, 1), F.conv2d: (0, 1), F.conv3d: (0, 1),
             F.scaled_dot_product_attention: (0, 1, 2)}
    return table


_MATMUL_INPUTS = _matmul_inputs()


def takes_bf16_input(module: nn.Module, device: torch.device) -> bool:
    """Whether an fp32-kept `module` runs on a bf16 input as it is, with fp32 arithmetic inside:
    torch's LayerNorm on a CPU does (fp32 statistics and weights, one rounding of the output)."""
    # a subclass qualifies only with LayerNorm's own forward (FSDP2's FSDPLayerNorm has it)
    return (isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward
            and torch.device(device).type == "cpu")


def native_on(device: torch.device, fmt_name: str) -> torch.dtype | None:
    """The dtype that runs `fmt_name` natively and fast on `device` (None: emulate in fp32).
    fp16 matmuls on a CPU run at under 1 GFLOP/s in torch, so fp16 is emulated there."""
    dtype = native_dtype(fmt_name)
    if dtype == torch.float16 and device.type == "cpu":
        return None
    return dtype


# the engine each model and optimizer is under: building a second one over them cannot work (the
# first replaced the model's parameters and holds the masters in the optimizer)
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class _Entry:
    """One parameter under the engine's care."""
    name: str
    working: nn.Parameter           # what the model reads
    master: nn.Parameter            # what the optimizer updates (a shadow without a master copy)
    grad_buf: torch.Tensor | None = None
    compensation: torch.Tensor | None = None

    def stored(self) -> torch.Tensor:
        """The working weight's data: this rank's shard when FSDP2 shards it (a view)."""
        return local(self.working.data)


class _ForwardChecks:
    """The checks one outermost forward pass recorded: the saturating casts' input-finite flags
    and (detect_overflow) the leaves' output-finite flags. They join the step's lists when the
    backward pass reaches the forward's outputs (Engine._take), once per backward pass."""
    __slots__ = ("casts", "outputs", "taken_in")

    def __init__(self):
        self.casts: list = []
        self.outputs: list = []
        self.taken_in = -1


@dataclass
class _Frame:
    name: str
    fp32: bool
    calls: list = field(default_factory=lambda: [0])


class _CastMode(TorchFunctionMode):
    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        positions = _MATMUL_INPUTS.get(func)
        if positions is None:
            return func(*args, **kwargs)
        return self.engine._matmul(func, positions, args, kwargs)


class Engine:
    """Mixed-precision training of `model` with `optimizer` (built on model's parameters) under
    `policy` (a Policy or a preset name). See the module docstring for the protocol."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: Policy | str = "bf16-mixed",
                 *, telemetry: Telemetry | bool | None = None, seed: int = 0, detect_overflow: bool | None = None,
                 device: torch.device | str | None = None, gemm: str = "auto"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.policy = Policy.preset(policy) if isinstance(policy, str) else policy
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a Policy or a preset name, got {type(policy).__name__}")
        for what, obj in (("model", model), ("optimizer", optimizer)):
            owner = _OWNERS.get(obj)
            if owner is not None and owner() is not None:
                raise RuntimeError(f"this {what} is already under a fewbits Engine (which replaced the model's "
                                   "parameters with working copies and holds the masters in the optimizer): "
                                   "keep using that engine, or build a new model and optimizer for a new one")
        first = next(model.parameters(), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None
                                                                       else torch.device("cpu"))
        pol = self.policy
        # linear layers whose formats have GEMMs of their own (train/gemm.py): int8, FP8 on FP8
        # hardware, row-wise FP8 anywhere; None: casts around GEMMs in the compute dtype. Decided
        # (and refused, ValueError) before the model and optimizer are touched or claimed.
        self.gemm_route = plan_route(pol, self.device, gemm)
        self.model, self.optimizer = model, optimizer
        _OWNERS[model] = _OWNERS[optimizer] = weakref.ref(self)
        self.compute_dtype = native_on(self.device, pol.activations) or torch.float32
        self.storage_dtype = native_on(self.device, pol.weights) or torch.float32
        compute_fmt = get_format(self.compute_dtype).name
        self.weights_fmt = get_format(pol.weights)
        self.cast_forward = get_format(pol.forward).name != compute_fmt or pol.fp8_recipe != "none"
        self.cast_backward = get_format(pol.backward).name != compute_fmt or pol.fp8_recipe != "none"
        self.cast_activations = get_format(pol.activations).name != compute_fmt
        self.needs_mode = (self.cast_forward or self.cast_backward or self.cast_activations
                           or self.storage_dtype != self.compute_dtype)
        if telemetry is True:
            telemetry = Telemetry()
        self.telemetry: Telemetry | None = telemetry or None
        self.detect_overflow = (get_format(pol.activations).max < 1e6) if detect_overflow is None else detect_overflow
        self.scaler = LossScaler(pol.loss_scaling, pol.init_scale, pol.growth_factor, pol.backoff_factor,
                                 pol.growth_interval)
        self.generators = {k: torch.Generator().manual_seed(seed * 7919 + i)
                           for i, k in enumerate(("update", "cast", "state"))}
        self.states = StateStore(optimizer, pol.optimizer_states, pol.state_rounding, self.generators["state"])
        self.step_count = 0
        self.slots: dict = {}
        self.last_step: dict = {}
        self.overflows: list[dict] = []
        self._frames: list[_Frame] = []
        # the step's checks: those of the forwards back-propagated since the last step, and those
        # of the casts in the backward passes; (label, finite: bool or 0-dim bool tensor)
        self._fwd_flags: list = []
        self._cast_flags: list = []
        self._forward: _ForwardChecks | None = None  # the checks of the forward pass now running
        self._backward_calls = 0
        self._stepping = False
        self._act_saturates = saturates(pol.activations) and self.cast_activations
        self._grad_saturates = (saturates(pol.grad_accum)
                                or (self.storage_dtype == torch.float32 and saturates(self.weights_fmt)))
        self._accumulating = False
        self._sampling = False
        self._mode: _CastMode | None = None
        self.entries: list[_Entry] = []
        self.plain_params: list[tuple[str, nn.Parameter]] = []
        self._fp32_modules = self._classify_modules()
        self._replace_parameters()
        self._install_hooks()
        if self.entries:  # the optimizer's parameters are masters whose gradients only engine.backward fills
            optimizer.register_step_pre_hook(self._refuse_plain_step)
        if any(is_dtensor(e.working) for e in self.entries):  # each rank rounds its own shards:
            import torch.distributed as dist  # its own stream of random words
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.generators["update"].manual_seed(seed * 7919 + 1_000_003 * (rank + 1))

    # -----------------------------------------------------------------------------------------
    # setup
    # -----------------------------------------------------------------------------------------
    def _classify_modules(self) -> set[str]:
        keep: set[str] = set()
        for name, m in self.model.named_modules():
            parent = name.rsplit(".", 1)[0] if "." in name else ("" if name else None)
            if (parent is not None and parent in keep) or self.policy.keeps_fp32(name, type(m).__name__):
                keep.add(name)
        return keep

    def _replace_parameters(self) -> None:
        opt_params = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        done: dict[int, nn.Parameter] = {}
        pol = self.policy
        for mod_name, module in self.model.named_modules():
            fp32 = mod_name in self._fp32_modules
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                if id(p) in done:  # tied weights share one working copy
                    if done[id(p)] is not p:
                        module._parameters[pname] = done[id(p)]
                    continue
                if (is_dtensor(p) and not fp32 and pol.master is None and self.weights_fmt.name != "fp32"
                        and p.requires_grad and id(p) in opt_params):
                    # FSDP2 shards it in the low-precision format (fully_shard_with_policy, no
                    # master): it stays in the module; the optimizer gets a float32 shadow of this
                    # rank's shard, filled only during step()
                    shadow = nn.Parameter(torch.empty(0, dtype=torch.float32, device=self.device))
                    self._swap_in_optimizer(p, shadow)
                    entry = _Entry(full, p, shadow)
                    if pol.update_rounding == "kahan":
                        entry.compensation = torch.zeros_like(local(p.data))
                    done[id(p)] = p
                    self.entries.append(entry)
                    continue
                lowp = not fp32 and (pol.master is not None or self.storage_dtype != p.dtype
                                     or p.dtype != native_dtype(self.weights_fmt))
                if not lowp or not p.is_floating_point():
                    done[id(p)] = p
                    self.plain_params.append((full, p))
                    continue
                if not p.requires_grad or id(p) not in opt_params:
                    with torch.no_grad():
                        p.data = round_to(p.data.float(), self.weights_fmt).to(self.storage_dtype)
                    done[id(p)] = p
                    self.plain_params.append((full, p))
                    continue
                with torch.no_grad():
                    if pol.master is not None and get_format(pol.master).name != "fp32":
                        p.data = round_to(p.data.float(), pol.master)
                    working = nn.Parameter(round_to(p.detach().float(), self.weights_fmt).to(self.storage_dtype))
                module._parameters[pname] = working
                done[id(p)] = working
                entry = _Entry(full, working, p)
                if pol.master is None:
                    if pol.update_rounding == "kahan":
                        entry.compensation = torch.zeros_like(working.data)
                    p.data = torch.empty(0, dtype=torch.float32, device=p.device)  # data only during step()
                self.entries.append(entry)
        self._names = {id(e.master): e.name for e in self.entries}
        self._names.update({id(p): n for n, p in self.plain_params})

    def _swap_in_optimizer(self, old: torch.Tensor, new: torch.Tensor) -> None:
        for group in self.optimizer.param_groups:
            group["params"] = [new if q is old else q for q in group["params"]]
        if old in self.optimizer.state:
            raise ValueError("the optimizer already holds state for a sharded parameter: build the "
                             "Engine before the first optimizer step")

    def _install_hooks(self) -> None:
        root = self.model
        for name, m in self.model.named_modules():
            fp32 = name in self._fp32_modules
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            outermost_fp32 = fp32 and (m is root or parent not in self._fp32_modules)
            is_leaf = next(m.children(), None) is None
            takes_bf16 = takes_bf16_input(m, self.device)
            m.register_forward_pre_hook(self._pre_hook(name, fp32, outermost_fp32, m is root, takes_bf16))
            m.register_forward_hook(self._post_hook(name, fp32, outermost_fp32, m is root, is_leaf,
                                                    isinstance(m, nn.modules.loss._Loss)), always_call=True)

    def _pre_hook(self, name, fp32, outermost_fp32, is_root, takes_bf16=False):
        def hook(module, args):
            if is_root:
                self._enter_forward()
            if is_root or not self._frames:  # the outermost hooked call: a new forward pass
                self._forward = _ForwardChecks()
            self._frames.append(_Frame(name, fp32))
            if outermost_fp32 and self.compute_dtype != torch.float32:
                if takes_bf16 and self.compute_dtype == torch.bfloat16 and not self.cast_activations:
                    return None
                return _map_float(args, lambda t: t.float())
            if is_root and not fp32 and self.compute_dtype != torch.float32:
                return _map_float(args, lambda t: t.to(self.compute_dtype))
            return None
        return hook

    def _post_hook(self, name, fp32, outermost_fp32, is_root, is_leaf, is_loss):
        def hook(module, args, output):
            if self._frames and self._frames[-1].name == name:
                self._frames.pop()
            try:
                if outermost_fp32 and not is_loss and not is_root and self.compute_dtype != torch.float32:
                    output = _map_float(output, lambda t: t.to(self.compute_dtype))
                elif is_leaf and not fp32 and self.cast_activations:
                    fwd = self._activation_round(name or "<root>")
                    output = _map_float(output, lambda t: cast(t, fwd, None))
                if self.detect_overflow and is_leaf and self._forward is not None:
                    _map_float(output, lambda t: self._forward.outputs.append((name, torch.isfinite(t.detach()).all()))
                               or t)
                if is_root:
                    output = _map_float(output, lambda t: t.float())
                if (is_root or not self._frames) and self._forward is not None:
                    self._attach(self._forward, output)
                return output
            finally:
                if is_root:
                    self._exit_forward()
                if is_root or not self._frames:
                    self._forward = None
        return hook

    def _attach(self, checks: _ForwardChecks, output) -> None:
        """Hang `checks` on the autograd graph of the forward's floating outputs: a gradient hook
        hands them to the step when a backward pass reaches an output (Engine._take). Without
        grad, or when nothing was checked, they are dropped here."""
        if not (checks.casts or checks.outputs) or not torch.is_grad_enabled():
            return

        def take(grad, checks=checks):
            self._take(checks)

        def hang(t):
            if t.requires_grad:
                t.register_hook(take)
            return t
        _map_float(output, hang)

    def _take(self, checks: _ForwardChecks) -> None:
        """A backward pass reached a forward's outputs: its checks join the step's (once per pass)."""
        if checks.taken_in != self._backward_calls:
            checks.taken_in = self._backward_calls
            self._cast_flags.extend(checks.casts)
            self._fwd_flags.extend(checks.outputs)

    def _forward_log(self) -> list | None:
        """Where a saturating cast in the forward pass now running logs its input's finiteness."""
        return self._forward.casts if self._forward is not None else None

    def _activation_round(self, label: str):
        """The rounding of activations to the policy's format; where it saturates, each input's
        finiteness is logged for step() (in training: grad enabled when the cast is set up)."""
        act = self.policy.activations
        if not (self._act_saturates and torch.is_grad_enabled()):
            return lambda x: round_to(x, act)

        def rnd(x):
            log = self._forward_log()
            if log is not None:
                log.append((label, torch.isfinite(x).all()))
            return round_to(x, act)
        return rnd

    def _enter_forward(self):
        self._frames.clear()
        self._sampling = self.telemetry is not None and self.telemetry.wants(self.step_count) \
            and torch.is_grad_enabled()
        if (self.needs_mode or self._sampling) and self._mode is None:
            self._mode = _CastMode(self)
            self._mode.__enter__()

    def _exit_forward(self):
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    # -----------------------------------------------------------------------------------------
    # casts
    # -----------------------------------------------------------------------------------------
    def _slot(self, key, role: str) -> ScaledCast:
        s = self.slots.get(key)
        if s is None:
            pol = self.policy
            fmt = pol.forward if role == "forward" else pol.backward
            mode = pol.forward_rounding if role == "forward" else pol.backward_rounding
            s = ScaledCast(fmt, pol.fp8_recipe, mode, pol.amax_history_len, pol.fp8_margin, pol.mx_block,
                           self.generators["cast"])
            s.label = ".".join(str(k) for k in key)
            if role == "backward":  # runs only in a backward pass: always part of a step
                s.finite_log = self._cast_flags
            self.slots[key] = s
        return s

    def _slot_from_checkpoint(self, key: tuple, state: dict) -> None:
        self._slot(key, key[-1]).load_state_dict(state)

    def _observer(self, layer: str, role: str):
        step, tel = self.step_count, self.telemetry

        def observe(before, after, sc):
            top = sc.fmt.max / sc.last_scale if sc.recipe in ("current", "delayed") else \
                (float("inf") if sc.recipe == "mx" else None)
            tel.record_cast(step, layer, role, sc.fmt, before, after, top)
        return observe

    @property
    def gemm_path(self) -> str:
        """How this engine runs the model's matmuls, in words (what the benchmarks and README print)."""
        dtype = str(self.compute_dtype).replace("torch.", "")
        if self.gemm_route is not None:
            rest = ("; other matmuls: " + dtype) if self.policy.matmuls == "linear" else \
                (f"; other matmuls: {dtype} GEMMs of emulated {self.policy.forward} / {self.policy.backward} values")
            return f"linear layers: {self.gemm_route.describe()}{rest}"
        if self.cast_forward or self.cast_backward:
            return (f"{dtype} GEMMs of values rounded to {self.policy.forward} (forward) / "
                    f"{self.policy.backward} (backward): emulated")
        return f"{dtype} GEMMs (native dtype)"

    def _linear(self, layer, idx, args, kwargs):
        """F.linear on the engine's GemmRoute: the three GEMMs in train/gemm.py."""
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        cd = self.compute_dtype
        x, w = x.to(cd), w.to(cd)
        b = b.to(cd) if b is not None else None
        pol, route, grad = self.policy, self.gemm_route, torch.is_grad_enabled()
        call = LinearCall(route, cd, label=layer, modes=(pol.forward_rounding, pol.backward_rounding),
                          generator=self.generators["cast"])
        if route.rowwise:
            call.forward_log = self._forward_log() if grad else None
            call.backward_log = self._cast_flags
        else:  # per tensor: the emulation's own casts (state, checkpoints and telemetry alike)
            casts = []
            for key, role, obs in (((layer, idx, 0, "forward"), "forward", f"{layer}#{idx}.0"),
                                   ((layer, idx, 1, "forward"), "forward", f"{layer}#{idx}.1"),
                                   ((layer, idx, "backward"), "backward", f"{layer}#{idx}")):
                slot = self._slot(key, role)
                slot.observer = self._observer(obs, role) if self._sampling else None
                if role == "forward":
                    slot.finite_log = self._forward_log() if grad else None
                casts.append(slot)
            call.casts = tuple(casts)
        out = lowp_linear(x, w, b, call)
        if self.cast_activations:
            out = cast(out, self._activation_round(layer), None)
        return out

    def _matmul(self, func, positions, args, kwargs):
        frame = self._frames[-1] if self._frames else _Frame("", False)
        if frame.fp32:
            return func(*args, **kwargs)
        idx = frame.calls[0]
        frame.calls[0] += 1
        layer = frame.name or "<root>"
        if self.gemm_route is not None and func is F.linear and len(args) >= 2 and \
                args[1].dim() == 2 and args[0].dim() >= 1:
            return self._linear(layer, idx, args, kwargs)
        lowp = self.policy.matmuls == "all"  # else only the linear layers take the GEMM formats
        args = list(args)
        for i, a in enumerate(args):
            if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
                continue
            if a.dtype != self.compute_dtype:
                a = a.to(self.compute_dtype)
            if lowp and i in positions and (self.cast_forward or self._sampling):
                slot = self._slot((layer, idx, i, "forward"), "forward")
                slot.observer = self._observer(f"{layer}#{idx}.{i}", "forward") if self._sampling else None
                slot.finite_log = self._forward_log() if torch.is_grad_enabled() else None  # not in evaluation
                if self.cast_forward:
                    a = cast(a, slot, None)
                elif self._sampling:
                    slot.observer(a, a, slot)
            args[i] = a
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        fwd = self._activation_round(layer) if self.cast_activations else None
        bwd = None
        if lowp and (self.cast_backward or self._sampling):
            slot = self._slot((layer, idx, "backward"), "backward")
            slot.observer = self._observer(f"{layer}#{idx}", "backward") if self._sampling else None
            bwd = slot if self.cast_backward else (lambda g, s=slot: (s.observer(g, g, s), g)[1])
        return cast(out, fwd, bwd)

    # -----------------------------------------------------------------------------------------
    # the step
    # -----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate the (scaled) loss and accumulate the gradients in the grad_accum format."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss must be a one-element tensor")
        self._backward_calls += 1  # the forwards this pass reaches hand their checks to the step (_take)
        self.scaler.scale_loss(loss.float()).backward()
        accum_fmt = get_format(self.policy.grad_accum)
        emulated_weights = self.storage_dtype == torch.float32 and self.weights_fmt.name != "fp32"
        sampled = self.telemetry is not None and self.telemetry.wants(self.step_count)
        for e in self.entries:
            g = e.working.grad
            if g is None:
                continue
            g = local(g)
            if self._grad_saturates:  # the rounding below would hide an inf
                self._cast_flags.append((e.name, torch.isfinite(g).all()))
            if sampled:  # the gradient as the working copy's format holds it (still loss-scaled)
                self.telemetry.record_cast(self.step_count, e.name, "weight_grad", self.weights_fmt, g)
            if emulated_weights:  # a parameter stored in fp16 has an fp16 gradient
                g = round_to(g, self.weights_fmt)
            if e.grad_buf is None:
                e.grad_buf = torch.zeros(g.shape, dtype=torch.float32, device=g.device)
            if not self._accumulating:
                e.grad_buf.copy_(g)
            else:
                e.grad_buf.add_(g)
                if accum_fmt.name != "fp32":
                    round_to(e.grad_buf, accum_fmt, out=e.grad_buf)
            e.working.grad = None
        self._accumulating = True

    def _grads(self) -> list[tuple[str, torch.Tensor]]:
        out = [(e.name, e.grad_buf) for e in self.entries if e.grad_buf is not None and self._accumulating]
        out += [(n, p.grad) for n, p in self.plain_params if p.grad is not None]
        return out

    def step(self) -> bool:
        """Unscale, check, update. Returns True if the optimizer stepped, False if the step was
        skipped because a gradient was inf or NaN (see self.last_step for what overflowed)."""
        stray = [e.name for e in self.entries if e.working.grad is not None]
        if stray:
            raise RuntimeError(f"gradients of {stray[:3]} come from a plain loss.backward(): under a fewbits "
                               "Engine call engine.backward(loss), then engine.step() (or engine.train_step(loss))")
        named = self._grads()
        found_inf = self.scaler.unscale_([g for _, g in named], nonfinite=self._saturated_nonfinite())
        scale_used = self.scaler.scale
        sampled = self.telemetry is not None and self.telemetry.wants(self.step_count)
        if found_inf and self.policy.skip_nonfinite:
            bad = [n for n, g in named if not bool(torch.isfinite(g).all())]
            layer = next((n for n, ok in self._fwd_flags if not bool(ok)), None)
            at_cast = next((n for n, ok in self._cast_flags if not bool(ok)), None)
            self.last_step = {"step": self.step_count, "stepped": False, "scale": scale_used,
                              "overflow_params": bad, "overflow_layer": layer, "nonfinite_cast": at_cast}
            self.overflows.append(self.last_step)
            self.scaler.update(True)
            self._finish_step()
            return False
        entries = [e for e in self.entries if e.grad_buf is not None and self._accumulating]
        no_master = self.policy.master is None
        if no_master:
            for e in self.entries:
                e.master.data = e.stored().float()
        for e in entries:
            e.master.grad = e.grad_buf
        before = {id(e): (e.master.detach().clone(), e.stored().clone()) for e in entries} if sampled else {}
        self.states.unpack()
        self._stepping = True
        try:
            self.optimizer.step()
        finally:
            self._stepping = False
        self.states.pack()
        self._refresh_working(no_master)
        if sampled:
            for e in entries:
                m0, w0 = before[id(e)]
                intended = m0 != e.master.detach()
                stored = e.master.detach() if not no_master else e.stored()
                stored0 = m0 if not no_master else w0
                # counts as tensors: telemetry reads them later, without a wait for the device here
                self.telemetry.record_lost_updates(self.step_count, e.name, intended.sum(),
                                                   (intended & (stored != stored0)).sum())
                if not no_master:
                    self.telemetry.record_cast(self.step_count, e.name, "weights", self.weights_fmt,
                                               e.master.detach(), e.working.detach())
        if no_master:
            for e in self.entries:
                e.master.data = torch.empty(0, dtype=torch.float32, device=e.master.device)
        self.last_step = {"step": self.step_count, "stepped": True, "scale": scale_used,
                          "overflow_params": [], "overflow_layer": None, "nonfinite_cast": None}
        self.scaler.update(False)
        self._finish_step()
        return True

    def _saturated_nonfinite(self) -> torch.Tensor | None:
        """One flag: did any saturating cast of this step get an inf or NaN (None: no such cast)."""
        if not self._cast_flags:
            return None
        checks = [ok for _, ok in self._cast_flags if isinstance(ok, torch.Tensor)]
        if not all(ok for _, ok in self._cast_flags if not isinstance(ok, torch.Tensor)):
            return torch.ones((), dtype=torch.bool)
        if not checks:
            return None
        dev = checks[0].device
        return ~torch.stack([c.to(dev) for c in checks]).all()

    def _refuse_plain_step(self, optimizer, args, kwargs):
        if not self._stepping:
            raise RuntimeError("this optimizer updates the master weights of a fewbits Engine, whose gradients "
                               "only the engine fills: call engine.backward(loss) and engine.step() (or "
                               "engine.train_step(loss)) instead of loss.backward() and optimizer.step()")

    def _refresh_working(self, no_master: bool) -> None:
        pol = self.policy
        with torch.no_grad():
            if no_master:
                gen = self.generators["update"]
                for e in self.entries:
                    land_update(e.stored(), e.master.data, self.weights_fmt, pol.update_rounding,
                                e.compensation, gen)
                return
            if get_format(pol.master).name != "fp32":
                for e in self.entries:
                    round_to(e.master.data, pol.master, out=e.master.data)
            if not self.entries:
                return
            if self.storage_dtype != torch.float32 or self.weights_fmt.name == "fp32":
                # the dtype cast is the format's nearest-even rounding
                torch._foreach_copy_([e.working.data for e in self.entries], [e.master.data for e in self.entries])
            else:
                for e in self.entries:
                    round_to(e.master.data, self.weights_fmt, out=e.working.data)

    def _finish_step(self) -> None:
        self.step_count += 1
        self._fwd_flags.clear()
        self._cast_flags.clear()

    def zero_grad(self) -> None:
        self._accumulating = False
        for e in self.entries:
            e.working.grad = None
            e.master.grad = None
        for _, p in self.plain_params:
            p.grad = None
        self._fwd_flags.clear()
        self._cast_flags.clear()

    def train_step(self, loss: torch.Tensor) -> bool:
        """backward + step + zero_grad."""
        self.backward(loss)
        stepped = self.step()
        self.zero_grad()
        return stepped

    # -----------------------------------------------------------------------------------------
    # reporting and checkpoints
    # -----------------------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps

    def master_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, the tensor the optimizer updates) for every parameter, fp32 masters included."""
        if self.policy.master is None:
            return [(e.name, e.working.detach()) for e in self.entries] + \
                [(n, p.detach()) for n, p in self.plain_params]
        return [(e.name, e.master.detach()) for e in self.entries] + [(n, p.detach()) for n, p in self.plain_params]

    def memory_bytes(self) -> dict:
        """Bytes held by the training state now: working weights, masters, gradient buffers,
        optimizer states, compensation buffers."""
        def nb(t):
            return 0 if t is None else t.numel() * t.element_size()
        working = sum(nb(e.stored()) for e in self.entries) + sum(nb(local(p.data)) for _, p in self.plain_params)
        master = sum(nb(e.master.data) for e in self.entries)
        grads = sum(nb(e.grad_buf) for e in self.entries) + \
            sum(nb(local(p.grad)) for _, p in self.plain_params if p.grad is not None)
        comp = sum(nb(e.compensation) for e in self.entries)
        states = self.states.nbytes()
        return {"weights": working, "master": master, "grads": grads, "optimizer_states": states,
                "compensation": comp, "total": working + master + grads + states + comp}

    def state_dict(self) -> dict:
        from .checkpoint import engine_state
        return engine_state(self)

    def load_state_dict(self, state: dict) -> None:
        from .checkpoint import load_engine_state
        load_engine_state(self, state)


def _map_float(obj, fn):
    """Apply fn to every floating tensor in obj (tensor, tuple, list, dict); other values as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        mapped = [_map_float(o, fn) for o in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
    if isinstance(obj, list):
        return [_map_float(o, fn) for o in obj]
    if isinstance(obj, dict):
        out = {k: _map_float(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(out)
        except Exception:  # noqa: BLE001 - a dict subclass that cannot be rebuilt from a dict
            return out
    return obj
