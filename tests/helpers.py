"""Helpers shared by the formats and kernels tests.

- exact comparison of results (NaN by NaN-ness, everything else bit for bit, zeros by sign),
- the scalar reference (fewbits.formats.round_value / encode_value) applied to a whole tensor, with
  the same per-element random words the kernels use for stochastic rounding,
- inputs around every rounding boundary of a format: all its values, all midpoints between
  neighbours, the float neighbours (nextafter) of both, both signs, and the special inputs.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits.formats import FloatFormat, IntFormat, LookupFormat, encode_value, round_value
from fewbits.kernels.random import draw_seed, random_word_reference


def ml_dtypes_rounds_exactly() -> bool:
    """Whether the installed ml_dtypes rounds float64 input directly and gives the nearest E8M0
    value for float32 subnormals, as fewbits does: from 0.7 on. Before 0.7 its casts went through
    float32 first (double rounding) and gave 2^-126 for every float32 in (2^-127, 2^-126)."""
    import ml_dtypes

    major, minor = (int(p) for p in ml_dtypes.__version__.split(".")[:2])
    return (major, minor) >= (0, 7)

INPUT_DTYPES = (torch.float32, torch.float64)
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}

# inputs that every format must handle: zeros, infinities, NaN, tiny and huge values, float32
# subnormals, float64-only magnitudes (they become 0 or inf when the input is float32)
SPECIAL_INPUTS = (
    0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan,
    1e-30, -1e-30, 2.0 ** -149, -(2.0 ** -149), 2.0 ** -130, 3 * 2.0 ** -140, 2.0 ** -126,
    3e38, -3e38, 3.4028235e38, 1e300, -1e300, 5e-324, -5e-324, 1e-310, 2.0 ** -1022,
    0.1, -0.1, 1 / 3, -1 / 3, 0.5, 1.0, -1.0, 1.5, 2.0 ** 20 + 0.5,
)


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------
def fmt_id(fmt) -> str:
    return fb.get_format(fmt).name


def valid_overflows(fmt) -> list[str]:
    """The overflow policies a format admits (saturate always; inf/nan where it has them)."""
    out = []
    for ovf in fb.OVERFLOW_POLICIES:
        try:
            fmt.check_overflow(ovf)
        except ValueError:
            continue
        out.append(ovf)
    return out


def enumerable(fmt) -> bool:
    return fmt.bits <= 20


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------
def _as_f64(a) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        if a.dtype.name == "bfloat16":
            a = a.astype(np.float32)
        a = torch.from_numpy(np.ascontiguousarray(a))
    return a.reshape(-1).to(torch.float64)


def same_mask(got, ref) -> torch.Tensor:
    """Elementwise: both NaN, or equal with the same sign bit (so -0 differs from +0)."""
    a, b = _as_f64(got), _as_f64(ref)
    assert a.shape == b.shape, (a.shape, b.shape)
    na, nb = torch.isnan(a), torch.isnan(b)
    return (na == nb) & (na | ((a == b) & (torch.signbit(a) == torch.signbit(b))))


def assert_same(got, ref, x=None, what: str = "", limit: int = 8):
    """Assert got equals ref bit for bit (NaN by NaN-ness); report the first mismatches."""
    ok = same_mask(got, ref)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero().flatten()
    g, r = _as_f64(got), _as_f64(ref)
    xs = _as_f64(x) if x is not None else None
    lines = [f"{what}: {bad.numel()} of {ok.numel()} differ"]
    for i in bad[:limit].tolist():
        src = f"x={xs[i].item()!r} " if xs is not None else ""
        lines.append(f"  [{i}] {src}got={g[i].item()!r} expected={r[i].item()!r}")
    raise AssertionError("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# the reference on tensors
# ---------------------------------------------------------------------------------------------
def seed_pair(seed: int) -> tuple[int, int]:
    """The seed pair fb.round draws from torch.Generator().manual_seed(seed)."""
    return draw_seed(torch.Generator().manual_seed(seed))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_round(x, fmt, mode="nearest_even", overflow=None, seed: int = 0) -> torch.Tensor:
    """round_value over every element of x (float64 result, x's shape); element i (flat, in
    logical order) gets random word i of the seed pair drawn from Generator().manual_seed(seed)."""
    fmt = fb.get_format(fmt)
    flat = _as_f64(x).tolist()
    if mode == "stochastic":
        lo, hi = seed_pair(seed)
        out = [round_value(v, fmt, mode, overflow, random_word_reference(lo, hi, i)) for i, v in enumerate(flat)]
    else:
        out = [round_value(v, fmt, mode, overflow) for v in flat]
    shape = tuple(x.shape)
    return torch.tensor(out, dtype=torch.float64).reshape(shape)


def reference_encode(x, fmt, mode="nearest_even", overflow=None, seed: int = 0) -> list[int]:
    fmt = fb.get_format(fmt)
    flat = _as_f64(x).tolist()
    if mode == "stochastic":
        lo, hi = seed_pair(seed)
        return [encode_value(v, fmt, mode, overflow, random_word_reference(lo, hi, i)) for i, v in enumerate(flat)]
    return [encode_value(v, fmt, mode, overflow) for v in flat]


def check_round(x: torch.Tensor, fmt, mode: str, overflow=None, seed: int = 0, what: str = "", ref=None):
    """fb.round(x) equals the reference applied to x (then cast to x's dtype) bit for bit."""
    fmt = fb.get_format(fmt)
    if ref is None:
        ref = reference_round(x, fmt, mode, overflow, seed)
    if x.dtype == torch.float32 and bool((ref.isfinite() & (ref.abs() > torch.finfo(torch.float32).max)).any()):
        # a finite result float32 cannot hold is refused, never a silent inf; float64 input gives it
        with pytest.raises(ValueError, match="beyond float32's range"):
            fb.round(x, fmt, mode, overflow, generator=generator(seed))
        x = x.double()
    y = fb.round(x, fmt, mode, overflow, generator=generator(seed))
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape
    ref = ref.to(x.dtype)
    assert_same(y, ref, x, what or f"{fmt.name} {mode} overflow={overflow} {x.dtype}")


# ---------------------------------------------------------------------------------------------
# inputs around the rounding boundaries
# ---------------------------------------------------------------------------------------------
def unique_bits(t: torch.Tensor) -> torch.Tensor:
    """Distinct bit patterns of a 1-D float tensor (keeps -0 and +0 apart; one NaN per pattern)."""
    it = _INT_VIEW[t.dtype]
    return torch.unique(t.contiguous().view(it)).view(t.dtype)


def with_neighbours(t: torch.Tensor) -> torch.Tensor:
    """t and the next representable values of its dtype below and above each element."""
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.full_like(t, -math.inf))
    return torch.cat([t, up, down])


