"""--format compressed-tensors: the weights transformers and the compressed-tensors package
decompress from what fewbits writes equal fewbits' dequantized weights bit for bit, for every
preset that fits; mixed schemes become config groups, float Linear layers the `ignore` list; the
schemes that do not fit are refused before any work, naming those that do."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fewbits as fb
from fewbits.files import compressed_tensors as ct
from fewbits.files.conversion import convert
from standard_dirs import export, narrow_llama_dir, tiny_llama
from standard_dirs import quantized_modules as _quantized

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


def _export(model, tmp_path):
    return export(model, tmp_path, ct.FORMAT)


def _load(out):
    """transformers' loading of a single-scheme compressed-tensors directory, every module
    decompressed by the compressed-tensors package as it loads (dequantize=True)."""
    from transformers import CompressedTensorsConfig
    return transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(
        dequantize=True))


def _decompressed(out) -> dict:
    """{module: weight} as the compressed-tensors package itself decompresses each quantized
    module of directory `out`, with its own config group's scheme."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    tensors = load_file(str(out / "model.safetensors"))
    weights = {}
    for scheme in qc.config_groups.values():
        for module in scheme.targets:
            state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
            state.pop("bias", None)
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            weights[module] = compressor.decompress(state, scheme)["weight"]
    return weights


@pytest.mark.parametrize("scheme", ct.FITTING_PRESETS)
def test_decompressed_weights_equal_fewbits_dequantized_weights(base, tmp_path, scheme):
    from compressed_tensors.quantization import QuantizationConfig

    model = fb.quantize_model(copy.deepcopy(base), scheme)
    out = _export(model, tmp_path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)  # compressed-tensors' own schema
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    loaded = _load(out)
    quantized = _quantized(model)
    assert len(quantized) == 8
    for name, m in quantized.items():
        got = loaded.get_submodule(name).weight
        assert got.dtype == torch.float32
        assert torch.equal(got, m.qweight.dequantize(torch.float32)), name


