"""Quantization measured on real models: quality against bits per parameter, size and speed.

A Subject is a real model with its own quality measure:
- MiniLM (all-MiniLM-L6-v2, genuine fp32 weights): mean cosine similarity of sentence
  embeddings to the fp32 model's, on real sentences from Python's pydoc topics (and Spearman
  agreement of their pairwise similarities);
- SmolLM2-135M (from a Q4_1 GGUF, dequantized to fp32): perplexity on the pydoc eval text.
  Its weights already sit on an asymmetric 4-bit grid with groups of 32 (fp16 scale and fp16
  minimum per group), which the q4_1 scheme reproduces bit for bit: no evidence of 4-bit quality
  (int4_asym_g32, with an integer zero point, is another grid);
- any Hugging Face model directory: a causal LM by perplexity, anything else by embeddings.

compare() quantizes a fresh copy of the model per scheme and returns one row per scheme with
at least scheme, bits_per_param, model_bytes, quality, quality_metric and throughput.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..quant import get_scheme
from ..quant.model import model_nbytes, quantize_model, resolve_plan

Q4_1_NOTE = ("SmolLM2's packaged weights are GGUF Q4_1 (asymmetric 4-bit, groups of 32, per group an fp16 "
             "scale and an fp16 minimum; the tied embedding Q8_0): the q4_1 scheme reproduces them bit for "
             "bit, so 4-bit results on this model are not evidence of 4-bit quality (MiniLM's genuine fp32 "
             "weights are).")


@dataclasses.dataclass
class Subject:
    """A real model under test. evaluate(model) -> {'quality': float, 'throughput': float, ...}."""

    name: str
    model: nn.Module
    quality_metric: str                     # "cosine" (higher is better) or "perplexity" (lower)
    evaluate: Callable[[nn.Module], dict]
    calibration: list                       # model inputs (dicts of kwargs) for GPTQ/sensitivity
    throughput_unit: str                    # "sentences/s" or "tokens/s"
    skip: tuple[str, ...] = ()
    note: str | None = None
    loss_fn: Callable | None = None         # loss_fn(output, batch) for sensitivity, if any

    @property
    def higher_is_better(self) -> bool:
        return self.quality_metric == "cosine"


# ---------------------------------------------------------------------------------------------
# subjects
# ---------------------------------------------------------------------------------------------
def _embedding_subject(name, model, tokenizer, n_eval: int, n_calib: int, note=None) -> Subject:
    from ..models.minilm import embed, embedding_quality
    from ..models.text import pydoc_sentences

    sentences = pydoc_sentences(n_eval + n_calib, seed=0)
    eval_s, calib_s = sentences[:n_eval], sentences[n_eval:]
    reference = embed(model, tokenizer, eval_s)
    calibration = sentence_calibration(tokenizer, calib_s)

    def evaluate(m):
        t0 = time.perf_counter()
        emb = embed(m, tokenizer, eval_s)
        dt = time.perf_counter() - t0
        q = embedding_quality(reference, emb)
        return {"quality": q.mean_cosine, "min_cosine": q.min_cosine, "spearman": q.spearman,
                "top1_agreement": q.top1_agreement, "throughput": len(eval_s) / dt, "eval_seconds": dt}

    return Subject(name, model, "cosine", evaluate, calibration, "sentences/s", note=note)


def minilm_subject(n_eval: int = 256, n_calib: int = 64) -> Subject:
    from ..models.minilm import load_minilm

    model, tokenizer = load_minilm()
    return _embedding_subject("all-MiniLM-L6-v2", model, tokenizer, n_eval, n_calib)


def _lm_subject(name, model, tokenizer, eval_tokens: int, calib_batches: int, seq_len: int, note=None,
                skip=()) -> Subject:
    # no skip list of its own: a tied lm_head stays in float by fewbits.quant's default (resolve_plan),
    # the same for the command line as for fb.quantize_model
    from ..models.smollm2 import perplexity
    from ..models.text import pydoc_split

    split = pydoc_split()
    calibration = causal_calibration(tokenizer, split.train, calib_batches, seq_len)

    def evaluate(m):
        t0 = time.perf_counter()
        r = perplexity(m, tokenizer, split.eval, seq_len=seq_len, max_tokens=eval_tokens)
        dt = time.perf_counter() - t0
        ppl = r if isinstance(r, float) else float(getattr(r, "perplexity", r))
        n_tok = getattr(r, "tokens", eval_tokens)
        return {"quality": ppl, "throughput": n_tok / dt, "eval_seconds": dt}

    def loss_fn(output, batch):
        logits = output.logits if hasattr(output, "logits") else output
        x = batch["input_ids"]
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))

    return Subject(name, model, "perplexity", evaluate, calibration, "tokens/s", skip=tuple(skip), note=note,
                   loss_fn=loss_fn)


CALIBRATION_SAMPLES = 8  # windows (causal LMs) or batches of 16 sentences (encoders)
CALIBRATION_LENGTH = 256  # tokens per window


def causal_calibration(tokenizer, text: str, batches: int = CALIBRATION_SAMPLES,
                       seq_len: int = CALIBRATION_LENGTH) -> list[dict]:
    """Calibration batches for a causal LM: the first `batches` consecutive windows of `seq_len`
    tokens of `text` (fewer where the text is shorter), without a KV cache."""
    # English takes ~4 characters a token: 8 a token leaves room for any tokenizer
    ids = tokenizer(text[:max(200_000, 8 * batches * seq_len)], return_tensors="pt")["input_ids"][0]
    return [{"input_ids": ids[i * seq_len:(i + 1) * seq_len].unsqueeze(0), "use_cache": False}
            for i in range(batches) if (i + 1) * seq_len <= ids.numel()]


def sentence_calibration(tokenizer, sentences, batch_size: int = 16) -> list[dict]:
    """GPTQ calibration batches for an encoder: the sentences, `batch_size` at a time, padded."""
    return [dict(tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=128,
                           return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]


def calibration_for_directory(source, text_file=None, batches: int = CALIBRATION_SAMPLES,
                              seq_len: int = CALIBRATION_LENGTH) -> list[dict]:
    """Calibration batches for the HF model directory `source`, from its own tokenizer: `batches`
    windows of `seq_len` tokens for a causal LM, `batches` batches of 16 sentences (lines)
    otherwise; the text is the file `text_file` or, by default, the training split of Python's
    pydoc topics."""
    if batches < 1 or seq_len < 16:
        raise ValueError(f"calibration needs at least 1 sample of at least 16 tokens, got {batches} x {seq_len}")
    from transformers import AutoTokenizer

    from ..models.text import pydoc_sentences, pydoc_split

    source = Path(source)
    arch = " ".join(json.loads((source / "config.json").read_text()).get("architectures") or [])
    _need_tokenizer(source, "GPTQ calibration")
    tokenizer = _load_part(source, "tokenizer", lambda: AutoTokenizer.from_pretrained(source, local_files_only=True))
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--calibration {text_file}: cannot read it as UTF-8 text ({e})") from None
        if not text.strip():
            raise ValueError(f"--calibration {text_file}: the file holds no text")
    if "CausalLM" in arch:
        calibration = causal_calibration(tokenizer, text if text_file is not None else pydoc_split().train, batches,
                                         seq_len)
        if not calibration:
            raise ValueError(f"--calibration {text_file or 'text'}: too short, fewer than {seq_len} tokens")
        return calibration
    lines = ([ln.strip() for ln in text.splitlines() if ln.strip()][:16 * batches] if text_file is not None
             else pydoc_sentences(16 * batches, seed=1))
    return sentence_calibration(tokenizer, lines)


def _need_tokenizer(source, what: str) -> None:
    """A ValueError when the directory holds no tokenizer files (transformers would otherwise
    make up an empty tokenizer, and the calibration would be empty)."""
    from ..files.hf_dir import TOKENIZER_FILES
    from ..files.streaming import tokenizer_files

    if tokenizer_files(str(source)) is None:
        raise ValueError(f"{source}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...): {what} turns "
                         "text into the model's tokens and needs them; add the model's tokenizer files")


GGUF_BUDGET_CANDIDATES = ("q8_0", "q6_k", "q5_k", "q4_k", "q5_0", "q4_0")
GGUF_LEGACY_CANDIDATES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def conversion_scheme(scheme: str, fmt: str) -> str:
    """The one resolution of a conversion's `--scheme` (fewbits quantize --out), made before the
    model is read: the canonical name -- a preset's ("q4k", "Q4-K" -> "q4_k"; "e4m3" -> "fp8") or a
    llama.cpp recipe's ("Q4_K_M" -> "q4_k_m") -- checked against the output format. For GGUF
    every preset with a GGUF block type is that type's llama.cpp recipe (its fallbacks for row
    lengths included: "q4k" is "q4_k", "w4a8" is written as "q4_0"); a preset without one (nf4,
    int8, fp8, ...) is refused here, and so is a llama.cpp mix for another format."""
    from ..files.gguf_blocks import gguf_block_type
    from ..files.gguf_file import MIXED_RECIPES, RECIPES
    from ..formats.names import normalize_name

    if not isinstance(scheme, str) or not scheme.strip():
        raise ValueError(f"--scheme needs a name, got {scheme!r}")
    recipe = {normalize_name(r): r for r in RECIPES}.get(normalize_name(scheme))
    if recipe in MIXED_RECIPES:
        if fmt != "gguf":
            raise ValueError(f"--scheme {scheme}: {recipe} is a llama.cpp mix of GGUF types: write it with "
                             "--format gguf (an OUT ending in .gguf)")
        return recipe
    try:
        preset = get_scheme(scheme)
    except ValueError as e:
        if fmt != "gguf":
            raise
        raise ValueError(f"{e}; with --format gguf also the llama.cpp mixes: {', '.join(MIXED_RECIPES)}") from None
    from ..files.standard_formats import STANDARD_FORMATS
    if fmt in STANDARD_FORMATS:
        try:
            STANDARD_FORMATS[fmt].scheme_args(preset)
        except ValueError as e:
            raise ValueError(f"--scheme {scheme}: {e}") from None
    if fmt != "gguf":
        return preset.name or scheme
    try:
        return gguf_block_type(preset).lower()
    except ValueError:
        raise ValueError(f"--scheme {scheme}: {preset.label} has no GGUF type, so it cannot be written with "
                         f"--format gguf; GGUF takes {', '.join(RECIPES)}; write {preset.label} with --format hf "
                         "or fewbits") from None


def conversion_plan(source, scheme: str | None, fmt: str, budget: float | None = None,
                    progress: Callable[[str], None] | None = None, embeddings: bool = False,
                    tied: str | None = None, vocabulary=None) -> dict:
    """What `fewbits quantize --out` quantizes: {"scheme", "rules", "embeddings", "tied", "types"}:
    the canonical scheme name (conversion_scheme), the rules, embeddings and tied of
    fewbits.files.conversion.convert, and for a llama.cpp recipe each module's GGML type with
    the reason it is not the recipe's own (gguf_file.gguf_recipe_types), else None.

    scheme: a preset for every Linear, or (GGUF) a llama.cpp mix such as q4_k_m, whose rules
    name every tensor's type, the token embedding included. budget: bits per parameter; the
    schemes are chosen per layer by measured sensitivity (among GGUF types for GGUF: the
    k-quants when every row length is a multiple of 256, else the legacy blocks). For GGUF a
    tied token embedding is quantized itself (llama.cpp reads the output head from it)."""
    from transformers import AutoConfig

    from ..files.gguf_file import gguf_recipe, gguf_recipe_types

    name = conversion_scheme(scheme, fmt) if scheme is not None else None
    if fmt == "gguf" and (embeddings or tied is not None):
        raise ValueError("embeddings and tied go with the hf and fewbits formats: for GGUF the recipe gives the "
                         "token embedding its type")
    from ..files.conversion import check_format_options
    from ..files.standard_formats import STANDARD_FORMATS
    check_format_options(fmt, embeddings, tied)
    if fmt != "gguf" and embeddings and (tied or "keep") == "keep" and _ties_embeddings(source):
        raise ValueError(f"{source}: the token embedding is the output layer's weight too (tie_word_embeddings), "
                         "so quantizing the embedding with tied 'keep' (--tied keep, the default) leaves both in "
                         "float; add --tied untie to quantize each")
    tied = "untie" if fmt == "gguf" else (tied or "keep")
    if budget is not None and not 1 <= budget <= 32:
        raise ValueError(f"--budget is in bits per parameter (1..32), got {budget}")
    if fmt == "gguf":  # an architecture, config or tokenizer the GGUF writer refuses: before any work
        from ..files.conversion import check_gguf_source
        check_gguf_source(source, vocabulary)  # vocabulary: a GGUF source's own (see convert)
    standard = STANDARD_FORMATS.get(fmt)
    if budget is not None and standard is not None and not standard.budget_candidates:
        raise ValueError(f"--budget chooses a scheme per layer, and --format {fmt} holds one scheme only "
                         f"({', '.join(standard.fitting_presets)}): give --scheme instead")
    if budget is not None:
        _need_tokenizer(source, "--budget (measuring each layer's sensitivity)")
        config = AutoConfig.from_pretrained(source)
        if fmt == "gguf":
            rows = {getattr(config, "hidden_size", 0), getattr(config, "intermediate_size", 0)}
            candidates = GGUF_BUDGET_CANDIDATES if all(r and r % 256 == 0 for r in rows) else GGUF_LEGACY_CANDIDATES
        else:
            own = standard.budget_candidates if standard is not None else BUDGET_CANDIDATES
            candidates = (name,) + own if name else own
            if standard is not None:  # the schemes the format holds on every layer's shape
                from ..files.streaming import model_skeleton
                shapes = {tuple(m.weight.shape) for m in model_skeleton(config).modules()
                          if isinstance(m, torch.nn.Linear)}
                candidates = tuple(c for c in candidates if standard.fits(c, shapes))
                if not candidates:
                    raise ValueError(f"--budget with --format {fmt}: no candidate scheme fits every layer shape "
                                     f"({', '.join('x'.join(map(str, s)) for s in sorted(shapes))})")
        subject = path_subject(source)
        allocation = allocate_for_budget(subject, list(dict.fromkeys(candidates)), budget, progress=progress)
        return {"scheme": None, "rules": dict(allocation["choices"]), "embeddings": embeddings, "tied": tied,
                "types": None}
    if name is None:
        raise ValueError("give --scheme NAME (or --budget BITS) with --out")
    if fmt == "gguf":  # llama.cpp's choice per tensor, its fallbacks included
        config = AutoConfig.from_pretrained(source)
        return {"scheme": name, "rules": gguf_recipe(name, config), "embeddings": True, "tied": tied,
                "types": gguf_recipe_types(name, config)}
    return {"scheme": name, "rules": name, "embeddings": embeddings, "tied": tied, "types": None}


def _ties_embeddings(source) -> bool:
    """Whether the model in directory `source` shares its token embedding with an output layer:
    a language-model head (a *ForCausalLM, *LMHeadModel or *ForMaskedLM architecture) and
    tie_word_embeddings, whose default in transformers is true."""
    try:
        cfg = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    heads = [a for a in cfg.get("architectures") or [] if isinstance(a, str)
             and a.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM"))]
    return bool(heads) and bool(cfg.get("tie_word_embeddings", True))


_FLOAT_GGML = ("F32", "F16", "BF16", "F64")


def written_types(types: dict, recipe_types: dict | None = None) -> list[dict]:
    """The GGML types a GGUF conversion wrote, most tensors first: [{"type", "count", "why"}],
    `types` as GGUFSummary.types ({type: tensor count}); `why` (or None) from the recipe's choices
    (conversion_plan's "types", gguf_file.RecipeChoice): a mix's rule, a row length that is not a
    multiple of the type's block (llama.cpp's fallback, or a matrix kept in float); float tensors
    that are no quantizable module are vectors (norms)."""
    choices = list((recipe_types or {}).values())
    floats = [t for t in types if t in _FLOAT_GGML]
    rows = []
    for t, n in sorted(types.items(), key=lambda kv: (-kv[1], kv[0])):
        if t in _FLOAT_GGML:
            kept = [c for c in choices if c.type is None and c.unfit is not None]
            where = "" if len(floats) == 1 else " (as " + "/".join(floats) + ")"
            parts = ["norms and other vectors"]
            if kept:
                parts.append(f"{len(kept)} {'matrix' if len(kept) == 1 else 'matrices'}{where} kept in float: "
                             + _unfit_text(kept, "no type of the recipe fits"))
            why = "; ".join(parts)
        else:
            mine = [c for c in choices if c.type == t]
            ruled = Counter(c.rule for c in mine if c.rule)
            parts = []
            if ruled:
                several = len(ruled) > 1 or len(ruled) < len(set(c.rule for c in mine))
                parts.append(", ".join(f"{r} ×{k}" if several else r for r, k in ruled.items()))
            unfit = [c for c in mine if c.unfit]
            if unfit:
                parts.append(_unfit_text(unfit, "llama.cpp's fallback")
                             + (f" (×{len(unfit)})" if len(unfit) < len(mine) else ""))
            why = "; ".join(parts) or None
        rows.append({"type": t, "count": n, "why": why})
    return rows


def _unfit_text(choices, outcome: str) -> str:
    """'rows of 64 and 128 are not a multiple of Q4_K's 256: llama.cpp's fallback'."""
    by_type: dict = {}
    for c in choices:
        by_type.setdefault((c.unfit, c.unfit_block), set()).add(c.row)
    return "; ".join(f"rows of {' and '.join(map(str, sorted(r)))} are not a multiple of {u}'s {b}: {outcome}"
                     for (u, b), r in by_type.items())


def written_types_text(rows: list[dict]) -> str:
    """'Q5_0 ×181 (rows of 576 are not ...: llama.cpp's fallback), Q4_K ×30, F32 ×61 (norms ...)'."""
    return ", ".join(f"{r['type']} ×{r['count']}" + (f" ({r['why']})" if r["why"] else "") for r in rows)


