"""decode.c, the one-call decode step (native.DecodeStep), piece by piece against the
obviously-correct arithmetic: the rotary embedding bit for bit against the torch ops it stands
for; the RMSNorm, one-query attention and SiLU and GELU (tanh) gates against float64 within the
float32 error of their own steps; DecodeStep's checks of its arguments (Gemma 3's and Phi-3's
options too). The whole step against the torch decode path is tested in
tests/models/test_decoder.py."""
from __future__ import annotations

import math

import pytest
import torch

from fewbits.kernels import native

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no native library")
U = 2.0 ** -24  # float32's unit roundoff


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("d", [1, 7, 8, 64, 576, 1001])
def test_rms_norm_within_float32_rounding_of_float64(d):
    g = _gen(d)
    h = torch.randn(d, generator=g) * torch.logspace(-3, 3, d)  # a spread of magnitudes
    w = torch.randn(d, generator=g)
    out = torch.empty(d)
    eps = 1e-5
    LIB.fb_decode_rms_norm(h.data_ptr(), w.data_ptr(), eps, d, out.data_ptr())
    h64, w64 = h.double(), w.double()
    ref = w64 * (h64 / torch.sqrt(h64.pow(2).mean() + eps))
    # the variance rounded once, + eps, sqrt, 1 / x, two products: at most 6 roundings
    assert ((out.double() - ref).abs() <= 8 * U * ref.abs() + 1e-38).all()


def test_rms_norm_of_zeros_is_zero():
    out, h, w = torch.full((16,), float("nan")), torch.zeros(16), torch.ones(16)
    LIB.fb_decode_rms_norm(h.data_ptr(), w.data_ptr(), 1e-6, 16, out.data_ptr())
    assert torch.equal(out, torch.zeros(16))


@pytest.mark.parametrize("heads,hd", [(1, 2), (9, 64), (3, 128), (2, 6)])
def test_rope_bit_for_bit_the_torch_ops(heads, hd):
    g = _gen(hd)
    x = torch.randn(heads, hd, generator=g)
    cos, sin = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    half = hd // 2
    want = x * cos + torch.cat((-x[:, half:], x[:, :half]), dim=-1) * sin
    got = x.clone()
    LIB.fb_decode_rope(got.data_ptr(), heads, hd, cos.data_ptr(), sin.data_ptr())
    assert torch.equal(got, want)


def _attend(q, k, v, heads, kv_heads, capacity, hd, length, scaling, softcap=0.0):
    out = torch.empty(heads, hd)
    scores = torch.empty(heads * capacity)
    LIB.fb_decode_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), heads, kv_heads, capacity, hd, length, scaling,
                         softcap, scores.data_ptr(), out.data_ptr())
    return out


@pytest.mark.parametrize("heads,kv_heads,hd,length", [(1, 1, 16, 1), (9, 3, 64, 1), (9, 3, 64, 300), (4, 4, 40, 17),
                                                      (8, 1, 128, 65)])
def test_attention_within_float32_error_of_float64(heads, kv_heads, hd, length):
    capacity = length + 5
    g = _gen(length)
    q = torch.randn(heads, hd, generator=g)
    k = torch.randn(kv_heads, capacity, hd, generator=g)
    v = torch.randn(kv_heads, capacity, hd, generator=g)
    k[:, length:] = float("nan")  # positions past the length are never read
    v[:, length:] = float("nan")
    scaling = hd ** -0.5
    out = _attend(q, k, v, heads, kv_heads, capacity, hd, length, scaling)
    group = heads // kv_heads
    kk = k[:, :length].double().repeat_interleave(group, 0)
    vv = v[:, :length].double().repeat_interleave(group, 0)
    s = torch.einsum("hd,hpd->hp", q.double(), kk) * scaling
    ref = torch.einsum("hp,hpd->hd", torch.softmax(s, -1), vv)
    # a score's error: the dot product's float32 sum (hd terms) and the scaling; exp turns an
    # absolute error e of the score into a relative one of ~e; the weighted sum adds length terms
    score_err = (hd + 2) * U * torch.einsum("hd,hpd->hp", q.double().abs(), kk.abs()) * scaling
    bound = (score_err.max(-1).values * 2 + (length + 4) * U)[:, None] * vv.abs().amax(1) * 2
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).abs() <= bound + 1e-30).all()


def test_capped_attention_within_float32_error_of_float64():
    """Gemma 2's soft-capped scores (cap tanh(s / cap)): against float64, within the float32
    error of the scores (tanh shrinks it) and of the weighted sum."""
    heads, kv_heads, hd, length, cap = 8, 2, 32, 40, 5.0
    g = _gen(7)
    q, k, v = (torch.randn(heads, hd, generator=g) * 3, torch.randn(kv_heads, length, hd, generator=g) * 3,
               torch.randn(kv_heads, length, hd, generator=g))
    out = _attend(q, k, v, heads, kv_heads, length, hd, length, hd ** -0.5, cap)
    kk, vv = k.double().repeat_interleave(4, 0), v.double().repeat_interleave(4, 0)
    s = torch.einsum("hd,hpd->hp", q.double(), kk) * hd ** -0.5
    ref = torch.einsum("hp,hpd->hd", torch.softmax(torch.tanh(s / cap) * cap, -1), vv)
    assert ((out.double() - ref).abs() <= 64 * (hd + length) * U * vv.abs().max()).all()
    uncapped = _attend(q, k, v, heads, kv_heads, length, hd, length, hd ** -0.5)
    assert (out - uncapped).abs().max() > 1e-3  # the cap changes the scores of this data


