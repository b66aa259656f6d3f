"""`fewbits quantize MODEL --scheme S --out OUT [--format F]`: the conversion writes a model the
target reads (fewbits, transformers, the gguf package's reader), and refuses bad input before
any work, leaving nothing behind."""
import contextlib
import io
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import fewbits as fb  # noqa: E402
from fewbits.cli import main  # noqa: E402



def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny tied Llama with a byte-level BPE tokenizer of 256 bytes and two merges."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny") / "llama"
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"th": 256, "the": 257, "<|endoftext|>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "h"), ("th", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def test_hf_directory_loads_and_gives_the_in_memory_logits(tiny, tmp_path):
    import transformers

    rc, out, err = run(["quantize", str(tiny), "--scheme", "int8", "--out", str(tmp_path / "q"), "--quiet"])
    assert rc == 0, err
    assert "bits/param" in out and "peak memory" in out and f"wrote {tmp_path / 'q'}" in out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "q"))
    loaded = fb.from_pretrained(tmp_path / "q")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    fb.quantize_model(reference, "int8")
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_gguf_file_reads_back_with_the_gguf_package(tiny, tmp_path):
    path = tmp_path / "m.gguf"
    rc, out, err = run(["quantize", str(tiny), "--scheme", "q8_0", "--out", str(path), "--quiet", "--json"])
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["format"] == "gguf" and summary["bytes"] == path.stat().st_size
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert "output.weight" not in types  # tied: llama.cpp reads the head from token_embd
    assert [p for p in os.listdir(tmp_path) if p != "m.gguf"] == []  # the staged directory is gone


def test_fewbits_file_loads_into_a_skeleton(tiny, tmp_path):
    import transformers

    path = tmp_path / "m.safetensors"
    rc, _, err = run(["quantize", "--model", str(tiny), "--scheme", "nf4", "--out", str(path), "--quiet"])
    assert rc == 0, err
    skeleton = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model = fb.load(path, skeleton)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"


def test_gptq_with_a_calibration_file(tiny, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rc, _, err = run(["quantize", str(tiny), "--scheme", "int4_g32", "--method", "gptq", "--calibration",
                      str(text), "--out", str(tmp_path / "q"), "--quiet"])
    assert rc == 0, err
    assert fb.from_pretrained(tmp_path / "q") is not None
    (tmp_path / "short.txt").write_text("too short")
    rc, _, err = run(["quantize", str(tiny), "--scheme", "int4", "--method", "gptq", "--calibration",
                      str(tmp_path / "short.txt"), "--out", str(tmp_path / "q2"), "--quiet"])
    assert rc == 2 and "too short" in err and not (tmp_path / "q2").exists()


def test_imatrix_says_how_much_calibration_it_read(tiny, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    rc, _, err = run(["quantize", str(tiny), "--scheme", "q4_0", "--method", "imatrix", "--calibration", str(text),
                      "--calibration-samples", "3", "--calibration-length", "64", "--out", str(tmp_path / "q")])
    assert rc == 0, err
    assert "imatrix calibration: 3 windows of 64 tokens (192 tokens) of " + str(text) in err, err
    assert fb.from_pretrained(tmp_path / "q") is not None
    # asked for more than the text holds: said, not silently cut
    rc, _, err = run(["quantize", str(tiny), "--scheme", "q4_0", "--method", "imatrix", "--calibration", str(text),
                      "--calibration-samples", "1000", "--calibration-length", "64", "--out", str(tmp_path / "q2")])
    assert rc == 0, err
    assert "the text holds no more (asked for 1000)" in err, err


@pytest.mark.parametrize("argv,code,message", [
    (["--scheme", "nf4", "--format", "gguf"], 2, "nf4 has no GGUF type"),
    (["--scheme", "q4_k_m"], 2, "write it with --format gguf"),
    (["--scheme", "int9"], 2, "unknown quantization scheme"),
    (["--scheme", "int8", "--format", "xml"], 2, "invalid choice"),
])
def test_bad_requests_are_one_line_errors_that_write_nothing(tiny, tmp_path, argv, code, message):
    out_path = tmp_path / "out"
    rc, out, err = run(["quantize", str(tiny), "--out", str(out_path), "--quiet", *argv])
    assert rc == code and message in err, err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_existing_output_needs_overwrite_and_a_broken_source_is_named(tiny, tmp_path):
    (tmp_path / "q").mkdir()
    rc, _, err = run(["quantize", str(tiny), "--scheme", "int8", "--out", str(tmp_path / "q"), "--quiet"])
    assert rc == 1 and "--overwrite" in err
    rc, _, err = run(["quantize", str(tiny), "--scheme", "int8", "--out", str(tmp_path / "q"), "--overwrite",
                      "--quiet"])
    assert rc == 0, err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tiny / "config.json").read_text())
    rc, _, err = run(["quantize", str(empty), "--scheme", "int8", "--out", str(tmp_path / "e"), "--quiet"])
    assert rc == 2 and str(empty) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "e").exists()
    rc, _, err = run(["quantize", str(tmp_path / "nowhere"), "--scheme", "int8", "--out", str(tmp_path / "x"),
                      "--quiet"])
    assert rc == 2 and "nowhere: file not found" in err


@pytest.mark.slow  # the per-layer sensitivity measurement: ~40 s here
def test_a_budget_chooses_gguf_types_per_tensor(tiny, tmp_path):
    path = tmp_path / "m.gguf"
    rc, out, err = run(["quantize", str(tiny), "--budget", "6", "--out", str(path), "--quiet", "--json"])
    assert rc == 0, err
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk.")}
    quantized = {v for k, v in types.items() if k.endswith("_proj.weight") or ".attn_" in k or ".ffn_" in k}
    assert quantized <= {"Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "F32"} and len(quantized - {"F32"}) >= 1
    assert json.loads(out)["bits_per_param"] > 0


def test_scheme_and_compare_together_are_refused(tiny, tmp_path):
    rc, out, err = run(["quantize", str(tiny), "--scheme", "int8", "--compare", "int4", "--out",
                        str(tmp_path / "x.gguf"), "--quiet"])
    assert rc == 2 and "give one of them" in err and os.listdir(tmp_path) == []


def test_a_gguf_without_a_tokenizer_is_written_with_a_warning(tmp_path):
    from fewbits.models import synthetic_llama_config, write_synthetic_llama

    src = tmp_path / "src"
    write_synthetic_llama(src, synthetic_llama_config("135m", hidden_size=64, intermediate_size=128,
                                                      num_hidden_layers=1, num_attention_heads=4,
                                                      num_key_value_heads=2, vocab_size=128))
    rc, _, err = run(["quantize", str(src), "--scheme", "q8_0", "--out", str(tmp_path / "m.gguf"), "--quiet"])
    assert rc == 0 and "no tokenizer files" in err and (tmp_path / "m.gguf").is_file()
