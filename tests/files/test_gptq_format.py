"""--format gptq: the GPTQ (v1, symmetric) checkpoint fewbits writes holds exactly fewbits' codes and
scales: unpacked as the GPTQ format defines it ((u - (qzeros + 1)) * scales), every quantized
weight equals fewbits' dequantized weight bit for bit, for every preset that fits;
what transformers' loader would read as random weights (a quantized lm_head, mixed schemes, float
layers) is refused, as are the schemes and shapes that do not fit, before any work, naming those
that do. GPTQModel's own reading, through transformers, is
test_gptqmodel_loads_it_through_transformers (slow; in the venv benchmarks/setup_gptqmodel.sh
makes); vLLM's is benchmarks/bench_vllm.py's."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import textwrap

import pytest
import torch

import fewbits as fb
from fewbits.files import gptq_format as gq
from fewbits.files.conversion import convert, formats_for
from fewbits.files.hf_dir import read_tensors
from standard_dirs import export, narrow_llama_dir, tiny_llama
from standard_dirs import quantized_modules as _quantized

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


def _export(model, tmp_path):
    return export(model, tmp_path, gq.FORMAT)


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


def _head_in_float(scheme):
    return {"lm_head": None, "*": scheme}


@pytest.mark.parametrize("scheme", gq.FITTING_PRESETS)
def test_unpacked_weights_equal_fewbits_dequantized_weights(base, tmp_path, scheme):
    model = fb.quantize_model(copy.deepcopy(base), _head_in_float(scheme))
    out = _export(model, tmp_path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    s = fb.get_scheme(scheme)
    bits = s.format.bits
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["sym"] is True
    assert qc["desc_act"] is False and qc["bits"] == bits and qc["lm_head"] is False
    assert qc["group_size"] == (s.group_size if s.granularity == "group" else -1)
    states = _module_states(out)
    quantized = _quantized(model)
    assert set(states) == set(quantized) and len(quantized) == 7
    for name, m in quantized.items():
        st = states[name]
        out_f, in_f = m.qweight.shape
        per = 32 // bits
        assert st["qweight"].dtype == torch.int32 and tuple(st["qweight"].shape) == (in_f // per, out_f)
        assert st["scales"].dtype == torch.float16 and st["g_idx"].dtype == torch.int32
        assert torch.equal(_unpack_gptq(st, bits), m.qweight.dequantize(torch.float32)), name


@pytest.mark.parametrize("rules, why", [
    ("w4a16_g32", r"'lm_head' lies outside the decoder blocks \(model\.layers\.\*\)"),
    ({"lm_head": None, "*.mlp.*": "w8a16", "*": "w4a16_g32"}, "one bits and group_size for all layers.*compressed"),
    ({"lm_head": None, "*.o_proj": None, "*": "w4a16_g32"}, "'model.layers.0.self_attn.o_proj' would stay in float"),
])
def test_what_transformers_would_read_as_random_weights_is_refused(base, tmp_path, rules, why):
    """transformers' GPTQ loader (optimum + GPTQModel) quantizes every Linear of the decoder blocks
    with one config and leaves the layers outside them in float, ignoring `lm_head: true` and the
    per-module `dynamic` overrides: anything else would load as random weights, silently."""
    model = fb.quantize_model(copy.deepcopy(base), rules)
    src = tmp_path / "fewbits"
    fb.save_pretrained(model, src)
    with pytest.raises(ValueError, match=why):
        gq.write_gptq(tmp_path / "gptq", read_tensors(src))
    assert not (tmp_path / "gptq").exists()


def test_q4_0_and_w4a16_g32_store_alike_and_mix(base, tmp_path):
    model = fb.quantize_model(copy.deepcopy(base), {"lm_head": None, "*.mlp.*": "q4_0", "*": "w4a16_g32"})
    states = _module_states(_export(model, tmp_path))
    for name, m in _quantized(model).items():
        assert torch.equal(_unpack_gptq(states[name], 4), m.qweight.dequantize(torch.float32)), name


@pytest.mark.parametrize("kind", ["opt", "classifier", "bert"])
def test_layers_outside_the_decoder_blocks_stay_in_float_or_are_refused(tmp_path, kind):
    """transformers' GPTQ loader quantizes only under the blocks' prefix: OPT's project_in/out and
    a classifier's score stay in float in what fewbits writes; a model without decoder blocks
    (BERT) is refused before any work."""
    torch.manual_seed(0)
    src = tmp_path / "src"
    if kind == "opt":
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            hidden_size=128, ffn_dim=256, num_hidden_layers=1, num_attention_heads=4, vocab_size=128,
            word_embed_proj_dim=64))
        outside = {"model.decoder.project_in", "model.decoder.project_out", "lm_head"}
    elif kind == "classifier":
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, num_labels=8, pad_token_id=0))
        outside = {"score"}
    else:
        model = transformers.BertModel(transformers.BertConfig(hidden_size=128, intermediate_size=256,
                                                               num_hidden_layers=1, num_attention_heads=4,
                                                               vocab_size=128))
    model.save_pretrained(src)
    if kind == "bert":
        with pytest.raises(ValueError, match="has none .*BERT.*compressed-tensors"):
            convert(src, tmp_path / "out", "w4a16_g32", format="gptq")
        assert not (tmp_path / "out").exists()
        return
    convert(src, tmp_path / "out", "w4a16_g32", format="gptq")
    states = _module_states(tmp_path / "out")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(states) == linears - outside and outside <= linears


def test_a_tied_model_keeps_its_float_head_tied(tmp_path):
    model = fb.quantize_model(tiny_llama(tie_word_embeddings=True), "w4a16_g32")  # tied "keep": head in float
    out = _export(model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["quantization_config"]["lm_head"] is False
    assert set(_module_states(out)) == set(_quantized(model)) and "lm_head" not in _quantized(model)


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
    src = narrow_llama_dir(tmp_path, monkeypatch)
    cases = [("w4a16", {}, "96 columns are not a whole number of groups of 128.*presets that fit a 96 x 96 weight: "
                           "w4a16_g32, q4_0, w8a16, q8_0"),
             ("int4_g32", {}, "fp16"),
             ({"*.mlp.*": "w8a16", "*": "w4a16_g32"}, {}, r"'lm_head' lies outside the decoder blocks"),
             ({"lm_head": None, "*.mlp.*": "w8a16", "*": "w4a16_g32"}, {}, "holds one bits and group_size"),
             ("w4a16_g32", {"embeddings": True, "tied": "untie"}, "keeps the embeddings in float: no --embeddings")]
    for scheme, options, message in cases:
        with pytest.raises(ValueError, match=message):
            convert(src, tmp_path / "out", scheme, format="gptq", **options)
        assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    summary = convert(src, tmp_path / "out", "w4a16_g32", format="gptq")  # the untied head stays in float
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 32 and qc["lm_head"] is False and summary.layers == 7
    from safetensors.torch import load_file
    assert "lm_head.weight" in load_file(str(tmp_path / "out" / "model.safetensors"))


# GPTQModel's reading (through transformers and optimum), in the venv benchmarks/setup_gptqmodel.sh
# makes (gptqmodel 7.7 wants a newer torch than CI pins and pulls ~1.6 GB: not in CI's venv)
_GPTQ_PYTHON = os.environ.get("FEWBITS_GPTQ_PYTHON") or os.path.join(
    os.environ.get("FEWBITS_GPTQ_VENV", os.path.expanduser("~/.cache/fewbits/gptqmodel-venv")), "bin", "python")
_GPTQ_READER = textwrap.dedent("""
    import sys, torch, transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cpu", dtype=torch.float32).eval()
    assert "fewbits" not in sys.modules
    out = {"weights": {}, "float": {}, "kinds": {}}
    for name, layer in m.named_modules():
        if hasattr(layer, "dequantize_weight"):
            out["weights"][name] = layer.dequantize_weight().t().contiguous()  # GPTQModel gives [in, out]
            out["kinds"][name] = type(layer).__name__
        elif isinstance(layer, torch.nn.Linear):
            out["float"][name] = layer.weight.detach().clone()
    with torch.no_grad():
        out["logits"] = m(torch.tensor([[1, 5, 9, 33, 70]])).logits
    torch.save(out, sys.argv[2])
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.access(_GPTQ_PYTHON, os.X_OK), reason="no GPTQModel venv (benchmarks/setup_gptqmodel.sh)")
@pytest.mark.parametrize("scheme", ["w4a16_g32", "w4a16", "w8a16", "q4_0"])
def test_gptqmodel_loads_it_through_transformers(tmp_path, scheme):
    """GPTQModel dequantizes in float16: its weights are fewbits' (exact in float32) rounded to
    float16, and its logits those of the float model holding fewbits' weights."""
    base = tiny_llama()
    model = fb.quantize_model(copy.deepcopy(base), _head_in_float(scheme))
    out = _export(model, tmp_path)
    result = tmp_path / "read.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([_GPTQ_PYTHON, "-c", _GPTQ_READER, str(out), str(result)], capture_output=True, text=True,
                       env=env, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    read = torch.load(result)
    quantized = _quantized(model)
    assert set(read["weights"]) == set(quantized)
    for name, m in quantized.items():
        assert torch.equal(read["weights"][name], m.qweight.dequantize(torch.float32).half()), name
    floats = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)} - set(quantized)
    assert set(read["float"]) == floats
    for name in floats:
        assert torch.equal(read["float"][name], base.get_submodule(name).weight), name
    with torch.no_grad():
        ours = model(torch.tensor([[1, 5, 9, 33, 70]])).logits
    assert torch.allclose(read["logits"], ours, atol=2e-3, rtol=1e-3)  # float16 weights in GPTQModel


def test_the_cli_plan_refuses_untie_budget_and_embeddings_first(tmp_path):
    from fewbits.study.quantization import conversion_plan
    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)  # no tokenizer: --budget's refusal must come before it is needed
    with pytest.raises(ValueError, match="--tied untie quantizes the output layer, which --format gptq keeps"):
        conversion_plan(str(src), "w4a16_g32", "gptq", tied="untie")
    with pytest.raises(ValueError, match="--format gptq holds one scheme only"):
        conversion_plan(str(src), None, "gptq", budget=5)
    with pytest.raises(ValueError, match="no --embeddings"):
        conversion_plan(str(src), "w4a16_g32", "gptq", embeddings=True)
    assert conversion_plan(str(src), "w4a16_g32", "gptq")["rules"] == "w4a16_g32"  # convert() applies it to the blocks