def test_attention_with_one_position_returns_its_value():
    q, k, v = torch.randn(4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    out = _attend(q, k, v, 4, 2, 3, 8, 1, 0.5)
    assert torch.equal(out, v[:, 0].repeat_interleave(2, 0))


def test_exp_within_two_ulp_of_float64():
    """fexp (decode.c's vectorizable e^x): within 2 ulp where e^x is a normal float32, 0 below
    -87.33654 (e^x subnormal or less), inf above 88.7228, NaN for NaN."""
    x = torch.cat([torch.linspace(-87.336, 88.72, 2_000_001), torch.randn(100_000, generator=_gen(9)),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0 ** -149, 0.5 * 0.6931471805599453])])
    out = torch.empty_like(x)
    LIB.fb_decode_exp(x.data_ptr(), x.numel(), out.data_ptr())
    ref = torch.exp(x.double())
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - 24)  # float32's ulp at ref
    normal = ref >= 2.0 ** -126
    assert ((out.double() - ref).abs() <= 2 * ulp)[normal].all()
    edges = torch.tensor([-87.34, -88.0, -100.0, -1e30, float("-inf"), 88.73, 89.0, 1e30, float("inf"), float("nan")])
    got = torch.empty_like(edges)
    LIB.fb_decode_exp(edges.data_ptr(), edges.numel(), got.data_ptr())
    assert torch.equal(got[:5], torch.zeros(5)) and torch.isposinf(got[5:9]).all() and torch.isnan(got[9])


def test_silu_gate_within_float32_error_of_float64():
    g = torch.cat([torch.linspace(-100, 100, 4001), torch.randn(999, generator=_gen(3)),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 89.0, -104.0])])
    u = torch.randn(g.numel(), generator=_gen(4))
    got = g.clone()
    LIB.fb_decode_silu_mul(got.data_ptr(), u.data_ptr(), g.numel())
    g64 = g.double()
    ref = g64 / (1 + torch.exp(-g64)) * u.double()
    # exp (< 2 ulp), the add, the division and the product; where exp(-g) overflows (g < -88.7)
    # the result is zero, as torch's silu gives, against |g e^g u| < 1e-36
    assert ((got.double() - ref).abs() <= 8 * U * ref.abs() + 1e-36).all()
    assert torch.equal(got[g < -89], torch.zeros_like(got[g < -89]))
    assert torch.equal(got[g < -89], torch.nn.functional.silu(g[g < -89]) * u[g < -89])


