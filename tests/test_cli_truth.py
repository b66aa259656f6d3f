"""The command line tells the truth (issue 29, item 6, and the command-line side of item 4): a scheme
alias is resolved before any decision; a GGUF conversion says which types it wrote, how many and why;
what can be checked before reading the model is checked first; a mistyped option gets that command's
usage and the close names; --scheme on a quantized model is refused; --quiet silences third-party
bars; `train --compare --json` writes no picture unasked; a float matrix left in an hf output is
named; a prompt that is not UTF-8 and a tokenizer larger than the embedding are clear errors."""
import contextlib
import io
import json
import os
from collections import Counter

import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import fewbits as fb  # noqa: E402
from fewbits import cli  # noqa: E402
from fewbits.cli import main  # noqa: E402
from fewbits.models import synthetic_llama_config, write_synthetic_llama  # noqa: E402
from tiny_tokenizer import save_byte_level_bpe  # noqa: E402


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _llama(path, vocab_size=384):
    cfg = synthetic_llama_config("135m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size)
    write_synthetic_llama(path, cfg)
    save_byte_level_bpe(path)
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("truth") / "llama")


@pytest.fixture(scope="module")
def q4k_gguf(src, tmp_path_factory):
    path = tmp_path_factory.mktemp("truth_gguf") / "m.gguf"
    rc, out, err = run(["quantize", str(src), "--scheme", "q4_k", "--out", str(path), "--quiet", "--json"])
    assert rc == 0, err
    return path, json.loads(out)


def _file_types(path):
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)


def _refuse_reading(monkeypatch):
    from fewbits.cli import quantize as cli

    def no(*a, **k):
        raise AssertionError("the model was read although the request could be refused before")
    monkeypatch.setattr(cli, "_quant_source", no)


# --- 1. aliases resolve before any decision -----------------------------------------------------
def test_a_scheme_alias_is_the_canonical_scheme_for_every_decision(src, q4k_gguf, tmp_path):
    path = tmp_path / "alias.gguf"
    rc, out, err = run(["quantize", str(src), "--scheme", "q4k", "--out", str(path), "--quiet", "--json"])
    assert rc == 0, err  # before: llama.cpp's fallbacks skipped, a long error at the end
    result = json.loads(out)
    assert result["scheme"] == "q4_k"
    assert _file_types(path) == _file_types(q4k_gguf[0])
    for spelling in ("Q4-K-M", "q4km"):
        rc, out, err = run(["quantize", str(src), "--scheme", spelling, "--out", str(tmp_path / f"{spelling}.gguf"),
                            "--quiet", "--json"])
        assert rc == 0 and json.loads(out)["scheme"] == "q4_k_m", err


def test_conversion_scheme_is_the_one_resolution():
    from fewbits.study.quantization import conversion_scheme

    assert conversion_scheme("q4k", "gguf") == "q4_k"
    assert conversion_scheme("Q4_K_M", "gguf") == "q4_k_m"
    assert conversion_scheme("e4m3", "hf") == "fp8"
    assert conversion_scheme("w4a8", "gguf") == "q4_0"  # its weights' GGUF type, fallbacks included
    with pytest.raises(ValueError, match="no GGUF type"):
        conversion_scheme("nf4", "gguf")
    with pytest.raises(ValueError, match="--format gguf"):
        conversion_scheme("q4km", "hf")
    with pytest.raises(ValueError, match="q4_k_m"):  # the close names and the mixes
        conversion_scheme("q4_kx", "gguf")


# --- 2. which types were written, how many, why ---------------------------------------------------
def test_a_gguf_conversion_says_which_types_it_wrote_and_why(src, q4k_gguf, tmp_path):
    path, result = q4k_gguf
    written = {r["type"]: r for r in result["types"]}
    assert {t: r["count"] for t, r in written.items()} == dict(_file_types(path))
    assert written["Q5_0"]["count"] == 15  # every matrix: rows of 64 and 128, not multiples of 256
    assert "not a multiple of Q4_K's 256: llama.cpp's fallback" in written["Q5_0"]["why"]
    assert "norms" in written["F32"]["why"]
    rc, out, err = run(["quantize", str(src), "--scheme", "q4_k", "--out", str(tmp_path / "t.gguf"), "--quiet"])
    assert rc == 0, err
    assert "GGUF types: Q5_0 ×15 (" in out and "llama.cpp's fallback" in out


