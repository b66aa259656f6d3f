"""The deployment path (`fewbits quantize ... --out`, files.conversion.convert, streaming,
hf_dir, the transformers quantizer, write_gguf) under hostile input: every bad source or target
is one clear error naming the problem, refused before the work where it can be, and nothing
partial is left beside the output (an existing output untouched)."""
import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import fewbits as fb  # noqa: E402
from fewbits.cli import main  # noqa: E402
from fewbits.files import FileFormatError  # noqa: E402
from fewbits.files import conversion, streaming  # noqa: E402
from fewbits.files.conversion import convert  # noqa: E402
from fewbits.models import synthetic_llama_config, write_synthetic_llama  # noqa: E402
from tiny_tokenizer import save_byte_level_bpe  # noqa: E402


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "llama"
    cfg = synthetic_llama_config("135m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=384)
    write_synthetic_llama(path, cfg, shard_bytes=40_000)  # six shards
    save_byte_level_bpe(path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(directory, name, make):
    """Replace tensor `name` in its shard by make(old tensor)."""
    from safetensors.torch import load_file, save_file

    shard = directory / json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = make(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})


def _edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def _no_quantizing(*args, **kwargs):
    raise AssertionError("quantized although the request was bad")


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,make,message", [
    ("model.layers.0.self_attn.q_proj.weight", lambda t: t[:32].clone(),
     r"q_proj\.weight \(model-0000\d-of-00006\.safetensors\): shape \[32, 64\] stored, .* gives \[64, 64\]"),
    ("model.norm.weight", lambda t: t[:63].clone(), r"model\.norm\.weight .*shape \[63\] stored"),
    ("model.layers.0.mlp.up_proj.weight", lambda t: t.to(torch.int32), r"up_proj\.weight .*int32 stored for a "
     "floating-point tensor"),
])
def test_a_shard_tensor_that_does_not_fit_the_config_is_refused_before_writing(llama, tmp_path, name, make, message):
    # was: quantized and written as it was (a directory that no loader accepts), exit 0
    bad = _copy(llama, tmp_path / "bad")
    _edit_tensor(bad, name, make)
    for method, calib in (("rtn", None), ("gptq", [{"input_ids": torch.arange(16)[None]}])):
        with pytest.raises(FileFormatError, match=message):
            convert(bad, tmp_path / "out", "int8", method=method, calibration=calib)
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_nan_weights_are_named_with_their_file(llama, tmp_path):
    # was: "x contains NaN or inf, ..." (RTN) / "W contains NaN or inf" (GPTQ): no tensor named
    bad = _copy(llama, tmp_path / "bad")

    def poison(t):
        t = t.clone()
        t[0, 0] = float("nan")
        return t
    _edit_tensor(bad, "model.layers.1.mlp.down_proj.weight", poison)
    for method, calib in (("rtn", None), ("gptq", [{"input_ids": torch.arange(16)[None]}])):
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight \(.*bad/model-0000\d-of-"
                                             r"00006\.safetensors\): .*NaN or inf"):
            convert(bad, tmp_path / "out", "q8_0", method=method, calibration=calib)
    assert sorted(os.listdir(tmp_path)) == ["bad"]


@pytest.mark.parametrize("changes", [{"hidden_size": -64}, {"vocab_size": 10 ** 12}])
def test_a_config_of_impossible_sizes_is_a_clear_error(llama, tmp_path, changes):
    # was: RuntimeError "negative dimension" / "can't allocate 256000000000000 bytes", exit 1 "unexpected"
    bad = _copy(llama, tmp_path / "bad")
    _edit_config(bad, **changes)
    rc, _, err = run(["quantize", str(bad), "--scheme", "int8", "--out", str(tmp_path / "out"), "--quiet"])
    key = next(iter(changes))
    assert rc == 2 and f"bad/config.json: {key} must be an integer from 1 to 2^31 - 1" in err, err
    assert "unexpected" not in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_a_missing_tensor_names_the_directory(llama, tmp_path):
    # was: "source: the weights lack ..." (the mapping has no .path)
    from safetensors.torch import load_file, save_file

    bad = _copy(llama, tmp_path / "bad")
    gone = "model.layers.1.mlp.down_proj.weight"
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"].pop(gone)
    save_file({k: v for k, v in load_file(shard).items() if k != gone}, shard, metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileFormatError, match=rf"^{bad}: the weights lack 1 tensor"):
        convert(bad, tmp_path / "out", "int8")