def _next_up_unbounded(fmt, v: float) -> float:
    """The value after fmt.max with an unbounded exponent range (the overflow midpoint's partner)."""
    if isinstance(fmt, FloatFormat):
        ex = math.floor(math.log2(v))
        return v + 2.0 ** (ex - fmt.man_bits)
    if isinstance(fmt, IntFormat):
        return v + 1.0
    return v * 2.0


def format_specials(fmt) -> list[float]:
    """Inputs at the edges of fmt: beyond max (the overflow midpoint, just above it, far above),
    around the smallest positive value, around the lowest value."""
    top = fmt.max
    nxt = _next_up_unbounded(fmt, top)
    pts = [top * 2, top * (1 + 2.0 ** -20), (top + nxt) / 2, nxt, top * 1e10]
    small = getattr(fmt, "min_positive", None) or fmt.min_normal or 1.0
    pts += [small / 2, small * 0.75, small * 1.5, small / 1024, small * 0.25]
    lowest = fmt.lowest
    pts += [lowest - abs(lowest) * 0.5 - 1, lowest * 1.0001]
    return pts + [-p for p in pts]


def _finish_inputs(base: torch.Tensor, dtype) -> torch.Tensor:
    t = unique_bits(base.to(dtype))
    return unique_bits(with_neighbours(t))


@functools.lru_cache(maxsize=256)
def boundary_inputs(fmt, dtype=torch.float32) -> torch.Tensor:
    """Every value of fmt, every midpoint of neighbouring values, their dtype neighbours, both
    signs, the special inputs and the format's edges (enumerable formats: at most 20 bits)."""
    vals = fmt.values()
    mids = (vals[1:] + vals[:-1]) / 2  # exact in float64 for every format fewbits enumerates
    base = torch.cat([vals, mids, torch.tensor(SPECIAL_INPUTS + tuple(format_specials(fmt)), dtype=torch.float64)])
    if not fmt.signed:
        base = torch.cat([base, -base])
    return _finish_inputs(base, dtype)


@functools.lru_cache(maxsize=1024)
def boundary_reference(fmt, dtype, mode: str, overflow, seed: int) -> torch.Tensor:
    """reference_round over boundary_inputs(fmt, dtype), computed once per session."""
    return reference_round(boundary_inputs(fmt, dtype), fmt, mode, overflow, seed)


