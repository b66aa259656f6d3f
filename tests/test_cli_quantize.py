"""`fewbits quantize`: the preset list, bad input, a tiny Hugging Face directory (tied
embeddings; a broken tokenizer), and a real run on MiniLM (slow)."""
from __future__ import annotations

import io
import json

import pytest
import torch

from fewbits.cli import main


def run(argv):
    import contextlib
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_list_presets_json():
    rc, out, _ = run(["quantize", "--list", "--json"])
    assert rc == 0
    rows = {r["scheme"]: r for r in json.loads(out)}
    assert rows["nf4_dq"]["bits_per_value"] == pytest.approx(4.127, abs=5e-4)
    assert rows["nvfp4"]["bits_per_value"] == 4.5
    assert rows["q4_0"]["formats"] == ["hf", "fewbits", "gguf", "compressed-tensors", "gptq"]
    assert rows["q4_k"]["formats"] == ["hf", "fewbits", "gguf"]
    assert rows["w8a8"]["formats"] == ["hf", "fewbits", "compressed-tensors"]
    assert rows["w4a16_g32"]["formats"] == ["hf", "fewbits", "gguf", "compressed-tensors", "gptq"]  # Q4_0 blocks
    assert rows["nf4"]["formats"] == ["hf", "fewbits", "bitsandbytes"]
    assert rows["nf4_dq"]["formats"] == ["hf", "fewbits"]


@pytest.mark.parametrize("argv, msg", [
    (["quantize", "--scheme", "nf5"], "unknown quantization scheme"),
    (["quantize", "--model", "/nonexistent/dir", "--scheme", "nf4", "--quiet"], "/nonexistent/dir: file not found"),
    (["quantize", "--budget", "0.5", "--quiet"], "--budget"),
    (["quantize"], "give --scheme"),
])
def test_bad_input_exits_2_with_a_message(argv, msg):
    rc, _, err = run(argv)
    assert rc == 2 and msg in err


@pytest.mark.slow
def test_real_minilm_run_json(tmp_path):
    pytest.importorskip("transformers")
    rc, out, _ = run(["quantize", "--model", "minilm", "--compare", "int8,nf4", "--quick", "--quiet",
                      "--json", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads(out)
    rows = {r["scheme"]: r for r in res["schemes"]}
    for r in rows.values():
        for key in ("scheme", "bits_per_param", "model_bytes", "quality", "quality_metric", "throughput"):
            assert key in r
    assert rows["fp32"]["quality"] == pytest.approx(1.0)
    assert rows["int8"]["quality"] > 0.99 > rows["nf4"]["quality"] > 0.9
    assert (tmp_path / "results.json").is_file() and (tmp_path / "quality_vs_bits.png").is_file()


def _tiny_hf_llama(path, tied=True):
    """A Hugging Face directory of a tiny Llama with a byte-level tokenizer (256 tokens)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return _tiny_hf_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_command_line_and_library_quantize_the_same_layers(tiny_llama_dir):
    """A tied lm_head: `fewbits quantize` and fb.quantize_model share one default (the head stays
    in float, tied), so they give the same model: same bytes, same parameters."""
    import transformers

    import fewbits as fb
    from fewbits.quant.model import model_nbytes

    rc, out, err = run(["quantize", "--model", str(tiny_llama_dir), "--scheme", "int4", "--quiet", "--json"])
    assert rc == 0, err
    rows = {r["scheme"]: r for r in json.loads(out)["schemes"]}
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    fb.quantize_model(model, "int4")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sizes = model_nbytes(model)
    assert sizes["params"] == params
    assert rows["int4"]["model_bytes"] == sizes["total"]
    assert rows["int4"]["model_bytes"] < rows["fp32"]["model_bytes"]


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": {broken', '{"version": "1.0"}', "",
                                     '{"version": "1.0", "model": {"type": "BPE"}}'])
def test_a_broken_tokenizer_is_a_clear_error(tiny_llama_dir, tmp_path, content):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "tokenizer.json").write_text(content)
    rc, out, err = run(["quantize", "--model", str(bad), "--scheme", "int8", "--quiet"])
    assert rc == 2 and out == ""
    assert err.startswith("fewbits quantize: error:") and len(err.strip().splitlines()) == 1, err
    assert "tokenizer" in err and str(bad) in err and "Traceback" not in err
