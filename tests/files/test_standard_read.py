"""fewbits reads compressed-tensors and GPTQ directories (its own and other tools' of the same
layout) as they are: the integer codes and scales become QuantizedTensors bit for bit
(StandardFormat.to_fewbits), fb.from_pretrained and `fewbits generate` load them into fewbits'
kernels, and what the reader does not take (act-order, asymmetric GPTQ, per-module overrides,
quantized activations, float codes, entries of the wrong shape or missing) is a FileFormatError
naming the file before anything is written."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import fewbits as fb
from fewbits.files import compressed_tensors as ct
from fewbits.files import gptq_format as gq
from fewbits.files.hf_dir import read_tensors
from fewbits.files.hf_quantizer import from_pretrained
from fewbits.files.safetensors_format import FileFormatError
from standard_dirs import export, tiny_llama
from standard_dirs import quantized_modules as _quantized

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


def _write(model, tmp_path, fmt):
    return export(model, tmp_path, fmt, quiet=True)  # mixed plans warn that vLLM would refuse them


def _same_weights(read, model):
    quantized = _quantized(model)
    assert set(read.quantized) == set(quantized)
    for name, m in quantized.items():
        qt = read[f"{name}.weight"]
        assert torch.equal(qt.int_codes(), m.qweight.int_codes()), name
        assert torch.equal(qt.dequantize(torch.float32), m.qweight.dequantize(torch.float32)), name


@pytest.mark.parametrize("scheme", gq.FITTING_PRESETS)
def test_gptq_reads_back_bit_for_bit(base, tmp_path, scheme):
    model = fb.quantize_model(copy.deepcopy(base), {"lm_head": None, "*": scheme})
    out = _write(model, tmp_path, gq.FORMAT)
    _same_weights(read_tensors(gq.FORMAT.to_fewbits(out, tmp_path / "back")), model)


@pytest.mark.parametrize("rules", list(ct.FITTING_PRESETS[:12]) + [
    {"*.mlp.*": "int8", "*.self_attn.[qk]_proj": "int4_g32", "*.self_attn.v_proj": "int4_asym"}])
def test_compressed_tensors_reads_back_bit_for_bit(base, tmp_path, rules):
    if isinstance(rules, str) and fb.get_scheme(rules).activations is not None:
        pytest.skip("quantized activations are not read")
    model = fb.quantize_model(copy.deepcopy(base), rules)
    out = _write(model, tmp_path, ct.FORMAT)
    _same_weights(read_tensors(ct.FORMAT.to_fewbits(out, tmp_path / "back")), model)


def test_from_pretrained_runs_a_gptq_and_a_compressed_tensors_directory(base, tmp_path):
    x = torch.tensor([[1, 5, 9, 33, 70]])
    for fmt, rules in ((gq.FORMAT, {"lm_head": None, "*": "w4a16_g32"}), (ct.FORMAT, "int4_asym_g32")):
        model = fb.quantize_model(copy.deepcopy(base), rules)
        out = _write(model, tmp_path / fmt.name, fmt)
        loaded = from_pretrained(out, dtype=torch.float32)
        for name, m in _quantized(model).items():
            layer = loaded.get_submodule(name)
            assert torch.equal(layer.qweight.dequantize(torch.float32), m.qweight.dequantize(torch.float32)), name
        with torch.no_grad():
            assert torch.allclose(loaded(x).logits, model(x).logits, atol=1e-4, rtol=1e-4)


def test_another_tools_compressed_tensors_layout_is_read(base, tmp_path):
    """llm-compressor targets "Linear" and ignores lm_head, with bf16 scales in a bf16 model."""
    model = fb.quantize_model(copy.deepcopy(base), {"lm_head": None, "*": "int4_g32"})
    out = _write(model, tmp_path, ct.FORMAT)
    cfg = json.loads((out / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["targets"] = ["Linear"]
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    (out / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(out / "model.safetensors"))
    exact = {k: v for k, v in tensors.items() if k.endswith("weight_scale")}
    for k, v in exact.items():  # scales a bf16 holds exactly, stored as bf16
        tensors[k] = v.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    read = read_tensors(ct.FORMAT.to_fewbits(out, tmp_path / "back"))
    assert set(read.quantized) == set(_quantized(model))
    for name, m in _quantized(model).items():
        qt = read[f"{name}.weight"]
        assert qt.scheme.scale_format == "bf16"
        assert torch.equal(qt.int_codes(), m.qweight.int_codes())
        want = m.qweight.int_codes().float() * m.qweight.scale_values().to(torch.bfloat16).float().repeat_interleave(32, 1)
        assert torch.equal(qt.dequantize(torch.float32), want)


def _gptq_dir(base, tmp_path, scheme="w4a16_g32"):
    model = fb.quantize_model(copy.deepcopy(base), {"lm_head": None, "*": scheme})
    return _write(model, tmp_path, gq.FORMAT), model


def _edit(out, config=None, tensors=None):
    from safetensors.torch import load_file, save_file
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})


def test_a_version_2_gptq_checkpoint_is_read(base, tmp_path):
    out, model = _gptq_dir(base, tmp_path)

    def v2(t):
        for k in [k for k in t if k.endswith(".qzeros")]:
            t[k] = torch.full_like(t[k], 0x88888888 - (1 << 32))  # zero points stored as they are: 8

    _edit(out, config=lambda qc: qc.update(checkpoint_format="gptq_v2"), tensors=v2)
    _same_weights(read_tensors(gq.FORMAT.to_fewbits(out, tmp_path / "back")), model)


PROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit, why", [
    ({"config": lambda qc: qc.update(sym=False)}, "asymmetric checkpoint"),
    ({"config": lambda qc: qc.update(dynamic={"-:.*o_proj": {}})}, "dynamic"),
    ({"config": lambda qc: qc.update(bits=3)}, "bits 3"),
    ({"config": lambda qc: qc.update(group_size=48)}, "not a whole number of groups of 48"),
    ({"tensors": lambda t: t.update({f"{PROJ}.g_idx": t[f"{PROJ}.g_idx"].flip(0)})}, "act-order"),
    ({"tensors": lambda t: t.update({f"{PROJ}.qzeros": t[f"{PROJ}.qzeros"] + 1})}, "zero points other than 8"),
    ({"tensors": lambda t: t.update({f"{PROJ}.scales": t[f"{PROJ}.scales"][:2]})}, "scales is torch.float16 \\[2, 128\\]"),
    ({"tensors": lambda t: t.pop(f"{PROJ}.qweight")}, "q_proj.qweight' is not in the directory"),
    ({"tensors": lambda t: t.update({"stray.codes": torch.zeros(4, dtype=torch.int32)})}, "'stray.codes'.*not a float"),
])
def test_what_the_gptq_reader_does_not_take_is_refused_before_writing(base, tmp_path, edit, why):
    out, _ = _gptq_dir(base, tmp_path)
    _edit(out, **edit)
    with pytest.raises(FileFormatError, match=why):
        gq.FORMAT.to_fewbits(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("scheme, why", [("w8a8", "quantized activations"), ("fp8_channel", "float-quantized")])
def test_compressed_tensors_the_reader_does_not_take_are_refused(base, tmp_path, scheme, why):
    model = fb.quantize_model(copy.deepcopy(base), scheme)
    out = _write(model, tmp_path, ct.FORMAT)
    with pytest.raises(FileFormatError, match=why):
        from_pretrained(out)
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("scheme", ["int4_g32", "int4_asym_g32", "int8", "int8_asym", "q4_0", "w8a16", "int4_channel"])
def test_from_int_codes_holds_what_quantize_stores(scheme):
    from fewbits.quant.tensor import QuantizedTensor, quantize
    qt = quantize(torch.randn(24, 96) * 3, scheme)
    back = QuantizedTensor.from_int_codes(scheme, qt.shape, qt.dtype, qt.int_codes(), qt.scale_values(),
                                          qt.zero_point_values())
    assert back.state_dict().keys() == qt.state_dict().keys()
    for key, value in qt.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize("change, why", [
    (lambda v, s, z: (v + 8, s, z), "values outside int4"),
    (lambda v, s, z: (v, s.masked_fill(s > s.median(), float("nan")), z), "not finite"),
    (lambda v, s, z: (v, s * (1 + 2 ** -20), z), "fp16 does not hold exactly"),
    (lambda v, s, z: (v.float(), s, z), "values must be integers"),
])
def test_from_int_codes_refuses_what_the_scheme_cannot_hold(change, why):
    from fewbits.quant.tensor import QuantizedTensor, quantize
    qt = quantize(torch.randn(8, 64), "w4a16_g32")
    v, s, z = change(qt.int_codes(), qt.scale_values(), None)
    with pytest.raises(ValueError, match=why):
        QuantizedTensor.from_int_codes("w4a16_g32", qt.shape, qt.dtype, v, s, z)


def test_odd_widths_read_back_in_compressed_tensors(tmp_path):
    """100 inputs and 100 outputs: neither a multiple of the 8 codes of an int32 word, the last word
    padded, zero points packed along the outputs."""
    model = tiny_llama(hidden_size=100, intermediate_size=200, num_attention_heads=2)
    rules = {"*.mlp.*": fb.QuantScheme("uint4", "channel", symmetric=False), "*": "int8_asym"}
    model = fb.quantize_model(model, rules)
    out = _write(model, tmp_path, ct.FORMAT)
    _same_weights(read_tensors(ct.FORMAT.to_fewbits(out, tmp_path / "back")), model)


def _ct_dir(base, tmp_path):
    model = fb.quantize_model(copy.deepcopy(base), "int4_g32")
    return _write(model, tmp_path, ct.FORMAT)


@pytest.mark.parametrize("edit, why", [
    ({"config": lambda qc: qc["config_groups"]["group_0"].update(targets=["re:("])}, "does not compile"),
    ({"config": lambda qc: qc["config_groups"]["group_0"].update(targets=["re:(.*)*(.*)*x$"])}, "nests quantifiers"),
    ({"config": lambda qc: qc.update(ignore=[7])}, "ignore entry 7 is not a string"),
    ({"tensors": lambda t: t.update({f"{PROJ}.weight": torch.zeros(128, 128)})}, "two weights for one layer"),
    ({"tensors": lambda t: t.update({f"{PROJ}.weight_scale": t[f"{PROJ}.weight_scale"] * float("inf")})},
     "not finite"),
    ({"tensors": lambda t: t.update({f"{PROJ}.weight_packed": t[f"{PROJ}.weight_packed"].float()})},
     "weight_packed is torch.float32"),
])
def test_what_the_compressed_tensors_reader_does_not_take_is_refused_before_writing(base, tmp_path, edit, why):
    out = _ct_dir(base, tmp_path)
    _edit(out, **edit)
    with pytest.raises(FileFormatError, match=why):
        ct.FORMAT.to_fewbits(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()