def smollm2_subject(eval_tokens: int = 4096, calib_batches: int = 8, seq_len: int = 256) -> Subject:
    from ..models.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    return _lm_subject("SmolLM2-135M (from Q4_1 GGUF)", model, tokenizer, eval_tokens, calib_batches, seq_len,
                       note=Q4_1_NOTE)


def path_subject(path: str | Path, eval_tokens: int = 4096) -> Subject:
    """A Hugging Face model directory (config.json + weights): causal LMs by perplexity,
    other models by embedding similarity."""
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        arch = " ".join(json.loads(cfg.read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg}: unreadable config ({e})") from None
    try:
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ImportError("loading a Hugging Face model needs transformers: pip install transformers") from None
    tokenizer = _load_part(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(path, local_files_only=True))
    if "CausalLM" in arch:
        model = _load_part(path, "model", lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True)).eval()
        return _lm_subject(path.name, model, tokenizer, eval_tokens, 8, 256)
    model = _load_part(path, "model", lambda: AutoModel.from_pretrained(
        path, dtype=torch.float32, local_files_only=True)).eval()
    return _embedding_subject(path.name, model, tokenizer, 256, 64)


def _load_part(path: Path, what: str, load: Callable):
    """load() of a user's model directory; a broken file there becomes one ValueError naming the
    directory and the part. transformers and tokenizers raise anything for a broken file (a
    JSONDecodeError, a KeyError, tokenizers' plain Exception, an OSError); a missing package stays
    an ImportError (it carries the pip hint)."""
    try:
        return load()
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        text = " ".join(str(exc).split()) or "no message"
        text = text if len(text) <= 300 else text[:300] + " ..."
        raise ValueError(f"{path}: the {what} could not be loaded ({type(exc).__name__}: {text})") from None


