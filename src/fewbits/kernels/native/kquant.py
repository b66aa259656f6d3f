"""Bindings of kquant.c: the k-quants' scale searches (float minimum, symmetric, and the
refinement of sub-scale codes), as fewbits.quant.scales defines them, and the signed-scale search
of a codebook block (IQ4_NL, fewbits.quant.lookup_search)."""
from __future__ import annotations

import ctypes

import torch


KQUANT_MAX_GROUP = 256  # kquant.c's longest group


def declare_kquant(lib: ctypes.CDLL) -> None:
    """The argument types of kquant.c's functions."""
    p, i64, i32, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_double
    lib.fb_kquant_float_min.argtypes = [p, i64, i64, i32, p, p, d, p, i32, p, p]
    lib.fb_kquant_float_min.restype = None
    lib.fb_kquant_symmetric.argtypes = [p, i64, i64, i32, p, p, d, d, p, i32, p]
    lib.fb_kquant_symmetric.restype = None
    lib.fb_kquant_refine.argtypes = [p, i64, i64, i32, p, p, i32, d, d, p, p, p, p, p, p, p, p]
    lib.fb_kquant_refine.restype = None
    lib.fb_lookup_signed.argtypes = [p, i64, i64, i32, p, p, p, i32, p, i32, p]
    lib.fb_lookup_signed.restype = None


LOOKUP_MAX_TABLE = 16  # kquant.c's largest codebook


def lookup_signed(lib, g: torch.Tensor, valid, table, candidates, weights=None) -> torch.Tensor:
    """The signed scale float64 [rows, groups] of a codebook block's search
    (fewbits.quant.lookup_search.signed_lookup_scales_reference): table: the codebook's values
    ascending (at most 16); candidates: the constants c of the candidate inverse scales
    c / (the value of largest magnitude); weights: as kquant_float_min's."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    w = _given_weights(g, weights)
    t, cands = _f64(table), _f64(candidates)
    if not 2 <= t.numel() <= LOOKUP_MAX_TABLE:
        raise ValueError(f"lookup_signed takes a codebook of 2 to {LOOKUP_MAX_TABLE} values, got {t.numel()}")
    scale = torch.empty(g.shape[:2], dtype=torch.float64)
    lib.fb_lookup_signed(g.data_ptr(), count, groups, n, _ptr(mask), _ptr(w), t.data_ptr(), t.numel(),
                         cands.data_ptr(), cands.numel(), scale.data_ptr())
    return scale


def kquant_supported(g: torch.Tensor, valid) -> bool:
    """Whether kquant.c takes this group view: CPU float32 [rows, groups, n], 1 <= n <= 256,
    a mask (if any) of shape [1, groups, n]."""
    return (g.device.type == "cpu" and g.dtype == torch.float32 and g.dim() == 3
            and 1 <= g.shape[-1] <= KQUANT_MAX_GROUP
            and (valid is None or tuple(valid.shape) == (1, *g.shape[1:])))


def _kquant_args(g: torch.Tensor, valid):
    if not kquant_supported(g, valid):
        raise ValueError(f"kquant kernels take a CPU float32 group view [rows, groups, n <= {KQUANT_MAX_GROUP}] "
                         f"and a mask [1, groups, n], got {g.dtype} {g.device} {tuple(g.shape)}")
    g = g.contiguous()
    mask = None if valid is None else valid.reshape(g.shape[1:]).to(torch.uint8).contiguous()
    return g, mask, g.shape[0] * g.shape[1], g.shape[1], g.shape[2]


def _f64(values) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _given_weights(g: torch.Tensor, weights):
    """The given weights of every value of g (float64, g's shape, contiguous), or None."""
    if weights is None:
        return None
    if tuple(weights.shape) != tuple(g.shape):
        raise ValueError(f"kquant weights of shape {tuple(weights.shape)}, expected the group view's {tuple(g.shape)}")
    return weights.to(device="cpu", dtype=torch.float64).contiguous()


def _ptr(t):
    return t.data_ptr() if t is not None else None


def kquant_float_min(lib, g: torch.Tensor, valid, nmax: float, candidates,
                     weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, -minimum) float64 [rows, groups] of the k-quants' float-minimum search
    (fewbits.quant.kquant_search._float_min_params with scale_method "mse"); candidates: the
    constants c of the candidate scales c / (max - min); weights: None (the search's own) or the
    weight of every value, float64 of g's shape (0 on padding)."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    w = _given_weights(g, weights)
    cands = _f64(candidates)
    scale = torch.empty(g.shape[:2], dtype=torch.float64)
    negmin = torch.empty(g.shape[:2], dtype=torch.float64)
    lib.fb_kquant_float_min(g.data_ptr(), count, groups, n, _ptr(mask), _ptr(w),
                            float(nmax), cands.data_ptr(), cands.numel(), scale.data_ptr(), negmin.data_ptr())
    return scale, negmin


def kquant_symmetric(lib, g: torch.Tensor, valid, lowest: float, top: float, candidates,
                     weights=None) -> torch.Tensor:
    """The signed scale float64 [rows, groups] of the k-quants' symmetric search
    (fewbits.quant.kquant_search._symmetric_params with "mse"); candidates: the constants c of the
    candidate scales c / (the value of largest magnitude), the first one the plain range; weights:
    as kquant_float_min's."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    w = _given_weights(g, weights)
    cands = _f64(candidates)
    scale = torch.empty(g.shape[:2], dtype=torch.float64)
    lib.fb_kquant_symmetric(g.data_ptr(), count, groups, n, _ptr(mask), _ptr(w),
                            float(lowest), float(top), cands.data_ptr(), cands.numel(), scale.data_ptr())
    return scale


def kquant_refine(lib, g: torch.Tensor, valid, lo_q: float, hi_q: float, de, code_pair, dme=None, min_pair=None,
                  weights=None):
    """(sub-scale codes, sub-minimum codes or None) float64 [rows, groups]: of the code pairs
    code_pair x min_pair (float64 [rows, groups] each) under the super-block scales de (dme),
    the one of least weighted squared error (fewbits.quant.kquant_search.refine_codes_reference);
    weights: as kquant_float_min's."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    w = _given_weights(g, weights)
    float_min = min_pair is not None
    shape = tuple(g.shape[:2])

    def f64(t):
        t = t.to(torch.float64).contiguous()
        if tuple(t.shape) != shape:
            raise ValueError(f"kquant_refine: a code or scale tensor of shape {tuple(t.shape)}, expected {shape}")
        return t

    keep = [f64(de), *(f64(c) for c in code_pair)]
    if float_min:
        keep += [f64(dme), *(f64(c) for c in min_pair)]
    best_s = torch.empty(shape, dtype=torch.float64)
    best_m = torch.empty(shape, dtype=torch.float64) if float_min else None
    ptr = [t.data_ptr() for t in keep] + ([None, None, None] if not float_min else [])
    lib.fb_kquant_refine(g.data_ptr(), count, groups, n, _ptr(mask), _ptr(w),
                         1 if float_min else 0, float(lo_q), float(hi_q), *ptr, best_s.data_ptr(),
                         best_m.data_ptr() if best_m is not None else None)
    return best_s, best_m
