"""Every GGUF fewbits writes, fewbits runs, at the precision stored; a hostile or broken GGUF (or
config.json) is refused with a FileFormatError naming the file, at once, before anything is built;
metadata that changes the numbers is honoured or refused, never ignored."""
import contextlib
import io
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import fewbits as fb  # noqa: E402
from fewbits.cli import main  # noqa: E402
from fewbits.files import FileFormatError, gguf_recipe  # noqa: E402
from fewbits.files.conversion import convert  # noqa: E402
from fewbits.files.gguf_file import RECIPES  # noqa: E402
from fewbits.files.gguf_header import read_header  # noqa: E402
from fewbits.models import synthetic_llama_config, write_synthetic_llama  # noqa: E402
from fewbits.models.decoder import LlamaDecoder  # noqa: E402
from tiny_tokenizer import save_byte_level_bpe  # noqa: E402

from gguf_craft import rewrite, serialize  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# (hidden, intermediate): rows that are multiples of 256 (k-quants as such) with a down projection
# of 288 (llama.cpp's Q5_0 / Q5_1 / Q8_0 fallback), and rows of 64 with a down projection of 136
# (no block type: that tensor stays float)
SHAPES = {"rows256": (256, 288), "rows64": (64, 136)}


def _source(root, hidden, inter, *, tied=True, dtype=torch.float32, **changes):
    extra = "".join(f"_{k}" for k in sorted(changes))
    path = root / f"src_{hidden}_{inter}_{'tied' if tied else 'untied'}_{str(dtype)[6:]}{extra}"
    if not path.exists():
        cfg = synthetic_llama_config("135m", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                                     tie_word_embeddings=tied, **changes)
        write_synthetic_llama(path, cfg, dtype=dtype, norm_range=(0.5, 1.5), seed=hidden + inter)
        save_byte_level_bpe(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_trust")


def _convert(src, out, recipe, **options):
    config = transformers.AutoConfig.from_pretrained(src)
    convert(src, out, gguf_recipe(recipe, config), embeddings=True, tied="untie", **options)
    return out


def _reference(path):
    """transformers' own GGUF loader: every tensor dequantized by the gguf package, in float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                             dtype=torch.float32).eval()


IDS = torch.tensor([[1, 5, 77, 200, 3, 258, 40, 9]])


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def q4_0(root):
    """A q4_0 GGUF of the rows64 source (its down projections stay float) to tamper with."""
    return _convert(_source(root, *SHAPES["rows64"]), root / "base_q4_0.gguf", "q4_0")


# --- 1. every file fewbits writes, fewbits runs, in the dtype stored --------------------------
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_gguf_fewbits_writes_it_runs(root, shape, recipe):
    path = _convert(_source(root, *SHAPES[shape]), root / f"{shape}_{recipe}.gguf", recipe)
    model = fb.from_pretrained(path)
    want = _logits(_reference(path))
    got = _logits(model)
    assert got.dtype == torch.float32
    # within the kernels' own rounding: torch's packed int4 matmul (the k-quants' kernel at a
    # batch of 8 tokens) takes bfloat16 activations by design
    assert (got - want).abs().max() <= 2e-2 * want.abs().max(), recipe
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # the float tensors in the model hold the file's values exactly (F32 norms not rounded)
    h = read_header(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    norm = next(t for t in h.tensors if t.name == "output_norm.weight")
    assert norm.ggml_type == "F32"
    stored = torch.from_numpy(np.array(blob[norm.start:norm.start + norm.nbytes].view(np.float32)))
    assert model.model.norm.weight.dtype == torch.float32
    assert torch.equal(model.model.norm.weight.detach(), stored)
    assert not torch.equal(stored, torch.ones_like(stored))
    result = LlamaDecoder(model).generate(IDS[:, :4], 4)
    assert result.tokens.shape == (1, 4)


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_generates_from_a_gguf_with_float_layers(root, q4_0):
    """`fewbits quantize src136 --scheme q4_0 --out x.gguf` keeps the down projections F32 (rows of
    136); `fewbits generate x.gguf` ran them against fp16 activations before."""
    src = _source(root, *SHAPES["rows64"])
    out = root / "cli_q4_0.gguf"
    rc, _, err = _run(["quantize", str(src), "--scheme", "q4_0", "--out", str(out), "--quiet"])
    assert rc == 0, err
    types = {t.name: t.ggml_type for t in read_header(out).tensors}
    assert types["blk.0.ffn_down.weight"] == "F32"
    rc, text, err = _run(["generate", str(out), "--prompt", "the", "--max-new-tokens", "3", "--quiet"])
    assert rc == 0, err
    assert "decode 2 tokens" in text


def test_f16_output_tensor_among_quantized_ones(root):
    """llama.cpp's --output-tensor-type f16: an F16 output.weight among Q4_0 tensors."""
    src = _source(root, 64, 128, tied=False, dtype=torch.float16)
    config = transformers.AutoConfig.from_pretrained(src)
    rules = gguf_recipe("q4_0", config)
    rules["lm_head"] = None
    out = root / "f16_output.gguf"
    convert(src, out, rules, embeddings=True, tied="keep")
    assert {t.name: t.ggml_type for t in read_header(out).tensors}["output.weight"] == "F16"
    model = fb.from_pretrained(out)
    want = _logits(_reference(out))
    # within the kernels' own rounding (a Q4_0 kernel may take bfloat16 activations on AMX)
    assert (_logits(model) - want).abs().max() <= 2e-2 * want.abs().max()
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# --- 2. no small file hangs the loader ---------------------------------------------------------
def _load_in_subprocess(path, timeout=120):
    """fb.from_pretrained(path) in a child limited to 4 GB of address space: (exit code, the
    child's last line). A hang fails the test instead of the run."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import fewbits as fb
        from fewbits.files import FileFormatError
        try:
            fb.from_pretrained({os.fspath(path)!r})
        except FileFormatError as e:
            print("FileFormatError:", e)
            sys.exit(3)
        print("loaded")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, lines[-1] if lines else ""


def test_huge_array_count_in_a_small_file_is_refused_at_once(tmp_path):
    """gguf-py's reader looped past the end of such a file, allocating (3.7 GB after 60 s)."""
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    blob += struct.pack("<Q", 20) + b"general.architecture" + struct.pack("<IQ", 8, 5) + b"llama"
    blob += struct.pack("<Q", 1) + b"x" + struct.pack("<IIQ", 9, 0, 1 << 40)  # an array of 2^40 u8
    blob += b"\0" * (65536 - len(blob))
    path = tmp_path / "array.gguf"
    path.write_bytes(blob)
    with pytest.raises(FileFormatError, match="declares 1099511627776 entries") as e:
        read_header(path)
    assert str(path) in str(e.value)
    rc, last = _load_in_subprocess(path)
    assert rc == 3 and "entries" in last, last


@pytest.mark.parametrize("count", [20000, 100000])
def test_block_count_beyond_the_tensors_is_refused(q4_0, tmp_path, count):
    bad = tmp_path / "blocks.gguf"
    rewrite(q4_0, bad, set={"llama.block_count": ("u32", count)})
    rc, last = _load_in_subprocess(bad)
    assert rc == 3 and f"block_count is {count}" in last and str(bad) in last, last


def test_config_layer_count_beyond_the_weights_is_refused(root, tmp_path):
    out = tmp_path / "dir"
    fb.files.convert(_source(root, 64, 128), out, "int4")
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 20000
    (out / "config.json").write_text(json.dumps(cfg))
    rc, last = _load_in_subprocess(out)
    assert rc == 3 and "num_hidden_layers is 20000" in last and "config.json" in last, last
    with pytest.raises(FileFormatError, match="2 layer"):
        fb.from_pretrained(out)


# --- 3. metadata that changes the numbers: honoured or refused ---------------------------------
def test_linear_rope_scaling_is_honoured(root, tmp_path):
    src = _source(root, 64, 128, tied=False, rope_scaling={"rope_type": "linear", "factor": 4.0})
    # only the token embedding quantized (a row lookup, exact), every matrix F32: float32 matmuls on
    # any CPU, so the comparison below sees RoPE alone (a quantized layer's kernel may take
    # bfloat16 activations on another CPU)
    rules = dict.fromkeys(gguf_recipe("q8_0", transformers.AutoConfig.from_pretrained(src)))
    rules.update({"model.embed_tokens": "q8_0", "lm_head": None})
    path = tmp_path / "linear.gguf"
    convert(src, path, rules, embeddings=True)
    assert {t.name: t.ggml_type for t in read_header(path).tensors}["output.weight"] == "F32"
    fields = gguf.GGUFReader(path).fields  # llama.cpp's own Python reader
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 4.0
    model = fb.from_pretrained(path)
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert model.config.rope_parameters["factor"] == 4.0
    # the reference: the same dequantized weights in a float model of the source's config
    plain = tmp_path / "plain.gguf"
    rewrite(path, plain, drop=("llama.rope.scaling.type", "llama.rope.scaling.factor"))
    unscaled = _reference(plain)  # transformers' GGUF loader reads no rope scaling
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src),
                                                              dtype=torch.float32).eval()
    reference.load_state_dict(unscaled.state_dict())
    want = _logits(reference)
    got = _logits(model)
    error = (got - want).abs().max()
    assert error <= 1e-4 * want.abs().max()
    ignored = (_logits(unscaled) - want).abs().max()  # what loading it as plain RoPE gives
    assert ignored > 1e-3 * want.abs().max() and ignored > 20 * error


