"""Counter-based random words for stochastic rounding: word i = hash(seed, i).

A hash of the element index (rather than a stream from a generator) is reproducible whatever the
threading or fusion, costs no memory pass, and has an obviously-equal Python reference.
"""
from __future__ import annotations

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
