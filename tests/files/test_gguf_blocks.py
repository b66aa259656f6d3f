"""GGUF legacy block formats (q8_0, q4_0, q4_1, q5_0, q5_1): fewbits' quantization and block
bytes equal the gguf package's numpy reference (gguf.quants.quantize) bit for bit, and
gguf.quants.dequantize of the bytes equals QuantizedTensor.dequantize()."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits.files.gguf_blocks import GGUF_BLOCK_TYPES, block_values, encode_blocks, gguf_block_type

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

# the k-quants: test_gguf_kquants.py; IQ4_NL, which gguf.quants does not quantize: test_gguf_iq4_nl.py
TYPES = [t for t in GGUF_BLOCK_TYPES if block_values(t) == 32 and t != "IQ4_NL"]


def hard_weights(shape, seed):
    """Random normal weights with the cases a block quantizer can get wrong: an all-zero block, a
    block with one huge value (positive and negative), a block whose two largest magnitudes tie
    with opposite signs, constant blocks, and values on exact halves of the grid."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    flat = w.reshape(-1, shape[-1])
    flat[0, :32] = 0.0
    if flat.shape[0] > 1:
        flat[1, 5] = 1e4
        flat[1, 40 % shape[-1]] = -3e3
    if flat.shape[0] > 2:
        flat[2, :32] = torch.arange(-16, 16) / 4.0  # halves on a Q4_0/Q8_0-like grid
        flat[2, 0], flat[2, 1] = 4.0, -4.0  # a tie of magnitudes: the first one decides Q4_0's sign
    if flat.shape[0] > 3:
        flat[3, :32] = -0.375  # constant block: d = 0 in Q4_1 / Q5_1
    if flat.shape[0] > 4:
        flat[4, :32] = torch.arange(32) * (1 / 15.0)  # Q4_1 steps: (x - min) * id lands near halves
    return w


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(8, 32), (16, 256), (3, 5, 96), (1, 64)])
def test_bytes_and_dequantization_equal_gguf(name, shape):
    preset, _, _ = GGUF_BLOCK_TYPES[name]
    qtype = GGMLQuantizationType[name]
    w = hard_weights(shape, seed=sum(shape))
    qt = fb.quantize(w, preset)
    want = gguf.quants.quantize(w.numpy(), qtype)
    got = encode_blocks(qt)
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    ref = gguf.quants.dequantize(want, qtype)
    assert np.array_equal(qt.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
    assert qt.nbytes == got.nbytes  # the scheme's own size is the GGUF size


@pytest.mark.parametrize("name", TYPES)
def test_many_random_scales(name):
    # magnitudes over many binades (fp16 subnormal scales included), rounding near every tie
    preset, _, _ = GGUF_BLOCK_TYPES[name]
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(512, 64, generator=gen) * 2.0 ** torch.randint(-20, 8, (512, 1), generator=gen)
    w[::3] += 2.0  # all-positive blocks: Q4_1's minimum is not widened to 0
    qt = fb.quantize(w, preset)
    qtype = GGMLQuantizationType[name]
    want = gguf.quants.quantize(w.numpy(), qtype)
    assert encode_blocks(qt).tobytes() == want.tobytes()
    assert np.array_equal(qt.dequantize().numpy(), gguf.quants.dequantize(want, qtype))


def test_float32_addition_rounds_as_llama_cpp():
    # x * id just below a half: trunc(x * id + 8.5) in float32 rounds the sum up to the next
    # integer (gguf gives code 9), where rounding x * id itself gives 8
    below_half = float(np.nextafter(np.float32(0.5), np.float32(0)))
    w = torch.zeros(1, 32)
    w[0, 0] = -8.0  # d = -8 / -8 = 1, id = 1
    w[0, 1] = below_half
    qt = fb.quantize(w, "q4_0")
    want = gguf.quants.quantize(w.numpy(), GGMLQuantizationType.Q4_0)
    assert encode_blocks(qt).tobytes() == want.tobytes()
    assert int(qt.int_codes()[0, 1]) == 1


def test_scheme_to_type_and_bad_input():
    assert {gguf_block_type(p) for p, _, _ in GGUF_BLOCK_TYPES.values()} == set(GGUF_BLOCK_TYPES)
    assert gguf_block_type(fb.quant.get_scheme("q4_0").with_(name="mine")) == "Q4_0"
    assert GGUF_BLOCK_TYPES["Q4_0"][1] == GGMLQuantizationType.Q4_0.value
    for name, (_, value, size) in GGUF_BLOCK_TYPES.items():
        assert GGMLQuantizationType(value).name == name
        assert gguf.constants.GGML_QUANT_SIZES[GGMLQuantizationType(value)] == (block_values(name), size)
    with pytest.raises(ValueError, match="no GGUF block format.*q8_0"):
        encode_blocks(fb.quantize(torch.randn(4, 64), "int4_g32"))
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_blocks(fb.quantize(torch.randn(4, 40), "q4_0"))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        encode_blocks(torch.zeros(4, 32))


@pytest.mark.parametrize("bad, msg", [
    (dict(format="fp4_e2m1", granularity="group", group_size=32, scale_method="gguf"), "integer format"),
    (dict(format="int4", granularity="channel", scale_method="gguf"), "in groups"),
    (dict(format="int4", granularity="group", group_size=32, scale_method="gguf", mode="stochastic"), "mode"),
    (dict(format="uint4", granularity="group", group_size=32, symmetric=False, scale_method="gguf"), "zero_point"),
])
def test_bad_gguf_schemes(bad, msg):
    with pytest.raises(ValueError, match=msg):
        fb.QuantScheme(**bad)


@pytest.mark.parametrize("name", TYPES)
def test_gptq_codes_are_written_exactly(name):
    # GPTQ chooses other codes than gguf's quantizer; the bytes still dequantize to fewbits' weights
    from fewbits.quant.gptq import gptq_quantize_weight

    preset, _, _ = GGUF_BLOCK_TYPES[name]
    gen = torch.Generator().manual_seed(3)
    W, X = torch.randn(16, 64, generator=gen), torch.randn(128, 64, generator=gen)
    qt = gptq_quantize_weight(W, X.T @ X, preset)
    blocks = encode_blocks(qt)
    got = gguf.quants.dequantize(blocks, GGMLQuantizationType[name])
    assert np.array_equal(got, qt.dequantize().numpy())


@pytest.mark.parametrize("name", TYPES)
def test_decode_blocks_reads_gguf_bytes(name):
    from fewbits.files.gguf_blocks import decode_blocks

    preset, _, size = GGUF_BLOCK_TYPES[name]
    qtype = GGMLQuantizationType[name]
    w = hard_weights((2, 6, 64), seed=11)
    raw = gguf.quants.quantize(w.numpy(), qtype)
    qt = decode_blocks(raw, name, w.shape)
    assert qt.scheme == fb.quant.get_scheme(preset) and tuple(qt.shape) == tuple(w.shape)
    assert np.array_equal(qt.dequantize().numpy(), gguf.quants.dequantize(raw, qtype))
    mine = fb.quantize(w, preset)  # the same codes and scales as quantizing here
    assert qt.state_dict().keys() == mine.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(qt.state_dict().values(), mine.state_dict().values()))
    assert encode_blocks(qt).tobytes() == raw.tobytes()
    with pytest.raises(ValueError, match=f"must be {12 * 2 * size} bytes"):
        decode_blocks(raw.reshape(-1)[:-1], name, w.shape)
    with pytest.raises(ValueError, match="multiple of 32"):
        decode_blocks(raw, name, (12, 4, 16))
    with pytest.raises(ValueError, match="unknown GGUF block type 'IQ2_XXS'"):
        decode_blocks(raw, "IQ2_XXS", w.shape)
