"""The C rounding kernels (fewbits.kernels.native_round, csrc/round32.c) equal the exact reference
bit for bit: every float format of the scaled, fixed and pow2 kinds and codebooks of at most 16
values, in every mode and overflow policy, on every boundary input (a sample above 12 bits); plus inputs built to land next to the stochastic decision's threshold (the codebook
kernel's float32 estimate must hand them to its float64 path), odd lengths, threads and the
dispatch rules. Skipped where the kernels are not built (no C compiler, or no AVX-512)."""
import pytest
import torch

import fewbits as fb
from fewbits import FloatFormat, IntFormat, LookupFormat
from fewbits.kernels import floatround as fr
from fewbits.kernels import native, native_round
from fewbits.kernels.random import draw_seed, random_words
from helpers import (assert_same, check_boundaries, check_round, fmt_id, generator, random_wide_floats,
                     sampled_boundary_inputs, valid_overflows)

pytestmark = pytest.mark.skipif(native_round._library() is None,
                                reason="the C rounding kernels are not built here (no compiler or no AVX-512)")

_CANDIDATES = [f for f in fb.list_formats() if f.kind != "lookup"] + [
    fb.get_format(n) for n in ("ue4m3", "e3m2nosub", "int12", "uint10", "e4m3fnuz_nosub")] + [
    FloatFormat(4, 3, bias=-3), FloatFormat(3, 1, specials="none", zero=False, subnormals=False),
    FloatFormat(3, 1, specials="fn", zero=False, subnormals=False, signed=False), IntFormat(16, False)]
C_KINDS = ("scaled", "fixed", "pow2")
FLOATS = [f for f in _CANDIDATES if f.bits <= 19 and fr.fits(f, fr.F32) and fr.kernel_kind(f, fr.F32) in C_KINDS
          and f.name != "fp32"]
CODEBOOKS = [fb.get_format("nf4"),
             LookupFormat("uneven", [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0]),
             LookupFormat("positive", [0.5, 1.0, 3.0, 10.0]),
             LookupFormat("tiny", [-(2.0 ** -133), 0.0, 2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -127]),
             LookupFormat("huge", [-3e38, 0.0, 3e38]),
             LookupFormat("no_zero", [-2.0, -1.0, 1.0, 2.0]),
             LookupFormat("sixteen", [float(v) for v in range(-8, 8)])]


def test_the_lists_are_what_they_claim():
    names = {f.name for f in FLOATS}
    assert {"fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "tf32", "fp4_e2m1", "fp6_e3m2", "e8m0", "int8", "uint4"} <= names
    assert {fr.kernel_kind(f, fr.F32) for f in FLOATS} == set(C_KINDS)


@pytest.mark.parametrize("fmt", FLOATS, ids=fmt_id)
@pytest.mark.parametrize("mode", fb.MODES)
def test_float_formats_equal_reference(fmt, mode):
    """Every boundary input (a deterministic sample of them above 12 bits), every policy."""
    for ovf in valid_overflows(fmt):
        what = f"C {fmt.name} {mode} {ovf}"
        if fmt.bits <= 12:
            check_boundaries(fmt, torch.float32, mode, ovf, what=what)
        else:
            check_round(sampled_boundary_inputs(fmt, torch.float32, n=300, seed=4), fmt, mode, ovf, seed=9, what=what)


def test_float_formats_equal_the_torch_kernels_on_wide_inputs():
    """2^16 values over 2^-150 .. 2^130 (subnormals, overflow, inf, NaN), every format, mode
    and policy: the C kernels against the eager torch kernels."""
    x = random_wide_floats(1 << 16, seed=11, dtype=torch.float32, lo=-150, hi=130)
    x[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 2.0 ** -149, -3e38])
    for fmt in FLOATS:
        for ovf in valid_overflows(fmt):
            for mode in fb.MODES:
                got = fb.round(x, fmt, mode, ovf, generator=generator(2))
                with fb.use_backend("eager"):
                    want = fb.round(x, fmt, mode, ovf, generator=generator(2))
                assert_same(got, want, x, f"{fmt.name} {mode} {ovf}")


