"""--format gptq: the GPTQ (v1, symmetric) checkpoint fewbits writes holds exactly fewbits' codes and
scales: unpacked as the GPTQ format defines it ((u - (qzeros + 1)) * scales), every quantized
weight equals fewbits' dequantized weight bit for bit, for every preset that fits; mixed schemes
and float layers become `dynamic` overrides; the schemes and shapes that do not fit are refused
before any work, naming those that do. (GPTQModel's own reading is in test_gptq_reader below,
when gptqmodel is installed; vLLM's in benchmarks/bench_vllm.py.)"""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import fewbits as fb
from fewbits.files import gptq_format as gq
from fewbits.files.conversion import convert, formats_for
from fewbits.files.hf_dir import read_tensors

transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128), **kw})
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


def _export(model, tmp_path):
    src, out = tmp_path / "fewbits", tmp_path / "gptq"
    fb.save_pretrained(model, src)
    gq.write_gptq(out, read_tensors(src))
    return out


def _quantized(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}


def _unpack_gptq(state: dict, bits: int) -> torch.Tensor:
    """A GPTQ v1 module's weight [out, in] in float32, unpacked word by word as the format defines
    it: input i of column o is bits (i % p)*bits.. of qweight[i // p, o], its zero point nibble
    (o % p) of qzeros[g_idx[i], o // p] plus one, its scale scales[g_idx[i], o]."""
    qweight, qzeros, scales, g_idx = (state[k] for k in ("qweight", "qzeros", "scales", "g_idx"))
    per, mask = 32 // bits, (1 << bits) - 1
    words_in, out_f = qweight.shape
    in_f = words_in * per
    shifts = torch.arange(per, dtype=torch.int64) * bits
    u = ((qweight.to(torch.int64).unsqueeze(1) >> shifts.view(1, per, 1)) & mask).reshape(in_f, out_f)
    z = ((qzeros.to(torch.int64).unsqueeze(2) >> shifts.view(1, 1, per)) & mask).reshape(qzeros.shape[0], -1)
    z = z[g_idx.long()] + 1  # [in, out]
    return ((u - z).to(torch.float32) * scales[g_idx.long()].to(torch.float32)).t()


def _module_states(out) -> dict[str, dict]:
    from safetensors.torch import load_file
    tensors = load_file(str(out / "model.safetensors"))
    states: dict[str, dict] = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf in ("qweight", "qzeros", "scales", "g_idx"):
            states.setdefault(module, {})[leaf] = value
    return states


