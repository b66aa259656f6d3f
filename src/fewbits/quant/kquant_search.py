"""The k-quant searches: each group's scale (and float minimum) of a super-block scheme (GGUF's
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) before the two-level rounding, and the choice of its sub-scale codes around the
super-block scale, as llama.cpp's reference k-quant quantizers weigh the error (make_qkx2_quants,
make_qx_quants).

The super-block kind of fewbits.quant.scales (SuperBlockScales) is the only caller: it asks
group_params for the groups' scales, rounds them to two levels, and asks refine_codes for the final
codes. Everything here is a leaf: float64 searches over a group view [rows, groups, n] that call
back into nothing of fewbits.quant. Each search runs in C (kernels/csrc/kquant.c) where the native
library serves (CPU float32, groups of at most 256 values), else in torch; the two agree bit for
bit (tests/quant/test_kquant_fast.py).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels import native
from .scheme import QuantScheme

# the candidate scales of the searches, as llama.cpp's k-quant quantizers try them:
# float minimums (make_qkx2_quants): iscale = (nmax + rmin + rdelta * i) / (max - min), i = 0..nstep,
# (rmin, rdelta, nstep) by element width (Q4_K, Q5_K: the reference quantizers'; Q2_K: its
# importance-matrix quantizer's make_qkx3_quants range, the reference's being (-0.5, 0.1, 15) on
# the absolute error); symmetric (make_qx_quants):
# iscale = -(nmax + 0.1 * i) / max, i = -9..9
_FLOAT_MIN_SEARCH = {2: (-0.9, 0.05, 36), 4: (-1.0, 0.1, 20), 5: (-0.5, 0.1, 15)}
_FLOAT_MIN_SEARCH_OTHER = (-1.0, 0.1, 20)
_SYMMETRIC_STEPS = (0,) + tuple(i for i in range(-9, 10) if i)
_SEARCH_VALUES = 1 << 20  # values searched at a time (the search works in float64)


# ---------------------------------------------------------------------------------------------
# each group's (scale, -minimum) before the two-level rounding
# ---------------------------------------------------------------------------------------------
def group_params(g: torch.Tensor, valid, scheme: QuantScheme, weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's (scale, -minimum) of a super-block scheme before the two-level rounding,
    float64 [rows, groups] (symmetric: (signed scale, None)); in row chunks of bounded size.

    Float minimums, unsigned grid 0..nmax (make_qkx2_quants' rule): min = min(group min, 0);
    "absmax": scale = (max - min) / nmax; "mse": weights w = sqrt(mean x^2) + |x|, and for each
    candidate iscale the codes L = clamp(round(iscale * (x - min)), 0, nmax) and the weighted
    least-squares (scale, min) of x ~ scale * L + min (min held at 0 when the fit is positive);
    the pair of least weighted squared error wins (the plain range is the first candidate).
    Symmetric, grid lowest..max (make_qx_quants' rule, weights x^2): "absmax": amax / max;
    "mse": for each candidate iscale = -(nmax + 0.1 i) / (the value of largest magnitude), with
    nmax = -lowest, codes L = clamp(round(iscale * x), lowest, max) and scale = sum(w x L) /
    sum(w L^2); the largest sum(w x L)^2 / sum(w L^2) (least weighted error) wins.
    Padding entries have weight 0 and are left out of the minimum and maximum.
    weights: None, or float64 of g's shape (importance_weights: 0 on padding): the "mse" search
    under these weights instead of its own, whatever the scheme's scale_method.

    Every sum is a group_sum (its order fixed). "mse" runs in kquant.c where the native library
    serves (CPU float32; fewbits.kernels.native), else as group_params_reference; the two agree
    bit for bit (tests/quant/test_kquant_fast.py)."""
    if scheme.scale_method == "mse" or weights is not None:
        lib = _kquant_library(g, valid)
        if lib is not None:
            lowest, top = _element_range(scheme)
            if scheme.zero_point == "float":
                return native.kquant_float_min(lib, g, valid, top, _float_min_candidates(scheme), weights)
            return native.kquant_symmetric(lib, g, valid, lowest, top, _symmetric_candidates(scheme), weights), None
    return group_params_reference(g, valid, scheme, weights)


