"""Streamed quantization (fewbits.files.streaming): a model quantized from disk tensor by tensor,
or decoder layer by decoder layer for GPTQ, equals the same model quantized in memory bit for
bit; bad sources are clear errors that leave nothing behind."""
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fewbits as fb  # noqa: E402
from fewbits.files import FileFormatError  # noqa: E402
from fewbits.files.hf_dir import read_tensors, save_pretrained  # noqa: E402
from fewbits.files.streaming import quantize_pretrained  # noqa: E402
from fewbits.models import synthetic_llama_config, write_synthetic_llama  # noqa: E402


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    sa, sb = a.state_dict(), b.state_dict()
    return (a.scheme == b.scheme and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and sa.keys() == sb.keys()
            and all(torch.equal(sa[k], sb[k]) for k in sa))


def assert_same_directories(x, y):
    a, b = read_tensors(x), read_tensors(y)
    assert set(a) == set(b)
    differ = [k for k in a if not _same(a[k], b[k])]
    assert not differ, differ
    cx = json.loads((x / "config.json").read_text())["quantization_config"]
    cy = json.loads((y / "config.json").read_text())["quantization_config"]
    assert cx["modules"] == cy["modules"]


def _llama(tmp_path_factory, hidden, inter, tied=True, dtype=torch.bfloat16):
    path = tmp_path_factory.mktemp("src") / "llama"
    cfg = synthetic_llama_config("135m", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                                 tie_word_embeddings=tied)
    write_synthetic_llama(path, cfg, dtype=dtype, shard_bytes=1 << 20)  # several shards
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama(tmp_path_factory, 64, 128)


@pytest.fixture(scope="module")
def llama_untied(tmp_path_factory):
    return _llama(tmp_path_factory, 256, 512, tied=False)


def _calibration(n=2, length=32, vocab=384):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (1, length), generator=g), "use_cache": False} for _ in range(n)]


def _in_memory(src, out, scheme, method, calibration=None, **kw):
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fb.quantize_model(model, scheme, method=method, calibration=calibration, **kw)
    save_pretrained(model, out)


@pytest.mark.parametrize("method,scheme", [("rtn", "int4"), ("rtn", "q4_0"), ("gptq", "int4"), ("gptq", "int8"),
                                           ("imatrix", "q4_0"), ("imatrix", "int4_g32")])
def test_streamed_equals_in_memory_bit_for_bit(llama, tmp_path, method, scheme):
    calibration = _calibration() if method != "rtn" else None
    summary = quantize_pretrained(llama, tmp_path / "streamed", scheme, method=method, calibration=calibration,
                                  dtype=torch.float32, max_shard_bytes=1 << 16)
    _in_memory(llama, tmp_path / "memory", scheme, method, calibration)
    assert_same_directories(tmp_path / "streamed", tmp_path / "memory")
    assert summary.layers == 14 and summary.peak_rss_bytes > 0
    assert (tmp_path / "streamed" / "model.safetensors.index.json").is_file()  # several output shards


@pytest.mark.parametrize("method", ["rtn", "gptq", "imatrix"])
def test_streamed_k_quants_and_an_untied_head_after_the_blocks(llama_untied, tmp_path, method):
    """lm_head of an untied model lies after the blocks: streamed GPTQ measures its Hessian (and
    imatrix its importance) from the blocks' recorded outputs, as the in-memory pass does from
    running them."""
    calibration = _calibration() if method != "rtn" else None
    rules = {"*mlp*": "q4_k", "*": "q6_k"}
    quantize_pretrained(llama_untied, tmp_path / "streamed", rules, method=method, calibration=calibration,
                        dtype=torch.float32)
    _in_memory(llama_untied, tmp_path / "memory", rules, method, calibration)
    assert_same_directories(tmp_path / "streamed", tmp_path / "memory")
    assert "lm_head" in json.loads((tmp_path / "streamed" / "config.json").read_text())["quantization_config"]["modules"]


