"""The codebook blocks' signed-scale search (IQ4_NL): kquant.c's fb_lookup_signed against the
torch reference, bit for bit, on every ISA the library builds for."""
from __future__ import annotations

import pytest
import torch

from fewbits.formats import get_format
from fewbits.kernels import native
from fewbits.quant.kquant_search import importance_weights
from fewbits.quant.lookup_search import candidates, signed_lookup_scales, signed_lookup_scales_reference

from helpers import build_c_source

FMT = get_format("iq4_nl")


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64"])
def lib(request, tmp_path_factory):
    return build_c_source(native.SOURCE_DIR / "kquant.c", request.param, tmp_path_factory.mktemp(request.param),
                          native.declare_kquant, ())


def _groups(rows, groups, n, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, groups, n, generator=gen) * 2.0 ** torch.randint(-30, 20, (rows, groups, 1), generator=gen)
    g[0] = 0.0  # empty groups
    g[1, :, :] = 0.25  # constant
    g[2] = g[2].abs()  # one-signed
    g[3, 0, 5] = 1e-16  # below the empty threshold alone
    g[4, :, 1] = g[4].abs().amax(-1) * -1  # the extreme negative: ties of magnitude, the first wins
    g[4, :, n - 1] = -g[4, :, 1]
    return g


@pytest.mark.parametrize("n", [32, 16, 7])
@pytest.mark.parametrize("weighted", [False, True])
def test_c_search_equals_the_reference(lib, n, weighted):
    g = _groups(40, 6, n, seed=n)
    valid = None
    if n == 7:  # a padded last group
        valid = torch.ones(1, 6, n, dtype=torch.bool)
        valid[0, -1, 4:] = False
        g[:, -1, 4:] = 0.0
    weights = None
    if weighted:
        importance = torch.rand(1, 6, n, generator=torch.Generator().manual_seed(1)) + 0.01
        weights = importance_weights(g, valid, importance)
    want = signed_lookup_scales_reference(g, valid, FMT, weights)
    got = native.lookup_signed(lib, g, valid, FMT.table, candidates(FMT), weights)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert (want[0] == 0).all()


def test_dispatch_and_signs():
    g = _groups(64, 4, 32, seed=3)
    d = signed_lookup_scales(g, None, FMT)
    assert torch.equal(d, signed_lookup_scales_reference(g, None, FMT))
    assert (d[2] < 0).any()  # positive groups: the long negative end of the table often fits best
    with pytest.raises(ValueError, match="codebook of 2 to 16"):
        native.lookup_signed(native.library() or pytest.skip("no native library"), g, None, list(range(17)), [1.0])
