"""Rounding to a codebook (LookupFormat such as NF4).

For codebooks of up to 32 values the code is a sum of comparisons against the neighbours' sums
(2x > v[i-1] + v[i]), fused into one loop by torch.compile; ties are exact because LookupFormat
only admits codebooks whose midpoints are exact in float64 and 2x is exact. Larger codebooks use
a binary search. Stochastic rounding computes frac = (x - lo) / (hi - lo) in float64, as the
reference does.

mode="bitsandbytes" (bitsandbytes' NF4 rule, LookupFormat.bitsandbytes_bounds) is a float32
rule for every input dtype: code = #{i: float32(x) > b[i]}, the float32 threshold kernel with
its bounds as thresholds (the C kernel takes the same table); codebooks of more than 32 values
by a binary search over the same bounds (torch.bucketize, as bitsandbytes itself).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..formats import LookupFormat
from .compile import compiled
from .random import random_words, seed_tensor

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


# --- float32 fast path: strict float32 thresholds, one compare per boundary --------------------
_F32_MODES = ("nearest_even", "nearest_away", "up", "down", "toward_zero")
_F32_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=256)
def f32_thresholds(fmt: LookupFormat, mode: str) -> tuple[float, ...] | None:
    """Float32 t_i with code = #{i: x > t_i} for every float32 x (None if the codebook has values
    float32 cannot hold). Boundary i decides between v[i-1] and v[i] at m (the midpoint for the
    nearest modes), going up on a tie where the mode says so. mode="bitsandbytes": its bounds."""
    if mode == "bitsandbytes":  # its bounds are its thresholds: code = #{i: x > b[i]}
        return fmt.bitsandbytes_bounds()
    v = fmt.table
    if any(abs(t) > 3e38 or float(np.float32(t)) != t for t in v):
        return None
    ties = _tie_up(fmt, mode) if mode in ("nearest_even", "nearest_away") else None
    # toward_zero (for codebooks holding 0): "down" on the positive side, "up" on the negative
    out = []
    for i in range(1, len(v)):
        if ties is not None:
            m, tie_up = (v[i - 1] + v[i]) / 2, ties[i - 1]
        elif mode == "down" or (mode == "toward_zero" and v[i] > 0):  # code = #{i: x >= v[i]}
            m, tie_up = v[i], True
        else:  # up: code = #{i: x > v[i-1]}
            m, tie_up = v[i - 1], False
        t = np.float32(m)
        if float(t) == m:  # x >= m  <=>  x > the float32 just below m
            t = np.nextafter(t, np.float32(-np.inf)) if tie_up else t
        elif float(t) > m:  # m falls between float32 values: x > m <=> x > the one below m
            t = np.nextafter(t, np.float32(-np.inf))
        out.append(float(t))
    return tuple(out)


def _round_f32(x, values: tuple, thresholds: tuple):
    xf = x.to(torch.float32)
    val = torch.full_like(xf, values[0])
    for v, t in zip(values[1:], thresholds):
        val = torch.where(xf > t, v, val)
    return torch.where(torch.isnan(xf), torch.nan, val).to(x.dtype)


def _round_f32_out(x, out, values: tuple, thresholds: tuple):
    out.copy_(_round_f32(x, values, thresholds))


def _codes_f32(x, thresholds: tuple):
    xf = x.to(torch.float32)
    code = torch.zeros_like(xf, dtype=torch.int64)
    for t in thresholds:
        code = code + (xf > t).to(torch.int64)
    return torch.where(torch.isnan(xf), -1, code)


def _neighbours_f32(xf, values: tuple, th_down: tuple, th_up: tuple):
    """(lo, hi, code_lo, code_hi): the table values just below/above x (equal when x is one, or
    beyond either end). One comparison per boundary: lo is the last value <= x, hi its successor
    unless x equals lo."""
    lo = torch.full_like(xf, values[0])
    nxt = torch.full_like(xf, values[1])
    c_lo = torch.zeros_like(xf, dtype=torch.int32)
    last = len(values) - 1
    for i, td in enumerate(th_down, start=1):
        c = xf > td  # x >= values[i]
        lo = torch.where(c, values[i], lo)
        nxt = torch.where(c, values[min(i + 1, last)], nxt)
        c_lo = c_lo + c.to(torch.int32)
    above = (xf > lo) & (nxt != lo)
    hi = torch.where(above, nxt, lo)
    return lo, hi, c_lo, c_lo + above.to(torch.int32)


def _pair_codes_f32(x, seed, mode: str, values: tuple, th_down: tuple, th_up: tuple):
    """Codes for toward_zero and stochastic (the modes that need both neighbours)."""
    xf = x.to(torch.float32)
    lo, hi, c_lo, c_hi = _neighbours_f32(xf, values, th_down, th_up)
    if mode == "toward_zero":
        straddle = (lo < 0) & (hi > 0)
        pick_hi = torch.where(straddle, hi.abs() < lo.abs(), hi <= 0)
    else:  # stochastic; the probability in float64, as the reference computes it
        x64, lo64, hi64 = xf.to(torch.float64), lo.to(torch.float64), hi.to(torch.float64)
        frac = (x64 - lo64) / torch.where(hi64 == lo64, 1.0, hi64 - lo64)
        thr = torch.floor(frac * 4294967296.0).to(torch.int64)
        idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64)
        r = random_words(idx, seed[0].to(torch.int64), seed[1].to(torch.int64))
        pick_hi = (hi != lo) & (r < thr)
    return torch.where(torch.isnan(xf), -1, torch.where(pick_hi, c_hi, c_lo)).to(torch.int64)


def _pair_round_f32(x, seed, mode: str, values: tuple, th_down: tuple, th_up: tuple):
    code = _pair_codes_f32(x, seed, mode, values, th_down, th_up)
    val = torch.full_like(x, values[0], dtype=torch.float32)
    for i, v in enumerate(values[1:], start=1):
        val = torch.where(code >= i, v, val)
    return torch.where(code < 0, torch.nan, val).to(x.dtype)


def _pair_round_f32_out(x, seed, out, mode: str, values: tuple, th_down: tuple, th_up: tuple):
    out.copy_(_pair_round_f32(x, seed, mode, values, th_down, th_up))


_pair_codes_compiled = compiled(_pair_codes_f32)
_pair_round_compiled = compiled(_pair_round_f32)
_pair_round_out_compiled = compiled(_pair_round_f32_out)
_round_f32_compiled = compiled(_round_f32)
_round_f32_out_compiled = compiled(_round_f32_out)
_codes_f32_compiled = compiled(_codes_f32)


def _fast_thresholds(x, fmt, mode):
    if mode == "bitsandbytes":  # a float32 rule for float64 input too: no exact path
        return f32_thresholds(fmt, mode) if fmt.num_values <= UNROLL_MAX else None
    if x.dtype in _F32_INPUTS and fmt.num_values <= UNROLL_MAX:
        if mode in _F32_MODES and not (mode == "toward_zero" and 0.0 not in fmt.table):
            return f32_thresholds(fmt, mode)
        th_down, th_up = f32_thresholds(fmt, "down"), f32_thresholds(fmt, "up")
        if th_down is not None and th_up is not None:
            return th_down, th_up
    return None


def _codes_search(x: torch.Tensor, fmt: LookupFormat, mode: str, seed) -> torch.Tensor:
    """The same codes by binary search (codebooks of any size)."""
    if mode == "bitsandbytes":
        bounds = torch.tensor(fmt.bitsandbytes_bounds(), dtype=torch.float32, device=x.device)
        xf = x.to(torch.float32)
        return torch.where(torch.isnan(xf), -1, torch.bucketize(xf, bounds))
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
    th = _fast_thresholds(x, fmt, mode)
    seed_t = seed_tensor(seed, x.device)
    if th is not None and isinstance(th[0], float):
        return _codes_f32_compiled(flat.numel(), flat, thresholds=th).view(x.shape)
    if th is not None:
        return _pair_codes_compiled(flat.numel(), flat, seed_t, mode=mode, values=fmt.table,
                                    th_down=th[0], th_up=th[1]).view(x.shape)
    seed_t = seed_tensor(seed, x.device)
    codes = _codes_compiled(flat.numel(), flat, _table(fmt, str(x.device)), seed_t,
                            mode=mode, n=fmt.num_values, tie_up=_tie_up(fmt, mode))
    return codes.view(x.shape)


def round_lookup(x: torch.Tensor, fmt: LookupFormat, mode: str, seed=(0, 0), out=None) -> torch.Tensor:
    """x rounded to the codebook (x's shape and dtype); written into `out` if given."""
    th = _fast_thresholds(x, fmt, mode)
    if th is not None and not isinstance(th[0], float):
        flat = x.reshape(-1)
        seed_t = seed_tensor(seed, x.device)
        static = dict(mode=mode, values=fmt.table, th_down=th[0], th_up=th[1])
        if out is not None and out.is_contiguous():
            _pair_round_out_compiled(flat.numel(), flat, seed_t, out.view(-1), **static)
            return out
        r = _pair_round_compiled(flat.numel(), flat, seed_t, **static).view(x.shape)
        return out.copy_(r) if out is not None else r
    if th is not None:
        flat = x.reshape(-1)
        if out is not None and out.is_contiguous():
            _round_f32_out_compiled(flat.numel(), flat, out.view(-1), values=fmt.table, thresholds=th)
            return out
        r = _round_f32_compiled(flat.numel(), flat, values=fmt.table, thresholds=th).view(x.shape)
        return out.copy_(r) if out is not None else r
    r = _round_lookup_general(x, fmt, mode, seed)
    return out.copy_(r) if out is not None else r


def _round_lookup_general(x, fmt, mode, seed):
    if fmt.num_values > UNROLL_MAX:
        codes = _codes_search(x, fmt, mode, seed)
        t = _table(fmt, str(x.device))
        return torch.where(codes < 0, torch.nan, t[codes.clamp(min=0)]).to(x.dtype)
    flat = x.reshape(-1)
    seed_t = seed_tensor(seed, x.device)
    r = _round_compiled(flat.numel(), flat, _table(fmt, str(x.device)), seed_t,
                        mode=mode, n=fmt.num_values, tie_up=_tie_up(fmt, mode))
    return r.view(x.shape)
