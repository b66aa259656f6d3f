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


def _plain_transformers(*directories) -> dict[str, str]:
    """{directory: "LOADED" or the exception's type} of transformers' AutoModelForCausalLM.
    from_pretrained of each, in one process that never imports fewbits (one start of
    transformers for all)."""
    code = textwrap.dedent(f"""
        import sys
        import transformers
        for d in {[os.fspath(d) for d in directories]!r}:
            try:
                transformers.AutoModelForCausalLM.from_pretrained(d)
                print("RESULT", d, "LOADED")
            except Exception as e:
                print("RESULT", d, type(e).__name__)
        assert "fewbits" not in sys.modules
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(os.fspath(directories[0])))
    assert r.returncode == 0, r.stderr[-2000:]
    results = dict(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("RESULT "))
    results["stderr"] = r.stderr
    return results


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
    """A fewbits int4 directory ("m"); the same with its guards stripped, as fewbits wrote it before
    the guard ("bare"); the model transformers-with-fewbits loaded from "m" saved again by
    transformers' own save_pretrained ("again"); and what plain transformers made of each."""
    import shutil
    model = fb.quantize_model(tiny_llama(), "int4")
    root = tmp_path_factory.mktemp("guard")
    out, bare, again = root / "m", root / "bare", root / "again"
    save_pretrained(model, out)
    shutil.copytree(out, bare)
    _rewrite(str(bare / SINGLE_NAME),
             lambda t: [t.pop(k) for k in [k for k, v in t.items() if v.dtype == GUARD_DTYPE and v.numel() == 0]])
    transformers.AutoModelForCausalLM.from_pretrained(out).save_pretrained(again)
    return {"model": model, "m": out, "bare": bare, "again": again, "plain": _plain_transformers(out, bare, again)}


def test_plain_transformers_refuses_a_fewbits_directory(saved):
    out = saved["m"]
    plain = safetensors_torch.load_file(str(out / SINGLE_NAME))
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    assert modules and all(plain[f"{m}.weight"].dtype == GUARD_DTYPE and plain[f"{m}.weight"].numel() == 0
                           for m in modules)
    assert saved["plain"][str(out)] == "RuntimeError", saved["plain"]["stderr"][-2000:]
    # what the user sees: transformers names the unknown method, then refuses the weights' shapes
    assert "fewbits" in saved["plain"]["stderr"] and "mismatch" in saved["plain"]["stderr"].lower()


def test_without_the_guards_plain_transformers_would_load_random_weights(saved):
    """Why the guard exists: transformers skips a quantization method it does not know."""
    assert saved["plain"][str(saved["bare"])] == "LOADED"
    # fewbits still reads a directory written before the guard
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(fb.from_pretrained(saved["bare"])(ids).logits, saved["model"](ids).logits)


def test_fewbits_and_transformers_with_fewbits_load_it_and_save_it_with_its_guards(saved, caplog):
    model, out, again = saved["model"], saved["m"], saved["again"]
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
    # transformers' own writer, through fewbits' quantizer, writes the guards back
    plain = safetensors_torch.load_file(str(again / SINGLE_NAME))
    assert all(plain[f"{m}.weight"].dtype == GUARD_DTYPE for m in loaded.config.quantization_config.plan)
    assert torch.equal(fb.from_pretrained(again)(ids).logits, want)
    assert saved["plain"][str(again)] == "RuntimeError"


@pytest.mark.parametrize("bad", [torch.zeros(1, dtype=torch.uint8), torch.empty(0, dtype=torch.int8),
                                 torch.zeros(64, 64)], ids=["uint8[1]", "int8[0]", "float[64,64]"])
def test_a_weight_stored_beside_a_quantized_module_is_refused_unless_it_is_the_guard(saved, tmp_path, bad):
    import shutil
    d = tmp_path / "d"
    shutil.copytree(saved["m"], d)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(str(d / SINGLE_NAME), lambda t: t.__setitem__(name, bad))
    with pytest.raises(FileFormatError, match="stored both as a float tensor and quantized"):
        read_tensors(d)
