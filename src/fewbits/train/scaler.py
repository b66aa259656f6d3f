"""Loss scaling: multiply the loss so that small gradients survive a narrow gradient format,
divide the gradients back before the update, and skip steps whose gradients overflowed.

Dynamic scaling follows torch.amp.GradScaler exactly (same defaults, same float32 arithmetic,
same order): on an overflow the scale is multiplied by backoff_factor and the growth counter
resets; after growth_interval overflow-free steps in a row it is multiplied by growth_factor
(unless that would be inf). tests/train/test_scaler.py compares the traces step by step.
"""
from __future__ import annotations

import numpy as np
import torch

from .shards import agreeing_group, local

_F32 = np.float32


class LossScaler:
    """mode: 'none' (scale 1, still skips non-finite steps), 'static' (fixed scale) or 'dynamic'."""

    def __init__(self, mode: str = "dynamic", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if mode not in ("none", "static", "dynamic"):
            raise ValueError(f"loss scaling mode {mode!r}: choose none, static or dynamic")
        self.mode = mode
        self.scale = float(_F32(1.0 if mode == "none" else init_scale))
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0
        self.history: list[float] = []   # the scale used by each update, in order
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scale == 1.0 else loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Divide every gradient by the scale in place; True if any is inf or NaN.

        Sharded gradients (DTensors, as FSDP2 leaves them) are checked shard by shard and the
        verdict is agreed across the ranks (an all-reduce of the flag), so that every rank skips
        the same steps even when only one rank's shard overflowed."""
        group = agreeing_group(grads)
        grads = [local(g) for g in grads]
        if not grads:
            return False
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        inv = torch.full((), float(_F32(1.0) / _F32(self.scale)), dtype=torch.float32, device=grads[0].device)
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same_dtype in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, inv)
        if group is not None:
            import torch.distributed as dist
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=None if group == "world" else group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Record this step's outcome and adapt the scale (GradScaler.update's rule)."""
        self.history.append(self.scale)
        if found_inf:
            self.skipped_steps += 1
        if self.mode != "dynamic":
            return
        if found_inf:
            self.scale = float(_F32(self.scale) * _F32(self.backoff_factor))
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:
            with np.errstate(over="ignore"):
                grown = _F32(self.scale) * _F32(self.growth_factor)
            if np.isfinite(grown):
                self.scale = float(grown)
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful

    def state_dict(self) -> dict:
        return {"mode": self.mode, "scale": self.scale, "growth_tracker": self.growth_tracker,
                "history": list(self.history), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.mode:
            raise ValueError(f"checkpoint's loss scaling is {state['mode']!r}, this engine's is {self.mode!r}")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.history = [float(v) for v in state["history"]]
        self.skipped_steps = int(state["skipped_steps"])