def test_scale_factor_without_a_type_is_linear_as_in_llama_cpp(q4_0, tmp_path):
    bad = tmp_path / "factor.gguf"
    rewrite(q4_0, bad, set={"llama.rope.scaling.factor": ("f32", 2.0)})
    assert fb.from_pretrained(bad).config.rope_parameters["factor"] == 2.0
    none = tmp_path / "none.gguf"
    rewrite(q4_0, none, set={"llama.rope.scaling.factor": ("f32", 2.0), "llama.rope.scaling.type": ("string", "none")})
    assert fb.from_pretrained(none).config.rope_parameters.get("rope_type", "default") == "default"


@pytest.mark.parametrize("edit, match", [
    ({"llama.rope.scaling.type": ("string", "yarn"), "llama.rope.scaling.factor": ("f32", 4.0)}, "yarn"),
    ({"llama.rope.scaling.factor": ("f32", -2.0)}, "rope.scaling.factor"),
    ({"llama.attention.layer_norm_rms_epsilon": ("f32", float("nan"))}, "layer_norm_rms_epsilon"),
    ({"llama.attention.layer_norm_rms_epsilon": ("f32", -1e-5)}, "layer_norm_rms_epsilon"),
    ({"llama.rope.freq_base": ("f32", float("nan"))}, "rope.freq_base"),
    ({"llama.rope.freq_base": ("f32", 0.0)}, "rope.freq_base"),
    ({"llama.expert_count": ("u32", 8)}, "expert_count"),
    ({"llama.attention.clamp_kqv": ("f32", 8.0)}, "clamp_kqv"),
    ({"llama.attention.head_count": ("string", "4")}, "head_count must be an integer"),
    ({"llama.attention.head_count": ("u32", 0)}, "head_count must be at least 1"),
    ({"llama.attention.head_count": ("i32", -4)}, "head_count must be at least 1"),
    ({"llama.rope.dimension_count": ("u32", 15)}, "rope.dimension_count 15"),
    ({"llama.embedding_length": ("string", "64")}, "embedding_length must be an integer"),
    ({"llama.embedding_length": ("u32", 128)}, "embedding_length is 128"),
    ({"llama.context_length": ("f32", 2048.0)}, "context_length must be an integer"),
    ({"general.architecture": ("string", "qwen2")}, "qwen2"),
    ({"tokenizer.ggml.eos_token_id": ("u32", 5000)}, "eos_token_id 5000"),
])
def test_metadata_refused_naming_the_file(q4_0, tmp_path, edit, match):
    bad = tmp_path / "bad.gguf"
    rewrite(q4_0, bad, set=edit)
    with pytest.raises(FileFormatError, match=match) as e:
        fb.from_pretrained(bad)
    assert str(bad) in str(e.value)


