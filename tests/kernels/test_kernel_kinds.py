"""Each of the three float kernels (fixed, scaled, generic) against the exact reference.

fb.round picks one kernel per format (floatround.kernel_kind); the generic kernel is the fallback
for layouts the fast ones cannot take, so it is checked here on every format directly.
"""
import math

import pytest
import torch

import fewbits as fb
from fewbits.formats import round_value
from fewbits.kernels import floatround as fr
from fewbits.kernels.random import draw_seed, random_word_reference
from fewbits.kernels.rounding import _round_tensor

FORMATS = [f for f in fb.list_formats() if f.kind != "lookup" and f.bits <= 8] + [
    fb.get_format(n) for n in ("bf16", "fp16", "tf32", "e5m7", "ue4m3", "e3m2nosub", "int12", "fp32")
]


def _inputs(fmt, dtype, n_random=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    if fmt.bits <= 8:
        v = fmt.values()
        pts = torch.cat([v, (v[1:] + v[:-1]) / 2])
    else:
        e = torch.randint(-30, 30, (n_random,), generator=g).double()
        pts = torch.randn(n_random, generator=g, dtype=torch.float64) * torch.exp2(e)
    specials = torch.tensor([0.0, math.inf, math.nan, fmt.max * 3, 1e-40, 2.0 ** -127, 1.5 * 2.0 ** -127])
    x = torch.cat([pts, specials.double()]).to(dtype)
    x = torch.cat([x, -x])
    up = torch.nextafter(x, torch.full_like(x, math.inf))
    down = torch.nextafter(x, torch.full_like(x, -math.inf))
    return torch.cat([x, up, down])


def _reference(x, fmt, mode, overflow, seed):
    vals = [round_value(v, fmt, mode, overflow, random_word_reference(seed[0], seed[1], i))
            for i, v in enumerate(x.double().tolist())]
    return torch.tensor(vals, dtype=torch.float64)


def _assert_same(got, ref, context):
    got, ref = got.double(), ref.double()
    nan_g, nan_r = torch.isnan(got), torch.isnan(ref)
    ok = (nan_g == nan_r) & (nan_g | ((got == ref) & (torch.signbit(got) == torch.signbit(ref))))
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise AssertionError(f"{context}: {int((~ok).sum())} mismatches, first: got {got[i].item()!r} "
                             f"want {ref[i].item()!r}")




@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_generic_kernel_matches_reference(fmt, dtype):
    """The fallback kernel, forced on formats that normally take a fast one (the fast kernels
    are compared with the reference through fb.round in test_round_exact.py)."""
    work = fr.F64 if dtype == torch.float64 else fr.F32
    dom = work if fr.fits(fmt, work) else fr.F64
    if not fr.fits(fmt, dom):
        pytest.skip("format needs more than float64")
    if fr.kernel_kind(fmt, dom) == "generic":
        pytest.skip("fb.round already uses the generic kernel for this format")
    if fr.kernel_kind(fmt, dom) == "pow2":
        pytest.skip("the generic kernel needs the format inside the domain's normal range")
    x = _inputs(fmt, dtype)
    modes = fb.MODES if fmt.bits <= 8 else ("nearest_even", "toward_zero", "stochastic")
    with fb.use_backend("eager"):
        for kind in ("generic",):
            for mode in modes:
                for overflow in ("saturate", "inf", "nan"):
                    try:
                        fmt.check_overflow(overflow)
                    except ValueError:
                        continue
                    seed = draw_seed(torch.Generator().manual_seed(7))
                    got = _round_tensor(x, fmt, mode, overflow, seed, kind=kind)
                    want = _reference(x, fmt, mode, overflow, seed).to(dtype)
                    _assert_same(got, want, f"{fmt.name} {kind} {mode} {overflow} {dtype}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "bf16", "e8m0", "int4"])
def test_compiled_kernels_equal_eager(name):
    """The fused (torch.compile) kernels give the eager kernels' bits on a large input."""
    fmt = fb.get_format(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-40, 40, (1 << 16,), generator=g).float())
    x[:4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0])
    for mode in ("nearest_even", "stochastic"):
        with fb.use_backend("eager"):
            want = fb.round(x, fmt, mode, generator=torch.Generator().manual_seed(5))
        with fb.use_backend("compiled"):
            got = fb.round(x, fmt, mode, generator=torch.Generator().manual_seed(5))
            out = torch.empty_like(x)
            fb.round(x, fmt, mode, generator=torch.Generator().manual_seed(5), out=out)
        _assert_same(got, want, f"{name} {mode} compiled")
        _assert_same(out, want, f"{name} {mode} compiled out=")