def get_subject(spec: str, quick: bool = False) -> Subject:
    if spec == "minilm":
        return minilm_subject(n_eval=96 if quick else 256, n_calib=32 if quick else 64)
    if spec == "smollm2":
        return smollm2_subject(eval_tokens=1024 if quick else 4096, calib_batches=4 if quick else 8)
    if Path(spec).exists():
        return path_subject(spec)
    raise ValueError(f"unknown model {spec!r}: use minilm, smollm2 or a path to a Hugging Face model directory")


# ---------------------------------------------------------------------------------------------
# measuring schemes
# ---------------------------------------------------------------------------------------------
def measure(subject: Subject, model: nn.Module, label: str, scheme_name: str | None,
            bits_per_param_of_layers: float | None = None) -> dict:
    sizes = model_nbytes(model)
    ev = subject.evaluate(model)
    row = {"scheme": label, "scheme_name": scheme_name, "bits_per_param": sizes["bits_per_param"],
           "model_bytes": sizes["total"], "quantized_bytes": sizes["quantized"],
           "quality_metric": subject.quality_metric, "throughput_unit": subject.throughput_unit}
    if bits_per_param_of_layers is not None:
        row["layer_bits_per_param"] = bits_per_param_of_layers
    row.update(ev)
    return row


def layer_bits(model: nn.Module, plan: dict) -> float:
    """Bits per parameter over the quantized layers only (codes + scales)."""
    n = b = 0
    for name, scheme in plan.items():
        w = model.get_submodule(name).weight
        n += w.numel()
        b += scheme.nbytes(w.shape) * 8
    return b / n if n else float("nan")