def group_params_reference(g: torch.Tensor, valid, scheme: QuantScheme, weights: torch.Tensor | None = None):
    """group_params in torch, in row chunks of bounded size (the reference of kquant.c)."""
    rows, groups, n = g.shape
    step = max(1, _SEARCH_VALUES // max(groups * n, 1))
    scales, mins = [], []
    for r0 in range(0, rows, step):
        x = g[r0:r0 + step].to(torch.float64)
        w = weights[r0:r0 + step].to(torch.float64) if weights is not None else None
        if scheme.zero_point == "float":
            s, m = _float_min_params(x, valid, scheme, w)
            mins.append(m)
        else:
            s = _symmetric_params(x, valid, scheme, w)
        scales.append(s)
    if not scales:
        empty = g.new_zeros((rows, groups), dtype=torch.float64)
        return empty, (empty.clone() if scheme.zero_point == "float" else None)
    return torch.cat(scales), (torch.cat(mins) if mins else None)


def importance_weights(g: torch.Tensor, valid, importance: torch.Tensor) -> torch.Tensor:
    """The weight of every value of the group view g [rows, groups, n] under importance-weighted
    rounding, float64 of g's shape: importance * sqrt(sigma2 + x^2), sigma2 the mean x^2 of the
    value's row (its real entries), 0 on padding. importance: each value's column's importance
    (the calibration's mean square input of that column, fewbits.quant.importance), broadcast
    to g ([1, groups, n] or g's shape).

    The form is llama.cpp's (quantize_row_q4_0_impl and its kin, which weigh its importance
    matrix so): the mean square input alone is what a layer's output error weighs each weight's
    error by (the diagonal of GPTQ's Hessian); the sqrt(sigma2 + x^2) factor leans the search
    toward a row's large weights, which llama.cpp measured to generalize better than the
    diagonal alone on little calibration."""
    x = g.to(torch.float64)
    x2 = x * x
    if valid is not None:
        x2 = torch.where(valid, x2, torch.zeros_like(x2))
        count = valid.sum().clamp(min=1).to(torch.float64)
    else:
        count = torch.tensor(float(max(g.shape[1] * g.shape[2], 1)), dtype=torch.float64)
    sigma2 = (x2.sum(dim=(1, 2)) / count).reshape(-1, 1, 1)
    w = importance.to(device=g.device, dtype=torch.float64) * torch.sqrt(sigma2 + x2)
    if valid is not None:
        w = torch.where(valid, w, torch.zeros_like(w))
    return w.expand(g.shape).contiguous()


def _float_min_params(x: torch.Tensor, valid, scheme: QuantScheme, w: torch.Tensor | None = None):
    nmax = float(2 ** scheme.format.bits - 1)
    inf = torch.tensor(float("inf"), dtype=x.dtype)
    lo = (torch.where(valid, x, inf) if valid is not None else x).amin(-1)
    lo = torch.where(lo < 0, lo, torch.zeros_like(lo))  # min(lo, 0), and +0.0 for either zero
    hi = (torch.where(valid, x, -inf) if valid is not None else x).amax(-1)
    span = hi - lo
    flat = span <= 0  # constant (or all-zero) groups: scale 0, the minimum holds the value
    safe_span = torch.where(flat, torch.ones_like(span), span)
    scale = torch.where(flat, torch.zeros_like(span), span / nmax)
    minimum = lo
    if scheme.scale_method == "mse" or w is not None:
        w = _weights(x, valid, scheme) if w is None else w
        sw, sx, sx2 = group_sum(w), group_sum(w * x), group_sum(w * x * x)
        xs = x - lo.unsqueeze(-1)

        def weighted_error(s, m, sl, sl2, sxl):  # sum w (s L + m - x)^2, from the sums
            return (s * s * sl2 + 2 * s * m * sl - 2 * s * sxl + m * m * sw - 2 * m * sx + sx2)

        def sums(iscale):
            L = torch.round(xs * iscale.unsqueeze(-1)).clamp_(0.0, nmax)
            wl = w * L
            return group_sum(wl), group_sum(wl * L), group_sum(wl * x)

        best = weighted_error(scale, minimum, *sums(1.0 / torch.where(flat, torch.ones_like(scale), scale)))
        for c in _float_min_candidates(scheme):
            sl, sl2, sxl = sums(c / safe_span)  # torch: safe_span.reciprocal() * c
            D = sw * sl2 - sl * sl
            ok = (D > 0) & ~flat
            safe_D = torch.where(ok, D, torch.ones_like(D))
            s = (sw * sxl - sx * sl) / safe_D
            m = (sl2 * sx - sl * sxl) / safe_D
            positive = m > 0
            s = torch.where(positive, sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), s)
            m = torch.where(positive, torch.zeros_like(m), m)
            err = weighted_error(s, m, sl, sl2, sxl)
            better = ok & (s > 0) & (err < best)
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            minimum = torch.where(better, m, minimum)
    return scale, -minimum