def test_a_token_list_of_integers_is_refused(q4_0, tmp_path):
    bad = tmp_path / "tokens.gguf"
    n = len(read_header(q4_0).get("tokenizer.ggml.tokens"))
    rewrite(q4_0, bad, set={"tokenizer.ggml.tokens": ("array[u32]", list(range(n)))})
    with pytest.raises(FileFormatError, match="tokenizer.ggml.tokens must be an array\\[string\\]"):
        fb.from_pretrained(bad)


def test_a_vocabulary_larger_than_the_embedding_is_refused(q4_0, tmp_path):
    h = read_header(q4_0)
    tokens = h.get("tokenizer.ggml.tokens") + [f"extra{i}" for i in range(10)]
    types = h.get("tokenizer.ggml.token_type").tolist() + [1] * 10
    bad = tmp_path / "vocab.gguf"
    rewrite(q4_0, bad, set={"tokenizer.ggml.tokens": ("array[string]", tokens),
                            "tokenizer.ggml.token_type": ("array[i32]", types)})
    with pytest.raises(FileFormatError, match="394 tokens, more than the 384 rows"):
        fb.from_pretrained(bad)


def test_big_endian_file_is_named(q4_0, tmp_path):
    bad = tmp_path / "be.gguf"
    rewrite(q4_0, bad, big_endian=True)
    with pytest.raises(FileFormatError, match="big-endian"):
        fb.from_pretrained(bad)


