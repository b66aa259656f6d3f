"""The C rounding kernels (fewbits.kernels.native_round, csrc/round32.c) equal the exact reference
bit for bit: stochastic rounding to every float format of the scaled kind, E8M0 in every mode,
and codebooks of at most 16 values in every mode, on every boundary input, in every overflow
policy; plus inputs built to land next to the stochastic decision's threshold (the codebook
kernel's float32 estimate must hand them to its float64 path), odd lengths, threads and the
dispatch rules. Skipped where the kernels are not built (no C compiler, or no AVX-512)."""
import pytest
import torch

import fewbits as fb
from fewbits import FloatFormat, IntFormat, LookupFormat
from fewbits.kernels import floatround as fr
from fewbits.kernels import native, native_round
from fewbits.kernels.random import draw_seed, random_words
from helpers import assert_same, boundary_inputs, check_boundaries, fmt_id, generator, random_wide_floats, valid_overflows

pytestmark = pytest.mark.skipif(native_round._library() is None,
                                reason="the C rounding kernels are not built here (no compiler or no AVX-512)")

_CANDIDATES = [f for f in fb.list_formats() if f.kind != "lookup"] + [
    fb.get_format(n) for n in ("ue4m3", "e3m2nosub", "int12", "uint10", "e4m3fnuz_nosub")] + [
    FloatFormat(4, 3, bias=-3), FloatFormat(3, 1, specials="none", zero=False, subnormals=False),
    FloatFormat(3, 1, specials="fn", zero=False, subnormals=False, signed=False), IntFormat(16, False)]
SCALED = [f for f in _CANDIDATES if f.bits <= 16 and fr.fits(f, fr.F32) and fr.kernel_kind(f, fr.F32) == "scaled"]
CODEBOOKS = [fb.get_format("nf4"),
             LookupFormat("uneven", [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0]),
             LookupFormat("positive", [0.5, 1.0, 3.0, 10.0]),
             LookupFormat("tiny", [-(2.0 ** -133), 0.0, 2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -127]),
             LookupFormat("huge", [-3e38, 0.0, 3e38]),
             LookupFormat("no_zero", [-2.0, -1.0, 1.0, 2.0]),
             LookupFormat("sixteen", [float(v) for v in range(-8, 8)])]


def test_the_lists_are_what_they_claim():
    assert {"fp8_e4m3", "fp8_e5m2", "fp16", "fp4_e2m1", "fp6_e3m2", "int8", "uint4"} <= {f.name for f in SCALED}
    assert fr.kernel_kind(fb.get_format("e8m0"), fr.F32) == "pow2"


@pytest.mark.parametrize("fmt", SCALED, ids=fmt_id)
def test_scaled_stochastic_equals_reference(fmt):
    for ovf in valid_overflows(fmt):
        check_boundaries(fmt, torch.float32, "stochastic", ovf, what=f"C {fmt.name} stochastic {ovf}")


@pytest.mark.parametrize("mode", fb.MODES)
def test_e8m0_equals_reference(mode):
    fmt = fb.get_format("e8m0")
    for ovf in valid_overflows(fmt):
        check_boundaries(fmt, torch.float32, mode, ovf, what=f"C e8m0 {mode} {ovf}")


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
    assert native_round.try_round(x, fb.get_format("fp8_e4m3"), "nearest_even", "saturate", (0, 0)) is None
