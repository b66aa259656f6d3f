"""Bindings of round32.c: rounding of contiguous float32 tensors to float/int formats and to
codebooks (native_round.try_round calls them)."""
from __future__ import annotations

import ctypes

import torch


def declare_round32(lib: ctypes.CDLL) -> None:
    """The argument types of round32.c's functions."""
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32
    lib.fb_round_float_f32.argtypes = [p, p, i64, p, i32, i32, u32, u32]
    lib.fb_round_float_f32.restype = i32
    lib.fb_round_lut_f32.argtypes = [p, p, i64, p, i32, p]
    lib.fb_round_lut_f32.restype = None
    lib.fb_round_lut_sr_f32.argtypes = [p, p, i64, p, i32, p, u32, u32]
    lib.fb_round_lut_sr_f32.restype = None
    lib.fb_round32_vectorized.argtypes = []
    lib.fb_round32_vectorized.restype = i32


def _check_flat(x: torch.Tensor, out: torch.Tensor) -> None:
    for t in (x, out):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"native rounding takes contiguous CPU float32 tensors, got {t.dtype} {t.device}")
    if out.numel() != x.numel():
        raise ValueError(f"out has {out.numel()} values for {x.numel()}")


FLOAT_KINDS = ("scaled", "fixed", "pow2")  # round32.c's kind numbers


def round_float_f32(lib, x: torch.Tensor, out: torch.Tensor, params: torch.Tensor, kind: str, mode: int,
                    seed) -> torch.Tensor:
    """x rounded into out by floatround's kernel `kind` (scaled, fixed or pow2) and its finishing
    step; params: int32, round32.c's P_* layout; mode: the index in fewbits.formats.MODES;
    seed: the pair of 31-bit seeds (stochastic rounding)."""
    _check_flat(x, out)
    rc = lib.fb_round_float_f32(x.data_ptr(), out.data_ptr(), x.numel(), params.data_ptr(), FLOAT_KINDS.index(kind),
                                int(mode), int(seed[0]), int(seed[1]))
    if rc != 0:
        raise ValueError(f"fb_round_float_f32 refused kind {kind!r}, mode {mode}")
    return out


def round_lut_f32(lib, x: torch.Tensor, out: torch.Tensor, thresholds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values[#{j: x > thresholds[j]}] (NaN for NaN) into out; float32 thresholds (<= 15,
    ascending) and values (one more)."""
    _check_flat(x, out)
    lib.fb_round_lut_f32(x.data_ptr(), out.data_ptr(), x.numel(), thresholds.data_ptr(), thresholds.numel(),
                         values.data_ptr())
    return out


def round_lut_sr_f32(lib, x: torch.Tensor, out: torch.Tensor, th_down: torch.Tensor, values: torch.Tensor,
                     seed) -> torch.Tensor:
    """Stochastic rounding to the codebook `values` (th_down: x > th_down[j] <=> x >= values[j+1])."""
    _check_flat(x, out)
    lib.fb_round_lut_sr_f32(x.data_ptr(), out.data_ptr(), x.numel(), th_down.data_ptr(), th_down.numel(),
                            values.data_ptr(), int(seed[0]), int(seed[1]))
    return out