def test_smollm2s_q4_k_fallback_is_counted_and_explained():
    """SmolLM2's shape (hidden 576, intermediate 1536, 30 layers, tied): 181 of 211 matrices are
    Q5_0, the issue's count, and the summary says why."""
    from fewbits.files.gguf_file import gguf_recipe_types
    from fewbits.study.quantization import written_types, written_types_text

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}
    types = gguf_recipe_types("q4_k", cfg)
    assert Counter(c.type for c in types.values()) == {"Q5_0": 181, "Q4_K": 30}
    text = written_types_text(written_types({"Q5_0": 181, "Q4_K": 30, "F32": 61}, types))
    assert text == ("Q5_0 ×181 (rows of 576 are not a multiple of Q4_K's 256: llama.cpp's fallback), "
                    "F32 ×61 (norms and other vectors), Q4_K ×30")
    q4km = gguf_recipe_types("q4_k_m", cfg)
    counts = Counter(c.type for c in q4km.values())
    assert counts == {"Q5_0": 166, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}  # attn_v, ffn_down: 14 layers more
    mixed = {r["type"]: r["why"] for r in written_types(dict(counts, F32=61), q4km)}
    assert mixed["Q8_0"] == ("q4_k_m's output layer ×1, q4_k_m's more bits for attn_v and ffn_down of some "
                             "layers ×14; rows of 576 are not a multiple of Q6_K's 256: llama.cpp's fallback")
    assert mixed["Q6_K"] == "q4_k_m's more bits for attn_v and ffn_down of some layers"
    kept = gguf_recipe_types("q4_0", dict(cfg, intermediate_size=1544))  # 1544 = 48 * 32 + 8
    assert kept["model.layers.0.mlp.down_proj"].type is None
    text = written_types_text(written_types({"Q4_0": 181, "F32": 91}, kept))
    assert text == ("Q4_0 ×181, F32 ×91 (norms and other vectors; 30 matrices kept in float: rows of 1544 are not "
                    "a multiple of Q4_0's 32: no type of the recipe fits)")


# --- 3. checks before reading the model ------------------------------------------------------------
def test_nf4_to_gguf_is_refused_before_the_model_is_read(src, tmp_path, monkeypatch):
    _refuse_reading(monkeypatch)
    rc, _, err = run(["quantize", str(src), "--scheme", "nf4", "--format", "gguf", "--out", str(tmp_path / "m"),
                      "--quiet"])
    assert rc == 2 and "nf4 has no GGUF type" in err and "--format hf" in err, err
    assert os.listdir(tmp_path) == []


def test_a_missing_model_file_is_not_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refuse_reading(monkeypatch)
    rc, _, err = run(["quantize", "nope.gguf", "--scheme", "q4_0", "--out", "d.gguf", "--quiet"])
    assert rc == 2 and "nope.gguf: file not found" in err and "unknown model" not in err, err
    rc, _, err = run(["generate", "nope.gguf", "--prompt", "x", "--quiet"])
    assert rc == 2 and "nope.gguf: file not found" in err, err
    assert os.listdir(tmp_path) == []


def test_an_hf_directory_named_like_a_gguf_file_is_refused(src, tmp_path, monkeypatch):
    _refuse_reading(monkeypatch)
    for fmt, name in (("hf", "x.gguf"), ("hf", "x.safetensors"), ("fewbits", "x.gguf")):
        rc, _, err = run(["quantize", str(src), "--scheme", "int4", "--format", fmt, "--out", str(tmp_path / name),
                          "--quiet"])
        assert rc == 2 and "the name ends in" in err and "or ask for" in err, err
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="the name ends in .gguf"):
        fb.files.conversion.convert(src, tmp_path / "y.gguf", "int4", format="hf")


def test_a_calibration_file_is_checked_before_the_model_is_read(src, tmp_path, monkeypatch):
    _refuse_reading(monkeypatch)
    out = str(tmp_path / "q")
    rc, _, err = run(["quantize", str(src), "--scheme", "int4", "--method", "gptq", "--calibration",
                      str(tmp_path / "none.txt"), "--out", out, "--quiet"])
    assert rc == 2 and "none.txt: file not found" in err, err
    (tmp_path / "c.txt").write_text("text")
    rc, _, err = run(["quantize", str(src), "--scheme", "int4", "--calibration", str(tmp_path / "c.txt"), "--out",
                      out, "--quiet"])
    assert rc == 2 and "--method imatrix or gptq calibrates on: rtn takes none" in err, err  # before: ignored
    for flag, value in (("--calibration-samples", "0"), ("--calibration-length", "-3")):
        rc, _, err = run(["quantize", str(src), "--scheme", "int4", "--method", "imatrix", flag, value, "--out", out,
                          "--quiet"])
        assert rc == 2 and f"{flag} must be a positive number" in err, err
    assert os.listdir(tmp_path) == ["c.txt"]


