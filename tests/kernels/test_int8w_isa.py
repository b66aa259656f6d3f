"""int8w.c (int8 weight-only layers, a few rows of x) in its three builds -- AVX-512, AVX2+FMA,
scalar C -- against the float64 product with the dequantized weight: every output within float32
summation error (each output is the float32 sum of code times x, times its row's scale once)."""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native
from helpers import build_c_source

SRC = native.SOURCE_DIR / "int8w.c"
BUILDS = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(scope="module", params=BUILDS)
def lib(request, tmp_path_factory):
    return build_c_source(SRC, request.param, tmp_path_factory.mktemp(request.param), native.declare_int8w, ())


@pytest.mark.parametrize("n,k", [(70, 320), (67, 100), (3, 17), (65, 16), (5, 1), (64, 4103)])
def test_the_product_with_the_dequantized_weight(lib, n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.1 + 1e-3
    w = q.double() * s.double()[:, None]
    weight = native.Int8Weight(q, s)
    assert native.Int8Weight.max_rows(lib) == 8
    for m in range(0, 9):
        x = torch.randn(m, k, generator=g) * 3
        y = weight.matmul(lib, x)
        assert y.shape == (m, n)
        ref = x.double() @ w.t()
        bound = (k + 2) * 2.0 ** -24 * (x.abs().double() @ w.abs().t()) + 1e-30
        assert bool(((y.double() - ref).abs() <= bound).all()), (m, (y.double() - ref).abs().max())
    wide = torch.randn(4, 2 * k, generator=g)
    assert torch.equal(weight.matmul(lib, wide[:, :k]), weight.matmul(lib, wide[:, :k].contiguous()))  # row stride
    assert torch.equal(weight.matmul(lib, wide[:, ::2]), weight.matmul(lib, wide[:, ::2].contiguous()))
    assert torch.equal(weight.matmul(lib, x[:1]).reshape(-1), _row(lib, weight, x[0]))


def _row(lib, weight, x):
    y = torch.empty(weight.n)
    native.int8w_rc(lib.fb_int8w_row(weight.row_call(), x.contiguous().data_ptr(), y.data_ptr()))
    return y


def test_bad_arguments_are_refused(lib):
    weight = native.Int8Weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="at most 8"):
        weight.matmul(lib, torch.zeros(9, 32))
    with pytest.raises(ValueError, match="float32"):
        weight.matmul(lib, torch.zeros(1, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32"):
        weight.matmul(lib, torch.zeros(1, 33))
    with pytest.raises(ValueError, match="int8"):
        native.Int8Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        native.Int8Weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(3))
    y = torch.empty(1, 4)
    assert lib.fb_int8w_matmul(0, 32, 9, 0, 0, 4, 32, y.data_ptr()) == -1  # more rows than the kernel takes