def _float_norm_nan(name, raw):
    if name == "blk.1.attn_norm.weight":
        return struct.pack("<f", float("nan")) + raw[4:]
    return raw


def test_nan_in_a_norm_tensor_is_refused(q4_0, tmp_path):
    bad = tmp_path / "nan.gguf"
    rewrite(q4_0, bad, data=_float_norm_nan)
    with pytest.raises(FileFormatError, match="blk.1.attn_norm.weight: holds NaN") as e:
        fb.from_pretrained(bad)
    assert str(bad) in str(e.value)


def test_nan_block_scale_is_reported_against_the_gguf(q4_0, tmp_path):
    def nan_scale(name, raw):
        if name == "blk.0.attn_q.weight":  # Q4_0: the first block's fp16 scale
            return np.array([np.nan], dtype=np.float16).tobytes() + raw[2:]
        return raw

    bad = tmp_path / "scale.gguf"
    rewrite(q4_0, bad, data=nan_scale)
    with pytest.raises(FileFormatError, match="blk.0.attn_q.weight: its scales hold NaN") as e:
        fb.from_pretrained(bad)
    assert str(e.value).startswith(str(bad))


@pytest.mark.parametrize("how", ["one byte off", "shared offset", "out of order"])
def test_tensor_offsets_must_follow_one_another(q4_0, tmp_path, how):
    def edit(infos):
        if how == "one byte off":
            infos[3][3] += 1
        elif how == "shared offset":
            infos[3][3] = infos[2][3]
        else:
            infos[2], infos[3] = infos[3], infos[2]
        return infos

    bad = tmp_path / "offsets.gguf"
    rewrite(q4_0, bad, tensors=edit)
    with pytest.raises(FileFormatError, match="tensors must follow one another"):
        fb.from_pretrained(bad)


