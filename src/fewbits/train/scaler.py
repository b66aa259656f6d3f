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

    def unscale_(self, grads: list[torch.Tensor], nonfinite: torch.Tensor | None = None) -> bool:
        """Divide every gradient by the scale in place; True if any is inf or NaN, or if the
        0-dim flag `nonfinite` (an earlier check on the device: a saturating cast met an inf) is set.

        Sharded gradients (DTensors, as FSDP2 leaves them) are checked shard by shard and the
        verdict is agreed across the ranks (an all-reduce of the flag), so that every rank skips
        the same steps even when only one rank's shard overflowed."""
        group = agreeing_group(grads)
        grads = [local(g) for g in grads]
        if not grads:
            return bool(nonfinite) if nonfinite is not None else False
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        inv = torch.full((), float(_F32(1.0) / _F32(self.scale)), dtype=torch.float32, device=grads[0].device)
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same_dtype in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, inv)
        if nonfinite is not None:
            found = torch.maximum(found, nonfinite.to(device=found.device, dtype=torch.float32))
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
        """Restore state_dict()'s output; ValueError (before any change) if it is malformed."""
        if not isinstance(state, dict) or set(state) != {"mode", "scale", "growth_tracker", "history", "skipped_steps"}:
            raise ValueError("a loss scaler state has the keys mode, scale, growth_tracker, history, skipped_steps")
        if state["mode"] != self.mode:
            raise ValueError(f"checkpoint's loss scaling is {state['mode']!r}, this engine's is {self.mode!r}")
        if not (_real(state["scale"]) and 0 < state["scale"] < float("inf")):
            raise ValueError(f"loss scale {state['scale']!r} is not a positive finite number")
        for key in ("growth_tracker", "skipped_steps"):
            if not (isinstance(state[key], int) and not isinstance(state[key], bool) and state[key] >= 0):
                raise ValueError(f"{key} {state[key]!r} is not a non-negative integer")
        if not (isinstance(state["history"], list) and all(_real(v) for v in state["history"])):
            raise ValueError("the loss scale history is not a list of numbers")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.history = [float(v) for v in state["history"]]
        self.skipped_steps = int(state["skipped_steps"])


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)

