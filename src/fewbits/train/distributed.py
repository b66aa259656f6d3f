"""Distributed training: a DDP gradient-communication hook that sends gradients in any fewbits
format, with optional error feedback, counting the bytes it sends against fp32.

Use with torch DDP after building the Engine (the engine puts the low-precision working copies
into the model; DDP must see those):

    engine = Engine(model, optimizer, "bf16-mixed")
    ddp = DistributedDataParallel(model)
    state = CompressedComm("fp8_e5m2", error_feedback=True)
    ddp.register_comm_hook(state, compressed_allreduce_hook)

Each bucket is rounded to the format (formats of 8 bits or fewer after a per-bucket power-of-two
scale that puts its amax at the top of the format's range), packed into bytes (fewbits codes,
or the bf16/fp16 bit patterns), all-gathered, decoded and averaged in fp32 on every rank in
rank order — so every rank ends with the same averaged gradient. Error feedback keeps what the
rounding dropped on this rank and adds it to the next step's bucket. A bucket holding inf or NaN
is sent as NaN (saturation would have made it finite): every rank's average is NaN and the Engine
skips the step on every rank; error feedback keeps nothing of it.

FSDP2: fully_shard_with_policy(model, policy) shards the model with
torch.distributed.fsdp.fully_shard and the MixedPrecisionPolicy that matches the policy, and
returns the policy to build the Engine with (see its docstring):

    engine = Engine(model, optimizer, fully_shard_with_policy(model, "fp8-hybrid"))

(the optimizer is built on model.parameters() after sharding).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..formats import get_format
from ..kernels import decode, encode
from .casts import native_dtype, round_to
from .engine import native_on, takes_bf16_input
from .fp8 import pow2_scale
from .policy import Policy


class CompressedComm:
    """State of compressed_allreduce_hook: format, error feedback, byte counters."""

    def __init__(self, fmt: str = "bf16", error_feedback: bool = False, process_group=None):
        self.fmt = get_format(fmt)
        if self.fmt.bits > 8 and native_dtype(self.fmt.name) is None and self.fmt.name != "fp32":
            raise ValueError(f"{self.fmt.name}: gradients travel as bf16, fp16, fp32 or a format of <= 8 bits")
        self.error_feedback = error_feedback
        self.process_group = process_group
        self.residuals: dict[int, torch.Tensor] = {}
        self.bytes_sent = 0
        self.bytes_fp32 = 0

    @property
    def compression(self) -> float:
        """bytes sent / bytes fp32 would have sent."""
        return self.bytes_sent / self.bytes_fp32 if self.bytes_fp32 else 1.0

    # -- one bucket ----------------------------------------------------------------------------
    def compress(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload bytes, the fp32 values the payload decodes to)."""
        dtype = native_dtype(self.fmt.name)
        if dtype is not None:
            q = g.to(dtype)
            return q.view(torch.uint8).reshape(-1), q.float()
        amax = float(g.abs().amax()) if g.numel() else 0.0
        if not math.isfinite(amax):  # a NaN scale: the bucket decodes to NaN on every rank
            codes = torch.zeros(g.shape, dtype=torch.uint8, device=g.device)
            header = torch.tensor([math.nan], dtype=torch.float32).view(torch.uint8).to(g.device)
            return torch.cat([header, codes.reshape(-1)]), torch.full_like(g, math.nan)
        scale = pow2_scale(amax, self.fmt.max)
        codes = encode(g * scale, self.fmt, overflow="saturate")
        header = torch.tensor([scale], dtype=torch.float32).view(torch.uint8).to(g.device)
        return torch.cat([header, codes.reshape(-1)]), decode(codes, self.fmt, dtype=torch.float32) / scale

    def decompress(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        dtype = native_dtype(self.fmt.name)
        if dtype is not None:
            return payload.view(dtype).float()
        scale = float(payload[:4].view(torch.float32))
        return decode(payload[4:4 + numel], self.fmt, dtype=torch.float32) / scale


def compressed_allreduce_hook(state: CompressedComm, bucket):  # DDP checks annotations: none here
    """DDP comm hook: average the bucket's gradients across ranks, sent in state.fmt."""
    buf = bucket.buffer()
    g = buf.detach().float()
    key = bucket.index()
    if state.error_feedback and key in state.residuals:
        g = g + state.residuals[key]
    payload, sent_values = state.compress(g)
    if state.error_feedback:  # nothing of a non-finite bucket (its step is skipped) carries over
        state.residuals[key] = torch.nan_to_num(g - sent_values, nan=0.0, posinf=0.0, neginf=0.0)
    world = dist.get_world_size(state.process_group)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload, group=state.process_group)
    total = torch.zeros_like(g)
    for p in gathered:  # rank order: the same sum on every rank
        total += state.decompress(p, g.numel())
    state.bytes_sent += payload.numel()
    state.bytes_fp32 += g.numel() * 4
    buf.copy_((total / world).to(buf.dtype))
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut



# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------
def fully_shard_with_policy(model, policy, *, mesh=None, units=(), reshard_after_forward: bool = True):
    """Shard `model` with FSDP2 (torch.distributed.fsdp.fully_shard) under a fewbits policy and
    return the Policy to give the Engine built on the sharded model.

        policy = fully_shard_with_policy(model, "fp8-hybrid")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # after sharding: DTensor params
        engine = Engine(model, opt, policy)

    With an fp32 master (bf16-mixed, fp8-hybrid, ...) FSDP2 owns the parameters and plays the
    role of the Engine's master/working pair: the sharded fp32 parameters are the masters (the
    optimizer updates them, each rank its shard), MixedPrecisionPolicy(param_dtype=
    <policy.weights>) all-gathers them as the bf16 working copy, and gradients are
    reduce-scattered in fp32 (or in policy.comm when that is bf16/fp16). The returned policy is
    the same one with weights="fp32", master=None ("<name>+fsdp2"), so the Engine leaves the
    (DTensor) parameters alone and only does the rest: the compute dtype, the emulated casts of
    matmul inputs/outputs/gradients (fp8 and its scaling recipes), fp32 modules, telemetry.

    Without a master (bf16-pure, bf16-pure-sr, bf16-pure-kahan) the weights are converted to the
    policy's format and sharded in it (half the bytes of fp32, per rank); the gradients are
    reduce-scattered in fp32 and stored in bf16. The Engine then gives the optimizer a float32
    shadow of each rank's shard during step() and lands the update in the bf16 shard by the
    policy's rule (nearest, stochastic with a stream of random words per rank, or Kahan with a
    compensation buffer per shard); optimizers must be elementwise (every torch.optim one but
    LBFGS), since each rank updates its shard alone.

    Modules the policy keeps in fp32 (norms, ...) are sharded as their own units with fp32
    parameters. `units`: further submodules (e.g. transformer blocks) to shard one by one.

    Refused (ValueError): a master other than fp32, weights in a format the device cannot store
    natively (fp16 on a CPU: FSDP2 would all-gather fp32; the forward casts still round matmul
    inputs, but the stored weights would not be fp16), 8-bit optimizer states, a grad_accum other
    than fp32 with a master (FSDP2 accumulates those gradients), and a comm format other than
    fp32/bf16/fp16. Loss scaling works: each rank checks
    its gradient shards for inf/NaN and the ranks agree on the verdict (LossScaler.unscale_), so
    all skip the same steps.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    pol = Policy.preset(policy) if isinstance(policy, str) else policy
    if not isinstance(pol, Policy):
        raise TypeError(f"policy must be a Policy or a preset name, got {type(policy).__name__}")
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    param_dtype = native_on(device, pol.weights)
    problems = []
    no_master = pol.master is None and pol.weights != "fp32"
    if pol.master is not None and pol.master != "fp32":
        problems.append(f"master={pol.master} (FSDP2's sharded parameters are the fp32 masters)")
    if pol.weights != "fp32" and param_dtype is None:
        problems.append(f"weights={pol.weights} is not a native dtype on {device.type}")
    if pol.optimizer_states != "fp32":
        problems.append(f"optimizer_states={pol.optimizer_states}")
    if pol.grad_accum != "fp32" and not no_master:  # without a master the Engine accumulates
        problems.append(f"grad_accum={pol.grad_accum}")
    reduce_dtype = native_dtype(pol.comm)
    if reduce_dtype is None:
        problems.append(f"comm={pol.comm} (FSDP2 reduces in fp32, bf16 or fp16)")
    if problems:
        raise ValueError(f"policy {pol.name!r} under FSDP2: unsupported: " + "; ".join(problems))

    kept = _outermost_fp32_modules(model, pol)
    if no_master:  # the weights themselves are stored, and sharded, in the low-precision dtype
        kept_names = {name for name, _ in kept}
        with torch.no_grad():
            for name, m in model.named_modules():
                if not any(name == k or name.startswith(k + ".") for k in kept_names):
                    for p in m.parameters(recurse=False):
                        if p.is_floating_point():
                            p.data = round_to(p.data.float(), pol.weights).to(param_dtype)
    for name, m in kept:
        if any(True for _ in m.parameters()):
            # as in the Engine: a bf16 input goes in as it is where the module computes in fp32
            keep_input = param_dtype == torch.bfloat16 and takes_bf16_input(m, device)
            fp32_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                           cast_forward_inputs=not keep_input)
            fully_shard(m, mesh=mesh, mp_policy=fp32_mp, reshard_after_forward=reshard_after_forward)
    mp = MixedPrecisionPolicy(param_dtype=None if no_master else param_dtype, reduce_dtype=reduce_dtype)
    for m in units:
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if no_master:
        return pol.replace(name=f"{pol.name}+fsdp2")
    return pol.replace(name=f"{pol.name}+fsdp2", weights="fp32", master=None)


def _outermost_fp32_modules(model, pol):
    """(name, module) of the modules the policy keeps in fp32 whose parent it does not."""
    kept: set[str] = set()
    out = []
    for name, m in model.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ("" if name else None)
        if parent is not None and parent in kept:
            kept.add(name)
        elif name and pol.keeps_fp32(name, type(m).__name__):
            kept.add(name)
            out.append((name, m))
    return out
