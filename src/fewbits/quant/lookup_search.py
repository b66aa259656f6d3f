"""The signed-scale search of a codebook block format (GGUF's IQ4_NL: a block of 32 values, one
fp16 scale d, each value d * table[code]), as llama.cpp's quantize_row_iq4_nl_impl searches it.

The table is not symmetric (-127..113), so the sign of d matters: a negative d puts a group's
value of largest magnitude on the table's long negative end. For each group the candidates are
the plain inverse scale 127 / max (max: the value of largest magnitude, with its sign) and
(t - 127) / max for t = -7..7; under each, every value goes to the nearest table entry, and the
weighted least-squares scale of that choice, d = sum(w q x) / sum(w q^2), scores
sum(w q x)^2 / sum(w q^2) (the larger, the smaller the weighted error). The best d wins.
Weights: x^2 (llama.cpp without an importance matrix), or the given importance weights
(kquant_search.importance_weights: importance * sqrt(sigma^2 + x^2), sigma^2 the row's mean
square; llama.cpp's IQ4_NL takes twice the block's mean square there). The search assigns a tie
between two table entries to the larger one (llama.cpp's best_index_int8); the elements written
are then rounded by fewbits.round (a tie to the even code): the same error, another entry.

Float64 over a group view [rows, groups, n], in C where the native library serves, else in torch
(the reference; the two agree bit for bit, tests/quant/test_lookup_search.py). The caller
(fewbits.quant.scales) rounds d to the scale format and the elements to nearest under it.
"""
from __future__ import annotations

import torch

from ..formats import LookupFormat
from ..kernels import native
from .kquant_search import _kquant_library, group_sum

SEARCH_STEPS = 7  # t = -7..7, llama.cpp's ntry for IQ4_NL
_SEARCH_VALUES = 1 << 20  # values searched at a time (float64 temporaries)
_EMPTY = 1e-15  # a group whose largest magnitude is below this gets scale 0 (llama.cpp's GROUP_MAX_EPS)


def nearest_entries(y: torch.Tensor, table: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """The table entry nearest each of y (float64), a tie going to the larger entry (llama.cpp's
    best_index_int8); beyond the ends, the end entry."""
    return table[torch.bucketize(y, midpoints, right=True)]


def candidates(fmt: LookupFormat) -> list[float]:
    """The constants c of the candidate inverse scales c / (the value of largest magnitude): the
    plain range -lowest first, then t + lowest for t = -7..7."""
    lowest = float(fmt.table[0])
    return [-lowest] + [t + lowest for t in range(-SEARCH_STEPS, SEARCH_STEPS + 1)]


def signed_lookup_scales(g: torch.Tensor, valid, fmt: LookupFormat, weights: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Each group's signed scale d, float64 [rows, groups] (0 for an empty group), by the search in
    the module docstring. g: [rows, groups, n]; valid: the mask of real entries or None (padding
    weighs 0); weights: None (x^2) or float64 of g's shape. In C (kernels/csrc/kquant.c) where the
    native library serves (CPU float32, groups of at most 256, codebooks of at most 16 values),
    else signed_lookup_scales_reference; the two agree bit for bit."""
    lib = _kquant_library(g, valid) if len(fmt.table) <= native.LOOKUP_MAX_TABLE else None
    if lib is not None:
        return native.lookup_signed(lib, g, valid, fmt.table, candidates(fmt), weights)
    return signed_lookup_scales_reference(g, valid, fmt, weights)


def signed_lookup_scales_reference(g: torch.Tensor, valid, fmt: LookupFormat, weights: torch.Tensor | None = None
                                   ) -> torch.Tensor:
    """signed_lookup_scales in torch, in row chunks of bounded size: every value in float64, each
    group's sums in group_sum's order (the definition kquant.c's fb_lookup_signed follows)."""
    rows, groups, n = g.shape
    table = torch.tensor(fmt.table, dtype=torch.float64, device=g.device)
    midpoints = (table[1:] + table[:-1]) / 2
    step = max(1, _SEARCH_VALUES // max(groups * n, 1))
    out = []
    for r0 in range(0, rows, step):
        x = g[r0:r0 + step].to(torch.float64)
        if valid is not None:
            x = torch.where(valid, x, torch.zeros_like(x))
        w = x * x if weights is None else weights[r0:r0 + step].to(torch.float64)
        if valid is not None:
            w = torch.where(valid, w, torch.zeros_like(w))
        peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # [r, groups, 1]: the first such, with its sign
        empty = peak.abs() < _EMPTY
        safe = torch.where(empty, torch.ones_like(peak), peak)
        best = d = None
        for c in candidates(fmt):
            q = nearest_entries(x * (c / safe), table, midpoints)
            wq = w * q
            sqx, sq2 = group_sum(wq * x), group_sum(wq * q)
            ok = sq2 > 0
            cand = torch.where(ok, sqx / torch.where(ok, sq2, torch.ones_like(sq2)), torch.zeros_like(sqx))
            merit = cand * sqx
            if d is None:
                d, best = cand, merit
                continue
            better = ok & (merit > best)
            d = torch.where(better, cand, d)
            best = torch.where(better, merit, best)
        out.append(torch.where(empty.squeeze(-1), torch.zeros_like(d), d))
    if not out:
        return g.new_zeros((rows, groups), dtype=torch.float64)
    return torch.cat(out)