@pytest.mark.parametrize("method", ["imatrix", "gptq"])
def test_streamed_imatrix_and_gptq_weigh_a_tied_embedding_by_its_heads_input(llama, tmp_path, method):
    """A tied embedding (GGUF's token_embd, llama.cpp's output head too) is weighed by the head's
    input: streamed, the head runs on the loaded embedding after the blocks; the result equals
    the in-memory one, differs from plain RTN's, and the output stays tied. GPTQ rounds it as
    imatrix does (one float pass first; the embedding has no Hessian of its own)."""
    rules = {"model.embed_tokens": "q4_0", "model.layers.*": "q4_0"}  # as the GGUF recipes: no lm_head rule
    calibration = _calibration()
    kw = {"embeddings": True, "tied": "untie"}
    quantize_pretrained(llama, tmp_path / "streamed", rules, method=method, calibration=calibration,
                        dtype=torch.float32, **kw)
    _in_memory(llama, tmp_path / "memory", rules, method, calibration, **kw)
    assert_same_directories(tmp_path / "streamed", tmp_path / "memory")
    quantize_pretrained(llama, tmp_path / "rtn", rules, dtype=torch.float32, **kw)
    weighted, plain = read_tensors(tmp_path / "streamed"), read_tensors(tmp_path / "rtn")
    assert "model.embed_tokens.weight" in weighted and "lm_head.weight" not in weighted
    assert not _same(weighted["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "streamed" / "config.json").read_text()).get("tie_word_embeddings", True)
    if method == "gptq":
        quantize_pretrained(llama, tmp_path / "imatrix", rules, method="imatrix", calibration=calibration,
                            dtype=torch.float32, **kw)
        assert _same(weighted["model.embed_tokens.weight"], read_tensors(tmp_path / "imatrix")["model.embed_tokens.weight"])


def test_the_output_loads_and_keeps_the_source_dtype(llama, tmp_path):
    quantize_pretrained(llama, tmp_path / "q", "int8")
    tensors = read_tensors(tmp_path / "q")
    assert tensors["model.norm.weight"].dtype == torch.bfloat16  # float tensors as the source holds them
    qt = tensors["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(qt, fb.QuantizedTensor) and qt.dtype == torch.bfloat16
    model = fb.from_pretrained(tmp_path / "q")
    ids = torch.arange(12).unsqueeze(0)
    assert torch.isfinite(model(ids).logits).all()


def test_a_tied_head_untied_on_purpose_is_written_with_its_own_weight(llama, tmp_path):
    quantize_pretrained(llama, tmp_path / "q", "int8", tied="untie")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and "lm_head" in cfg["quantization_config"]["modules"]
    assert isinstance(read_tensors(tmp_path / "q")["lm_head.weight"], fb.QuantizedTensor)


def test_bad_sources_are_clear_errors_and_leave_nothing(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileFormatError, match="no config.json"):
        quantize_pretrained(tmp_path, tmp_path / "out", "int8")
    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    gone = "model.layers.1.mlp.up_proj.weight"
    shard = broken / index["weight_map"].pop(gone)
    kept = {k: v for k, v in load_file(shard).items() if k != gone}
    save_file(kept, shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileFormatError, match=r"lack 1 tensor.*layers\.1\.mlp\.up_proj\.weight"):
        quantize_pretrained(broken, tmp_path / "out", "int8")
    with pytest.raises(ValueError, match="no layer matched"):
        quantize_pretrained(llama, tmp_path / "out", {"nothing*": "int8"})
    with pytest.raises(ValueError, match="calibration"):
        quantize_pretrained(llama, tmp_path / "out", "int8", method="gptq")
    with pytest.raises(ValueError, match="method must be"):
        quantize_pretrained(llama, tmp_path / "out", "int8", method="awq")
    # GPTQ's options are checked before the calibration passes start (a tied embedding first
    # costs a whole streamed pass)
    with pytest.raises(ValueError, match="shrink must be a number in"):
        quantize_pretrained(llama, tmp_path / "out", "int8", method="gptq", calibration=[object()], shrink=2)
    with pytest.raises(TypeError, match="unexpected options for gptq: shrinkage"):
        quantize_pretrained(llama, tmp_path / "out", "int8", method="gptq", calibration=[object()], shrinkage=0.3)
    assert not os.path.exists(tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        quantize_pretrained(llama, tmp_path / "out", "int8")


def test_an_interrupted_run_leaves_nothing_that_looks_finished(llama, tmp_path):
    def stop(done, total, name):
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_pretrained(llama, tmp_path / "out", "int8", progress=stop)
    assert os.listdir(tmp_path) == []
