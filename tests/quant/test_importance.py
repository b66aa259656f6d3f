"""Importance-weighted rounding ("imatrix"): the importance each linear layer's input columns get
from calibration data, and the scale searches of every integer block format under it.

- the weighted searches in C (kernels/csrc/kquant.c) equal their torch reference bit for bit;
- importance_weights is the documented formula;
- on a layer whose inputs are far from uniform, the weighted searches cut the layer's output
  error (the error they are meant to cut) for every block format, GGUF's and the plain int4
  ones, and equal importance leaves plain RTN's scales for plain RTN's error;
- collect_importance is each layer's mean square input, damped; quantize_model(method="imatrix")
  is quantize() under it, layer by layer;
- bad importance is a clear error."""

import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits.quant import get_scheme, quantize
from fewbits.quant import kquant_search as ks
from fewbits.quant.importance import DAMP, collect_importance, damped
from fewbits.quant.tensor import importance_view, takes_importance, to_groups

BLOCK_SCHEMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
PLAIN_SCHEMES = ("int4_g32", "int4_asym_g32", "int4", "int8")


def _layer(rows=48, cols=512, seed=0):
    """A weight, inputs whose columns differ in scale by ~4 orders of magnitude (as a
    transformer's do), and those columns' mean squares."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g) * 0.05
    col_scale = torch.rand(cols, generator=g) ** 4 * 10 + 0.01
    X = torch.randn(4096, cols, generator=g) * col_scale.sqrt()
    return W, X, X.square().mean(0)


def _output_error(W, Q, X) -> float:
    return float(((X @ (Q - W).T) ** 2).mean())


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_weighted_searches_in_c_equal_the_torch_reference(lib, name, monkeypatch):
    s = get_scheme(name)
    g = torch.Generator().manual_seed(3)
    for cols in (512, 300, 40):  # 300, 40: padded groups and short super-blocks
        W = torch.randn(11, cols, generator=g) * 0.1
        W[0] = 0.0
        W[1, ::7] = 3.0
        imp = torch.rand(cols, generator=g)
        imp[::5] = 0.0  # columns of no importance
        grp, valid = to_groups(W, s)
        w = ks.importance_weights(grp, valid, importance_view(imp, s, W.shape))
        assert ks._kquant_library(grp, valid) is not None
        fast = ks.group_params(grp, valid, s, w)
        ref = ks.group_params_reference(grp, valid, s, w)
        assert torch.equal(fast[0], ref[0]) and (fast[1] is None or torch.equal(fast[1], ref[1])), (name, cols)
        if s.super_block is not None:  # the floor/ceil choice of the sub-scale codes too
            sub = s.sub_scale_format_of
            d = torch.rand(11, -(-grp.shape[1] * s.group_size // s.super_block), generator=g, dtype=torch.float64)
            dmin = d.clone() if s.zero_point == "float" else None
            a = ks.refine_codes(grp, valid, s, sub, fast[0], fast[1], d, dmin, w)
            with monkeypatch.context() as m:
                m.setattr(ks, "_kquant_library", lambda *_: None)  # the torch reference
                b = ks.refine_codes(grp, valid, s, sub, fast[0], fast[1], d, dmin, w)
            assert torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1])), (name, cols)


def test_importance_weights_are_the_documented_formula():
    W = torch.tensor([[3.0, -1.0, 0.5, 2.0, 1.0]])
    s = get_scheme("q4_0")  # groups of 32: one padded group
    grp, valid = to_groups(W, s)
    imp = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.5])
    w = ks.importance_weights(grp, valid, importance_view(imp, s, W.shape))
    x = W[0].double()
    sigma2 = (x * x).mean()
    expected = imp.double() * torch.sqrt(sigma2 + x * x)
    assert torch.allclose(w[0, 0, :5], expected, rtol=0, atol=1e-15)
    assert torch.count_nonzero(w[0, 0, 5:]) == 0  # padding weighs nothing


@pytest.mark.parametrize("name", BLOCK_SCHEMES + PLAIN_SCHEMES)
def test_importance_cuts_the_output_error_of_every_integer_format(name):
    W, X, ms = _layer()
    plain = quantize(W, name).dequantize()
    weighted = quantize(W, name, importance=damped(ms)).dequantize()
    assert _output_error(W, weighted, X) < 0.95 * _output_error(W, plain, X), name
    # the weights are a real quantization of W under the scheme: same sizes, codes in range
    assert quantize(W, name, importance=damped(ms)).nbytes == quantize(W, name).nbytes


def test_weighted_gguf_blocks_are_read_back_by_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    from fewbits.files.gguf_blocks import encode_blocks, gguf_block_type

    W, _, ms = _layer(rows=8, cols=256)
    for name in BLOCK_SCHEMES:
        qt = quantize(W, name, importance=damped(ms))
        qtype = getattr(gguf.GGMLQuantizationType, gguf_block_type(name))
        theirs = torch.from_numpy(gguf.quants.dequantize(encode_blocks(qt), qtype).reshape(W.shape).copy())
        assert torch.equal(theirs.float(), qt.dequantize()), name


def test_collect_importance_is_the_damped_mean_square_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = [torch.randn(5, 8), torch.randn(3, 8)]
    imp = collect_importance(model, ["0", "2"], batches)
    x0 = torch.cat(batches)
    x2 = torch.relu(model[0](x0)).detach()
    for name, x in (("0", x0), ("2", x2)):
        ms = x.double().square().mean(0)
        assert torch.allclose(imp[name].double(), ms + DAMP * ms.mean(), rtol=1e-6), name
    with pytest.raises(TypeError, match="nn.Linear"):
        collect_importance(model, ["1"], batches)


def test_quantize_model_imatrix_is_quantize_under_each_layers_importance():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.mul_(torch.rand(64) ** 3 * 4)  # columns of the second layer's input differ
    batches = [torch.randn(16, 64) * torch.rand(64) ** 2 for _ in range(4)]
    imp = collect_importance(model, ["0", "2"], batches)
    reference = {n: quantize(model.get_submodule(n).weight.detach(), "q4_0", importance=imp[n]) for n in ("0", "2")}
    plain = {n: quantize(model.get_submodule(n).weight.detach(), "q4_0") for n in ("0", "2")}
    q = fb.quantize_model(model, "q4_0", method="imatrix", calibration=batches)
    for n in ("0", "2"):
        got = q.get_submodule(n).qweight
        assert torch.equal(got.dequantize(), reference[n].dequantize()), n
        assert not torch.equal(got.dequantize(), plain[n].dequantize()), n
    with pytest.raises(ValueError, match="needs calibration"):
        fb.quantize_model(nn.Sequential(nn.Linear(64, 8)), "q4_0", method="imatrix")


def test_recipe_fixed_scales_are_rounded_to_nearest_under_imatrix():
    """MX and NVFP4 scales are fixed by their recipes: quantize() refuses importance for them,
    and quantize_model(method="imatrix") rounds those layers to nearest."""
    W, _, ms = _layer(rows=16, cols=64)
    for name in ("mxfp4", "nvfp4", "bf16"):
        assert not takes_importance(name, W.shape)
        with pytest.raises(ValueError, match="fixed by its recipe"):
            quantize(W, name, importance=ms)
    model = nn.Sequential(nn.Linear(64, 16))
    weight = model[0].weight.detach().clone()
    q = fb.quantize_model(model, "mxfp4", method="imatrix", calibration=[torch.randn(4, 64)])
    assert torch.equal(q[0].qweight.dequantize(), quantize(weight, "mxfp4").dequantize())


@pytest.mark.parametrize("importance,message", [
    (torch.ones(63), "one value per input column"),
    (torch.ones(64, 1), "one value per input column"),
    (-torch.ones(64), "finite and non-negative"),
    (torch.full((64,), float("nan")), "finite and non-negative"),
    (torch.zeros(64), "zero in every column"),
    ([1.0] * 64, "must be a torch.Tensor"),
])
def test_bad_importance_is_a_clear_error(importance, message):
    W = torch.randn(8, 64)
    with pytest.raises((ValueError, TypeError), match=message):
        quantize(W, "q4_0", importance=importance)


def test_importance_goes_with_column_groups_only():
    with pytest.raises(ValueError, match="input columns of a matrix"):
        quantize(torch.randn(8, 64), "int8_tensor", importance=torch.ones(64))
    with pytest.raises(ValueError, match="do not go with given scales"):
        s = get_scheme("int4_g32")
        quantize_with = fb.quant.scales.scale_groups
        grp, valid = to_groups(torch.randn(4, 64), s)
        quantize_with(grp, valid, s, (4, 64), scales=torch.ones(4, 2), weights=torch.ones_like(grp, dtype=torch.float64))


def test_damping_keeps_every_column_weighed():
    ms = torch.tensor([0.0, 0.0, 4.0, 0.0])
    d = damped(ms)
    assert bool((d > 0).all()) and torch.allclose(d, torch.tensor([0.01, 0.01, 4.01, 0.01]))
    assert torch.equal(damped(torch.zeros(3)), torch.ones(3))  # nothing seen: equal weights
    with pytest.raises(ValueError, match="damp"):
        damped(ms, -1.0)
