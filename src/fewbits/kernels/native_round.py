"""The C rounding kernels (csrc/round32.c) for float32 values on a CPU, in every mode: float
formats of floatround's scaled kind (fp8, fp6, fp4, fp16, ints ...), fixed kind (bf16, tf32)
and pow2 kind (E8M0), and codebooks of at most 16 values (NF4 ...). The compiled torch kernels
ran stochastic rounding, E8M0 and codebooks well below memory speed; these run at it (see
benchmarks/bench_round.py). Built for AVX-512 only: elsewhere the compiled torch kernels are
faster, and stay.

They run under the default backend ("auto") when fewbits.kernels.native could build its
library; `use_backend("eager" | "compiled")`, FEWBITS_NATIVE=0 and `native.turned_off()` keep the
torch kernels. Results are bit-identical to those kernels and to the scalar reference (tests in
tests/kernels/test_native_round.py, over every boundary input of every format they take).
"""
from __future__ import annotations

import functools

import torch

from ..formats import MODES, LookupFormat
from . import floatround as fr
from . import native
from .compile import default_backend
from .lookupround import f32_thresholds

# the parameter layout of round32.c (its P_* enum)
_FINISH_KEYS = ("maxp", "maxn", "ovfp", "ovfn", "infp", "infn", "sat", "signed", "negzero", "negres", "minres")


@functools.lru_cache(maxsize=256)
def float_params(fmt, overflow: str, kind: str) -> torch.Tensor:
    """int32 [m (pow2: the exponent codes' parity flip), m_sub, emin_b, clamp, *finish_spec] of
    fmt in the float32 domain: round32.c's P_* layout."""
    sp = fr._static_params(fmt, fr.F32, overflow)
    spec = fr.finish_spec(fmt, fr.F32, overflow)
    first = sp[fr.I_PFLIP] if kind == "pow2" else sp[fr.I_M]
    vals = [first, sp[fr.I_MSUB], sp[fr.I_EMINB], sp[fr.I_CLAMP], *spec]
    assert len(spec) == len(_FINISH_KEYS)
    return torch.tensor([int(v) for v in vals], dtype=torch.int32)


@functools.lru_cache(maxsize=256)
def _lut_tables(fmt: LookupFormat, mode: str):
    """(thresholds float32 [<= 15], values float32 [n]) for the C codebook kernels, or None.
    mode="bitsandbytes" needs nothing of its own: its bounds are the thresholds."""
    if fmt.num_values > 16:
        return None
    th = f32_thresholds(fmt, "down" if mode == "stochastic" else mode)
    if th is None or any(b < a for a, b in zip(th, th[1:])):
        return None
    values = torch.tensor(fmt.table, dtype=torch.float64)
    if not torch.equal(values.float().double(), values):
        return None
    return torch.tensor(th, dtype=torch.float32), values.float()


def _library():
    """The native library where its rounding kernels are vectorized (built for AVX-512), else None."""
    lib = native.library()
    return lib if lib is not None and lib.fb_round32_vectorized() else None


def _eligible(t: torch.Tensor, out) -> bool:
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and (out is None or (out.is_contiguous() and out.dtype == torch.float32))
            and default_backend())


def try_round(t: torch.Tensor, fmt, mode: str, overflow: str, seed, out=None) -> torch.Tensor | None:
    """fb.round of a contiguous float32 CPU tensor by a C kernel, or None where none applies."""
    if not _eligible(t, out):
        return None
    if isinstance(fmt, LookupFormat):
        if mode == "toward_zero" and 0.0 not in fmt.table:
            return None
        tables = _lut_tables(fmt, mode)
        if tables is None:
            return None
        lib = _library()
        if lib is None:
            return None
        dst = out if out is not None else torch.empty_like(t)
        th, values = tables
        if mode == "stochastic":
            return native.round_lut_sr_f32(lib, t, dst, th, values, seed)
        return native.round_lut_f32(lib, t, dst, th, values)
    if not fr.fits(fmt, fr.F32):
        return None
    kind = fr.kernel_kind(fmt, fr.F32)
    if kind not in native.FLOAT_KINDS:
        return None
    if kind == "fixed" and not 0 <= fr._static_params(fmt, fr.F32, overflow)[fr.I_M] <= 22:
        return None  # nothing to drop (fp32 itself): the torch kernel
    lib = _library()
    if lib is None:
        return None
    dst = out if out is not None else torch.empty_like(t)
    return native.round_float_f32(lib, t, dst, float_params(fmt, overflow, kind), kind, MODES.index(mode), seed)
