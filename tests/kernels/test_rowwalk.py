"""The order the decode-size matmuls walk a weight's rows in (csrc/rowwalk.h: each thread's share
cut into four streams of rows, taken a row from each in turn) changes where the codes come from,
never what a row computes: every output row is written once, with the same bits as the same row
in a layer of its own, at one thread and two, for shares that do not split evenly into streams.
Covers the three kernels that walk rows that way: lut4 (int4, nf4, mxfp4), w4a8 and int8w."""
from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native
from fewbits.quant.modules import QuantLinear

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library")

# (scheme, the C function its one-row forward calls)
SCHEMES = [("int4", "fb_lut4_row"), ("nf4", "fb_lut4_row"), ("mxfp4", "fb_lut4_row"),
           ("w4a8", "fb_w4a8_row"), ("int8", "fb_int8w_row")]
# rows: under the parallel threshold (64; 4 and 7: streams of one or two rows, in one thread), at
# it, and shares of two threads that leave streams of unequal length (65 -> 32 + 33 -> 8, 8, 8, 9)
ROWS = [4, 7, 64, 65, 67, 130, 257]


@pytest.fixture
def threads():
    """torch's thread count restored after the test, and torch.empty filled with NaN meanwhile
    (deterministic mode): a row the walk skips would otherwise keep the right bits from an
    earlier call whose freed output buffer the next call reuses"""
    before = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(before)


def _layer(scheme: str, weight: torch.Tensor) -> QuantLinear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return QuantLinear.from_linear(lin, scheme).eval()


@pytest.mark.parametrize("scheme,row_fn", SCHEMES)
@pytest.mark.parametrize("n", ROWS)
def test_every_row_once_with_its_own_bits_at_one_and_two_threads(threads, scheme, row_fn, n):
    g = torch.Generator().manual_seed(n)
    k = 256
    weight = torch.randn(n, k, generator=g)
    q = _layer(scheme, weight)
    if q._row is None or q._row[0] != row_fn:
        pytest.skip(f"{scheme} takes no {row_fn} on this CPU")
    x = torch.randn(1, k, generator=g)
    # each row alone: a layer of that one row (per-row quantization: the same codes and scales)
    alone = torch.cat([_layer(scheme, weight[i:i + 1])(x) for i in range(n)], dim=1)
    with torch.inference_mode():
        for t in (1, 2):
            torch.set_num_threads(t)
            for _ in range(2):
                y = q(x)
                assert torch.equal(y.view(torch.int32), alone.view(torch.int32)), (scheme, n, t)
    ref = q.reference_forward(x)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("scheme,row_fn", [("w4a8", "fb_w4a8_row"), ("int8", "fb_int8w_row")])
def test_a_few_rows_of_x_walk_the_same_rows(threads, scheme, row_fn):
    """w4a8 and int8w walk the rows this way for batches of a few rows of x too"""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(131, 128, generator=g)
    q = _layer(scheme, weight)
    if q._row is None or q._row[0] != row_fn:
        pytest.skip(f"{scheme} takes no {row_fn} on this CPU")
    x = torch.randn(3, 128, generator=g)
    with torch.inference_mode():
        torch.set_num_threads(1)
        one = q(x)
        torch.set_num_threads(2)
        two = q(x)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    ref = q.reference_forward(x)
    assert torch.allclose(one, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
