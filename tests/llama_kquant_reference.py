"""A small numpy port of llama.cpp's reference k-quant quantizers (ggml-quants.c:
quantize_row_q4_K_ref / q5_K_ref / q6_K_ref with make_qkx2_quants and make_qx_quants), written
from reading them, as an oracle of the algorithm for the tests: it returns the values the
reference's blocks dequantize to (the scales, minimums and codes llama.cpp would choose).

float32 arithmetic as in C, sums accumulated left to right (np.cumsum); nearest_int is round
half to even (the C code's 1.5 * 2^23 trick under the default rounding mode). Vectorized over
blocks; not part of fewbits (tests only)."""
from __future__ import annotations

import numpy as np

f32 = np.float32


def _sum(a):
    return np.cumsum(a, axis=-1, dtype=f32)[..., -1] if a.shape[-1] else np.zeros(a.shape[:-1], f32)


def _nearest(a):
    return np.rint(a.astype(f32))


def _fp16(a):
    return a.astype(np.float16).astype(f32)


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep):
    """(scale, the_min >= 0, L) per row of x [n, k]: llama.cpp's min/scale search (use_mad false)."""
    x = x.astype(f32)
    w = weights.astype(f32)
    mn = np.minimum(x.min(-1), f32(0))
    mx = x.max(-1)
    sum_w, sum_x = _sum(w), _sum(w * x)
    flat = mx == mn
    span = np.where(flat, f32(1), mx - mn).astype(f32)
    iscale = (f32(nmax) / span).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    L = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(f32)
    diff = scale[:, None] * L + mn[:, None] - x
    best = _sum(w * diff * diff)
    for i in range(nstep + 1):
        isc = ((f32(rmin) + f32(rdelta) * f32(i) + f32(nmax)) / span).astype(f32)
        La = np.clip(_nearest(isc[:, None] * (x - mn[:, None])), 0, nmax).astype(f32)
        sum_l, sum_l2, sum_xl = _sum(w * La), _sum(w * La * La), _sum(w * La * x)
        D = (sum_w * sum_l2 - sum_l * sum_l).astype(f32)
        ok = D > 0
        Ds = np.where(ok, D, f32(1))
        this_scale = ((sum_w * sum_xl - sum_x * sum_l) / Ds).astype(f32)
        this_min = ((sum_l2 * sum_x - sum_l * sum_xl) / Ds).astype(f32)
        pos = this_min > 0
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale).astype(f32)
        this_min = np.where(pos, f32(0), this_min).astype(f32)
        d = this_scale[:, None] * La + this_min[:, None] - x
        mad = _sum(w * d * d)
        better = ok & (mad < best) & ~flat
        L = np.where(better[:, None], La, L)
        best = np.where(better, mad, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, f32(0), scale)
    L = np.where(flat[:, None], f32(0), L)
    return scale.astype(f32), (-mn).astype(f32), L


def make_qx_quants(x, nmax):
    """(scale, L in -nmax..nmax-1) per row of x [n, k]: llama.cpp's rmse_type 1 search (weights x^2)."""
    x = x.astype(f32)
    idx = np.abs(x).argmax(-1)
    mx = np.take_along_axis(x, idx[:, None], -1)[:, 0]
    zero = np.abs(mx) < f32(1e-30)
    mxs = np.where(zero, f32(1), mx)
    w = x * x
    iscale = (-f32(nmax) / mxs).astype(f32)
    L = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1).astype(f32)
    sumlx, suml2 = _sum(w * x * L), _sum(w * L * L)
    scale = (sumlx / suml2).astype(f32)
    best = (scale * sumlx).astype(f32)
    for i in range(-9, 10):
        if i == 0:
            continue
        isc = (-(f32(nmax) + f32(0.1) * f32(i)) / mxs).astype(f32)
        La = np.clip(_nearest(isc[:, None] * x), -nmax, nmax - 1).astype(f32)
        slx, sl2 = _sum(w * x * La), _sum(w * La * La)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        sc = (slx / np.where(sl2 > 0, sl2, f32(1))).astype(f32)
        L = np.where(better[:, None], La, L)
        scale = np.where(better, sc, scale)
        best = np.where(better, (sc * slx).astype(f32), best)
    return np.where(zero, f32(0), scale).astype(f32), np.where(zero[:, None], f32(0), L)


def q45_k_reference(x: np.ndarray, bits: int) -> np.ndarray:
    """The values quantize_row_q4_K_ref (bits 4) / q5_K_ref (bits 5) blocks dequantize to, for
    rows of x [rows, k * 256]."""
    nmax = 2 ** bits - 1
    rmin, nstep = (-1.0, 20) if bits == 4 else (-0.5, 15)
    shape = x.shape
    sub = x.astype(f32).reshape(-1, 32)  # sub-blocks
    av = np.sqrt(_sum(sub * sub) / f32(32)).astype(f32)
    scales, mins, L = make_qkx2_quants(sub, av[:, None] + np.abs(sub), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale, max_min = scales.max(-1), mins.max(-1)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0)).astype(f32)
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0)).astype(f32)
    ls = np.minimum(63, _nearest(inv_scale[:, None] * scales)).astype(f32)
    lm = np.minimum(63, _nearest(inv_min[:, None] * mins)).astype(f32)
    d = _fp16((max_scale / f32(63)).astype(f32))
    dmin = _fp16((max_min / f32(63)).astype(f32))
    ds = (d[:, None] * ls).astype(f32).reshape(-1)
    dm = (dmin[:, None] * lm).astype(f32).reshape(-1)
    safe = np.where(ds == 0, f32(1), ds)
    requant = np.clip(_nearest((sub + dm[:, None]) / safe[:, None]), 0, nmax).astype(f32)
    L = np.where((ds == 0)[:, None], L, requant)
    return (ds[:, None] * L - dm[:, None]).astype(f32).reshape(shape)


def q6_k_reference(x: np.ndarray) -> np.ndarray:
    """The values quantize_row_q6_K_ref blocks dequantize to, for rows of x [rows, k * 256]."""
    shape = x.shape
    sub = x.astype(f32).reshape(-1, 16)
    scales, L = make_qx_quants(sub, 32)
    scales = scales.reshape(-1, 16)
    idx = np.abs(scales).argmax(-1)
    max_scale = np.take_along_axis(scales, idx[:, None], -1)[:, 0]
    empty = max_scale == 0
    iscale = (f32(-128) / np.where(empty, f32(1), max_scale)).astype(f32)
    d = np.where(empty, f32(0), _fp16((f32(1) / iscale).astype(f32)))
    ls = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(f32)
    ls = np.where(empty[:, None], f32(0), ls)
    ds = (d[:, None] * ls).astype(f32).reshape(-1)
    safe = np.where(ds == 0, f32(1), ds)
    requant = np.clip(_nearest(sub / safe[:, None]), -32, 31).astype(f32)
    L = np.where((ds == 0)[:, None], L, requant)
    return (ds[:, None] * L).astype(f32).reshape(shape)