@pytest.mark.parametrize("scheme", gq.FITTING_PRESETS)
def test_unpacked_weights_equal_fewbits_dequantized_weights(base, tmp_path, scheme):
    model = fb.quantize_model(copy.deepcopy(base), scheme)
    out = _export(model, tmp_path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    s = fb.get_scheme(scheme)
    bits = s.format.bits
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["sym"] is True
    assert qc["desc_act"] is False and qc["bits"] == bits and "dynamic" not in qc and qc["lm_head"] is True
    assert qc["group_size"] == (s.group_size if s.granularity == "group" else -1)
    states = _module_states(out)
    quantized = _quantized(model)
    assert set(states) == set(quantized) and len(quantized) == 8  # lm_head included
    for name, m in quantized.items():
        st = states[name]
        out_f, in_f = m.qweight.shape
        per = 32 // bits
        assert st["qweight"].dtype == torch.int32 and tuple(st["qweight"].shape) == (in_f // per, out_f)
        assert st["scales"].dtype == torch.float16 and st["g_idx"].dtype == torch.int32
        assert torch.equal(_unpack_gptq(st, bits), m.qweight.dequantize(torch.float32)), name


def test_a_mixed_plan_and_float_layers_are_dynamic_overrides(base, tmp_path):
    rules = {"*.mlp.*": "w8a16", "*.self_attn.[qkv]_proj": "w4a16_g32", "lm_head": "w4a16_g32"}  # o_proj: float
    model = fb.quantize_model(copy.deepcopy(base), rules)
    out = _export(model, tmp_path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # the base is the most used scheme (4 layers in groups of 32); the others override it
    assert (qc["bits"], qc["group_size"], qc["lm_head"]) == (4, 32, True)
    dyn = qc["dynamic"]
    mlp, attn = r"^model\.layers\.0\.mlp\.", r"^model\.layers\.0\.self_attn\."
    eight = {"bits": 8, "group_size": -1}
    assert dyn == {f"+:{mlp}down_proj$": eight, f"+:{mlp}gate_proj$": eight, f"+:{mlp}up_proj$": eight,
                   f"+:{mlp}gate_up_proj$": eight,  # the layer vLLM fuses gate and up into
                   f"-:{attn}o_proj$": {}}
    for pattern in dyn:  # each regex matches its own module and no other
        matched = [n for n, m in base.named_modules() if re.match(pattern[2:], n)]
        assert len(matched) == (0 if "gate_up_proj" in pattern else 1), pattern
    states = _module_states(out)
    for name, m in _quantized(model).items():
        bits = m.qweight.scheme.format.bits
        assert torch.equal(_unpack_gptq(states[name], bits), m.qweight.dequantize(torch.float32)), name
    from safetensors.torch import load_file
    assert "model.layers.0.self_attn.o_proj.weight" in load_file(str(out / "model.safetensors"))  # in float


def test_a_quantized_head_is_stated_and_a_tied_one_written_untied(tmp_path):
    model = fb.quantize_model(tiny_llama(tie_word_embeddings=True), "w4a16_g32", tied="untie")
    out = _export(model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True
    st = _module_states(out)["lm_head"]
    assert torch.equal(_unpack_gptq(st, 4), model.lm_head.qweight.dequantize(torch.float32))


@pytest.mark.parametrize("scheme, why", [
    ("int4_g32", "fp16.*fp32.*w4a16_g32"), ("int4_asym_g32", "symmetric-only"), ("w8a8", "weights only"),
    ("q4_1", "float minimum"), ("q4_k", "super-blocks"), ("nf4", "integer codes"), ("int3", "3-bit"),
    ("fp8_channel", "integer codes"), ("nf4_dq", "integer codes"),
])
def test_schemes_without_an_exact_form_are_refused_naming_those_that_fit(scheme, why):
    with pytest.raises(ValueError, match=why) as e:
        gq.FORMAT.scheme_args(scheme)
    assert "schemes that fit gptq: w4a16, w4a16_g32, q4_0, w8a16, q8_0" in str(e.value)
    assert "gptq" not in formats_for(scheme)


def test_the_presets_that_fit_are_listed_for_gptq_and_compressed_tensors():
    for scheme in gq.FITTING_PRESETS:
        assert {"gptq", "compressed-tensors"} <= set(formats_for(scheme)), scheme


def test_shapes_that_do_not_pack_are_refused():
    assert gq.FORMAT.fits("w4a16_g32", [(64, 96)]) and not gq.FORMAT.fits("w4a16", [(64, 96)])
    assert not gq.FORMAT.fits("w4a16_g32", [(60, 64)])  # 60 outputs: not whole int32 words of zero points
    with pytest.raises(ValueError, match=r"60 x 64 weight is not a whole number of words.*presets that fit a "
                                         r"60 x 64 weight: w8a16, q8_0"):
        gq.FORMAT.check_module("m", "w4a16_g32", (60, 64))


def test_conversion_refuses_before_any_work(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    from fewbits.files import hf_dir
    monkeypatch.setattr(hf_dir, "ShardWriter", None)  # nothing may be written before the checks
    cases = [("w4a16", {}, "96 columns are not a whole number of groups of 128.*presets that fit a 96 x 96 weight: "
                           "w4a16_g32, q4_0, w8a16, q8_0"),
             ("int4_g32", {}, "fp16"),
             ("w4a16_g32", {"embeddings": True, "tied": "untie"}, "model.embed_tokens.*Embedding")]
    for scheme, options, message in cases:
        with pytest.raises(ValueError, match=message):
            convert(src, tmp_path / "out", scheme, format="gptq", **options)
        assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    summary = convert(src, tmp_path / "out", "w4a16_g32", format="gptq")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["group_size"] == 32
    assert summary.bytes > 0
