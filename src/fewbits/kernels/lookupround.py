"""Rounding to a codebook (LookupFormat such as NF4), computed in float64.

Neighbours come from a binary search over the sorted table; ties are decided by comparing 2x with
lo + hi, which is exact in float64 for the codebooks LookupFormat admits. Stochastic rounding uses
frac = (x - lo) / (hi - lo) computed in float64, as the reference does.
"""
from __future__ import annotations

import functools

import torch

from ..formats import LookupFormat
from .random import random_words


@functools.lru_cache(maxsize=64)
def _table(fmt: LookupFormat, device: str) -> torch.Tensor:
    return torch.tensor(fmt.table, dtype=torch.float64, device=device)


def lookup_indices(x: torch.Tensor, fmt: LookupFormat, mode: str, seed=(0, 0)) -> torch.Tensor:
    """Codes (int64 indices into fmt.table) of x rounded to the codebook; NaN maps to -1."""
    t = _table(fmt, str(x.device))
    x64 = x.to(torch.float64)
    n = t.numel()
    nan = torch.isnan(x64)
    xc = torch.where(nan, 0.0, x64).clamp(t[0], t[-1])
    i = (torch.searchsorted(t, xc, right=True) - 1).clamp(0, n - 2)
    lo, hi = t[i], t[i + 1]
    exact_lo = xc == lo
    if mode == "up":
        up = ~exact_lo
    elif mode == "down":
        up = xc == hi
    elif mode == "toward_zero":
        up = (xc == hi) | ((~exact_lo) & torch.where((lo < 0) & (hi > 0), hi.abs() < lo.abs(), hi <= 0))
    elif mode == "stochastic":
        idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64).reshape(x.shape)
        r = random_words(idx, seed[0], seed[1])
        frac = (xc - lo) / (hi - lo)
        thr = torch.floor(frac * 2.0 ** 32).to(torch.int64)
        up = (r < thr) | (xc == hi)
    else:
        two_x, s = 2 * xc, lo + hi
        if mode == "nearest_away":
            tie_up = hi.abs() > lo.abs()
        else:
            tie_up = (i % 2) == 1
        up = (two_x > s) | ((two_x == s) & tie_up)
    code = i + up.to(torch.int64)
    return torch.where(nan, -1, code)


def round_lookup(x: torch.Tensor, fmt: LookupFormat, mode: str, seed=(0, 0)) -> torch.Tensor:
    codes = lookup_indices(x, fmt, mode, seed)
    t = _table(fmt, str(x.device))
    vals = t[codes.clamp(min=0)]
    return torch.where(codes < 0, torch.nan, vals).to(x.dtype)