def compare(subject: Subject, schemes: Sequence[str], method: str = "rtn",
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """fp32 first, then one row per scheme; every model is a fresh copy of the fp32 one."""
    say = progress or (lambda msg: None)
    say(f"{subject.name}: fp32 baseline")
    rows = [measure(subject, subject.model, "fp32", None)]
    for name in schemes:
        scheme = get_scheme(name)
        say(f"{subject.name}: {scheme.label} ({method})")
        model = copy.deepcopy(subject.model)
        plan = resolve_plan(model, scheme, skip=subject.skip)
        lb = layer_bits(model, plan)
        t0 = time.perf_counter()
        quantize_model(model, scheme, skip=subject.skip, method=method,
                       calibration=subject.calibration if method != "rtn" else None)
        row = measure(subject, model, scheme.label, name, lb)
        row["method"] = method
        row["quantize_seconds"] = time.perf_counter() - t0
        rows.append(row)
        del model
    return rows


def plot_quality_vs_bits(rows: list[dict], subject: Subject, path: str | Path) -> Path:
    """Quality against bits per parameter of the quantized layers, one point per scheme."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: the caller's backend stays
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    base = rows[0]
    markers = "osD^v<>pPX*h"
    for i, r in enumerate(rows[1:]):  # a legend, not labels: points at nearly equal bits overlap
        x = r.get("layer_bits_per_param", r["bits_per_param"])
        ax.scatter(x, r["quality"], s=42, zorder=3, marker=markers[i % len(markers)],
                   label=f"{r.get('scheme_name') or r['scheme']} ({x:.3g} b)")
    ax.axhline(base["quality"], color="k", lw=1, ls="--", label=f"fp32 ({base['quality']:.4g})")
    ax.set_xlabel("bits per parameter of the quantized layers (scales included)")
    ax.set_ylabel(f"{subject.quality_metric} ({'higher' if subject.higher_is_better else 'lower'} is better)")
    if not subject.higher_is_better:
        ax.set_yscale("log")
    ax.set_title(f"{subject.name}: quality against bits")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    if subject.note:
        fig.text(0.01, 0.01, subject.note, fontsize=6.5, wrap=True)
    fig.tight_layout(rect=(0, 0.05 if subject.note else 0, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


BUDGET_CANDIDATES = ("int8", "int4_g32", "int4", "int3", "int2")


def allocate_for_budget(subject: Subject, candidates: Sequence[str], budget_bits: float,
                        progress: Callable[[str], None] | None = None, calib_batches: int = 2) -> dict:
    """Per-layer schemes that fit `budget_bits` per parameter (stored bits of the quantized
    layers) with the least predicted quality loss; applied to a copy and measured.

    Returns {'row': a compare() row, 'choices': {layer: scheme}, 'predicted': ..., 'measured': ...}.
    """
    from ..quant.sensitivity import allocate_bits, apply_allocation, layer_sensitivity

    say = progress or (lambda msg: None)
    model = copy.deepcopy(subject.model)
    calib = subject.calibration[:calib_batches]
    say(f"{subject.name}: per-layer sensitivity of {', '.join(candidates)} on {len(calib)} batches")
    table = layer_sensitivity(model, list(candidates), calib, loss_fn=subject.loss_fn, skip=subject.skip)
    allocation = allocate_bits(table, budget_bits_per_param=budget_bits,
                               metric="loss" if table.has_loss else "sqnr")
    say(f"{subject.name}: applying the allocation ({allocation.bits_per_param:.3f} bits/param)")
    t0 = time.perf_counter()
    report = apply_allocation(model, allocation, data=calib, loss_fn=subject.loss_fn)
    row = measure(subject, model, f"allocated (≤{budget_bits:g} bits)", f"alloc≤{budget_bits:g}",
                  report.measured_bits_per_param)
    row["method"] = "rtn"
    row["quantize_seconds"] = time.perf_counter() - t0
    return {"row": row, "budget_bits_per_param": budget_bits, "choices": dict(allocation.choices),
            "scheme_counts": allocation.scheme_counts(), "predicted": allocation.to_dict(),
            "measured": report.to_dict()}