@pytest.mark.parametrize("argv,usage,hint", [
    (["quantize", "smollm2", "--schema", "q4_0"], "usage: fewbits quantize", "did you mean --scheme?"),
    (["generate", "smollm2", "--prompt", "x", "--max-tokens", "3"], "usage: fewbits generate",
     "did you mean --max-new-tokens?"),
    (["quantise", "smollm2"], "usage: fewbits [-h]", "did you mean quantize?"),
])
def test_a_mistyped_option_shows_the_commands_usage_and_the_close_name(argv, usage, hint):
    rc, _, err = run(argv)
    assert rc == 2 and usage in err and hint in err, err


# --- 4. generate --scheme on a quantized model; --quiet; train --json -----------------------------
@pytest.fixture(scope="module")
def int4_dir(src, tmp_path_factory):
    path = tmp_path_factory.mktemp("truth_int4") / "q"
    rc, _, err = run(["quantize", str(src), "--scheme", "int4", "--out", str(path), "--quiet"])
    assert rc == 0, err
    return path


def test_generate_refuses_a_scheme_on_a_quantized_model(int4_dir, q4k_gguf):
    for model in (int4_dir, q4k_gguf[0]):
        rc, out, err = run(["generate", str(model), "--scheme", "int8", "--prompt", "the", "--max-new-tokens", "2",
                            "--quiet"])
        assert rc == 2 and "quantized already" in err and "drop --scheme" in err and out == "", err
    rc, out, err = run(["generate", str(int4_dir), "--prompt", "the", "--max-new-tokens", "2", "--quiet", "--json"])
    assert rc == 0 and json.loads(out)["scheme"] is None, err


@pytest.mark.parametrize("fmt, scheme", [("gptq", "w4a16_g32"), ("compressed-tensors", "int4_asym_g32")])
def test_generate_runs_what_quantize_writes_in_a_standard_format(src, tmp_path, fmt, scheme):
    """`fewbits generate` reads a GPTQ or compressed-tensors directory as it is (fewbits' kernels),
    the same tokens as the fewbits directory of the same scheme."""
    outs = {}
    for f in (fmt, "hf"):
        path = tmp_path / f
        rc, _, err = run(["quantize", str(src), "--scheme", scheme, "--format", f, "--out", str(path), "--quiet"])
        assert rc == 0, err
        if f == fmt:
            assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == f
        rc, out, err = run(["generate", str(path), "--prompt", "the cat", "--max-new-tokens", "6", "--quiet", "--json"])
        assert rc == 0, err
        outs[f] = json.loads(out)
    assert f"({fmt}, read by fewbits)" in outs[fmt]["model"]
    assert outs[fmt]["text"] == outs["hf"]["text"] and outs[fmt]["path"] == outs["hf"]["path"]


def test_generate_leaves_a_bitsandbytes_directory_to_transformers(src, tmp_path):
    """fewbits does not read bitsandbytes directories: `fewbits generate` loads them through
    transformers (with bitsandbytes), as any other quantization method it does not read."""
    pytest.importorskip("bitsandbytes")
    path = tmp_path / "bnb"
    rc, _, err = run(["quantize", str(src), "--scheme", "nf4", "--format", "bitsandbytes", "--out", str(path),
                      "--quiet"])
    assert rc == 0, err
    rc, out, err = run(["generate", str(path), "--prompt", "the cat", "--max-new-tokens", "3", "--quiet", "--json"])
    assert rc == 0, err
    assert json.loads(out)["model"] == str(path)  # transformers' model, not "read by fewbits"


def test_generate_reports_the_canonical_scheme(src):
    rc, out, err = run(["generate", str(src), "--scheme", "INT-8", "--prompt", "the", "--max-new-tokens", "2",
                        "--quiet", "--json"])
    assert rc == 0 and json.loads(out)["scheme"] == "int8", err


