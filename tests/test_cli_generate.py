"""`fewbits generate`: a tiny Hugging Face directory quantized on the fly or written quantized
by `fewbits quantize`, SmolLM2 through a GGUF file, the decode path reported, and bad input."""
from __future__ import annotations

import json

import pytest
import torch

from fewbits.cli import main
from test_cli_quantize import _tiny_hf_llama, run

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_hf_llama(tmp_path_factory.mktemp("tiny_generate"), tied=False)


def _generate(*argv):
    rc, out, err = run(["generate", *map(str, argv), "--quiet"])
    assert rc == 0, err
    return out


def test_quantized_on_the_fly_runs_the_native_step_and_equals_the_library(tiny_dir):
    import transformers

    import fewbits as fb
    from fewbits.models import LlamaDecoder

    got = json.loads(_generate(tiny_dir, "--prompt", "hello", "--scheme", "int4_g32", "--max-new-tokens", 12,
                               "--no-stop", "--json"))
    assert got["path"] == "native" and "native_reason" not in got
    assert got["new_tokens"] == 12 and got["prompt_tokens"] == 5 and got["scheme"] == "int4_g32"
    assert got["decode_tokens_per_s"] > 0 and got["prefill_tokens_per_s"] > 0 and not got["stopped_at_eos"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    fb.quantize_model(model, "int4_g32", tied="untie")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok("hello", return_tensors="pt")["input_ids"]
    want = LlamaDecoder(model, path="torch").generate(ids, 12)
    assert got["text"] == tok.decode(want.tokens[0], skip_special_tokens=True)


def test_text_output_names_the_path(tiny_dir):
    out = _generate(tiny_dir, "--prompt", "hi", "--max-new-tokens", 3, "--threads", 1)
    assert out.startswith("hi")
    assert "1 thread(s), torch decode path" in out and "no one-row C kernel" in out
    out = _generate(tiny_dir, "--prompt", "hi", "--max-new-tokens", 3, "--scheme", "nf4", "--path", "native")
    assert "native decode path" in out and "did not run" not in out


def test_a_directory_written_quantized_runs_as_stored(tiny_dir, tmp_path):
    out_dir = tmp_path / "q"
    rc, _, err = run(["quantize", str(tiny_dir), "--scheme", "int4_g32", "--out", str(out_dir), "--format", "hf",
                      "--quiet"])
    assert rc == 0, err
    got = json.loads(_generate(out_dir, "--prompt", "abc", "--max-new-tokens", 4, "--json"))
    assert got["path"] == "native" and got["scheme"] is None and got["new_tokens"] <= 4


def test_smollm2_from_a_gguf_file(tmp_path):
    pytest.importorskip("gguf")
    from fewbits.models import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ImportError as e:
        pytest.skip(str(e))
    path = tmp_path / "m.gguf"
    rc, _, err = run(["quantize", "smollm2", "--scheme", "q4_0", "--out", str(path), "--quiet"])
    assert rc == 0, err
    got = json.loads(_generate(path, "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", 24,
                               "--json"))
    assert got["path"] == "native" and "Paris" in got["text"]


@pytest.mark.parametrize("argv,msg", [
    (["nowhere", "--prompt", "x"], "nowhere: file not found"),
    (["smollm2", "--prompt", "x", "--scheme", "int5"], "unknown quantization scheme 'int5'"),
    (["smollm2", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["smollm2", "--prompt", "x", "--threads", "0"], "--threads must be at least 1"),
])
def test_bad_input_exits_2(argv, msg):
    rc, _, err = run(["generate", *argv, "--quiet"])
    assert rc == 2 and msg in err and "Traceback" not in err


def test_native_path_on_a_float_model_exits_2(tiny_dir):
    rc, _, err = run(["generate", str(tiny_dir), "--prompt", "x", "--path", "native", "--quiet"])
    assert rc == 2 and "path='native' cannot run this model" in err


def test_an_empty_prompt_exits_2(tiny_dir):
    rc, _, err = run(["generate", str(tiny_dir), "--prompt", "", "--quiet"])
    assert rc == 2 and "the prompt is empty" in err


def test_main_is_the_console_script():
    assert main(["generate", "--help"]) == 0


def test_the_continuation_keeps_its_leading_space(tmp_path):
    """A Llama-2-style tokenizer (Metaspace, then a decoder that strips one leading space) drops
    the first new token's space when the new tokens are decoded alone: the printed text decodes
    them after the prompt instead."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["\u2581hello", "\u2581world", "\u2581the", "\u2581cat"]  # words only: every token prints
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    cfg = transformers.LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    got = json.loads(_generate(tmp_path, "--prompt", "hello world", "--max-new-tokens", 4, "--no-stop", "--json"))
    words_out = got["text"].split(" ")
    assert got["text"].startswith(" ") and len(words_out) == 5
    assert all(w in ("hello", "world", "the", "cat") for w in words_out[1:])
    out = _generate(tmp_path, "--prompt", "hello world", "--max-new-tokens", 4, "--no-stop")
    assert out.splitlines()[0] == "hello world" + got["text"]


@pytest.mark.parametrize("damage", ["config", "weights", "gguf"])
def test_broken_model_files_exit_2_with_one_line(tiny_dir, tmp_path, damage):
    """A model read from disk is checked before use: a broken config.json, weights file or GGUF
    is one line on stderr and exit code 2, never a traceback."""
    import shutil

    if damage == "gguf":
        path = tmp_path / "m.gguf"
        path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)  # a header, then garbage
    else:
        path = tmp_path / "m"
        shutil.copytree(tiny_dir, path)
        if damage == "config":
            (path / "config.json").write_text('{"model_type": "llama", ')
        else:
            weights = path / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:100])
    rc, out, err = run(["generate", str(path), "--prompt", "x", "--quiet"])
    assert rc == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and str(path) in err


def test_one_new_token_is_the_prompt_alone(tiny_dir):
    got = json.loads(_generate(tiny_dir, "--prompt", "hello", "--scheme", "int4_g32", "--max-new-tokens", 1,
                               "--json"))
    assert got["new_tokens"] == 1 and got["path"] == "torch" and "native_reason" not in got
    out = _generate(tiny_dir, "--prompt", "hello", "--scheme", "int4_g32", "--max-new-tokens", 1)
    assert "no decode step" in out and "did not run" not in out
