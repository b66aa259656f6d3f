"""Rounding to a codebook (LookupFormat such as NF4).

For codebooks of up to 32 values the code is a sum of comparisons against the neighbours' sums
(2x > v[i-1] + v[i]), fused into one loop by torch.compile; ties are exact because LookupFormat
only admits codebooks whose midpoints are exact in float64 and 2x is exact. Larger codebooks use
a binary search. Stochastic rounding computes frac = (x - lo) / (hi - lo) in float64, as the
reference does.
"""
from __future__ import annotations

import functools

import torch

from ..formats import LookupFormat
from .compile import compiled
from .random import random_words

UNROLL_MAX = 32


@functools.lru_cache(maxsize=64)
def _table(fmt: LookupFormat, device: str) -> torch.Tensor:
    return torch.tensor(fmt.table, dtype=torch.float64, device=device)


def _tie_up(fmt: LookupFormat, mode: str) -> tuple[bool, ...]:
    """For each boundary i (between v[i-1] and v[i]): does a tie go to v[i]?"""
    v = fmt.table
    if mode == "nearest_away":
        return tuple(abs(v[i]) > abs(v[i - 1]) for i in range(1, len(v)))
    return tuple(i % 2 == 0 for i in range(1, len(v)))


def _codes_unrolled(x, table, seed, mode: str, n: int, tie_up: tuple):
    """int64 codes of x (any float dtype, 1-D); NaN gives -1."""
    x64 = x.to(torch.float64)
    zero = torch.zeros_like(x64, dtype=torch.int64)
    if mode in ("nearest_even", "nearest_away"):
        two_x = 2 * x64
        code = zero
        for i in range(1, n):
            s = table[i - 1] + table[i]
            up = (two_x > s) | ((two_x == s) & tie_up[i - 1]) if tie_up[i - 1] else two_x > s
            code = code + up.to(torch.int64)
    else:
        down = zero
        up = zero
        for i in range(1, n):
            down = down + (x64 >= table[i]).to(torch.int64)
            up = up + (x64 > table[i - 1]).to(torch.int64)
        if mode == "down":
            code = down
        elif mode == "up":
            code = up
        else:
            lo, hi = table[down], table[up]
            if mode == "toward_zero":
                straddle = (lo < 0) & (hi > 0)
                pick_hi = torch.where(straddle, hi.abs() < lo.abs(), hi <= 0)
                code = torch.where(pick_hi, up, down)
            else:  # stochastic
                idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64)
                r = random_words(idx, seed[0].to(torch.int64), seed[1].to(torch.int64))
                frac = (x64 - lo) / torch.where(hi == lo, 1.0, hi - lo)
                thr = torch.floor(frac * 4294967296.0).to(torch.int64)
                code = torch.where((hi != lo) & (r < thr), up, down)
    return torch.where(torch.isnan(x64), -1, code)


def _round_unrolled(x, table, seed, mode: str, n: int, tie_up: tuple):
    code = _codes_unrolled(x, table, seed, mode, n, tie_up)
    # table[code] without a gather: v[0] + sum of the steps below the code; every partial sum
    # is a table value, so each addition is exact
    value = table[0] + torch.zeros_like(x, dtype=torch.float64)
    for i in range(1, n):
        value = value + torch.where(code >= i, table[i] - table[i - 1], 0.0)
    return torch.where(code < 0, torch.nan, value).to(x.dtype)


_codes_compiled = compiled(_codes_unrolled)
_round_compiled = compiled(_round_unrolled)


def _codes_search(x: torch.Tensor, fmt: LookupFormat, mode: str, seed) -> torch.Tensor:
    """The same codes by binary search (codebooks of any size)."""
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
        thr = torch.floor((xc - lo) / (hi - lo) * 4294967296.0).to(torch.int64)
        up = (r < thr) | (xc == hi)
    else:
        two_x, s = 2 * xc, lo + hi
        tie_up = hi.abs() > lo.abs() if mode == "nearest_away" else (i % 2) == 1
        up = (two_x > s) | ((two_x == s) & tie_up)
    code = i + up.to(torch.int64)
    return torch.where(nan, -1, code)


def lookup_indices(x: torch.Tensor, fmt: LookupFormat, mode: str, seed=(0, 0)) -> torch.Tensor:
    """Codes (int64 indices into fmt.table) of x rounded to the codebook, x's shape; NaN gives -1."""
    if fmt.num_values > UNROLL_MAX:
        return _codes_search(x, fmt, mode, seed)
    flat = x.reshape(-1)
    seed_t = torch.tensor(seed, dtype=torch.int64, device=x.device)
    codes = _codes_compiled(flat.numel(), flat, _table(fmt, str(x.device)), seed_t,
                            mode=mode, n=fmt.num_values, tie_up=_tie_up(fmt, mode))
    return codes.view(x.shape)


def round_lookup(x: torch.Tensor, fmt: LookupFormat, mode: str, seed=(0, 0)) -> torch.Tensor:
    if fmt.num_values > UNROLL_MAX:
        codes = _codes_search(x, fmt, mode, seed)
        t = _table(fmt, str(x.device))
        return torch.where(codes < 0, torch.nan, t[codes.clamp(min=0)]).to(x.dtype)
    flat = x.reshape(-1)
    seed_t = torch.tensor(seed, dtype=torch.int64, device=x.device)
    r = _round_compiled(flat.numel(), flat, _table(fmt, str(x.device)), seed_t,
                        mode=mode, n=fmt.num_values, tie_up=_tie_up(fmt, mode))
    return r.view(x.shape)
