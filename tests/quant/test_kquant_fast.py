"""The k-quant scale search (q4_k, q5_k, q6_k) in C (kernels/csrc/kquant.c) against its torch
reference in fewbits.quant.scales, bit for bit: the group scales and minimums of the search,
the floor/ceil choice of the sub-scale codes, and whole quantize() results, on random weights,
genuine MiniLM weights, hard rows and rows that are not a multiple of 256; and the fixed order
of the sums (group_sum) and the correctly rounded square root they both follow."""
import math

import pytest
import torch

from fewbits.kernels import native
from fewbits.quant import get_scheme, quantize
from fewbits.quant import scales as sc
from fewbits.quant.tensor import STATE_KEYS, to_groups

KQUANTS = ("q4_k", "q5_k", "q6_k")


def hard_rows(cols: int, seed: int) -> torch.Tensor:
    """Rows that reach every branch of the searches: zeros, constants of either sign, tiny,
    subnormal and huge magnitudes, one-sided rows, outliers, half-zero rows, values on a grid
    (ties), a lone outlier in zeros."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(cols), torch.full((cols,), 0.5), torch.full((cols,), -3.0),
            torch.randn(cols, generator=g) * 1e-30, torch.randn(cols, generator=g) * 1e30,
            torch.randn(cols, generator=g) * 1e-42, torch.randn(cols, generator=g).abs(),
            -torch.randn(cols, generator=g).abs()]
    r = torch.randn(cols, generator=g) * 0.01
    r[::37] = 5.0
    rows.append(r)
    r = torch.randn(cols, generator=g)
    r[: cols // 2] = 0
    rows.append(r)
    rows.append(torch.randint(-8, 8, (cols,), generator=g).float() * 0.125)
    r = torch.randn(cols, generator=g) * 1e-6
    r[min(5, cols - 1)] = 1.0
    rows.append(r)
    r = torch.zeros(cols)
    r[min(3, cols - 1)] = -2.0
    rows.append(r)
    rows.append(torch.distributions.StudentT(2.0).sample((cols,)) * 0.05)
    return torch.stack(rows)


def _weights_cases():
    g = torch.Generator().manual_seed(0)
    yield "randn", torch.randn(24, 1024, generator=g) * 0.02
    yield "randn_300", torch.randn(8, 300, generator=g)  # padded groups, a short super-block
    for cols in (256, 512, 40, 7, 1000):
        yield f"hard_{cols}", hard_rows(cols, cols)


def _state(qt):
    return {k: getattr(qt, k) for k in STATE_KEYS if getattr(qt, k, None) is not None}


def _assert_identical(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype.is_floating_point:  # bits, so that -0.0 and +0.0 count as different
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.parametrize("name", KQUANTS)
def test_group_params_in_c_equal_the_torch_reference(lib, name):
    s = get_scheme(name)
    for case, w in _weights_cases():
        g, valid = to_groups(w, s)
        fast = sc.group_params(g, valid, s)
        ref = sc.group_params_reference(g, valid, s)
        for i, (a, b) in enumerate(zip(fast, ref)):
            if b is None:
                assert a is None
                continue
            _assert_identical(a, b, f"{name} {case} part {i}")


@pytest.mark.parametrize("name", KQUANTS)
def test_quantize_with_the_c_search_equals_quantize_without(lib, name):
    for case, w in _weights_cases():
        fast = _state(quantize(w, name))
        with native.turned_off():
            ref = _state(quantize(w, name))
        assert fast.keys() == ref.keys()
        for k in fast:
            _assert_identical(fast[k], ref[k], f"{name} {case} {k}")


@pytest.mark.parametrize("name", KQUANTS)
def test_the_c_search_on_genuine_minilm_weights(lib, name):
    minilm = pytest.importorskip("fewbits.models.minilm")
    from safetensors import safe_open

    try:
        path = minilm.minilm_path() / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            w = f.get_tensor("encoder.layer.2.output.dense.weight").float()[:96]  # [96, 1536]
    except (FileNotFoundError, OSError) as e:
        pytest.skip(f"MiniLM weights unavailable: {e}")
    fast = _state(quantize(w, name))
    with native.turned_off():
        ref = _state(quantize(w, name))
    for k in fast:
        _assert_identical(fast[k], ref[k], f"{name} minilm {k}")


def test_refined_codes_in_c_equal_the_reference_on_groups_with_odd_sizes(lib):
    # a super-block scheme of groups of 24 (no k-quant preset: the general-length code paths)
    s = get_scheme("q4_k").with_(name=None, group_size=24, super_block=192)
    w = torch.cat([hard_rows(480, 1), torch.randn(4, 480)])
    g, valid = to_groups(w, s)
    fast = _state(quantize(w, s))
    with native.turned_off():
        ref = _state(quantize(w, s))
    for k in fast:
        _assert_identical(fast[k], ref[k], f"groups of 24 {k}")
    for a, b in zip(sc.group_params(g, valid, s), sc.group_params_reference(g, valid, s)):
        _assert_identical(a, b, "groups of 24")


def test_gptq_with_the_c_search_equals_gptq_without(lib):
    from fewbits.quant.gptq import gptq_quantize_weight

    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 512, generator=g) * 0.05
    x = torch.randn(64, 512, generator=g)
    h = x.T @ x
    for name in ("q4_k", "q6_k"):
        fast = _state(gptq_quantize_weight(w, h, name))
        with native.turned_off():
            ref = _state(gptq_quantize_weight(w, h, name))
        for k in fast:
            _assert_identical(fast[k], ref[k], f"gptq {name} {k}")


def _halving_sum(values):
    a, m = list(values), len(values)
    while m > 1:
        h = m // 2
        off = m - h
        for i in range(h):
            a[i] = a[i] + a[i + off]
        m = off
    return a[0] if values else 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 16, 24, 31, 32, 33])
def test_group_sum_adds_in_its_documented_order(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(50, n, generator=g, dtype=torch.float64) * torch.logspace(-12, 12, n, dtype=torch.float64)
    got = sc.group_sum(t)
    want = torch.tensor([_halving_sum(row) for row in t.tolist()], dtype=torch.float64)
    assert torch.equal(got, want)
    assert sc.group_sum(torch.zeros(3, 0, dtype=torch.float64)).tolist() == [0.0, 0.0, 0.0]


def test_the_square_root_of_the_weights_is_correctly_rounded():
    v = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 10
    got = sc._sqrt(v)
    assert got.tolist() == [math.sqrt(x) for x in v.tolist()]


def test_kquant_kernels_refuse_what_they_do_not_take(lib):
    g = torch.zeros(2, 3, 32)
    with pytest.raises(ValueError, match="CPU float32 group view"):
        native.kquant_float_min(lib, g.double(), None, 15.0, [15.0])
    with pytest.raises(ValueError, match="CPU float32 group view"):
        native.kquant_symmetric(lib, torch.zeros(2, 3, 300), None, -32.0, 31.0, [-32.0])
    assert not native.kquant_supported(g, torch.ones(1, 3, 16, dtype=torch.bool))
    d = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="shape"):
        native.kquant_refine(lib, g, None, 0.0, 15.0, d, (d, torch.zeros(3, 2)), d, (d, d))