def test_gptq_or_a_budget_without_tokenizer_files_is_refused_clearly(llama, tmp_path):
    # was: "calibration data is empty" (transformers made up an empty tokenizer)
    bare = _copy(llama, tmp_path / "bare")
    for f in os.listdir(bare):
        if f.startswith("tokenizer"):
            os.remove(bare / f)
    for extra in (["--method", "gptq"], ["--budget", "6"]):
        rc, _, err = run(["quantize", str(bare), "--scheme", "int4", "--out", str(tmp_path / "out"), "--quiet",
                          *extra])
        assert rc == 2 and "no tokenizer files" in err and str(bare) in err, err
    assert sorted(os.listdir(tmp_path)) == ["bare"]


# ---------------------------------------------------------------------------------------------
# GGUF targets: refused before the work of quantizing
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def phi(tmp_path_factory, llama):
    """A model of an architecture GGUF export does not cover (Phi)."""
    path = tmp_path_factory.mktemp("src") / "phi"
    cfg = transformers.PhiConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=300)
    torch.manual_seed(0)
    transformers.PhiForCausalLM(cfg).save_pretrained(path)
    for f in os.listdir(llama):
        if f.startswith("tokenizer"):
            shutil.copy(llama / f, path / f)
    return path


def test_gguf_of_an_unsupported_architecture_is_refused_before_any_work(phi, tmp_path):
    # was: refused by write_gguf after the whole quantization (and, with --budget, after the
    # per-layer sensitivity measurement: 17 s on a 2-layer model)
    from fewbits.study import quantization as sq

    with mock.patch.object(streaming, "quantize_pretrained", _no_quantizing), \
            mock.patch.object(conversion, "quantize_pretrained", _no_quantizing), \
            mock.patch.object(sq, "allocate_for_budget", _no_quantizing):
        for extra in (["--scheme", "q8_0"], ["--budget", "6"]):
            rc, _, err = run(["quantize", str(phi), "--out", str(tmp_path / "m.gguf"), "--quiet", *extra])
            assert rc == 2 and "does not support the architecture PhiForCausalLM; supported: LlamaForCausalLM" in err
        with pytest.raises(ValueError, match="PhiForCausalLM"):
            convert(phi, tmp_path / "m.gguf", "q8_0")
    assert os.listdir(tmp_path) == []


def test_gguf_with_a_broken_tokenizer_names_the_source_before_any_work(llama, tmp_path):
    # was: refused after quantizing, naming the deleted staging directory
    # (".../.m.gguf.fewbits-convert-xxxx/model")
    bad = _copy(llama, tmp_path / "bad")
    (bad / "tokenizer.json").write_text("{garbage")
    with mock.patch.object(conversion, "quantize_pretrained", _no_quantizing):
        rc, _, err = run(["quantize", str(bad), "--scheme", "q8_0", "--out", str(tmp_path / "m.gguf"), "--quiet"])
    assert rc == 2 and f"cannot read a tokenizer from {str(bad)!r}" in err, err
    assert "fewbits-" not in err and sorted(os.listdir(tmp_path)) == ["bad"]


def test_gguf_into_a_directory_is_refused_before_any_work(llama, tmp_path):
    # was: refused by write_gguf after the quantization
    (tmp_path / "m.gguf").mkdir()
    (tmp_path / "m.gguf" / "keep").write_text("mine")
    with mock.patch.object(conversion, "quantize_pretrained", _no_quantizing):
        rc, _, err = run(["quantize", str(llama), "--scheme", "q8_0", "--out", str(tmp_path / "m.gguf"), "--overwrite",
                          "--quiet"])
        assert rc == 1 and "is a directory" in err
        with pytest.raises(FileNotFoundError, match="does not exist"):
            convert(llama, tmp_path / "nowhere" / "m.gguf", "q8_0")
    assert os.listdir(tmp_path) == ["m.gguf"] and os.listdir(tmp_path / "m.gguf") == ["keep"]