def test_truncated_gguf_names_the_file(q4_0, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = q4_0.read_bytes()
    bad.write_bytes(data[:len(data) - 1000])
    with pytest.raises(FileFormatError, match="past the end of the file") as e:
        fb.from_pretrained(bad)
    assert str(bad) in str(e.value)
    rc, _, err = _run(["quantize", str(bad), "--scheme", "q8_0", "--out", str(tmp_path / "out.gguf"), "--quiet"])
    assert rc == 2 and str(bad) in err and "past the end of the file" in err, err


def test_quantizing_a_gguf_keeps_its_rope_scaling(root, tmp_path):
    """`fewbits quantize x.gguf` read the file through transformers, which drops the rope scaling:
    the model it wrote was another model. Now it goes through fewbits' reader."""
    src = _source(root, 64, 128, rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = _convert(src, tmp_path / "linear.gguf", "q8_0")
    out = tmp_path / "again.gguf"
    rc, _, err = _run(["quantize", str(path), "--scheme", "q8_0", "--out", str(out), "--quiet"])
    assert rc == 0, err
    fields = gguf.GGUFReader(out).fields  # llama.cpp's own Python reader
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 4.0


def test_architectures_naming_a_non_model_class(root, tmp_path):
    out = tmp_path / "dir"
    fb.files.convert(_source(root, 64, 128), out, "int4")
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["AutoTokenizer"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileFormatError, match="AutoTokenizer.*not a transformers model class") as e:
        fb.from_pretrained(out)
    assert "config.json" in str(e.value)


def test_generate_refuses_a_plain_directory_stating_more_layers_than_it_holds(root, tmp_path):
    """transformers built 20000 layers (minutes, gigabytes) before noticing the weights were missing."""
    src = tmp_path / "plain"
    shutil.copytree(_source(root, 64, 128), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 20000
    (src / "config.json").write_text(json.dumps(cfg))
    code = ("import sys; from fewbits.cli import main; "
            f"sys.exit(main(['generate', {str(src)!r}, '--prompt', 'the', '--max-new-tokens', '2', '--quiet']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "num_hidden_layers is 20000, but the weights hold 2 layer(s)" in proc.stderr


# --- found by benchmarks/fuzz_files.py ---------------------------------------------------------
@pytest.mark.parametrize("edit, match", [
    ({"llama.block_count": ("u32", 2 ** 32 - 1)}, "block_count is 4294967295"),
    ({"llama.feed_forward_length": ("u64", 2 ** 63)}, "feed_forward_length is 9223372036854775808"),
    ({"llama.attention.head_count": ("u32", 64)}, "heads of 1 dimensions"),
])
def test_sizes_are_checked_against_the_tensors_before_anything_is_built(q4_0, tmp_path, edit, match):
    bad = tmp_path / "size.gguf"
    rewrite(q4_0, bad, set=edit)
    rc, last = _load_in_subprocess(bad)
    assert rc == 3 and re.search(match, last), last


def test_a_vector_in_a_block_type_is_refused(q4_0, tmp_path):
    bad = tmp_path / "vector.gguf"
    rewrite(q4_0, bad, tensors=lambda infos: [[n, d, "Q8_0" if n == "output_norm.weight" else t, o]
                                              for n, d, t, o in infos])
    with pytest.raises(FileFormatError, match="output_norm.weight: a 1-D tensor in Q8_0"):
        fb.from_pretrained(bad)


@pytest.fixture(scope="module")
def int4_dir(root):
    out = root / "int4_dir"
    fb.files.convert(_source(root, 64, 128), out, "int4")
    return out


def _delete(key):
    return lambda c: c.pop(key)


def _set(key, value):
    return lambda c: c.update({key: value})


def _rope(**values):
    return lambda c: c.update({"rope_parameters": {**c["rope_parameters"], **values}})


@pytest.mark.parametrize("edit, match", [
    # weights the directory does not hold (transformers filled them at random)
    (_delete("num_hidden_layers"), "num_hidden_layers|weights the directory does not hold"),
    (_set("tie_word_embeddings", False), "does not hold: lm_head.weight"),
    (_set("attention_bias", True), "does not hold: .*bias"),
    (_set("architectures", ["LlamaForSequenceClassification"]), "does not hold: score.weight"),
    # values that are no model (NaN logits, or an exception that named no file)
    (_set("rms_norm_eps", float("nan")), "rms_norm_eps must be a finite number > 0"),
    (_rope(rope_theta=0), "rope_theta must be a finite number > 0"),
    (_rope(rope_type="linear", factor=-1.0), "factor must be a finite number > 0"),
    (_set("num_hidden_layers", 2 ** 31), "num_hidden_layers must be an integer"),
    (_set("num_attention_heads", 0), "num_attention_heads must be an integer"),
    (_set("hidden_size", "64"), "hidden_size must be an integer"),
    (_set("hidden_act", "nonsense"), "hidden_act 'nonsense'"),
    (_set("dtype", "int8"), "dtype must be one of"),
    (_set("output_hidden_states", "yes"), "output_hidden_states must be true or false"),
    (_set("return_dict", False), "return_dict false"),
    (_set("architectures", 7), "architectures must be a list"),
    (_set("bos_token_id", "1"), "transformers cannot build the model it describes"),
])
def test_a_config_json_that_is_no_model_is_refused(int4_dir, tmp_path, edit, match):
    bad = tmp_path / "bad"
    shutil.copytree(int4_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileFormatError, match=match) as e:
        fb.from_pretrained(bad)
    assert "config.json" in str(e.value)


# --- found in review -----------------------------------------------------------------------------
def test_duplicate_tokens_are_a_file_format_error(q4_0, tmp_path):
    """The tokenizers library raises a plain Exception for them, which escaped as 'unexpected'."""
    bad = tmp_path / "dup.gguf"
    rewrite(q4_0, bad, set={"tokenizer.ggml.tokens": ("array[string]", ["a"] * 384),
                            "tokenizer.ggml.token_type": ("array[i32]", [1] * 384)})
    with pytest.raises(FileFormatError, match="its tokenizer cannot be read"):
        fb.from_pretrained(bad)


def test_nested_arrays_and_long_tensor_names_are_refused_as_llama_cpp_does(q4_0, tmp_path):
    nested = tmp_path / "nested.gguf"
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    blob += struct.pack("<Q", 1) + b"x" + struct.pack("<IIQ", 9, 9, 4_000_000) + struct.pack("<IQ", 0, 0) * 4_000
    nested.write_bytes(blob)
    with pytest.raises(FileFormatError, match="an array of arrays"):
        read_header(nested)
    long = tmp_path / "long.gguf"
    rewrite(q4_0, long, tensors=lambda infos: [["blk." + "9" * 70 if n == "output_norm.weight" else n, d, t, o]
                                               for n, d, t, o in infos])
    with pytest.raises(FileFormatError, match="not shorter than 64 bytes"):
        read_header(long)


def test_keys_llama_cpp_never_reads_and_odd_ones(q4_0, tmp_path):
    old = tmp_path / "layout.gguf"
    rewrite(q4_0, old, set={"llama.tensor_data_layout": ("string", "Meta AI original pth")})
    fb.from_pretrained(old)  # early converters wrote it; llama.cpp ignores it
    arr = tmp_path / "experts.gguf"
    rewrite(q4_0, arr, set={"llama.expert_count": ("array[u32]", [0, 0])})
    with pytest.raises(FileFormatError, match="expert_count"):
        fb.from_pretrained(arr)
    digit = tmp_path / "digit.gguf"
    rewrite(q4_0, digit, tensors=lambda infos: [["blk.\u00b2.x" if n == "output_norm.weight" else n, d, t, o]
                                                for n, d, t, o in infos])
    with pytest.raises(FileFormatError):
        fb.from_pretrained(digit)
    freqs = tmp_path / "freqs.gguf"
    rewrite(q4_0, freqs, tensors=lambda infos: [["rope_freqs.weight" if n == "output_norm.weight" else n, d, t, o]
                                                for n, d, t, o in infos])
    with pytest.raises(FileFormatError, match="rope_freqs.weight: per-dimension RoPE frequency factors"):
        fb.from_pretrained(freqs)


def test_a_second_stack_of_more_blocks_is_no_contradiction(int4_dir, tmp_path):
    """Qwen2-VL's 32 vision blocks beside 28 text layers, DeepSeek-V3's extra MTP layer: the stated
    count is checked against the stack that could hold it, and only more than any holds is refused."""
    from fewbits.files.hf_dir import check_layer_count

    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(28)]
    names += [f"visual.blocks.{i}.attn.qkv.weight" for i in range(32)]
    check_layer_count("config.json", {"num_hidden_layers": 28}, names)
    check_layer_count("config.json", {"num_hidden_layers": 61},
                      [f"model.layers.{i}.mlp.up_proj.weight" for i in range(62)])
    with pytest.raises(FileFormatError, match="num_hidden_layers is 33, but the weights hold 32 layer"):
        check_layer_count("config.json", {"num_hidden_layers": 33}, names)


@pytest.mark.parametrize("edit, match", [
    (_set("num_attention_heads", 0), "config.json: num_attention_heads must be an integer"),
    (_set("tie_word_embeddings", False), "config.json: the model it describes has weights the directory does not hold: lm_head"),
])
def test_generate_names_config_json_for_a_plain_directory(root, tmp_path, edit, match):
    """The tokenizer builds the config too: a head count of 0 was reported as 'the tokenizer could
    not be loaded (ZeroDivisionError)'; layers the weights lack were filled at random."""
    src = tmp_path / "plain"
    shutil.copytree(_source(root, 64, 128), src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    rc, _, err = _run(["generate", str(src), "--prompt", "the", "--max-new-tokens", "2", "--quiet"])
    assert rc == 2 and re.search(match, err), err


def test_a_quantization_config_changed_after_the_write_is_refused(int4_dir, tmp_path):
    """int4 -> nf4 keeps the code layout, so the codes loaded through the nf4 codebook (logits 0.75
    off) without a word (the fuzzer's last silent load): each shard records the schemes it was
    written with."""
    from safetensors import safe_open

    bad = tmp_path / "bad"
    shutil.copytree(int4_dir, bad)
    with safe_open(str(bad / "model.safetensors"), "pt") as f:
        assert "fewbits_modules" in f.metadata()
    cfg = json.loads((bad / "config.json").read_text())
    qc = cfg["quantization_config"]
    (key,) = qc["schemes"]
    qc["schemes"][key]["format"] = "nf4"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileFormatError, match="config.json was changed after the model was written") as e:
        fb.from_pretrained(bad)
    assert str(e.value).startswith(str(bad / "config.json"))
