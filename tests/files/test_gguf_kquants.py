"""GGUF k-quants (q4_k, q5_k, q6_k): the schemes' sizes, the block bytes against the gguf
package's own dequantizer (gguf.quants.dequantize of encode_blocks(qt) equals qt.dequantize() bit
for bit), decoding, the scale search against a plain range and against llama.cpp's reference
algorithm (a port in llama_kquant_reference.py), GPTQ, and fb.save / fb.load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits.files.gguf_blocks import GGUF_BLOCK_TYPES, decode_blocks, encode_blocks, gguf_block_type
from fewbits.quant import QuantScheme, get_scheme

import llama_kquant_reference as llama

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

KQUANTS = {"Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def hard_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal weights with the rows a two-level quantizer can get wrong: zeros, a constant,
    negative-only, positive-only, one outlier, huge and tiny magnitudes, a row whose super-blocks
    differ in scale by 2^20, exact grid values."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    w[0] = 0.0
    w[1] = 0.3
    w[2] = -w[2].abs()
    w[3] = w[3].abs() + 1.0
    w[4, 7] = 500.0
    w[5] *= 3e4
    w[6] *= 1e-7
    w[7, : cols // 2] *= 2.0 ** -20
    w[8] = -0.625
    w[9, :32] = torch.arange(32) / 15.0
    w[10] *= 1e30  # fp16 super-block scales saturate: clipped, but written as read
    return w


@pytest.mark.parametrize("type_name", list(KQUANTS))
@pytest.mark.parametrize("method", ["mse", "absmax"])
@pytest.mark.parametrize("shape", [(12, 256), (11, 768), (2, 6, 512)])
def test_gguf_dequantizes_the_bytes_to_fewbits_values(type_name, method, shape):
    scheme = get_scheme(KQUANTS[type_name])
    if method != scheme.scale_method:
        scheme = scheme.with_(scale_method=method)
    w = hard_rows(int(np.prod(shape[:-1])), shape[-1], seed=sum(shape)).reshape(shape)
    qt = fb.quantize(w, scheme)
    blocks = encode_blocks(qt)
    size = GGUF_BLOCK_TYPES[type_name][2]
    assert blocks.dtype == np.uint8 and blocks.shape == (*shape[:-1], shape[-1] // 256 * size)
    mine = qt.dequantize().numpy()
    theirs = gguf.quants.dequantize(blocks, GGMLQuantizationType[type_name])
    assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32))
    assert np.isfinite(mine).all()
    if method == "mse":
        assert qt.nbytes == blocks.nbytes == scheme.nbytes(shape)


@pytest.mark.parametrize("type_name", list(KQUANTS))
def test_exact_rows_stay_exact(type_name):
    w = hard_rows(12, 256, seed=1)
    q = fb.quantize(w, KQUANTS[type_name]).dequantize()
    assert torch.equal(q[0], w[0])  # zeros
    if type_name != "Q6_K":  # a float minimum holds a constant row up to its 6-bit code
        assert torch.allclose(q[1], w[1], rtol=1e-2) and torch.allclose(q[8], w[8], rtol=1e-2)
    # negative-only and positive-only rows cost no more than a normal row (row 11) of that scale
    normal = _mse(q[11], w[11]) / float(w[11].abs().max()) ** 2
    for r in (2, 3):
        assert _mse(q[r], w[r]) / float(w[r].abs().max()) ** 2 < 2 * normal


@pytest.mark.parametrize("type_name", list(KQUANTS))
def test_decode_blocks_reads_back_codes_and_scales(type_name):
    preset = KQUANTS[type_name]
    w = hard_rows(12, 512, seed=5)
    qt = fb.quantize(w, preset)
    blocks = encode_blocks(qt)
    back = decode_blocks(blocks, type_name, w.shape)
    assert back.scheme == get_scheme(preset) and tuple(back.shape) == tuple(w.shape)
    assert qt.state_dict().keys() == back.state_dict().keys()
    for key, t in qt.state_dict().items():
        assert torch.equal(t, back.state_dict()[key]), key
    assert torch.equal(back.scale_values(), qt.scale_values())
    assert encode_blocks(back).tobytes() == blocks.tobytes()
    # bytes from a file: any bit pattern decodes, and gguf agrees on what it means
    noise = np.random.default_rng(0).integers(0, 256, size=blocks.shape, dtype=np.uint8)
    halves_at = {"Q6_K": 208, "Q3_K": 108}  # finite d (and dmin)
    if type_name in halves_at:
        noise.reshape(-1, GGUF_BLOCK_TYPES[type_name][2])[:, halves_at[type_name]:] = np.array([0.01], np.float16).view(np.uint8)
    elif type_name == "Q2_K":
        noise.reshape(-1, 84)[:, 80:] = np.array([0.01, 0.02], np.float16).view(np.uint8)
    else:
        noise.reshape(-1, GGUF_BLOCK_TYPES[type_name][2])[:, :4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
    read = decode_blocks(noise, type_name, w.shape)
    want = gguf.quants.dequantize(noise, GGMLQuantizationType[type_name])
    assert np.array_equal(read.dequantize().numpy().view(np.uint32), want.view(np.uint32))
    assert encode_blocks(read).tobytes() == noise.tobytes()


@pytest.mark.parametrize("type_name", list(KQUANTS))
def test_bad_shapes_and_byte_counts(type_name):
    preset, _, size = KQUANTS[type_name], None, GGUF_BLOCK_TYPES[type_name][2]
    raw = encode_blocks(fb.quantize(torch.randn(3, 512), preset))
    with pytest.raises(ValueError, match=f"must be {3 * 2 * size} bytes"):
        decode_blocks(raw.reshape(-1)[:-1], type_name, (3, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        decode_blocks(raw, type_name, (6, 256 + 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        encode_blocks(fb.quantize(torch.randn(4, 384), preset))  # fine for fewbits, not for GGUF
    qt = fb.quantize(torch.randn(4, 384), preset)  # a short last super-block dequantizes as usual
    assert qt.scale_values().shape == (4, 384 // qt.scheme.group_size)


def test_schemes_are_data():
    assert [get_scheme(n).bits_per_value() for n in ("q4_k", "q5_k", "q6_k")] == [4.5, 5.5, 6.5625]
    for type_name, preset in KQUANTS.items():
        s = get_scheme(preset)
        assert gguf_block_type(s) == type_name and gguf_block_type(s.with_(name="mine")) == type_name
        assert QuantScheme.from_dict(s.to_dict()) == s
        assert s.bits_per_value((4096, 4096)) == s.bits_per_value()
        assert gguf.constants.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]] == (256, s.nbytes((1, 256)))
    assert "super-blocks of 256 (uint6 sub-scales)" in get_scheme("q4_k").describe()
    with pytest.raises(ValueError, match="no GGUF block format"):
        gguf_block_type(get_scheme("q4_k").with_(scale_format="bf16"))


@pytest.mark.parametrize("fields, msg", [
    (dict(super_block=256), "need both super_block"),
    (dict(super_block=100, sub_scale_format="uint6"), "multiple of group_size"),
    (dict(super_block=256, sub_scale_format="int8"), "unsigned sub_scale_format"),
    (dict(super_block=256, sub_scale_format="fp8_e4m3"), "integer format"),
    (dict(super_block=256, sub_scale_format="uint6", scale_method="percentile"), "'absmax' or 'mse'"),
    (dict(super_block=256, sub_scale_format="uint6", scale_format="e4m3"), "fp32, fp16 or bf16"),
])
def test_bad_super_block_schemes(fields, msg):
    base = dict(format="uint4", granularity="group", group_size=32, symmetric=False, zero_point="float",
                scale_format="fp16")
    with pytest.raises(ValueError, match=msg):
        QuantScheme(**{**base, **fields})
    with pytest.raises(ValueError, match="signed sub_scale_format"):
        QuantScheme("int6", "group", group_size=16, super_block=256, sub_scale_format="uint8")
    with pytest.raises(ValueError, match="granularity='group'"):
        QuantScheme("int6", "channel", super_block=256, sub_scale_format="int8")
    with pytest.raises(ValueError, match="cannot be given"):
        fb.quantize(torch.randn(2, 256), "q6_k", scales=torch.ones(2, 16))


def _minilm_down(index: int = 0) -> torch.Tensor:
    minilm = pytest.importorskip("fewbits.models.minilm")
    from safetensors import safe_open
    try:
        path = minilm.minilm_path() / "model.safetensors"
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with safe_open(str(path), "pt") as f:
        names = [k for k in f.keys() if k.endswith(f"layer.{index}.output.dense.weight")]
        return f.get_tensor(names[0]).to(torch.float32)


def _mse(a, b) -> float:
    return float((a.double() - b.double()).pow(2).mean())


def _port(type_name, w):
    """What llama.cpp's reference quantizer (no importance matrix) makes of w: the port's values."""
    x = w.numpy()
    if type_name in ("Q4_K", "Q5_K"):
        return llama.q45_k_reference(x, get_scheme(KQUANTS[type_name]).format.bits)
    return {"Q2_K": llama.q2_k_reference, "Q3_K": llama.q3_k_reference, "Q6_K": llama.q6_k_reference}[type_name](x)


@pytest.mark.parametrize("type_name", list(KQUANTS))
def test_search_beats_plain_range_and_llama_cpp_on_minilm(type_name):
    w = _minilm_down(0)  # [384, 1536], genuine fp32
    preset = KQUANTS[type_name]
    qt = fb.quantize(w, preset)
    blocks = encode_blocks(qt)
    assert np.array_equal(gguf.quants.dequantize(blocks, GGMLQuantizationType[type_name]), qt.dequantize().numpy())
    ours = _mse(qt.dequantize(), w)
    plain = _mse(fb.quantize(w, get_scheme(preset).with_(scale_method="absmax")).dequantize(), w)
    port = _port(type_name, w)
    theirs = _mse(torch.from_numpy(port), w)
    assert ours < 0.9 * plain, (ours, plain)
    if type_name == "Q3_K":
        # llama.cpp's make_q3_quants moves one code at a time while the group's fit improves; its
        # scales come out ~3% better in plain MSE than fewbits' 19-candidate search (measured
        # 1.033x here; the importance-weighted search, what --method imatrix runs, is the same
        # algorithm as llama.cpp's imatrix path, make_qx_quants)
        assert ours < 1.05 * theirs, (ours, theirs)
    else:
        assert ours < theirs, (ours, theirs)


@pytest.mark.parametrize("type_name", list(KQUANTS))
def test_llama_cpp_port_is_a_fair_oracle(type_name):
    # the port is close to fewbits' search on normal data (a broken port would make the
    # comparison above meaningless), and better than the plain range
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(4))
    port = _port(type_name, w)
    theirs = _mse(torch.from_numpy(port), w)
    ours = _mse(fb.quantize(w, KQUANTS[type_name]).dequantize(), w)
    plain = _mse(fb.quantize(w, get_scheme(KQUANTS[type_name]).with_(scale_method="absmax")).dequantize(), w)
    # Q2_K's reference minimizes the weighted absolute error (make_qkx2_quants' use_mad), not the
    # squared one measured here: ~1.2x fewbits' MSE
    assert 0.9 * ours < theirs < min((1.3 if type_name == "Q2_K" else 1.15) * ours, plain), (ours, theirs, plain)


def _check_gptq(w, H, type_name, act_order, better=0.8):
    from fewbits.quant.gptq import gptq_solve, hessian_error

    preset = KQUANTS[type_name]
    result = gptq_solve(w, H, preset, act_order=act_order)  # itself checks the stored tensor reproduces Q
    rtn = fb.quantize(w, preset).dequantize()
    assert hessian_error(w, result.dequantized, H) < better * hessian_error(w, rtn, H)
    blocks = encode_blocks(result.qtensor)
    assert np.array_equal(gguf.quants.dequantize(blocks, GGMLQuantizationType[type_name]), result.dequantized.numpy())


@pytest.mark.parametrize("type_name, act_order", [("Q4_K", False), ("Q6_K", True)])
def test_gptq_on_a_minilm_weight_beats_rtn_and_writes_exact_blocks(type_name, act_order):
    w = _minilm_down(1)[:64]  # 64 output rows: GPTQ's column loop stays quick
    gen = torch.Generator().manual_seed(0)
    # FFN-down-like inputs: the GELU of correlated normal pre-activations
    X = torch.nn.functional.gelu(torch.randn(512, 1536, generator=gen) @ (torch.randn(1536, 1536, generator=gen) / 40)
                                 + 0.2)
    _check_gptq(w, 2 * X.T.double() @ X.double() / X.shape[0], type_name, act_order)


@pytest.mark.slow
@pytest.mark.parametrize("type_name", list(KQUANTS))
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_minilm_with_calibration_beats_rtn(type_name, act_order):
    minilm = pytest.importorskip("fewbits.models.minilm")
    from fewbits.models.text import pydoc_sentences
    from fewbits.quant.gptq import collect_hessians

    try:
        model, tokenizer = minilm.load_minilm()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(str(e))
    name = "encoder.layer.1.output.dense"
    calib = sorted(pydoc_sentences(64, seed=0), key=len)
    batches = [dict(tokenizer(calib[i:i + 16], padding=True, return_tensors="pt")) for i in range(0, 64, 16)]
    H = collect_hessians(model, [name], batches)[name]
    _check_gptq(model.get_submodule(name).weight.detach(), H, type_name, act_order)


def test_fb_save_load_round_trips_a_kquant_model(tmp_path):
    gen = torch.Generator().manual_seed(0)

    def build():
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 64))

    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    fb.quantize_model(model, {"0": "q4_k", "2": "q5_k", "4": "q6_k"})
    x = torch.randn(3, 256, generator=gen)
    before = model(x)
    fb.save(model, tmp_path / "m.safetensors")
    loaded = fb.load(tmp_path / "m.safetensors", model=build())
    assert torch.equal(loaded(x), before)
    for name in ("0", "2", "4"):
        a, b = model.get_submodule(name).qweight, loaded.get_submodule(name).qweight
        assert a.scheme == b.scheme
        assert all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())
