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
rounding dropped on this rank and adds it to the next step's bucket.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..formats import get_format
from ..kernels import decode, encode
from .casts import native_dtype
from .fp8 import pow2_scale


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
        scale = pow2_scale(float(g.abs().amax()) if g.numel() else 0.0, self.fmt.max)
        codes = encode(g * scale, self.fmt, overflow="saturate")
        header = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
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
    if state.error_feedback:
        state.residuals[key] = g - sent_values
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