def test_a_mixed_plan_is_config_groups_and_float_layers_are_ignored(base, tmp_path):
    rules = {"*.mlp.*": "w8a8", "*.self_attn.[qk]_proj": "int4_g32", "*.self_attn.v_proj": "int4_asym"}
    model = fb.quantize_model(copy.deepcopy(base), rules)
    with pytest.warns(UserWarning, match=r"vLLM fuses .*q_proj, .*v_proj \(int4_asym / int4_g32\)"):
        out = _export(model, tmp_path)  # q, k and v differ: vLLM would refuse it, transformers loads it
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = sorted(qc["config_groups"].values(), key=lambda g: g["targets"][0])
    assert qc["format"] == "mixed-precision"
    assert [(g["format"], g["targets"]) for g in groups] == [
        ("int-quantized", [f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]),
        ("pack-quantized", ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"]),
        ("pack-quantized", ["model.layers.0.self_attn.v_proj"])]
    assert groups[0]["input_activations"]["strategy"] == "token" and groups[0]["input_activations"]["dynamic"]
    assert groups[2]["weights"]["symmetric"] is False and groups[2]["weights"]["group_size"] == 128
    assert qc["ignore"] == ["lm_head", "model.layers.0.self_attn.o_proj"]
    weights = _decompressed(out)
    quantized = _quantized(model)
    assert set(weights) == set(quantized)
    for name, m in quantized.items():
        assert torch.equal(weights[name], m.qweight.dequantize(torch.float32)), name


def test_plain_transformers_without_fewbits_runs_it(base, tmp_path):
    model = fb.quantize_model(copy.deepcopy(base), "int4_g32")
    out = _export(model, tmp_path)
    reference = copy.deepcopy(base)
    for name, m in _quantized(model).items():
        reference.get_submodule(name).weight.data.copy_(m.qweight.dequantize(torch.float32))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.save({"ids": ids, "logits": reference(ids).logits.detach()}, tmp_path / "want.pt")
    code = textwrap.dedent(f"""
        import sys, torch, transformers
        want = torch.load({str(tmp_path / 'want.pt')!r})
        m = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})
        got = m(want["ids"]).logits
        assert "fewbits" not in sys.modules
        print("EQUAL" if torch.equal(got, want["logits"]) else f"DIFF {{(got - want['logits']).abs().max()}}")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0 and "EQUAL" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("scheme, why", [
    ("nf4", "nf4 codes"), ("nf4_dq", "double-quantized"), ("q4_1", "float minimum"), ("q4_k", "super-blocks"),
    ("int3", "3-bit"), ("w4a8", "activations"), ("mxfp6", "MX blocks of fp6_e3m2"), ("nvfp4", "nvfp4 blocks"), ("bf16", "plain cast"),
])
def test_schemes_without_an_exact_form_are_refused_naming_those_that_fit(scheme, why):
    with pytest.raises(ValueError, match=why) as e:
        ct.scheme_args(scheme)
    assert "int4_g32" in str(e.value) and "w8a8" in str(e.value)


def test_an_asymmetric_signed_format_is_refused():
    from fewbits.quant.scheme import QuantScheme
    with pytest.raises(ValueError, match="unsigned zero points"):
        ct.scheme_args(QuantScheme("int4", "group", group_size=32, symmetric=False))
    assert not ct.fits(QuantScheme("int8", "group", group_size=32, symmetric=False))
    assert ct.fits("int4_g32", (576, 1536)) and not ct.fits("int4", (576, 1536))


def test_an_untied_quantized_head_of_a_tied_model_is_written_untied(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    model = fb.quantize_model(transformers.LlamaForCausalLM(cfg).eval(), "int4_g32", tied="untie")
    out = _export(model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head" in str(config["quantization_config"])
    loaded = _load(out)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.qweight.dequantize(torch.float32))
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_conversion_refuses_before_any_work(tmp_path, monkeypatch):
    src = narrow_llama_dir(tmp_path, monkeypatch)
    cases = [("int4", {}, "96 columns are not a whole number of groups of 128.*presets that fit a 96 x 96 weight: "
                          "int4_g32, int4_asym_g32, int4_channel, q4_0, w4a16_g32, int8"),
             ("nf4", {}, "nf4 codes"),
             ("int4_g32", {"embeddings": True, "tied": "untie"}, "keeps the embeddings in float: no --embeddings")]
    for scheme, options, message in cases:
        with pytest.raises(ValueError, match=message):
            convert(src, tmp_path / "out", scheme, format="compressed-tensors", **options)
        assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    convert(src, tmp_path / "out", "int4_g32", format="compressed-tensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["format"] == \
        "pack-quantized"


def test_a_symmetric_mixed_plan_runs_in_transformers_compressed_mode(base, tmp_path):
    """transformers' default mode keeps the modules compressed (decompressing in forward, the int8
    activations quantized per token), each with its own config group."""
    model = fb.quantize_model(copy.deepcopy(base), {"*.mlp.*": "w8a8", "*.self_attn.[qk]_proj": "int4_g32"})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(_export(model, tmp_path))
    assert hasattr(loaded.model.layers[0].mlp.up_proj, "weight_scale")  # still compressed
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    got, want = loaded(ids).logits, model(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_mxfp4_runs_in_transformers_default_mode_in_bfloat16(base, tmp_path):
    """compressed-tensors decompresses MXFP4 to bfloat16 (E2M1 values times powers of two: exact),
    so a bfloat16 model in transformers' default mode computes with fewbits' weights exactly
    (in float32 it needs dequantize=True, which the preset test above uses)."""
    model = fb.quantize_model(copy.deepcopy(base), "mxfp4")
    out = _export(model, tmp_path)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    reference = copy.deepcopy(base)
    for name, m in _quantized(model).items():
        reference.get_submodule(name).weight.data = m.qweight.dequantize(torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    x = torch.tensor([[1, 5, 9, 33]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, reference.to(torch.bfloat16)(x).logits)
