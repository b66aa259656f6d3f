"""A small numpy port of llama.cpp's reference k-quant quantizers (ggml-quants.c:
quantize_row_q2_K_ref / q3_K_ref / q4_K_ref / q5_K_ref / q6_K_ref with make_qkx2_quants,
make_q3_quants and make_qx_quants), written
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


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad=False):
    """(scale, the_min >= 0, L) per row of x [n, k]: llama.cpp's min/scale search (use_mad: the
    weighted absolute error instead of the squared one)."""
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
    def err(diff):
        return _sum(w * np.abs(diff)) if use_mad else _sum(w * diff * diff)

    best = err(scale[:, None] * L + mn[:, None] - x)
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
        mad = err(this_scale[:, None] * La + this_min[:, None] - x)
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


def q2_k_reference(x: np.ndarray) -> np.ndarray:
    """The values quantize_row_q2_K_ref blocks dequantize to, for rows of x [rows, k * 256]."""
    shape = x.shape
    sub = x.astype(f32).reshape(-1, 16)
    scales, mins, L = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(-1, 16), mins.reshape(-1, 16)
    max_scale, max_min = np.maximum(scales.max(-1), f32(0)), np.maximum(mins.max(-1), f32(0))

    def two_level(v, top):
        iscale = (f32(15) / np.where(top > 0, top, f32(1))).astype(f32)
        codes = np.where(top[:, None] > 0, _nearest(iscale[:, None] * v), f32(0)).astype(f32)
        return codes, np.where(top > 0, _fp16((top / f32(15)).astype(f32)), f32(0))

    ls, d = two_level(scales, max_scale)
    lm, dmin = two_level(mins, max_min)
    ds = (d[:, None] * ls).astype(f32).reshape(-1)
    dm = (dmin[:, None] * lm).astype(f32).reshape(-1)
    safe = np.where(ds == 0, f32(1), ds)
    requant = np.clip(_nearest((sub + dm[:, None]) / safe[:, None]), 0, 3).astype(f32)
    L = np.where((ds == 0)[:, None], L, requant)
    return (ds[:, None] * L - dm[:, None]).astype(f32).reshape(shape)


def make_q3_quants(x, nmax):
    """(scale, L in -nmax..nmax-1) per row of x [n, k]: llama.cpp's make_q3_quants with do_rmse
    (weights x^2; up to 5 passes that move one code at a time while the weighted fit improves)."""
    x = x.astype(f32)
    idx = np.abs(x).argmax(-1)
    mx = np.take_along_axis(x, idx[:, None], -1)[:, 0]
    zero = np.abs(mx) < f32(1e-15)
    iscale = (-f32(nmax) / np.where(zero, f32(1), mx)).astype(f32)
    L = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1).astype(f32)
    w = (x * x).astype(f32)
    sumlx, suml2 = _sum(w * x * L), _sum(w * L * L)
    for _ in range(5):
        changed = np.zeros(x.shape[0], bool)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx = (sumlx - wi * xi * li).astype(f32)
            sl2 = (suml2 - wi * li * li).astype(f32)
            pos = slx > 0
            new_l = np.clip(_nearest((xi * sl2).astype(f32) / np.where(pos, slx, f32(1))), -nmax, nmax - 1).astype(f32)
            slx2 = (slx + wi * xi * new_l).astype(f32)
            sl22 = (sl2 + wi * new_l * new_l).astype(f32)
            take = pos & (new_l != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new_l, li)
            sumlx = np.where(take, slx2, sumlx).astype(f32)
            suml2 = np.where(take, sl22, suml2).astype(f32)
            changed |= take
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f32(1)), f32(0)).astype(f32)
    return np.where(zero, f32(0), scale), np.where(zero[:, None], f32(0), L)


def q3_k_reference(x: np.ndarray) -> np.ndarray:
    """The values quantize_row_q3_K_ref blocks dequantize to, for rows of x [rows, k * 256]."""
    shape = x.shape
    sub = x.astype(f32).reshape(-1, 16)
    scales, L = make_q3_quants(sub, 4)
    scales = scales.reshape(-1, 16)
    idx = np.abs(scales).argmax(-1)
    max_scale = np.take_along_axis(scales, idx[:, None], -1)[:, 0]
    empty = max_scale == 0
    iscale = (f32(-32) / np.where(empty, f32(1), max_scale)).astype(f32)
    d = np.where(empty, f32(0), _fp16((f32(1) / iscale).astype(f32)))
    ls = np.clip(_nearest(iscale[:, None] * scales), -32, 31).astype(f32)
    ls = np.where(empty[:, None], f32(0), ls)
    ds = (d[:, None] * ls).astype(f32).reshape(-1)
    safe = np.where(ds == 0, f32(1), ds)
    requant = np.clip(_nearest(sub / safe[:, None]), -4, 3).astype(f32)
    L = np.where((ds == 0)[:, None], L, requant)
    return (ds[:, None] * L).astype(f32).reshape(shape)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=f32)


def _best_index(a):
    """llama.cpp's best_index_int8 over IQ4_NL_VALUES: the nearest entry's index, a tie to the upper."""
    v = IQ4_NL_VALUES
    mu = np.clip(np.searchsorted(v, a, side="left"), 1, len(v) - 1)  # v[mu-1] < a <= v[mu]
    lower = (a - v[mu - 1]) < (v[mu] - a)
    idx = np.where(lower, mu - 1, mu)
    return np.where(a <= v[0], 0, np.where(a >= v[-1], len(v) - 1, idx))


def iq4_nl_reference(x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """The values llama.cpp's quantize_iq4_nl (quantize_row_iq4_nl_impl, ntry 7) blocks dequantize
    to, for rows of x [rows, k * 32]; weights: the importance matrix row [k * 32] or None (x^2)."""
    shape = x.shape
    xb = x.astype(f32).reshape(-1, 32)
    if weights is None:
        w = xb * xb
    else:
        sigma2 = (f32(2) * _sum(xb * xb) / f32(32)).astype(f32)
        qw = np.broadcast_to(weights.astype(f32).reshape(1, -1, 32), (shape[0],) + (shape[-1] // 32, 32)).reshape(-1, 32)
        w = (qw * np.sqrt(sigma2[:, None] + xb * xb)).astype(f32)
    idx = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, idx[:, None], -1)[:, 0]
    empty = np.abs(mx) < f32(1e-15)
    mxs = np.where(empty, f32(1), mx)

    def fit(inv):
        q = IQ4_NL_VALUES[_best_index((inv[:, None] * xb).astype(f32))]
        sqx, sq2 = _sum(w * q * xb), _sum(w * q * q)
        return sqx, sq2

    d0 = (-mxs / IQ4_NL_VALUES[0]).astype(f32)
    sqx, sq2 = fit((f32(1) / d0).astype(f32))
    d = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, f32(1)), f32(0)).astype(f32)
    best = (d * sqx).astype(f32)
    for t in range(-7, 8):
        sqx, sq2 = fit(((f32(t) + IQ4_NL_VALUES[0]) / mxs).astype(f32))
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        dn = (sqx / np.where(sq2 > 0, sq2, f32(1))).astype(f32)
        d = np.where(better, dn, d)
        best = np.where(better, (dn * sqx).astype(f32), best)
    d = np.where(empty, f32(0), d)
    inv = np.where(d == 0, f32(0), f32(1) / np.where(d == 0, f32(1), d)).astype(f32)
    q = IQ4_NL_VALUES[_best_index((inv[:, None] * xb).astype(f32))]
    return (_fp16(d)[:, None] * q).astype(f32).reshape(shape)