@pytest.mark.parametrize("fmt", CODEBOOKS, ids=fmt_id)
@pytest.mark.parametrize("mode", fb.MODES)
def test_codebook_equals_reference(fmt, mode):
    check_boundaries(fmt, torch.float32, mode, None, what=f"C {fmt.name} {mode}")


def _near_thresholds(fmt, seed: int, n: int = 1 << 15) -> torch.Tensor:
    """Inputs whose stochastic decision is within a few float32 steps of the element's random
    word: x = lo + (word + 1) / 2^32 * (hi - lo) and its neighbours."""
    lo_seed, hi_seed = draw_seed(generator(seed))
    words = random_words(torch.arange(n), lo_seed, hi_seed).double()
    t = torch.tensor(fmt.table, dtype=torch.float64)
    j = torch.randint(0, t.numel() - 1, (n,), generator=torch.Generator().manual_seed(seed))
    x = (t[j] + (words + 1) / 2 ** 32 * (t[j + 1] - t[j])).float()
    step = torch.randint(-3, 4, (n,), generator=torch.Generator().manual_seed(seed + 1))
    up, down = torch.nextafter(x, torch.full_like(x, 1e38)), torch.nextafter(x, torch.full_like(x, -1e38))
    return torch.where(step > 0, up, torch.where(step < 0, down, x))


@pytest.mark.parametrize("fmt", [CODEBOOKS[0], CODEBOOKS[1], CODEBOOKS[6]], ids=fmt_id)
def test_codebook_stochastic_next_to_the_threshold(fmt):
    """The float32 estimate cannot decide these; the float64 path must (without it, ~half of
    them differ)."""
    x = _near_thresholds(fmt, seed=5)
    got = fb.round(x, fmt, "stochastic", generator=generator(5))
    with fb.use_backend("eager"):
        want = fb.round(x, fmt, "stochastic", generator=generator(5))
    assert_same(got, want, x, f"{fmt.name} next to the threshold")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4099])
def test_lengths_and_threads(n):
    x = random_wide_floats(n, seed=n, dtype=torch.float32, lo=-30, hi=30)
    for fmt, mode in (("fp8_e4m3", "stochastic"), ("e8m0", "nearest_even"), ("nf4", "stochastic"),
                      ("nf4", "nearest_even")):
        with fb.use_backend("eager"):
            want = fb.round(x, fmt, mode, generator=generator(3))
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert_same(fb.round(x, fmt, mode, generator=generator(3)), want, x, f"{fmt} {mode} n={n}")
                out = torch.empty_like(x)
                assert fb.round(x, fmt, mode, generator=generator(3), out=out) is out
                assert_same(out, want, x, f"{fmt} {mode} n={n} out=")
        finally:
            torch.set_num_threads(before)


def test_dispatch(monkeypatch):
    calls = []
    real = native.round_lut_sr_f32
    monkeypatch.setattr(native, "round_lut_sr_f32", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(64, 64)
    fb.round(x, "nf4", "stochastic")
    assert len(calls) == 1                                  # auto: the C kernel
    with fb.use_backend("eager"):
        fb.round(x, "nf4", "stochastic")
    with fb.use_backend("compiled"):
        fb.round(x, "nf4", "stochastic")
    with native.turned_off():
        fb.round(x, "nf4", "stochastic")
    fb.round(x.t(), "nf4", "stochastic")                    # not contiguous
    fb.round(x.double(), "nf4", "stochastic")               # not float32
    assert len(calls) == 1
    assert native_round.try_round(x, fb.get_format("fp32"), "nearest_even", "saturate", (0, 0)) is None
    assert native_round.try_round(x, fb.get_format("ue8m0fn"), "nearest_even", "saturate", (0, 0)) is None  # generic