# --- DecodeStep's arguments ------------------------------------------------------------------
def _kernel(n_in, n_out):
    """A RowKernel computing y = 0 (fb_lut4_row over zero codes)."""
    w = native.Lut4Weight(torch.zeros(n_out * n_in // 2, dtype=torch.uint8), torch.ones(n_out, n_in // 32),
                          torch.arange(16.0), n_out, n_in, 32)
    return native.RowKernel(native.function_address(LIB, "fb_lut4_row"), w.row_call(n_in), native.lut4_rc, None, n_in, n_out, w)


def _step_args(d=64, heads=2, kv=1, hd=32, inter=96, capacity=8, layers=2):
    specs = [{"q": _kernel(d, heads * hd), "k": _kernel(d, kv * hd), "v": _kernel(d, kv * hd), "o": _kernel(heads * hd, d),
              "gate": _kernel(d, inter), "up": _kernel(d, inter), "down": _kernel(inter, d),
              "norm1": torch.ones(d), "norm2": torch.ones(d), "eps1": 1e-5, "eps2": 1e-5} for _ in range(layers)]
    cache = torch.zeros(layers, 1, kv, capacity, hd)
    return dict(lib=LIB, layers=specs, norm_f=torch.ones(d), eps_f=1e-5, k_cache=cache, v_cache=cache.clone(),
                cos=torch.ones(capacity, hd), sin=torch.zeros(capacity, hd), heads=heads, kv_heads=kv, head_dim=hd,
                scaling=hd ** -0.5)


def test_decode_step_with_zero_weights():
    """All-zero linear layers: the residual stream is the embedding, normalized at the end; the
    caches hold zeros at the position written and are untouched elsewhere."""
    args = _step_args()
    args["k_cache"].fill_(7.0)
    step = native.DecodeStep(**args)
    h = torch.randn(64, generator=_gen(5))
    want = h / torch.sqrt(h.double().pow(2).mean() + 1e-5).float()
    out = step(h.clone(), 3)
    assert torch.allclose(out, want, rtol=1e-6, atol=0)
    assert (args["k_cache"][:, :, :, 3] == 0).all() and (args["k_cache"][:, :, :, :3] == 7).all()


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(heads=3), "RowKernel of"),
    (lambda a: a.update(head_dim=31), "unsupported heads"),
    (lambda a: a.update(kv_heads=0), "unsupported heads"),
    (lambda a: a["layers"][1].update(down=_kernel(64, 64)), "layer 1 down"),
    (lambda a: a["layers"][0].update(q="not a kernel"), "layer 0 q"),
    (lambda a: a["layers"][0].update(norm2=torch.ones(63)), "layer 0 norm2"),
    (lambda a: a.update(k_cache=torch.zeros(2, 1, 1, 8, 32, dtype=torch.float64)), "k_cache"),
    (lambda a: a.update(v_cache=torch.zeros(2, 1, 1, 16, 32)[:, :, :, ::2]), "v_cache"),
    (lambda a: a.update(sin=torch.zeros(7, 32)), "sin"),
    (lambda a: a.update(layers=[]), "at least one layer"),
    # the Gemma 3 / Phi-3 options
    (lambda a: a["layers"][1].update(k=None, v=None), "fused projections .* in every layer or in none"),
    (lambda a: a["layers"][0].update(act="gelu"), "act must be one of silu, gelu_tanh"),
    (lambda a: a["layers"][0].update(window=-1), "window must be a non-negative int"),
    (lambda a: a["layers"][0].update(window=True), "window must be a non-negative int"),
    (lambda a: a["layers"][0].update(window=2 ** 63), "window must be a non-negative int"),
    (lambda a: a["layers"][0].update(cos=torch.ones(7, 32)), "layer 0 cos"),
    (lambda a: a["layers"][1].update(post1=torch.ones(63), eps_p1=1e-6), "layer 1 post1"),
    (lambda a: a["layers"][1].update(softcap=float("nan")), "softcap must be a finite number"),
])
def test_decode_step_refuses_bad_arguments(change, match):
    args = _step_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        native.DecodeStep(**args)


def test_decode_step_refuses_bad_calls():
    step = native.DecodeStep(**_step_args())
    with pytest.raises(ValueError, match="outside the cache"):
        step(torch.zeros(64), 8)
    with pytest.raises(ValueError, match="outside the cache"):
        step(torch.zeros(64), -1)
    with pytest.raises(ValueError, match="h must be"):
        step(torch.zeros(63), 0)
    with pytest.raises(ValueError, match="h must be"):
        step(torch.zeros(64, dtype=torch.float64), 0)


def test_a_failing_kernel_is_reported_by_its_own_check():
    """A row kernel that refuses its arguments (here a lut4 row whose group no longer divides K)
    stops the step, and the layer's own return-code check raises."""
    args = _step_args()
    bad = _kernel(64, 64)
    rows = native._Lut4Row.from_address(bad.args)
    rows.group = 48
    args["layers"][1]["o"] = bad
    step = native.DecodeStep(**args)
    with pytest.raises(RuntimeError, match="lut4 kernel refused"):
        step(torch.randn(64), 0)


def test_attention_the_same_bits_at_one_and_two_threads():
    heads, kv, hd, length, capacity = 12, 4, 64, 300, 320
    g = _gen(11)
    q, k, v = torch.randn(heads, hd, generator=g), torch.randn(kv, capacity, hd, generator=g), \
        torch.randn(kv, capacity, hd, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(q, k, v, heads, kv, capacity, hd, length, 0.125)
        torch.set_num_threads(2)
        two = _attend(q, k, v, heads, kv, capacity, hd, length, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_gelu_tanh_gate_within_float32_error_of_float64():
    """Gemma's GELU (tanh) times the up projection: x / (1 + e^(-2y)) u, y = sqrt(2/pi) (x + 0.044715 x^3),
    within a few float32 roundings of float64 (relative to |x u|: where e^(-2y) is large the result
    is far below it) and of torch's F.gelu(approximate="tanh") in float32."""
    g = torch.cat([torch.linspace(-20, 20, 4001), torch.randn(999, generator=_gen(5)),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 30.0, -30.0])])
    u = torch.randn(g.numel(), generator=_gen(6))
    got = g.clone()
    LIB.fb_decode_gelu_tanh_mul(got.data_ptr(), u.data_ptr(), g.numel())
    g64, u64 = g.double(), u.double()
    ref = 0.5 * g64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3))) * u64
    assert ((got.double() - ref).abs() <= 16 * U * (g64 * u64).abs() + 1e-36).all()
    torch_ref = torch.nn.functional.gelu(g, approximate="tanh") * u
    assert ((got - torch_ref).abs() <= 16 * U * (g * u).abs() + 1e-36).all()
    assert torch.equal(got[g == 0], torch.zeros_like(got[g == 0]))