def _symmetric_params(x: torch.Tensor, valid, scheme: QuantScheme, w: torch.Tensor | None = None):
    fmt = scheme.format
    if scheme.scale_method != "mse" and w is None:
        return x.abs().amax(-1) / float(fmt.max)
    lowest, top = float(fmt.lowest), float(fmt.max)
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)  # the value of largest magnitude
    zero = peak == 0
    safe_peak = torch.where(zero, torch.ones_like(peak), peak)
    w = _weights(x, valid, scheme) if w is None else w
    scale = best = None
    for c in _symmetric_candidates(scheme):
        iscale = c / safe_peak  # torch: safe_peak.reciprocal() * c
        L = torch.round(x * iscale.unsqueeze(-1)).clamp_(lowest, top)
        wl = w * L
        sumlx, suml2 = group_sum(wl * x), group_sum(wl * L)
        ok = suml2 > 0
        safe_l2 = torch.where(ok, suml2, torch.ones_like(suml2))
        s = sumlx / safe_l2
        merit = sumlx * s  # sum(w x L)^2 / sum(w L^2): the larger, the smaller the weighted error
        if scale is None:
            scale, best = torch.where(ok, s, torch.zeros_like(s)), torch.where(ok, merit, torch.zeros_like(s))
            continue
        better = ok & (merit > best)
        best = torch.where(better, merit, best)
        scale = torch.where(better, s, scale)
    return torch.where(zero, torch.zeros_like(scale), scale)


# ---------------------------------------------------------------------------------------------
# the sub-scale codes under the super-block scales
# ---------------------------------------------------------------------------------------------
def refine_codes(g, valid, scheme, sub, scale, neg_min, d, dmin, weights=None):
    """Each group's sub-scale codes (and sub-minimum codes) under the super-block scales d (dmin):
    of the codes just below and just above scale / d (-minimum / dmin), the pair whose elements,
    rounded under it, have the least weighted squared error (the weights of group_params); the
    first of equal ones, in the order (floor, floor), (floor, ceil), (ceil, floor), (ceil, ceil).
    By kquant.c where the native library serves (see group_params), else by
    refine_codes_reference; the two agree bit for bit. sub: the sub-scale format (an IntFormat);
    weights: as group_params'."""
    groups = g.shape[1]
    per = scheme.super_block // scheme.group_size
    lowest, top = sub.lowest, sub.max

    def neighbours(values, dd):  # dd [rows, super-blocks] expanded to its groups, as scales.expand_super
        de = dd.repeat_interleave(per, dim=1)[:, :groups].to(torch.float64)
        zero = de == 0
        c = torch.floor(values / torch.where(zero, torch.ones_like(de), de))
        pair = [c.clamp(lowest, top), (c + 1).clamp(lowest, top)]
        return [torch.where(zero, torch.zeros_like(p), p) for p in pair], de

    sc_pairs, de = neighbours(scale, d)
    m_pairs = dme = None
    if neg_min is not None:
        m_pairs, dme = neighbours(neg_min, dmin)
    lo_q, hi_q = _element_range(scheme)
    lib = _kquant_library(g, valid)
    if lib is not None:
        codes, mcodes = native.kquant_refine(lib, g, valid, lo_q, hi_q, de, sc_pairs, dme, m_pairs, weights)
    else:
        codes, mcodes = refine_codes_reference(g, valid, scheme, de, sc_pairs, dme, m_pairs, weights)
    return codes.to(torch.int64), (mcodes.to(torch.int64) if mcodes is not None else None)


