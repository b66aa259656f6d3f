"""Emulated casts: the fast paths equal fb.round; scaling recipes equal slow references."""
import math

import pytest
import torch

import fewbits as fb
from fewbits.train import ScaledCast, cast, mx_round, pow2_scale, round_to, scaled_round


def awkward_values(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-30, 20, (4000,), generator=g).float())
    specials = torch.tensor([0.0, -0.0, 65504.0, 65520.0, 65519.99, 7e4, -1e6, 2.0 ** -24, 2.0 ** -25,
                             3 * 2.0 ** -26, 1e-30, math.inf, -math.inf, math.nan, 3.4e38])
    return torch.cat([x, specials]).to(dtype)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_to_native_path_equals_fb_round(fmt, dtype):
    x = awkward_values(dtype)
    got = round_to(x, fmt)
    ref = fb.round(x, fmt)
    assert got.dtype == x.dtype
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))
    out = torch.empty_like(x)
    round_to(x, fmt, out=out)
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))


def test_round_to_other_formats_and_modes_are_fb_round():
    x = awkward_values()
    for fmt, mode in [("fp8_e4m3", "nearest_even"), ("fp16", "toward_zero"), ("tf32", "nearest_even")]:
        assert torch.equal(torch.nan_to_num(round_to(x, fmt, mode)), torch.nan_to_num(fb.round(x, fmt, mode)))
    a = round_to(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(3))
    b = fb.round(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_cast_is_straight_through_with_rounded_gradient():
    x = torch.tensor([1.0 + 2.0 ** -12, 3e-9, 1e5], requires_grad=True)
    y = cast(x, lambda t: round_to(t, "fp16"), lambda g: round_to(g, "fp8_e5m2"))
    assert torch.equal(y.detach(), fb.round(x.detach(), "fp16")) and y[2].item() == math.inf
    y.backward(torch.tensor([0.3, 1e-7, 1.0]))
    assert x.grad.tolist() == fb.round(torch.tensor([0.3, 1e-7, 1.0]), "fp8_e5m2").tolist()
    # without grad, cast is the forward function only
    with torch.no_grad():
        assert cast(x, lambda t: t * 2, None).tolist() == (x * 2).tolist()


def test_pow2_scale():
    for amax in [1e-9, 0.3, 1.0, 448.0, 449.0, 5e5]:
        s = pow2_scale(amax, 448.0)
        assert math.log2(s).is_integer()
        assert amax * s <= 448.0 < 2 * amax * s
    assert pow2_scale(0.0, 448.0) == 1.0 and pow2_scale(math.inf, 448.0) == 1.0
    assert pow2_scale(1.0, 448.0, margin=2) == 2.0 ** 6


def test_scaled_round_is_exact_rescaling():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e-6
    s = pow2_scale(float(x.abs().max()), 448.0)
    got = scaled_round(x, "fp8_e4m3", s)
    ref = fb.round(x.double() * s, "fp8_e4m3", overflow="saturate") / s
    assert torch.equal(got.double(), ref)
    assert (got != 0).float().mean() > 0.95  # unscaled, every value would flush in e4m3
    assert (fb.round(x, "fp8_e4m3") == 0).all()


def mx_reference(x, fmt, block):
    """One block at a time, in Python floats."""
    fmt = fb.get_format(fmt)
    emax = math.floor(math.log2(fmt.max))
    rows = x.reshape(-1, x.shape[-1]).tolist()
    out = []
    for row in rows:
        res = []
        for i in range(0, len(row), block):
            blk = row[i:i + block]
            amax = max(abs(v) for v in blk)
            e = (math.frexp(amax)[1] - 1 - emax) if amax > 0 else -127
            scale = 2.0 ** max(-127, min(127, e))
            q = fb.round(torch.tensor([v / scale for v in blk], dtype=torch.float64), fmt, overflow="saturate")
            res += [float(v) * scale for v in q]
        out.append(res)
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_mx_round_matches_reference(fmt):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 70, generator=g) * torch.exp2(torch.randint(-20, 10, (3, 70), generator=g).float())
    x[1, 32:64] = 0.0
    got = mx_round(x, fmt, block=32)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got.double(), mx_reference(x, fmt, 32))


def test_delayed_scaling_uses_history():
    sc = ScaledCast("fp8_e4m3", "delayed", history_len=2)
    a = torch.full((4,), 1.0)
    sc(a)                        # empty history: its own amax
    assert sc.last_scale == 256.0
    big = torch.full((4,), 100.0)
    out = sc(big)                # scale from history (amax 1): 100 * 256 saturates at 448
    assert sc.last_scale == 256.0 and out.max().item() == 448.0 / 256
    sc(a)                        # history [1, 100]: scale from 100
    assert sc.last_scale == 4.0
    sc(a)
    sc(a)                        # history [1, 1] after the window slides
    assert sc.last_scale == 256.0
    sc(torch.tensor([math.inf])) # a non-finite amax never enters the history
    assert list(sc.history) == [1.0, 1.0]
    cur = ScaledCast("fp8_e4m3", "current")
    cur(big)
    assert cur.last_scale == 4.0