# ---------------------------------------------------------------------------------------------
# full disks and killed runs
# ---------------------------------------------------------------------------------------------
def _full_safetensors(*args, **kwargs):
    from safetensors import SafetensorError
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("out", ["q", "m.gguf", "m.safetensors"])
def test_a_full_disk_is_one_error_naming_the_output_and_the_old_output_stays(llama, tmp_path, out):
    # was: "SafetensorError: ... (unexpected; FEWBITS_TRACEBACK=1 shows where)", naming nothing
    target = tmp_path / out
    assert run(["quantize", str(llama), "--scheme", "q8_0", "--out", str(target), "--quiet"])[0] == 0
    before = {p: (target / p).read_bytes() for p in os.listdir(target)} if target.is_dir() else target.read_bytes()
    def full_disk(*args, **kwargs):  # hf_dir writes its shards itself
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch("safetensors.torch.save_file", _full_safetensors), \
            mock.patch("fewbits.files.hf_dir.write_safetensors", full_disk):
        rc, _, err = run(["quantize", str(llama), "--scheme", "q4_0", "--out", str(target), "--overwrite", "--quiet"])
    assert rc == 1 and f"cannot write {target}" in err and "No space left on device" in err, err
    assert "unexpected" not in err and "fewbits-tmp" not in err
    assert os.listdir(tmp_path) == [out]
    after = {p: (target / p).read_bytes() for p in os.listdir(target)} if target.is_dir() else target.read_bytes()
    assert after == before


def test_a_full_disk_while_the_gguf_is_written_names_the_file(llama, tmp_path):
    # was: "[Errno 28] No space left on device", no file named
    calls = []

    def full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, *args, **kwargs)
    write = gguf.GGUFWriter.write_tensor_data
    with mock.patch.object(gguf.GGUFWriter, "write_tensor_data", full):
        rc, _, err = run(["quantize", str(llama), "--scheme", "q8_0", "--out", str(tmp_path / "m.gguf"), "--quiet"])
    assert rc == 1 and f"cannot write {tmp_path / 'm.gguf'}: No space left on device" in err, err
    assert os.listdir(tmp_path) == []


def test_a_killed_conversion_leaves_its_staging_to_the_next_run(llama, tmp_path):
    # was: ".m.gguf.fewbits-convert-xxxx" and ".fewbits-source-xxxx" (a GGUF source's whole float
    # model) stayed forever after a SIGKILL; now they are locked temporaries of the output that
    # the next write of it removes
    out = tmp_path / "m.gguf"
    child = ("import os, sys\nfrom fewbits.files.conversion import scratch_directory\n"
             "work = scratch_directory(sys.argv[1]).__enter__()\n"
             "os.makedirs(os.path.join(work, 'model'))\n"
             "open(os.path.join(work, 'model', 'shard.safetensors'), 'wb').write(b'x' * 1000)\n"
             "os._exit(9)\n")
    subprocess.run([sys.executable, "-c", child, str(out)], check=False, timeout=60)
    assert len(os.listdir(tmp_path)) == 1 and os.listdir(tmp_path) != ["m.gguf"]  # the dead run's staging
    convert(llama, out, "q8_0")
    assert os.listdir(tmp_path) == ["m.gguf"]


# ---------------------------------------------------------------------------------------------
# crafted quantized directories
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized(tmp_path_factory, llama):
    path = tmp_path_factory.mktemp("q") / "q"
    convert(llama, path, "int4_g32")
    return path


@pytest.mark.parametrize("edit,message", [
    (("config", {"vocab_size": 1000}), r"model\.embed_tokens\.weight \(model\.safetensors\): shape \[384, 64\] "
                                       r"stored, the model's config\.json gives \[1000, 64\]"),
    (("config", {"vocab_size": 10 ** 12}), r"config\.json: vocab_size must be an integer from 1 to 2\^31 - 1"),
    (("tensor", "model.norm.weight", lambda t: t[:63].clone()), r"model\.norm\.weight .*shape \[63\] stored"),
    (("tensor", "model.norm.weight", lambda t: t.to(torch.int64)), r"model\.norm\.weight .*int64 stored"),
])
@pytest.mark.parametrize("loader", ["fb", "transformers"])
def test_a_quantized_directory_whose_float_tensors_do_not_fit_is_named(quantized, tmp_path, edit, message, loader):
    # was: transformers' "RuntimeError: You set `ignore_mismatched_sizes` to `False` ... look at the
    # above report!"
    from safetensors.torch import load_file, save_file

    bad = _copy(quantized, tmp_path / "bad")
    if edit[0] == "config":
        _edit_config(bad, **edit[1])
    else:
        tensors = load_file(bad / "model.safetensors")
        tensors[edit[1]] = edit[2](tensors[edit[1]])
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    load = fb.from_pretrained if loader == "fb" else transformers.AutoModelForCausalLM.from_pretrained
    with pytest.raises(FileFormatError, match=message):
        load(bad)
