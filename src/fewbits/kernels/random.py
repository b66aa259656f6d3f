"""Counter-based random words for stochastic rounding: word i = hash(seed, i).

A hash of the element index (rather than a stream from a generator) is reproducible whatever the
threading or fusion, costs no memory pass, and has an obviously-equal Python reference.
"""
from __future__ import annotations

import functools

import torch

M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # both multipliers < 2**31, so 32-bit x multiplier never overflows int64
_C2 = 0x5BD1E995


def _mix_ref(h: int) -> int:
    h ^= h >> 16
    h = (h * _C1) & M32
    h ^= h >> 15
    h = (h * _C2) & M32
    h ^= h >> 16
    return h


def random_word_reference(seed_lo: int, seed_hi: int, index: int) -> int:
    """The 32-bit random word of element `index` (Python ints; the definition)."""
    h = _mix_ref((index & M32) ^ seed_lo)
    return _mix_ref(h ^ seed_hi ^ (index >> 32))


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * _C1) & M32
    h = h ^ (h >> 15)
    h = (h * _C2) & M32
    return h ^ (h >> 16)


def random_words(index: torch.Tensor, seed_lo, seed_hi) -> torch.Tensor:
    """Vectorized random_word_reference over an int64 index tensor (seeds: ints or 0-d tensors)."""
    h = _mix((index & M32) ^ seed_lo)
    return _mix(h ^ seed_hi ^ (index >> 32))


def draw_seed(generator: torch.Generator | None = None) -> tuple[int, int]:
    """Two 31-bit seeds drawn from `generator` (or torch's global RNG): reproducible under manual_seed."""
    s = torch.randint(0, 2 ** 31 - 1, (2,), generator=generator, dtype=torch.int64)
    return int(s[0]), int(s[1])



@functools.lru_cache(maxsize=64)
def _cached_on(values: tuple, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def ints_on(values: tuple, device, dtype: torch.dtype = torch.int64, fill: dict | None = None) -> torch.Tensor:
    """A short vector of Python ints on `device`: `values` with entry i replaced by fill[i].

    On an accelerator this avoids a blocking host-to-device copy per call: `values` is copied
    there once and cached, and the `fill` entries (per-call seeds) are written by fill kernels
    that take the value as an argument. On the CPU: a plain torch.tensor."""
    dev = torch.device(device)
    if dev.type == "cpu":
        if fill:
            values = tuple(fill.get(i, v) for i, v in enumerate(values))
        return torch.tensor(values, dtype=dtype)
    base = _cached_on(tuple(values), str(dev), dtype)
    if not fill or all(values[i] == v for i, v in fill.items()):
        return base  # shared: the kernels only read it
    t = base.clone()
    for i, v in fill.items():
        t[i] = v
    return t


def seed_tensor(seed: tuple[int, int], device) -> torch.Tensor:
    """The seed pair as an int64 tensor [2] on `device` (see ints_on)."""
    return ints_on((0, 0), device, fill={0: int(seed[0]), 1: int(seed[1])})
