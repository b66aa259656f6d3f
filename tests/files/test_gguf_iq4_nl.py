"""GGUF IQ4_NL (blocks of 32 of llama.cpp's non-linear codebook under a signed fp16 scale): the
bytes against the gguf package's own dequantizer (gguf only dequantizes IQ4_NL; fewbits chooses
the codes), decoding arbitrary bytes, the scale search against a port of llama.cpp's quantizer
(tests/llama_kquant_reference.py), with and without importance weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fewbits as fb
from fewbits.files.gguf_blocks import _decode_blocks_reference, _encode_blocks_reference, decode_blocks, encode_blocks
from fewbits.quant import get_scheme

import llama_kquant_reference as llama

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

IQ4_NL = GGMLQuantizationType.IQ4_NL


def hard(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows over many binades, and (the first 7 rows) zeros, a constant, one-signed rows, an
    outlier, a saturating scale, the codebook itself."""
    gen = torch.Generator().manual_seed(seed)
    n = max(rows, 8)
    w = torch.randn(n, cols, generator=gen) * 2.0 ** torch.randint(-20, 8, (n, 1), generator=gen)
    w[0] = 0.0
    w[1] = 0.3  # constant
    w[2] = -w[2].abs()
    w[3] = w[3].abs() + 1.0
    w[4, 7] = 500.0
    w[5] *= 1e30  # the fp16 scale saturates
    w[6, :32] = torch.tensor(llama.IQ4_NL_VALUES).repeat(2) / 7.0  # the codebook itself
    return w[:rows]


def _mse(a, b) -> float:
    return float((torch.as_tensor(a).double() - b.double()).pow(2).mean())


@pytest.mark.parametrize("shape", [(8, 32), (16, 256), (3, 5, 96), (1, 64)])
def test_gguf_dequantizes_the_bytes_to_fewbits_values(shape):
    w = hard(int(np.prod(shape[:-1])), shape[-1], seed=sum(shape)).reshape(shape)
    qt = fb.quantize(w, "iq4_nl")
    blocks = encode_blocks(qt)
    assert blocks.shape == (*shape[:-1], shape[-1] // 32 * 18) and qt.nbytes == blocks.nbytes
    assert blocks.tobytes() == _encode_blocks_reference(qt).tobytes()
    mine = qt.dequantize().numpy()
    assert np.array_equal(mine.view(np.uint32), gguf.quants.dequantize(blocks, IQ4_NL).view(np.uint32))
    assert np.isfinite(mine).all()
    assert torch.equal(qt.dequantize()[0 if len(shape) == 2 else (0, 0)], torch.zeros(shape[-1]))


def test_decode_blocks_reads_any_bytes_as_gguf_does():
    noise = np.random.default_rng(3).integers(0, 256, size=(12, 4 * 18), dtype=np.uint8)
    noise.reshape(-1, 18)[:, :2] = np.array([0.01], np.float16).view(np.uint8)  # finite d
    noise.reshape(-1, 18)[::5, :2] = np.array([-3.5], np.float16).view(np.uint8)  # negative d
    read = decode_blocks(noise, "IQ4_NL", (12, 128))
    assert read.scheme == get_scheme("iq4_nl")
    want = gguf.quants.dequantize(noise, IQ4_NL)
    assert np.array_equal(read.dequantize().numpy().view(np.uint32), want.view(np.uint32))
    ref = _decode_blocks_reference(noise, "IQ4_NL", (12, 128))
    assert all(torch.equal(a, b) for a, b in zip(read.state_dict().values(), ref.state_dict().values()))
    assert encode_blocks(read).tobytes() == noise.tobytes()
    with pytest.raises(ValueError, match="must be 864 bytes"):
        decode_blocks(noise.reshape(-1)[:-1], "IQ4_NL", (12, 128))
    with pytest.raises(ValueError, match="multiple of 32"):  # a file's shape that no block holds
        decode_blocks(noise, "IQ4_NL", (12, 100))
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_blocks(fb.quantize(torch.randn(4, 48), "iq4_nl"))  # fine for fewbits, not for GGUF


def test_the_scale_is_signed_and_the_extreme_may_take_the_long_end():
    # a block whose largest magnitude is positive: a negative d maps it onto -127, the table's long end
    w = torch.linspace(-1.0, 1.0, 32).reshape(1, 32) ** 3
    w[0, -1] = 1.0
    qt = fb.quantize(w, "iq4_nl")
    assert float(qt.scale_values()[0, 0]) < 0
    assert _mse(qt.dequantize(), w) < _mse(fb.quantize(w, "q4_0").dequantize(), w)


def test_search_matches_llama_cpp_and_beats_q4_0():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen)
    ours = _mse(fb.quantize(w, "iq4_nl").dequantize(), w)
    theirs = _mse(llama.iq4_nl_reference(w.numpy()), w)
    q4_0 = _mse(fb.quantize(w, "q4_0").dequantize(), w)
    # the same search; fewbits rounds the elements under the fp16 d, llama.cpp under the unrounded one
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)
    assert ours < 0.85 * q4_0, (ours, q4_0)


def test_importance_weights_lower_the_weighted_error():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 256, generator=gen)
    importance = torch.rand(256, generator=gen) ** 4 + 1e-3  # a few columns matter most
    plain = fb.quantize(w, "iq4_nl").dequantize()
    weighted = fb.quantize(w, "iq4_nl", importance=importance).dequantize()

    def err(q):
        return float(((q - w).double() ** 2 * importance.double()).sum())

    assert err(weighted) < 0.95 * err(plain)
    theirs = torch.from_numpy(llama.iq4_nl_reference(w.numpy(), importance.numpy()))
    assert err(weighted) < 1.02 * err(theirs), (err(weighted), err(theirs))
    assert np.array_equal(gguf.quants.dequantize(encode_blocks(fb.quantize(w, "iq4_nl", importance=importance)), IQ4_NL),
                          weighted.numpy())
