"""A fewbits-only directory never loads as random weights: each quantized module's guard
("m.weight", an empty uint8 tensor; fewbits.files.hf_dir.GUARD_DTYPE) makes transformers without
fewbits refuse it, while fewbits' reader and its transformers quantizer take the guard as part of
the quantized module."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fewbits as fb
from fewbits.files.hf_dir import GUARD_DTYPE, SINGLE_NAME, read_tensors, save_pretrained
from fewbits.files.safetensors_format import FileFormatError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def _plain_transformers(directory) -> subprocess.CompletedProcess:
    """transformers' AutoModelForCausalLM.from_pretrained in a process that never imports fewbits."""
    code = textwrap.dedent(f"""
        import sys
        import transformers
        transformers.AutoModelForCausalLM.from_pretrained({os.fspath(directory)!r})
        assert "fewbits" not in sys.modules
        print("LOADED")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.fspath(directory)))


def _rewrite(path, change):
    """Rewrite a safetensors file with change(tensors) applied, keeping its metadata."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = safetensors_torch.load_file(path)
    change(tensors)
    safetensors_torch.save_file(tensors, path, metadata=metadata)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = fb.quantize_model(tiny_llama(), "int4")
    out = tmp_path_factory.mktemp("guard") / "m"
    save_pretrained(model, out)
    return model, out


def test_plain_transformers_refuses_a_fewbits_directory(saved):
    model, out = saved
    plain = safetensors_torch.load_file(str(out / SINGLE_NAME))
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    assert modules and all(plain[f"{m}.weight"].dtype == GUARD_DTYPE and plain[f"{m}.weight"].numel() == 0
                           for m in modules)
    r = _plain_transformers(out)
    assert r.returncode != 0 and "LOADED" not in r.stdout, r.stdout + r.stderr[-2000:]
    # what the user sees: transformers names the unknown method, then refuses the weights' shapes
    assert "fewbits" in r.stderr and "mismatch" in r.stderr.lower(), r.stderr[-2000:]


def test_without_the_guards_plain_transformers_would_load_random_weights(saved, tmp_path):
    """Why the guard exists: transformers skips a quantization method it does not know."""
    import shutil
    _, out = saved
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    _rewrite(str(bare / SINGLE_NAME),
             lambda t: [t.pop(k) for k in [k for k, v in t.items() if v.dtype == GUARD_DTYPE and v.numel() == 0]])
    r = _plain_transformers(bare)
    assert r.returncode == 0 and "LOADED" in r.stdout, r.stderr[-2000:]
    # fewbits still reads a directory written before the guard
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(fb.from_pretrained(bare)(ids).logits, saved[0](ids).logits)


def test_fewbits_and_transformers_with_fewbits_load_it_and_save_it_with_its_guards(saved, tmp_path, caplog):
    model, out = saved
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(ids).logits
    tensors = read_tensors(out)
    assert all(isinstance(tensors[f"{m}.weight"], fb.QuantizedTensor) for m in tensors.quantized)
    tensors.close()
    assert torch.equal(fb.from_pretrained(out)(ids).logits, want)
    with caplog.at_level("WARNING"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert "UNEXPECTED" not in caplog.text  # the guards are no unexpected keys
    assert torch.equal(loaded(ids).logits, want)
    again = tmp_path / "again"
    loaded.save_pretrained(again)  # transformers' own writer, through fewbits' quantizer
    plain = safetensors_torch.load_file(str(again / SINGLE_NAME))
    assert all(plain[f"{m}.weight"].dtype == GUARD_DTYPE for m in loaded.config.quantization_config.plan)
    assert torch.equal(fb.from_pretrained(again)(ids).logits, want)
    assert _plain_transformers(again).returncode != 0


@pytest.mark.parametrize("bad", [torch.zeros(1, dtype=torch.uint8), torch.empty(0, dtype=torch.int8),
                                 torch.zeros(64, 64)], ids=["uint8[1]", "int8[0]", "float[64,64]"])
def test_a_weight_stored_beside_a_quantized_module_is_refused_unless_it_is_the_guard(saved, tmp_path, bad):
    import shutil
    _, out = saved
    d = tmp_path / "d"
    shutil.copytree(out, d)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(str(d / SINGLE_NAME), lambda t: t.__setitem__(name, bad))
    with pytest.raises(FileFormatError, match="stored both as a float tensor and quantized"):
        read_tensors(d)
