"""The peak memory of a call as the allocator records it (torch's CPU allocator through the
profiler, CUDA's peak counter): measure_peak_memory, below the estimator and the measured steps
(fewbits.memory.measure) that both use it; and the one probe of this machine's kernels the
estimator needs (bf16_matmul_float32_buffer)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..progress import quiet_native_stderr
from .storage import _storages, tensor_bytes


@dataclass(frozen=True)
class MeasuredMemory:
    """peak = baseline + increase. baseline: bytes of the distinct storages held before the
    measured call (the `held` objects; on CUDA without `held`, everything allocated on the
    device); increase: the highest total of bytes allocated during the call and still alive;
    retained: of those, what was still alive at its end; peak_op: the operator whose allocation
    reached the peak (CPU only)."""
    peak: int
    baseline: int
    increase: int
    retained: int
    peak_op: str
    method: str


def _allocator_bytes(held) -> int:
    """Bytes of the distinct storages of `held` as the CUDA caching allocator counts them
    (blocks of 512 bytes)."""
    return sum(-(-nbytes // 512) * 512 for nbytes in _storages(tuple(held)).values())


@functools.lru_cache(maxsize=None)
def bf16_matmul_float32_buffer() -> bool:
    """Whether this machine's CPU matmul of several bfloat16 rows allocates a float32 buffer of
    its output beside the output (torch's oneDNN path on Xeons with AMX does; AMD EPYC's path
    does not): a probe of one 16 x 64 by 64 x 64 product, measured once per process."""
    a, w = torch.ones(16, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16)
    _, m = measure_peak_memory(lambda: torch.nn.functional.linear(a, w), held=(a, w))
    return m.increase >= 16 * 64 * (2 + 4)


def measure_peak_memory(fn: Callable[[], Any], held: Iterable = (), device: str | torch.device = "cpu"):
    """Run fn() and return (its result, MeasuredMemory).

    On a CPU the measurement is the CPU allocator's own record: torch's profiler reports every
    allocation and free made through it while fn runs (profile_memory=True); the peak of the bytes
    allocated during fn and still alive, plus the bytes of the distinct storages of `held` (the
    model, optimizer, ... alive before fn), is the peak. Frees of memory that existed before fn are
    not seen, so pass objects whose tensors fn does not free (call zero_grad(set_to_none=True)
    before measuring a training step). On CUDA: torch.cuda.max_memory_allocated during fn above
    what was allocated before it, plus the bytes of `held` (everything allocated before fn if
    `held` is empty)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        # as on the CPU: the baseline is what `held` holds before fn (not whatever else the
        # process keeps on the device); without `held`, everything allocated before fn
        baseline = _allocator_bytes(held) if held else start
        result = fn()
        torch.cuda.synchronize(dev)
        increase = torch.cuda.max_memory_allocated(dev) - start
        retained = torch.cuda.memory_allocated(dev) - start
        return result, MeasuredMemory(baseline + increase, baseline, increase, retained, "", "cuda allocator")
    if dev.type != "cpu":
        raise ValueError(f"memory is measured on cpu or cuda, not {dev.type}")
    from torch.profiler import ProfilerActivity, profile

    baseline = tensor_bytes(*held) if held else 0
    # kineto prints a 'USDT: ... profiler_start' / 'profiler_stop' pair on fd 2 per profile
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []
    stack = [(node, "") for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, parent = stack.pop()
        extra = node.extra_fields
        if type(extra).__name__.endswith("Allocation"):
            if extra.device.type == "cpu":
                events.append((node.start_time_ns, extra.id, extra.alloc_size, extra.ptr, parent))
        else:
            parent = node.name
        stack.extend((child, parent) for child in node.children)
    events.sort(key=lambda e: (e[0], e[1]))
    live: dict[int, int] = {}
    total = peak = 0
    peak_op = ""
    for _, _, size, ptr, op in events:
        if size > 0:
            live[ptr] = size
            total += size
            if total > peak:
                peak, peak_op = total, op
        elif ptr in live:  # memory allocated before fn: its free is invisible, see the docstring
            total -= live.pop(ptr)
    return result, MeasuredMemory(baseline + peak, baseline, peak, total, peak_op, "cpu allocator (torch profiler)")


__all__ = ["MeasuredMemory", "measure_peak_memory"]
