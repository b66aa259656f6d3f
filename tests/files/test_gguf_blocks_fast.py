"""encode_blocks / decode_blocks (bytes moved as bytes) against their plain references
(_encode_blocks_reference / _decode_blocks_reference, through integer values), byte for byte,
on every GGUF block type: quantized weights of many shapes, GPTQ codes, hard rows, and
arbitrary block bytes read back."""
import numpy as np
import pytest
import torch

from fewbits.files import gguf_blocks as gb
from fewbits.quant import quantize
from fewbits.quant.tensor import STATE_KEYS

TYPES = list(gb.GGUF_BLOCK_TYPES)


def _shapes(block):
    return [(block,), (1, block), (3, block), (2, 5, 2 * block), (7, 4 * block), (16, 8 * block)]


def _hard(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    flat = w.reshape(-1, shape[-1])
    if flat.shape[0] > 2:
        flat[0] = 0.0
        flat[1] = 1.5  # constant
        flat[2, ::7] = 40.0  # outliers
    return w


def _same_state(a, b, what):
    for k in STATE_KEYS:
        u, v = getattr(a, k, None), getattr(b, k, None)
        assert (u is None) == (v is None), f"{what}: {k}"
        if u is None:
            continue
        assert u.dtype == v.dtype and u.shape == v.shape, f"{what}: {k}"
        if u.dtype.is_floating_point:
            u, v = u.view(torch.int16) if u.element_size() == 2 else u.view(torch.int32), \
                v.view(torch.int16) if v.element_size() == 2 else v.view(torch.int32)
        assert torch.equal(u, v), f"{what}: {k}"


@pytest.mark.parametrize("type_name", TYPES)
def test_encode_blocks_equals_the_reference_on_every_shape(type_name):
    preset = gb.GGUF_BLOCK_TYPES[type_name][0]
    for i, shape in enumerate(_shapes(gb.block_values(type_name))):
        qt = quantize(_hard(shape, i), preset)
        fast, ref = gb.encode_blocks(qt), gb._encode_blocks_reference(qt)
        assert fast.dtype == ref.dtype == np.uint8 and fast.shape == ref.shape
        assert np.array_equal(fast, ref), (type_name, shape)


@pytest.mark.parametrize("type_name", TYPES)
def test_decode_blocks_equals_the_reference_on_arbitrary_bytes(type_name):
    _, _, size = gb.GGUF_BLOCK_TYPES[type_name]
    rng = np.random.default_rng(7)
    for shape in _shapes(gb.block_values(type_name)):
        count = int(np.prod(shape)) // gb.block_values(type_name)
        raw = rng.integers(0, 256, count * size, dtype=np.uint8)
        raw.reshape(count, size)[:, :2] = np.array([0.01], dtype="<f2").view(np.uint8)  # finite scales
        fast = gb.decode_blocks(raw, type_name, shape)
        ref = gb._decode_blocks_reference(raw, type_name, shape)
        _same_state(fast, ref, f"{type_name} {shape}")
        # and back: the bytes read are the bytes written
        assert np.array_equal(gb.encode_blocks(fast).reshape(-1), gb._encode_blocks_reference(ref).reshape(-1))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_encode_blocks_of_gptq_codes_equals_the_reference(type_name):
    from fewbits.quant.gptq import gptq_quantize_weight

    block = gb.block_values(type_name)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 2 * block, generator=g) * 0.05
    x = torch.randn(32, 2 * block, generator=g)
    qt = gptq_quantize_weight(w, x.T @ x, gb.GGUF_BLOCK_TYPES[type_name][0])
    assert np.array_equal(gb.encode_blocks(qt), gb._encode_blocks_reference(qt))
    back = gb.decode_blocks(gb.encode_blocks(qt), type_name, tuple(w.shape))
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_w4a8_weights_are_stored_as_q4_0():
    """The activations' scheme is chosen when a layer runs, not stored: a w4a8 weight is GGUF
    Q4_0, with Q4_0's bytes."""
    w = torch.randn(8, 128)
    assert gb.gguf_block_type("w4a8") == "Q4_0"
    assert np.array_equal(gb.encode_blocks(quantize(w, "w4a8")), gb.encode_blocks(quantize(w, "q4_0")))
    with pytest.raises(ValueError, match="no GGUF block format"):
        gb.gguf_block_type("w8a8")