def test_kernel_choice():
    """The fast kernels are the ones used for the common formats."""
    assert fr.kernel_kind(fb.get_format("bf16"), fr.F32) == "fixed"
    assert fr.kernel_kind(fb.get_format("tf32"), fr.F32) == "fixed"
    for name in ("fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "int8", "uint4"):
        assert fr.kernel_kind(fb.get_format(name), fr.F32) == "scaled", name
    assert fr.kernel_kind(fb.get_format("e8m0"), fr.F64) == "scaled_m0"
    assert fr.kernel_kind(fb.get_format("e8m0"), fr.F32) == "pow2"  # 2^-127 is a float32 subnormal


# ---------------------------------------------------------------------------------------------
# the scaled kernel where the arithmetic flushes float32 subnormals (Triton's code on CUDA)
# ---------------------------------------------------------------------------------------------
SCALED_F32 = [f for f in FORMATS if fr.kernel_kind(f, fr.F32).startswith("scaled")]


def test_scaled_formats_are_many():
    assert {"fp8_e4m3", "fp4_e2m1", "fp16", "int8"} <= {f.name for f in SCALED_F32}


def _flushing(f):
    def g(y, *args, **kwargs):
        return f(torch.where(y.abs() < 2.0 ** -126, torch.zeros_like(y), y), *args, **kwargs)
    return g


@pytest.mark.parametrize("style", ["all arithmetic", "rounding functions"])
@pytest.mark.parametrize("fmt", SCALED_F32, ids=lambda f: f.name)
def test_scaled_kernel_under_flush_to_zero(fmt, style, monkeypatch, eager_kernels):
    """Two stand-ins for Triton's flushing on the CPU: every operation flushes (the CPU's own
    flush-to-zero mode, torch.set_flush_denormal), or only floor/ceil/round flush their argument
    (as Triton's were seen to). Either way the scaled kernel's workaround gives exactly the
    results of the normal arithmetic, float32 subnormal inputs included, in every mode."""
    tiny = torch.tensor([2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -140, 1.5 * 2.0 ** -130, 2.0 ** -127,
                         (1 - 2.0 ** -23) * 2.0 ** -126], dtype=torch.float32)
    x = torch.cat([_inputs(fmt, torch.float32), tiny, -tiny])
    seed = (12345, 678)
    monkeypatch.setattr(fr, "_flushes_subnormals", lambda t: True)
    for mode in fb.MODES:
        want = _reference(x, fmt, mode, None, seed).float()
        if style == "rounding functions":
            with monkeypatch.context() as m:
                for name in ("floor", "ceil", "round"):
                    m.setattr(torch, name, _flushing(getattr(torch, name)))
                got = _round_tensor(x, fmt, mode, fmt.default_overflow, seed)
        else:
            if not torch.set_flush_denormal(True):
                pytest.skip("this CPU cannot flush subnormals")
            try:
                got = _round_tensor(x, fmt, mode, fmt.default_overflow, seed)
            finally:
                torch.set_flush_denormal(False)
        ok = (torch.isnan(got) & torch.isnan(want)) | ((got == want) & (torch.signbit(got) == torch.signbit(want)))
        bad = (~ok).nonzero().flatten()[:5].tolist()
        assert not bad, [(x[i].item(), got[i].item(), want[i].item(), mode) for i in bad]
