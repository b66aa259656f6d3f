"""mode="bitsandbytes": bitsandbytes' NF4 rounding, bit for bit, on its bucket bounds.

bitsandbytes (quantize_4bit, quant_type="nf4") takes code = #{i: float32(x) > b[i]} with float32
bounds b[i] = (v[i] + v[i+1]) / 2; fewbits' exact rounding (nearest_even) differs on 10 of the
15 bounds. The inputs here are the bounds themselves, their float32 neighbours, the exact
midpoints and the codebook values, both signs; blocks of 64 with absmax 1, so bitsandbytes'
scaling (x * (1 / absmax)) leaves them as they are. The scaled case (other absmax values) is in
tests/quant/test_quant_oracles.py. Every path is checked: the scalar reference, the C codebook
kernel (thresholds), the compiled and eager torch kernels, encode, other input dtypes, and the
binary search of codebooks above 32 values.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import fewbits as fb
from fewbits import LookupFormat
from fewbits.formats import MODE_PRESETS, encode_value, round_value
from fewbits.kernels import native_round
from fewbits.quant import QuantScheme
from helpers import assert_same, reference_encode, reference_round

NF4 = fb.get_format("nf4")


@pytest.fixture(scope="module")
def bnbf():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("bitsandbytes.functional")


def _bounds_inputs(fmt) -> torch.Tensor:
    """The bitsandbytes bounds of fmt, the exact midpoints and the values (float32 where they
    are not), each with its float32 neighbours, both signs: 1-D float32."""
    b = torch.tensor(fmt.bitsandbytes_bounds(), dtype=torch.float32)
    t = torch.tensor(fmt.table, dtype=torch.float64)
    mids = ((t[1:] + t[:-1]) / 2).float()
    base = torch.cat([b, mids, t.float(), torch.zeros(1)])
    base = torch.cat([base, -base])
    up = torch.nextafter(base, torch.full_like(base, math.inf))
    down = torch.nextafter(base, torch.full_like(base, -math.inf))
    return torch.cat([base, up, down])


def _nf4_inputs() -> torch.Tensor:
    """_bounds_inputs of NF4 within [-1, 1] (a block's absmax stays 1)."""
    x = _bounds_inputs(NF4)
    return x[x.abs() <= 1]


def _bnb_codes(bnbf, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' NF4 codes of x (|x| <= 1), in blocks of 64 that each start with 1.0 so that
    every block's absmax is 1: int64 codes of x."""
    per = 63
    n_blocks = -(-x.numel() // per)
    body = torch.zeros(n_blocks * per, dtype=x.dtype)
    body[:x.numel()] = x
    blocks = torch.cat([torch.ones(n_blocks, 1, dtype=x.dtype), body.reshape(n_blocks, per)], dim=1)
    packed, state = bnbf.quantize_4bit(blocks.reshape(-1), blocksize=64, quant_type="nf4")
    assert torch.equal(state.absmax, torch.ones(n_blocks))
    codes = fb.unpack(packed.reshape(-1), 4, blocks.numel(), order="high_first").to(torch.int64)
    return codes.reshape(n_blocks, 64)[:, 1:].reshape(-1)[:x.numel()]


def test_bounds_are_bitsandbytes_float32_midpoints(bnbf):
    """The bounds are bitsandbytes' own table's float32 midpoints; 10 of them are not where exact
    rounding puts the decision (the issue: 10 of 15 bounds give another code)."""
    code = bnbf.get_4bit_type("nf4", device="cpu")
    assert tuple(code.tolist()) == NF4.table
    assert NF4.bitsandbytes_bounds() == tuple(((code[:-1] + code[1:]) / 2).tolist())
    b = torch.tensor(NF4.bitsandbytes_bounds())
    exact = fb.encode(b, NF4, mode="nearest_even").to(torch.int64)
    assert int((exact != torch.arange(15)).sum()) == 10  # exact rounding takes these bounds up


def test_issue_repro(bnbf):
    x = torch.zeros(64)
    x[0], x[1], x[2] = 1.0, 0.6427869200706482, 0.8614784479141235
    assert fb.encode(x, NF4)[1:3].tolist() == [14, 15]  # exact rounding, unchanged
    assert fb.encode(x, NF4, mode="bitsandbytes")[1:3].tolist() == [13, 14]
    assert _bnb_codes(bnbf, x[1:3]).tolist() == [13, 14]


def test_every_path_equals_bitsandbytes_on_the_bounds(bnbf):
    x = _nf4_inputs()
    want = _bnb_codes(bnbf, x)
    values = torch.tensor(NF4.table)[want]
    # the scalar reference
    assert reference_encode(x, NF4, "bitsandbytes") == want.tolist()
    # encode and round, each backend (auto: the C kernel for round where it is built)
    for backend in ("auto", "compiled", "eager"):
        with fb.use_backend(backend):
            assert torch.equal(fb.encode(x, NF4, mode="bitsandbytes").to(torch.int64), want), backend
            assert_same(fb.round(x, NF4, "bitsandbytes"), values, x, backend)
            out = torch.empty_like(x)
            fb.round(x, NF4, "bitsandbytes", out=out)
            assert_same(out, values, x, f"{backend} out=")
    # the bounds do decide: exact rounding gives another code exactly on 10 of the bounds
    diff = fb.encode(x, NF4).to(torch.int64) != want
    moved = set(x[diff].tolist())
    assert len(moved) == 10 and moved <= set(NF4.bitsandbytes_bounds())


@pytest.mark.skipif(native_round._library() is None, reason="the C rounding kernels are not built here")
def test_c_kernel_takes_the_bounds():
    """The C codebook kernel itself (not a fallback) with bitsandbytes' thresholds."""
    x = _bounds_inputs(NF4)
    got = native_round.try_round(x, NF4, "bitsandbytes", "saturate", (0, 0))
    assert got is not None
    assert_same(got, reference_round(x, NF4, "bitsandbytes").float(), x, "C kernel")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_input_dtypes_are_cast_to_float32_first(bnbf, dtype):
    """bitsandbytes casts its input to float32 and decides there; so does the preset, float64
    included (a float64 just above a bound that rounds onto it goes to the lower code)."""
    x = _nf4_inputs().to(dtype)
    if dtype == torch.float64:  # float64 values between the float32 bound and its neighbours
        b = torch.tensor(NF4.bitsandbytes_bounds(), dtype=torch.float64)
        x = torch.cat([x, b + 2.0 ** -40, b - 2.0 ** -40, -b + 2.0 ** -40, -b - 2.0 ** -40])
    want = torch.tensor(reference_encode(x, NF4, "bitsandbytes"))
    assert torch.equal(want, _bnb_codes(bnbf, x.float()))
    for backend in ("compiled", "eager"):
        with fb.use_backend(backend):
            assert torch.equal(fb.encode(x, NF4, mode="bitsandbytes").to(torch.int64), want), backend
            got = fb.round(x, NF4, "bitsandbytes")
            assert got.dtype == dtype
            assert_same(got, torch.tensor(NF4.table, dtype=torch.float64)[want].to(dtype), x, backend)


CODEBOOKS = [LookupFormat("uneven", [-10.0, -0.3125, 2.0 ** -10, 0.25, 7.0]),
             LookupFormat("sixteen", [float(v) for v in range(-8, 8)]),
             # a bound whose float32 sum rounds: (1 - 2^-24) + 3 is 4 in float32, the bound 2
             LookupFormat("odd_sums", [-1.0, 2.0 ** -24, 0.5 + 2.0 ** -24, 1.0 - 2.0 ** -24, 3.0]),
             LookupFormat("forty", [i / 8 - 2.5 for i in range(40)])]  # > 32 values: binary search


@pytest.mark.parametrize("fmt", CODEBOOKS, ids=lambda f: f.name)
def test_other_codebooks_fast_paths_equal_reference(fmt):
    x = torch.cat([_bounds_inputs(fmt), torch.tensor([math.inf, -math.inf, math.nan, 1e30, -1e30])])
    ref = reference_round(x, fmt, "bitsandbytes").float()
    finite = ~torch.isnan(x)
    codes = torch.tensor(reference_encode(x[finite], fmt, "bitsandbytes"))
    for backend in ("auto", "compiled", "eager"):
        with fb.use_backend(backend):
            assert_same(fb.round(x, fmt, "bitsandbytes"), ref, x, f"{fmt.name} {backend}")
            assert torch.equal(fb.encode(x[finite], fmt, mode="bitsandbytes").to(torch.int64), codes)


def test_reference_rule():
    """The rule spelled out: a value equal to a bound goes down, the next float32 up."""
    for i, b in enumerate(NF4.bitsandbytes_bounds()):
        up = float(torch.nextafter(torch.tensor(b), torch.tensor(2.0)))
        assert encode_value(b, NF4, "bitsandbytes") == i
        assert encode_value(up, NF4, "bitsandbytes") == i + 1
    assert round_value(2.0, NF4, "bitsandbytes") == 1.0 and round_value(-5.0, NF4, "bitsandbytes") == -1.0


def test_preset_is_for_float32_codebooks_only():
    assert "bitsandbytes" in MODE_PRESETS and "bitsandbytes" not in fb.MODES
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="codebooks"):
        fb.round(x, "fp8_e4m3", "bitsandbytes")
    with pytest.raises(ValueError, match="codebooks"):
        fb.encode(x, "int4", mode="bitsandbytes")
    with pytest.raises(ValueError, match="codebooks"):
        round_value(0.5, fb.get_format("e2m1"), "bitsandbytes")
    with pytest.raises(ValueError, match="float32"):
        fb.round(x, LookupFormat("f64", [0.0, 0.1, 1.0]), "bitsandbytes")
    with pytest.raises(ValueError, match="codebooks"):
        QuantScheme("int4", "group", mode="bitsandbytes")
    with pytest.raises(ValueError, match="unknown rounding mode 'bnb'.*bitsandbytes"):
        fb.round(x, NF4, "bnb")
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    with pytest.raises(ValueError, match="codebooks"):
        fb.round(x, "e4m3", "bitsandbytes", generator=g)
    assert torch.equal(g.get_state(), state)
