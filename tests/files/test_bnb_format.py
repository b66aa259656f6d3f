"""--format bitsandbytes: transformers (no fewbits import, in a subprocess) loads the directory
fewbits writes as bitsandbytes Linear4bit layers, whose weights bitsandbytes dequantizes to
fewbits' own NF4 weights bit for bit; the float Linear layers are skipped by name; what does not fit
(nf4_dq, other codes, widths that are not whole blocks) is refused before any work."""
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
from fewbits.files import bnb_format
from fewbits.files.conversion import convert, formats_for
from standard_dirs import export, narrow_llama_dir, tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")


# plain transformers + bitsandbytes, without fewbits: each Linear4bit's weight as bitsandbytes
# dequantizes it (before any forward, which may repack it for bitsandbytes' CPU kernel), the float
# Linear layers' weights, and the logits of a few tokens
_READER = textwrap.dedent("""
    import sys, torch, transformers, bitsandbytes as bnb
    assert "fewbits" not in sys.modules
    m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cpu").eval()
    assert "fewbits" not in sys.modules
    out = {"weights": {}, "float": {}}
    for name, layer in m.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            out["weights"][name] = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        elif isinstance(layer, torch.nn.Linear):
            out["float"][name] = layer.weight.detach().clone()
    with torch.no_grad():
        out["logits"] = m(torch.tensor([[1, 5, 9, 33, 70]])).logits
    torch.save(out, sys.argv[2])
""")


def _read_with_bitsandbytes(directory, tmp_path) -> dict:
    result = tmp_path / "read.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", _READER, str(directory), str(result)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(result)


def _export(model, tmp_path):
    return export(model, tmp_path, bnb_format.FORMAT)


def test_bitsandbytes_dequantizes_fewbits_nf4_weights_bit_for_bit(tmp_path):
    base = tiny_llama()
    rules = {"*.mlp.*": "nf4", "*.self_attn.[qkv]_proj": "nf4", "lm_head": "nf4"}  # o_proj stays in float
    model = fb.quantize_model(copy.deepcopy(base), rules)
    out = _export(model, tmp_path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"] and qc["bnb_4bit_quant_type"] == "nf4"
    assert qc["llm_int8_skip_modules"] == ["model.layers.0.self_attn.o_proj"]
    read = _read_with_bitsandbytes(out, tmp_path)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}
    assert set(read["weights"]) == set(quantized) and len(quantized) == 7  # lm_head included
    for name, m in quantized.items():
        assert read["weights"][name].dtype == torch.float32
        assert torch.equal(read["weights"][name], m.qweight.dequantize(torch.float32)), name
    assert set(read["float"]) == {"model.layers.0.self_attn.o_proj"}
    assert torch.equal(read["float"]["model.layers.0.self_attn.o_proj"], base.model.layers[0].self_attn.o_proj.weight)
    with torch.no_grad():
        ours = model(torch.tensor([[1, 5, 9, 33, 70]])).logits
    # bitsandbytes' fused CPU kernel computes in bfloat16 where the CPU has AVX512-BF16: close, not equal
    assert torch.allclose(read["logits"], ours, atol=3e-2, rtol=3e-2)


def test_a_tied_model_with_its_head_quantized_is_written_untied(tmp_path):
    model = fb.quantize_model(tiny_llama(tie_word_embeddings=True), "nf4", tied="untie")
    out = _export(model, tmp_path)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    read = _read_with_bitsandbytes(out, tmp_path)
    assert torch.equal(read["weights"]["lm_head"], model.lm_head.qweight.dequantize(torch.float32))


@pytest.mark.parametrize("scheme, why", [
    ("nf4_dq", "double-quantizes"), ("fp4", "NF4"), ("int4_g32", "NF4"), ("q4_k", "NF4"),
])
def test_schemes_without_an_exact_form_are_refused(scheme, why):
    with pytest.raises(ValueError, match=why) as e:
        bnb_format.FORMAT.scheme_args(scheme)
    assert "schemes that fit bitsandbytes: nf4" in str(e.value)
    assert "bitsandbytes" not in formats_for(scheme)
    assert "bitsandbytes" in formats_for("nf4")


def test_conversion_refuses_before_any_work(tmp_path, monkeypatch):
    src = narrow_llama_dir(tmp_path, monkeypatch)
    for scheme, message in [("nf4", "96 columns are not a whole number of groups of 64.*presets that fit a 96 x 96 "
                                    "weight: none"), ("nf4_dq", "double-quantizes")]:
        with pytest.raises(ValueError, match=message):
            convert(src, tmp_path / "out", scheme, format="bitsandbytes")
        assert not (tmp_path / "out").exists()