def check_boundaries(fmt, dtype, mode: str, overflow, seed: int = 7, what: str = ""):
    """check_round over boundary_inputs, sharing the (slow) reference between backends."""
    check_round(boundary_inputs(fmt, dtype), fmt, mode, overflow, seed, what,
                ref=boundary_reference(fmt, dtype, mode, overflow, seed))


def _code_points(fmt, codes) -> list[float]:
    """Values of the given codes and the midpoints to the next code of the same sign."""
    pts = []
    top = 2 ** fmt.bits
    for c in codes:
        v = fmt.decode_code(c)
        pts.append(v)
        if not math.isfinite(v) or c + 1 >= top:
            continue
        if isinstance(fmt, FloatFormat):
            if fmt.code_kind(c + 1) != "finite" or fmt.split_code(c + 1)[0] != fmt.split_code(c)[0]:
                continue
        w = fmt.decode_code(c + 1)
        pts.append(float((Fraction(v) + Fraction(w)) / 2))
    return pts


def sampled_boundary_inputs(fmt, dtype, n: int = 1500, seed: int = 0) -> torch.Tensor:
    """Like boundary_inputs, for a deterministic random sample of n codes (wide formats)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** fmt.bits, n, dtype=np.uint64).tolist()
    pts = _code_points(fmt, [int(c) for c in codes])
    if isinstance(fmt, FloatFormat):
        m = fmt.man_bits
        edge = list(range(0, 4)) + [2 ** m - 1, 2 ** m, 2 ** m + 1]
        sign = 1 << (fmt.bits - 1) if fmt.signed else 0
        edge += [c | sign for c in edge]
        pts += _code_points(fmt, edge)
    base = torch.tensor(pts + list(SPECIAL_INPUTS) + format_specials(fmt), dtype=torch.float64)
    if not fmt.signed:
        base = torch.cat([base, -base])
    return _finish_inputs(base, dtype)


def random_wide_floats(n: int, seed: int, dtype=torch.float64, lo: int = -160, hi: int = 140) -> torch.Tensor:
    """n random values spread over many binades (every sign, magnitude from 2^lo to 2^hi)."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(n, generator=g, dtype=torch.float64)
    ex = torch.randint(lo, hi, (n,), generator=g).to(torch.float64)
    return (mant * torch.exp2(ex)).to(dtype)


def code_bits_of(fmt) -> int:
    return 2 ** fmt.bits if not isinstance(fmt, LookupFormat) else fmt.num_values


# fewbits name -> (ml_dtypes / numpy type name, torch dtype name or None): the formats the oracles share
ORACLE_TYPES = {
    "bf16": ("bfloat16", "bfloat16"),
    "fp16": ("float16", "float16"),
    "fp32": ("float32", "float32"),
    "fp64": ("float64", "float64"),
    "fp8_e4m3": ("float8_e4m3fn", "float8_e4m3fn"),
    "fp8_e4m3_ieee": ("float8_e4m3", None),
    "fp8_e4m3fnuz": ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    "fp8_e4m3b11fnuz": ("float8_e4m3b11fnuz", None),
    "fp8_e5m2": ("float8_e5m2", "float8_e5m2"),
    "fp8_e5m2fnuz": ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    "fp8_e3m4": ("float8_e3m4", None),
    "fp6_e3m2": ("float6_e3m2fn", None),
    "fp6_e2m3": ("float6_e2m3fn", None),
    "fp4_e2m1": ("float4_e2m1fn", None),
    "e8m0": ("float8_e8m0fnu", "float8_e8m0fnu"),
}


def build_c_source(src, march: str, tmp_dir, declare, extra_flags=()):
    """ctypes library of one csrc/ file compiled for `march` ("native": the library fewbits itself
    loads), with `declare` setting its argument types; pytest.skip where it cannot be built or run."""
    import ctypes
    import platform
    import shutil
    import subprocess

    import pytest

    from fewbits.kernels import native

    if march == "native":
        lib = native.library()
        if lib is None:
            pytest.skip(native.status()["reason"])
        return lib
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the x86-64 levels exist on x86-64 only")
    if march == "x86-64-v3" and not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA to run an x86-64-v3 build")
    if march == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX-512 F/BW/DQ/VL to run a skylake-avx512 build")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_dir / (src.stem + ".so")
    flags = [f for f in native.CFLAGS if not f.startswith("-march")]
    r = subprocess.run([cc, *flags, f"-march={march}", *extra_flags, "-o", str(out), str(src), "-lm"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    built = ctypes.CDLL(str(out))  # our own file, just written in pytest's private directory
    declare(built)
    return built