def refine_codes_reference(g, valid, scheme, de, sc_pairs, dme, m_pairs, weights=None):
    """refine_codes' choice in torch (the reference kquant.c is tested against): float64
    codes [rows, groups] (and sub-minimum codes, or None)."""
    rows, groups, n = g.shape
    lo_q, hi_q = _element_range(scheme)
    step = max(1, _SEARCH_VALUES // max(groups * n, 1))
    out_s, out_m = [], []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = g[r0:r1].to(torch.float64)
        w = _weights(x, valid, scheme) if weights is None else weights[r0:r1].to(torch.float64)
        best = best_s = best_m = None
        for cs in sc_pairs:
            for cm in (m_pairs if m_pairs is not None else [None]):
                s_ = (de[r0:r1] * cs[r0:r1]).unsqueeze(-1)
                m_ = -(dme[r0:r1] * cm[r0:r1]).unsqueeze(-1) if cm is not None else 0.0
                q = torch.round((x - m_) / torch.where(s_ == 0, torch.ones_like(s_), s_)).clamp_(lo_q, hi_q)
                err = group_sum(w * (q * s_ + m_ - x) ** 2)
                if best is None:
                    best, best_s, best_m = err, cs[r0:r1], (cm[r0:r1] if cm is not None else None)
                    continue
                better = err < best
                best = torch.where(better, err, best)
                best_s = torch.where(better, cs[r0:r1], best_s)
                if cm is not None:
                    best_m = torch.where(better, cm[r0:r1], best_m)
        out_s.append(best_s)
        out_m.append(best_m)
    if not out_s:
        empty = g.new_zeros((rows, groups), dtype=torch.float64)
        return empty, (empty.clone() if m_pairs is not None else None)
    return torch.cat(out_s), (torch.cat(out_m) if m_pairs is not None else None)


# ---------------------------------------------------------------------------------------------
# helpers of both searches
# ---------------------------------------------------------------------------------------------
def _element_range(scheme: QuantScheme) -> tuple[float, float]:
    """The element grid of a super-block scheme: 0..2^b-1 (float minimums), else lowest..max."""
    fmt = scheme.format
    if scheme.zero_point == "float":
        return 0.0, float(2 ** fmt.bits - 1)
    return float(fmt.lowest), float(fmt.max)


def _float_min_candidates(scheme: QuantScheme) -> list[float]:
    """The constants c of the float-minimum search's candidate scales c / (max - min)."""
    bits = scheme.format.bits
    nmax = float(2 ** bits - 1)
    rmin, rdelta, nstep = _FLOAT_MIN_SEARCH.get(bits, _FLOAT_MIN_SEARCH_OTHER)
    return [rmin + rdelta * i + nmax for i in range(nstep + 1)]


def _symmetric_candidates(scheme: QuantScheme) -> list[float]:
    """The constants c of the symmetric search's candidate scales c / (the value of largest
    magnitude); the first is the plain range."""
    nmax = -float(scheme.format.lowest)
    return [-(nmax + 0.1 * i) for i in _SYMMETRIC_STEPS]


def _weights(x: torch.Tensor, valid, scheme: QuantScheme) -> torch.Tensor:
    """The weights of the k-quant searches, as llama.cpp's reference quantizers weigh the error:
    float minimums sqrt(mean x^2) + |x| (per group), symmetric x^2; 0 on padding. x: float64."""
    if scheme.zero_point == "float":
        count = x.shape[-1] if valid is None else valid.sum(-1).clamp(min=1)
        w = x.abs() + _sqrt(group_sum(x * x) / count).unsqueeze(-1)
    else:
        w = x * x
    if valid is not None:
        w = torch.where(valid, w, torch.zeros_like(w))
    return w


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """The square root rounded to nearest, as IEEE 754 and C's sqrt() define it: torch's own
    float64 sqrt on the CPU is not always (MKL's: about 1 value in 100 comes out one ulp off),
    so the CPU reference takes numpy's; CUDA's double sqrt is correctly rounded."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.sqrt(t.detach().contiguous().numpy()))
    return torch.sqrt(t)


def _kquant_library(g: torch.Tensor, valid):
    """The native library where kquant.c takes this group view (CPU float32, groups of at most
    256 values, not empty), else None (FEWBITS_NATIVE=0, no compiler, another device: torch)."""
    if not g.numel() or not native.kquant_supported(g, valid):
        return None
    return native.library()


def group_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in one fixed order, the order of every sum of the k-quant
    searches, which their C kernel (kernels/csrc/kquant.c) follows too: halving, with m values
    left and h = m // 2, a[i] = a[i] + a[i + m - h] for i < h, then m = m - h, until one is left
    (32 values: a[i] + a[i + 16], then + 8, + 4, + 2, + 1; of an odd m the middle value is
    carried on). torch's own .sum() order depends on the CPU's vector width and the tensor's
    shape, so the searches spell theirs out: they give the same results on every CPU, device
    and path. float64 in, float64 out; an empty last dimension sums to 0."""
    m = t.shape[-1]
    if m == 0:
        return t.sum(-1)
    while m > 1:
        h = m // 2
        head = t[..., :h] + t[..., m - h:m]
        t = head if m == 2 * h else torch.cat([head, t[..., h:m - h]], dim=-1)
        m -= h
    return t[..., 0]