def test_quiet_silences_third_party_progress_bars(q4k_gguf, tmp_path):
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()  # what earlier tests of this process left
    rc, out, err = run(["quantize", str(q4k_gguf[0]), "--scheme", "int8", "--out", str(tmp_path / "q"), "--quiet"])
    assert rc == 0 and err == "", err  # before: transformers' "Converting and de-quantizing GGUF tensors" bar
    assert hf_logging.is_progress_bar_enabled() == before  # restored after the command


def test_train_compare_json_writes_no_picture_unless_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--task", "mlp", "--compare", "fp32,bf16-mixed", "--steps", "2", "--json", "--quiet"]
    rc, out, err = run(argv)
    assert rc == 0, err
    assert len(json.loads(out)) == 2 and os.listdir(tmp_path) == []
    rc, _, err = run(argv + ["--plot", "loss.png"])
    assert rc == 0 and os.listdir(tmp_path) == ["loss.png"], err


# --- 5. the float matrices an hf output keeps ---------------------------------------------------
def test_an_hf_output_names_the_tied_embedding_it_keeps_in_float(src, tmp_path):
    rc, out, err = run(["quantize", str(src), "--scheme", "int4", "--out", str(tmp_path / "q"), "--quiet", "--json"])
    assert rc == 0, err
    result = json.loads(out)
    assert [f["name"] for f in result["float_matrices"]] == ["model.embed_tokens.weight"]
    assert result["float_matrices"][0]["shape"] == [384, 64]
    assert "tied embedding/lm_head model.embed_tokens.weight (384×64, bfloat16) stays in float" in result["notes"][0]
    assert "--embeddings --tied untie" in result["notes"][0]
    rc, out, err = run(["quantize", str(src), "--scheme", "int4", "--out", str(tmp_path / "e"), "--quiet",
                        "--embeddings", "--tied", "untie", "--json"])
    assert rc == 0, err
    result = json.loads(out)
    assert "float_matrices" not in result
    model = fb.from_pretrained(tmp_path / "e")
    assert all(type(m).__name__.startswith("Quant") for m in (model.get_input_embeddings(), model.lm_head))
    rc, _, err = run(["quantize", str(src), "--scheme", "int4", "--out", str(tmp_path / "k"), "--quiet",
                      "--embeddings"])
    assert rc == 2 and "--tied untie" in err and not (tmp_path / "k").exists(), err
    rc, _, err = run(["quantize", str(src), "--scheme", "q4_0", "--out", str(tmp_path / "g.gguf"), "--quiet",
                      "--embeddings"])
    assert rc == 2 and "--format hf or fewbits" in err, err


# --- 6. the command-line side of item 4 -------------------------------------------------------------
def test_a_prompt_that_is_not_utf8_is_a_clear_error(src):
    prompt = os.fsdecode(b"caf\xff\xfe")  # how sys.argv holds bytes that are not UTF-8: lone surrogates
    rc, out, err = run(["generate", str(src), "--prompt", prompt, "--max-new-tokens", "2", "--quiet"])
    assert rc == 2 and "--prompt is not valid UTF-8" in err and "0xff" in err and "unexpected" not in err, err


def test_a_tokenizer_larger_than_the_embedding_is_a_clear_error(tmp_path):
    small = _llama(tmp_path / "small", vocab_size=200)  # the tokenizer has 259 tokens
    rc, out, err = run(["generate", str(small), "--prompt", "the", "--max-new-tokens", "2", "--quiet"])
    assert rc == 2 and str(small) in err and "embedding has 200 rows" in err and "unexpected" not in err, err


def test_quiet_silences_warnings_and_library_logging_and_restores_them(capsys):
    import logging
    import warnings

    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()  # what earlier tests of this process left
    library = hf_logging.get_logger("transformers.modeling_utils")
    enabled = library.isEnabledFor(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cli._third_party_quiet(True):
            warnings.warn("a third-party warning")
            assert not library.isEnabledFor(logging.WARNING)
            assert not logging.getLogger("somelib").isEnabledFor(logging.WARNING)
            list(tqdm(range(3), desc="a bar"))
            exec(compile("import warnings; warnings.warn('fewbits: news')", "x", "exec"), {"__name__": "fewbits.x"})
        assert [str(w.message) for w in caught] == ["fewbits: news"]  # fewbits' own warnings still show
    assert capsys.readouterr().err == ""
    assert hf_logging.get_verbosity() == level and library.isEnabledFor(logging.WARNING) == enabled
    list(tqdm(range(3), desc="a bar"))
    assert "a bar" in capsys.readouterr().err
