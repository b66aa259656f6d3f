"""`fewbits study`: run every experiment on the built-in real models and write the report.

    study = run_study(out="fewbits-report", quick=False, parts=PARTS, model=None)

Parts (each a function of a StudyContext returning a PartOutput: figures, tables, numbers):
  formats  every format's range and precision, its bit layout, and one number in every format
  memory   memory of a model per format and per training policy: estimated and measured
  speed    matmul throughput per dtype and rounding throughput per format, on this machine
  quant    real models quantized under each scheme: quality against bits per parameter
  train    a small model trained under each precision policy: loss, underflow, lost updates

A part that fails (a missing optional package, an error) is reported as failed with its error
in the report; the other parts still run and the report is still written. Progress lines go
to stderr throughout. `quick` shrinks every part to fit a first contact (a few minutes on 2
cores): MiniLM only, fewer schemes, policies and steps, short speed probes.
"""
from __future__ import annotations

import datetime
import math
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._version import __version__
from ..progress import Every, Lines
from .report import write_report

PARTS = ("formats", "memory", "speed", "quant", "train")
DEFAULT_OUT = "fewbits-report"

# what each part runs, full and quick
EXPLAIN_NUMBERS = (0.3952, math.pi)
MEMORY_SCHEMES = ("fp32", "bf16", "int8", "int4", "nf4_dq", "mxfp4", "nvfp4")
MEMORY_POLICIES = ("fp32", "bf16-mixed", "bf16-pure", "fp8-hybrid", "bf16-mixed-8bit-adam")
MEASURED_SCHEMES = ("fp32", "bf16")
MEASURED_POLICIES = ("fp32", "bf16-mixed", "bf16-pure")
ROUND_FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "nf4", "int8")
QUANT_SCHEMES = ("int8", "fp8_channel", "mxfp8", "mxfp6", "int4", "int4_asym", "nf4", "nf4_dq", "mxfp4", "nvfp4",
                 "int3")
QUANT_SCHEMES_QUICK = ("int8", "int4", "nf4", "mxfp4")
SMOLLM2_GRID_SCHEME = "int4_asym_g32"  # reproduces SmolLM2's Q4_1 weights: shown, flagged
# SmolLM2 evaluates ~20x slower than MiniLM: the 8-bit schemes (fair on its weights), a few 4-bit
# ones (flattered by its Q4_1 grid) and the grid itself, on 2048 tokens
SMOLLM2_SCHEMES = ("int8", "fp8_channel", "mxfp8", "int4", "nf4", "mxfp4", "nvfp4", SMOLLM2_GRID_SCHEME)
SMOLLM2_EVAL_TOKENS = 2048
QUANT_BUDGET_BITS = 4.5
TRAIN_POLICIES = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-mixed-unscaled", "fp8-hybrid", "fp8-hybrid-unscaled",
                  "fp8-rowwise", "mxfp8", "int8-mixed", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan")
# the step speed of the GPT LM of `fewbits train --task lm` (where the matmuls dominate) per policy
LM_SPEED_POLICIES = ("bf16-mixed", "int8-mixed", "int8-mixed-gw8", "fp8-hybrid", "fp8-rowwise")
LM_SPEED_ROUNDS = 3
TRAIN_POLICIES_QUICK = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-mixed-unscaled", "bf16-pure")
TRAIN_STEPS, TRAIN_STEPS_QUICK = 300, 120
HISTOGRAM_POLICY = "fp16-mixed-unscaled"


# ---------------------------------------------------------------------------------------------
# what a part returns
# ---------------------------------------------------------------------------------------------
@dataclass
class PartOutput:
    """Figures (PNG files in the output directory), tables (raw rows + a display format per
    column), numbers (anything else worth keeping), notes, warnings (a sub-step that failed) and
    highlights (one-line findings for the top of the report), in the order they were added."""
    figures: list[dict] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    highlights: list[str] = field(default_factory=list)
    order: list[tuple[str, int]] = field(default_factory=list)

    def figure(self, file: str, title: str, caption: str = "") -> None:
        self.figures.append({"file": file, "title": title, "caption": caption})
        self.order.append(("figure", len(self.figures) - 1))

    def table(self, title: str, columns: Sequence[tuple[str, str, str]], rows: list[dict], note: str = "") -> None:
        """columns: (row key, label, display format: text, int, num, f3, pct, x, bytes, ms, ...)."""
        self.tables.append({"title": title, "columns": [{"key": k, "label": lab, "format": f} for k, lab, f in columns],
                            "rows": rows, "note": note})
        self.order.append(("table", len(self.tables) - 1))

    def as_dict(self) -> dict:
        return {"figures": self.figures, "tables": self.tables, "numbers": self.numbers, "notes": self.notes,
                "warnings": self.warnings, "highlights": self.highlights, "order": self.order}


class Progress(Lines):
    """Prints '[fewbits study 1:23] message' lines to a stream (stderr by default)."""

    def __init__(self, stream=None, enabled: bool = True):
        super().__init__("fewbits study", stream, enabled, clock=True)


@dataclass
class StudyContext:
    out: Path
    quick: bool
    model: str | None
    say: Callable[[str], None]
    subjects: dict = field(default_factory=dict)

    def subject(self, spec: str):
        """A quantization Subject (model, tokenizer-based evaluation, calibration), loaded once."""
        if spec not in self.subjects:
            from . import quantization as sq

            self.say(f"loading {spec}")
            if spec == "smollm2" and not self.quick:
                self.subjects[spec] = sq.smollm2_subject(eval_tokens=SMOLLM2_EVAL_TOKENS, calib_batches=4)
            else:
                self.subjects[spec] = sq.get_subject(spec, quick=self.quick)
        return self.subjects[spec]

    def model_specs(self) -> list[str]:
        if self.model:
            return [self.model]
        return ["minilm"] if self.quick else ["minilm", "smollm2"]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_") or "model"


# ---------------------------------------------------------------------------------------------
# part 1: formats
# ---------------------------------------------------------------------------------------------
def part_formats(ctx: StudyContext) -> PartOutput:
    from ..formats import IntFormat, list_formats
    from ..formats.explanation import explain, format_summary
    from .figures import save_explain_figure, save_formats_figure

    out = PartOutput()
    fmts = list_formats()
    ctx.say(f"formats: {len(fmts)} formats, bit layouts")
    save_formats_figure(fmts, ctx.out / "formats.png")
    out.figure("formats.png", "Bit layouts and where the values lie",
               "Left: one box per bit (sign, exponent, mantissa; integers and codebooks as one field). Right: "
               "the positive values of each format on a log scale: every value as a tick for 8-bit and smaller "
               "formats, the density of values for 16-bit ones, the range for wider ones.")
    rows = []
    for f in fmts:
        s = format_summary(f)
        rows.append({"format": s["name"], "bits": s["bits"], "layout": s["layout"], "max": s["max"],
                     "min_normal": s["min_normal"], "min_subnormal": s["min_subnormal"], "eps": s["eps"],
                     "decimal_digits": s["decimal_digits"], "num_values": s["num_values"],
                     "bytes_per_billion": s["bytes_per_billion"], "specials": s["specials_description"],
                     "description": s["description"]})
    out.table("Every format", [
        ("format", "format", "text"), ("bits", "bits", "int"), ("layout", "layout", "text"), ("max", "max", "num"),
        ("min_normal", "min normal", "num"), ("min_subnormal", "min subnormal", "num"), ("eps", "eps", "num"),
        ("decimal_digits", "digits", "f1"), ("num_values", "finite values", "int"),
        ("bytes_per_billion", "10^9 values", "bytes"), ("specials", "specials", "text")], rows,
        "layout: sign-exponent-mantissa bits; int/uint: integers (a quantizer adds the scale); codebook: an index "
        "into a table of values. min normal: for integers and codebooks, the smallest positive value. eps: the "
        "gap between 1 and the next value. digits: decimal digits of precision. 10^9 values: storage without scales.")
    out.numbers["formats"] = rows
    explain_formats = [f.name for f in fmts if not isinstance(f, IntFormat)] + \
        [f.name for f in fmts if isinstance(f, IntFormat) and f.name in ("int4", "int8")]
    for x in EXPLAIN_NUMBERS:
        ctx.say(f"formats: {x!r} in every format")
        records = explain(x, explain_formats)
        name = "pi" if x == math.pi else _slug(repr(x))
        file = f"explain_{name}.png"
        save_explain_figure(records, ctx.out / file)
        label = "π" if x == math.pi else repr(x)
        out.figure(file, f"{label} in every format",
                   "Each bar is the relative error of the nearest value (round to nearest, ties to even) in that "
                   "format, on a log scale; the label is the value stored. Colour says what happened: exact, "
                   "rounded, saturated to the largest value, flushed to zero.")
        erows = [{"format": r["format"], "value": r["value"], "value_text": _value_text(r["value"]),
                  "abs_error": r["abs_error"], "rel_error": r["rel_error"], "status": r["status"],
                  "bits": r["bits"], "hex": r["hex"]} for r in records]
        out.numbers[f"explain_{name}"] = erows
        if x == EXPLAIN_NUMBERS[0]:
            out.table(f"{label} in every format", [
                ("format", "format", "text"), ("value_text", "stored value", "text"),
                ("abs_error", "abs error", "sci"), ("rel_error", "rel error", "sci"), ("status", "status", "text"),
                ("bits", "bits (sign|exponent|mantissa)", "text"), ("hex", "code", "text")], erows,
                "Every float format, nf4, and int4/int8 for the integers: they carry no scale here, so 0.3952 "
                "becomes 0 (a quantizer divides by a scale first: see the quantization part). `fewbits explain X` "
                "prints this table for any number and every format.")
            by = {r["format"]: r for r in erows}
            if "fp8_e4m3" in by and "bf16" in by:
                e4, b16 = by["fp8_e4m3"], by["bf16"]
                out.highlights.append(f"{label} is stored as {e4['value_text']} in fp8_e4m3 "
                                      f"({e4['rel_error']:.1%} off) and as {b16['value_text']} in bf16 "
                                      f"({b16['rel_error']:.2%} off).")
    return out


def _value_text(v: float) -> str:
    s = repr(float(v))
    return s[:-2] if s.endswith(".0") else s


# ---------------------------------------------------------------------------------------------
# part 2: memory
# ---------------------------------------------------------------------------------------------
def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _memory_inputs(subject, training: bool) -> dict:
    """A calibration batch of the subject as forward kwargs; causal LMs train on their own ids."""
    batch = dict(subject.calibration[0])
    if subject.quality_metric == "perplexity" and training:
        batch.update(labels=batch["input_ids"], use_cache=False)
    return batch


def _memory_row(label: str, est, measured) -> dict:
    row = {"precision": label, "bits_per_param": est.weight_bits, "estimated": est.total, "peak_phase": est.peak_phase,
           "measured": None if measured is None else measured.peak, "error": None}
    row.update({k: est.components.get(k, 0) for k in ("weights", "master_weights", "gradients", "optimizer_states",
                                                        "activations", "kv_cache", "workspace")})
    row["at_peak"] = dict(est.at_peak)
    if measured is not None:
        row["error"] = (est.total - measured.peak) / measured.peak
    return row


def part_memory(ctx: StudyContext) -> PartOutput:
    import copy

    from ..memory import estimate_memory, measure_inference, measure_training_step

    out = PartOutput()
    ctx.say("memory: reference tables (1B and 7B parameters)")
    ref = []
    for s in MEMORY_SCHEMES:
        est = estimate_memory("1B", scheme=s)
        ref.append({"precision": s, "bits_per_param": est.weight_bits, "weights": est.weights})
    train_ref = []
    for p in MEMORY_POLICIES:
        est = estimate_memory("7B", mode="training", policy=p)
        train_ref.append({"precision": p, "weights": est.weights, "master_weights": est.master_weights,
                          "gradients": est.gradients, "optimizer_states": est.optimizer_states, "total": est.total})
    out.numbers["per_billion_inference"] = ref
    out.numbers["7b_training"] = train_ref
    for spec in ctx.model_specs():
        try:
            subject = ctx.subject(spec)
        except Exception as exc:  # noqa: BLE001 - one model failing leaves the others
            out.warnings.append(f"{spec}: could not be loaded ({type(exc).__name__}: {exc})")
            continue
        ids = subject.calibration[0]["input_ids"]
        batch, seq = int(ids.shape[0]), int(ids.shape[1])
        avail = _available_memory()
        inf_rows, train_rows = [], []
        for s in MEMORY_SCHEMES:
            est = estimate_memory(subject.model, scheme=s, batch=batch, seq_len=seq)
            measured = None
            if s in MEASURED_SCHEMES and (avail is None or est.total < 0.5 * avail):
                ctx.say(f"memory: {subject.name} inference, {s}: measuring")
                measured = measure_inference(copy.deepcopy(subject.model), _memory_inputs(subject, False), scheme=s)
            inf_rows.append(_memory_row(s, est, measured))
        for p in MEMORY_POLICIES:
            est = estimate_memory(subject.model, mode="training", policy=p, batch=batch, seq_len=seq)
            measured = None
            if p in MEASURED_POLICIES and (avail is None or est.total < 0.5 * avail):
                ctx.say(f"memory: {subject.name} training step, {p}: measuring")
                model = copy.deepcopy(subject.model)
                try:
                    measured = measure_training_step(model, _memory_inputs(subject, True), p)
                finally:
                    del model
            train_rows.append(_memory_row(p, est, measured))
        slug = _slug(spec if not os.path.exists(spec) else Path(spec).name)
        file = f"memory_{slug}.png"
        from .charts import save_memory_figure

        save_memory_figure([
            {"title": f"inference: a forward pass over {batch} × {seq} tokens", "rows": [
                {"label": r["precision"], "at_peak": r["at_peak"], "measured": r["measured"]} for r in inf_rows]},
            {"title": f"training: one AdamW step on {batch} × {seq} tokens", "rows": [
                {"label": r["precision"], "at_peak": r["at_peak"], "measured": r["measured"]} for r in train_rows]},
        ], ctx.out / file, title=f"{subject.name}: memory at the peak, estimated (bars) and measured (◆)")
        out.figure(file, f"{subject.name}: memory per format and per training policy",
                   "Each bar stacks what is alive at the estimated peak; the diamond is the peak measured from "
                   "torch's CPU allocator while the same forward pass or training step ran.")
        cols_inf = [("precision", "format / scheme", "text"), ("bits_per_param", "bits/param", "f3"),
                    ("weights", "weights", "bytes"), ("activations", "activations", "bytes"),
                    ("kv_cache", "KV cache", "bytes"), ("workspace", "workspace", "bytes"),
                    ("estimated", "estimated", "bytes"), ("measured", "measured", "bytes"),
                    ("error", "error", "pct")]
        out.table(f"{subject.name}: inference over {batch} × {seq} tokens", cols_inf, inf_rows,
                  "estimated and measured: the peak; error: (estimated − measured) / measured. Quantization schemes: "
                  "the linear layers quantized (scales included), the rest in bf16. Measured only where torch runs "
                  "the format natively (fp32, bf16); — : not measured.")
        cols_train = [("precision", "policy", "text"), ("weights", "weights", "bytes"),
                      ("master_weights", "master", "bytes"), ("gradients", "gradients", "bytes"),
                      ("optimizer_states", "optimizer", "bytes"), ("activations", "activations", "bytes"),
                      ("estimated", "estimated", "bytes"), ("measured", "measured", "bytes"),
                      ("error", "error", "pct"), ("peak_phase", "peak during", "text")]
        out.table(f"{subject.name}: one training step (AdamW) on {batch} × {seq} tokens", cols_train, train_rows,
                  "Components in full; the peak is the largest sum alive at once over the step's phases. Mixed "
                  "policies run as fp32 parameters under torch.autocast; pure ones store the model in bf16.")
        out.numbers[slug] = {"model": subject.name, "batch": batch, "seq_len": seq, "inference": inf_rows,
                             "training": train_rows}
        worst = [r for r in inf_rows + train_rows if r["error"] is not None]
        if worst:
            w = max(worst, key=lambda r: abs(r["error"]))
            out.highlights.append(f"{subject.name}: memory estimated within {abs(w['error']):.1%} of the measured "
                                  f"peak in all {len(worst)} measured cases (worst: {w['precision']}).")
    out.table("Weights of 10^9 parameters", [("precision", "format / scheme", "text"),
                                            ("bits_per_param", "bits/param", "f3"), ("weights", "weights", "bytes")],
              ref, "Scale overhead included: nf4_dq 4.127 bits (double-quantized scales), mxfp4 4.25, nvfp4 4.5.")
    out.table("Training a 7B model: the state alone (AdamW)", [
        ("precision", "policy", "text"), ("weights", "weights", "bytes"), ("master_weights", "master", "bytes"),
        ("gradients", "gradients", "bytes"), ("optimizer_states", "optimizer", "bytes"),
        ("total", "total (peak)", "bytes")], train_ref,
        "A bare parameter count: no activations. Mixed precision keeps fp32 weights and states (autocast "
        "recasts to bf16 on the fly); only pure bf16 or 8-bit optimizer states shrink the state.")
    return out


# ---------------------------------------------------------------------------------------------
# part 3: speed
# ---------------------------------------------------------------------------------------------
_TORCH_CASTS = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _best_seconds(fn, budget_s: float, min_calls: int = 3) -> float:
    best = math.inf
    start = time.perf_counter()
    calls = 0
    while calls < min_calls or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        calls += 1
        if calls >= 200:
            break
    return best


def rounding_speed(formats: Sequence[str], modes: Sequence[str], n: int, budget_s: float,
                   progress: Callable[[str], None] | None = None) -> tuple[list[dict], float]:
    """fb.round throughput (million values per second) of n float32 values into each format and
    mode, written into a preallocated buffer, beside torch's own cast where torch has the dtype.
    The first call is timed apart (it compiles the kernel). Returns (rows, copy Melem/s)."""
    from .. import kernels

    say = progress or (lambda m: None)
    gen = torch.Generator().manual_seed(0)
    # values over many binades, so normal, subnormal, underflow and saturation paths all run
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 13, (n,), generator=gen).float())
    buf = torch.empty_like(x)
    copy_s = _best_seconds(lambda: buf.copy_(x), budget_s / 2)
    rows = []
    for f in formats:
        torch_melems = None
        if f in _TORCH_CASTS and hasattr(torch, _TORCH_CASTS[f]):
            dt = getattr(torch, _TORCH_CASTS[f])
            torch_melems = n / _best_seconds(lambda: buf.copy_(x.to(dt)), budget_s / 2) / 1e6
        for mode in modes:
            say(f"rounding to {f}, {mode}")
            kw = {"generator": torch.Generator().manual_seed(1)} if mode == "stochastic" else {}
            t0 = time.perf_counter()
            kernels.round(x, f, mode=mode, out=buf, **kw)
            first = time.perf_counter() - t0
            sec = _best_seconds(lambda: kernels.round(x, f, mode=mode, out=buf, **kw), budget_s)
            rows.append({"format": f, "mode": mode, "melems": n / sec / 1e6, "first_call_s": first,
                         "torch_melems": torch_melems,
                         "vs_torch": (n / sec / 1e6) / torch_melems if torch_melems else None})
    return rows, n / copy_s / 1e6


def layer_speed_part(ctx: StudyContext) -> dict:
    """The speed part's layer table: a 4096 x 4096 Linear (2048 in a quick run) at batch 1 and 64,
    fewbits' schemes beside the installed peers (the same function as `fewbits bench`)."""
    from .layer_speed import BENCH_FEWBITS, BENCH_PEERS, layer_speed, linear_stack

    return layer_speed(linear_stack(2048 if ctx.quick else 4096, layers=1), (1, 64), BENCH_FEWBITS, BENCH_PEERS,
                       budget_s=0.3 if ctx.quick else 1.0, progress=lambda m: ctx.say(f"speed: {m}"))


def part_speed(ctx: StudyContext) -> PartOutput:
    from .. import kernels
    from ..hardware import KNOWN_ACCELERATORS, run_bench
    from .charts import save_matmul_figure, save_rounding_figure
    from .hardware_figures import save_roofline_figure
    from .layer_speed import layer_speed_rows

    out = PartOutput()
    res = run_bench(budget_s=0.3 if ctx.quick else 1.0, progress=lambda m: ctx.say(f"speed: {m}"))
    matmuls = [dict(vars(m)) for m in res.matmuls.values()]
    bw = vars(res.bandwidth)
    out.numbers.update(machine=res.machine, bandwidth=bw, matmul=matmuls, roofline=res.shapes,
                       bench_seconds=res.seconds)
    save_matmul_figure(matmuls, ctx.out / "matmul.png")
    out.figure("matmul.png", "Matrix multiplication throughput per precision",
               "The best of repeated n × n × n products per dtype with torch's own CPU kernels (int8: torch._int_mm, "
               "int32 accumulation); the label gives the ratio to fp32. Missing dtypes have no kernel here.")
    shown = [dict(m, n=m["n"] if m["available"] else None, gflops=m["gflops"] if m["available"] else None)
             for m in matmuls]
    out.table("Matmul throughput", [
        ("dtype", "dtype", "text"), ("kernel", "kernel", "text"), ("n", "n", "int"), ("gflops", "GFLOP/s", "num"),
        ("ratio", "× fp32", "x"), ("note", "note", "text")], shown,
        f"Memory bandwidth here: {bw['copy_gbs']:.3g} GB/s copy, {bw['read_gbs']:.3g} GB/s read. — : not measured "
        "here, for the reason in the note (such a dtype has no ceiling on the roofline below).")
    out.numbers["layer_speed"] = layers = layer_speed_part(ctx)
    out.table(f"Layer speed beside the tools users would pick instead: {layers['stack']}, "
              f"{layers['threads']} threads", [
                  ("batch", "batch", "int"), ("label", "variant", "text"), ("kind", "from", "text"),
                  ("kernel", "kernel", "text"), ("median_ms", "median ms", "f3"), ("x_fp32", "× fp32", "x"),
                  ("bytes", "weights", "bytes"), ("rel_err", "rel err", "sci")], layer_speed_rows(layers),
              "One interleaved run (round-robin, the order rotating): fewbits' QuantLinear in each scheme beside "
              "bitsandbytes (eval mode, inference_mode), torchao (the layer in bfloat16, torch.compile'd) and torch's "
              "quantize_dynamic; × fp32 is fp32's median time over the variant's. rel err: ||y − y_fp32|| / "
              "||y_fp32||. Rows without a batch: peers that are not installed or do not run here, and why.")
    save_roofline_figure(res, ctx.out / "roofline.png")
    out.figure("roofline.png", "Rooflines: this machine beside known accelerators",
               "Left: each dtype's ceiling here (bandwidth × arithmetic intensity, capped by its measured peak), with "
               "two matmul shapes: one token through a 4096² layer (bandwidth-bound) and 512 tokens (compute-bound). "
               "Right: the published bf16 (solid) and fp8 (dashed) ceilings of a few accelerators.")
    out.table("Where the two shapes sit", [
        ("shape", "shape M×N×K", "text"), ("dtype", "dtype", "text"), ("intensity", "op/byte", "num"),
        ("ridge", "ridge", "num"), ("bound", "bound here", "text"), ("attainable_gflops", "roofline GFLOP/s", "num"),
        ("measured_gflops", "measured GFLOP/s", "num")], res.shapes,
        "ridge: operations per byte above which a matmul is compute-bound here. Only the dtypes measured here: "
        + (", ".join(sorted({r["dtype"] for r in res.shapes})) or "none") + ".")
    acc = [dict(vars(a)) for a in KNOWN_ACCELERATORS]
    out.table("Published peaks of known accelerators (dense, TFLOP/s; int8 TOP/s)", [
        ("name", "accelerator", "text"), ("memory_gb", "memory GB", "num"), ("bandwidth_gbs", "GB/s", "num"),
        ("fp32", "fp32", "num"), ("tf32", "tf32", "num"), ("fp16", "fp16", "num"), ("bf16", "bf16", "num"),
        ("fp8", "fp8", "num"), ("int8", "int8", "num"), ("note", "note", "text")], acc)
    out.numbers["accelerators"] = acc
    if ctx.quick:
        # fb.round's fast kernels are compiled once per format and mode: tens of seconds each on a
        # fresh machine, which a quick run cannot spend (and the eager fallback would misrepresent)
        out.notes.append("Quick run: rounding throughput is measured in the full run (it compiles one kernel "
                         "per format on first use).")
    else:
        with kernels.use_backend("auto"):
            rows, copy_melems = rounding_speed(ROUND_FORMATS, ("nearest_even", "stochastic"), 2 ** 22, 0.5,
                                               lambda m: ctx.say(f"speed: {m}"))
        out.numbers.update(rounding=rows, rounding_copy_melems=copy_melems)
        save_rounding_figure(rows, ctx.out / "rounding.png", copy_melems)
        out.figure("rounding.png", "Rounding throughput per format",
                   "fb.round of 4M float32 values into each format, written into a preallocated tensor (the result "
                   "stays float32, holding only values the format has), beside torch's own cast where torch has the "
                   "dtype, and a plain copy: the memory limit.")
        out.table("Rounding throughput", [
            ("format", "format", "text"), ("mode", "mode", "text"), ("melems", "M values/s", "f0"),
            ("torch_melems", "torch cast M/s", "f0"), ("vs_torch", "× torch", "x"),
            ("first_call_s", "first call s", "f2")], rows,
            f"Best of repeated calls; the first call compiles the kernel (its own column). A float32 copy runs at "
            f"{copy_melems:,.0f} M values/s here.")
    one = {r["label"]: r["x_fp32"] for r in layers["batches"].get("1", {}).get("rows", []) if r["x_fp32"]}
    shown = [f"{label} {one[label]:.2f}×" for label in ("int4 g128", "nf4", "bnb nf4", "torchao int4 wo (cpu)")
             if label in one]
    if shown:
        out.highlights.append(f"One token through {layers['stack']} ({layers['threads']} threads), as a multiple of "
                              f"fp32's speed in one run: {', '.join(shown)}.")
    bf16 = res.matmuls.get("bf16")
    if bf16 is not None and bf16.available and bf16.ratio:
        out.highlights.append(f"bf16 matmuls run {bf16.ratio:.2f}× as fast as fp32 on this machine "
                              f"({bf16.gflops:,.0f} GFLOP/s); memory copy {bw['copy_gbs']:.3g} GB/s.")
    return out


# ---------------------------------------------------------------------------------------------
# part 4: quantization
# ---------------------------------------------------------------------------------------------
def _quant_table(out: PartOutput, subject, rows: list[dict]) -> None:
    cosine = subject.quality_metric == "cosine"
    base = rows[0]["quality"]
    for r in rows:
        r["quality_change"] = (r["quality"] - base) / base if base else None
    cols = [("scheme", "scheme", "text"), ("layer_bits_per_param", "bits/param", "f3"),
            ("bits_per_param", "model bits/param", "f3"), ("model_bytes", "model size", "bytes"),
            ("quality", "cosine" if cosine else "perplexity", "f5" if cosine else "f3"),
            ("quality_change", "change", "pct")]
    if cosine:
        cols += [("spearman", "Spearman", "f4"), ("top1_agreement", "top-1 agree", "pct")]
    cols += [("throughput", subject.throughput_unit, "f1"), ("quantize_seconds", "quantize s", "f1")]
    out.table(f"{subject.name}: quantized under each scheme", cols, rows,
              ("cosine: mean cosine similarity of sentence embeddings to the fp32 model's (1 = identical), on real "
               "sentences from Python's pydoc text; Spearman: agreement of the pairwise similarity rankings; top-1 "
               "agree: sentences whose nearest neighbour is unchanged." if cosine else
               "perplexity on held-out pydoc text (lower is better).")
              + " bits/param: of the quantized layers, scales and zero points included; model bits/param also "
                "counts the layers kept in float (embeddings, norms).")


def _allocation_table(out: PartOutput, subject, allocation: dict, row: dict) -> None:
    pred, meas = allocation["predicted"], allocation["measured"]
    by_loss = pred.get("metric") == "loss"
    counts = ", ".join(f"{k} × {v}" for k, v in allocation["scheme_counts"].items())
    arow = {"budget": allocation["budget_bits_per_param"], "predicted_bits": meas.get("predicted_bits_per_param"),
            "measured_bits": meas.get("measured_bits_per_param"), "schemes": counts,
            "predicted": meas.get("predicted_loss") if by_loss else meas.get("predicted_sqnr_db"),
            "measured": meas.get("measured_loss") if by_loss else meas.get("measured_sqnr_db"),
            "quality": row["quality"]}
    what = "loss" if by_loss else "SQNR dB"
    out.table(f"{subject.name}: the best scheme per layer under {allocation['budget_bits_per_param']:g} bits per "
              "parameter", [
                  ("budget", "budget bits", "f3"), ("predicted_bits", "predicted bits", "f3"),
                  ("measured_bits", "measured bits", "f3"), ("schemes", "layers per scheme", "text"),
                  ("predicted", f"predicted {what}", "f3"), ("measured", f"measured {what}", "f3"),
                  ("quality", subject.quality_metric, "f5" if subject.quality_metric == "cosine" else "f3")],
              [arow],
              "SQNR: signal-to-noise ratio of the model's output against fp32, in dB (higher is better). "
              f"Each layer's sensitivity to every candidate ({', '.join(allocation.get('candidates', []))}) was "
              "measured on calibration data, then the choice per layer that minimizes the predicted "
              f"{'loss increase' if by_loss else 'output noise'} within the budget was applied and measured. "
              "Its point is in the plot beside the uniform schemes.")


def part_quant(ctx: StudyContext) -> PartOutput:
    from . import quantization as sq

    out = PartOutput()
    specs = ctx.model_specs()
    if "smollm2" in specs or not ctx.model:
        out.notes.append(sq.Q4_1_NOTE)
    if ctx.quick and not ctx.model:
        out.notes.append("Quick run: MiniLM with four schemes. The full run (without --quick) adds SmolLM2-135M, "
                         "more schemes and the best allocation under a budget.")
    for spec in specs:
        try:
            subject = ctx.subject(spec)
        except Exception as exc:  # noqa: BLE001
            out.warnings.append(f"{spec}: could not be loaded ({type(exc).__name__}: {exc})")
            continue
        schemes = list(QUANT_SCHEMES_QUICK if ctx.quick else SMOLLM2_SCHEMES if spec == "smollm2" else QUANT_SCHEMES)
        rows = sq.compare(subject, schemes, progress=lambda m: ctx.say(f"quant: {m}"))
        for r in rows:
            if spec == "smollm2" and r.get("scheme_name") == SMOLLM2_GRID_SCHEME:
                r["_flag"] = True
        allocation = None
        allocate = getattr(sq, "allocate_for_budget", None)
        # not on SmolLM2: its weights already sit on a 4-bit grid (the allocation would chase it), and
        # profiling its 210 layers under every candidate takes longer than the whole study may
        if not ctx.quick and allocate is not None and spec != "smollm2":
            candidates = list(getattr(sq, "BUDGET_CANDIDATES", ("int8", "int4", "int3")))
            try:
                ctx.say(f"quant: {subject.name}: best allocation under {QUANT_BUDGET_BITS} bits per parameter")
                allocation = allocate(subject, candidates, QUANT_BUDGET_BITS, progress=lambda m: ctx.say(f"quant: {m}"))
                rows.append(allocation.pop("row"))
                allocation["candidates"] = candidates
            except Exception as exc:  # noqa: BLE001
                out.warnings.append(f"{subject.name}: the allocation under a budget failed "
                                    f"({type(exc).__name__}: {exc})")
                allocation = None
        slug = _slug(spec if not os.path.exists(spec) else Path(spec).name)
        file = f"quant_{slug}.png"
        sq.plot_quality_vs_bits(rows, subject, ctx.out / file)
        out.figure(file, f"{subject.name}: quality against bits per parameter",
                   "One point per scheme: the bits each quantized weight costs (scales included) against the "
                   "model's quality; the dashed line is fp32. Up and to the left is better for cosine, down and to "
                   "the left for perplexity." + (f" {subject.note}" if subject.note else ""))
        _quant_table(out, subject, rows)
        if spec == "smollm2":
            out.tables[-1]["note"] += f" Highlighted: {SMOLLM2_GRID_SCHEME}, the model's own Q4_1 grid: " \
                                      "no evidence of 4-bit quality."
        if allocation is not None:
            _allocation_table(out, subject, allocation, rows[-1])
        out.numbers[slug] = {"model": subject.name, "quality_metric": subject.quality_metric, "note": subject.note,
                             "schemes": rows, "allocation": allocation}
        if allocation is not None:
            out.numbers[slug]["allocation_budget_bits"] = QUANT_BUDGET_BITS
        if subject.quality_metric == "cosine":
            four = [r for r in rows[1:] if r.get("layer_bits_per_param") and r["layer_bits_per_param"] < 5
                    and not r.get("_flag")]
            if four:
                best = max(four, key=lambda r: r["quality"])
                out.highlights.append(f"{subject.name}: best scheme under 5 bits is {best['scheme']} "
                                      f"({best['layer_bits_per_param']:.3f} bits), cosine to fp32 "
                                      f"{best['quality']:.4f}.")
    if not out.tables:
        raise RuntimeError("no model could be quantized: " + "; ".join(out.warnings))
    if not ctx.quick and getattr(sq, "allocate_for_budget", None) is None:
        out.notes.append("The best allocation under a budget is not available in this version "
                         "(fewbits.study.quantization.allocate_for_budget).")
    elif not ctx.quick and "smollm2" in specs:
        out.notes.append("The best allocation under a budget runs on MiniLM only: SmolLM2's weights already sit on "
                         "a 4-bit grid, which the allocation would chase.")
    return out


# ---------------------------------------------------------------------------------------------
# part 5: training
# ---------------------------------------------------------------------------------------------
def _lm_speed_table(ctx: StudyContext, out: PartOutput) -> None:
    """Which policies run their GEMMs natively here, and how fast a step of the GPT LM is under each."""
    from .tasks import TaskConfig, step_speed

    cfg = TaskConfig("lm")
    ctx.say(f"train: LM step speed under {', '.join(LM_SPEED_POLICIES)} ({LM_SPEED_ROUNDS} rounds)")
    try:
        rows = step_speed(LM_SPEED_POLICIES, cfg, rounds=LM_SPEED_ROUNDS)
    except Exception as exc:  # noqa: BLE001 - the MLP runs still make the part
        out.warnings.append(f"LM step speed failed: {type(exc).__name__}: {exc}")
        return
    base = next((r["step_time_s"] for r in rows if r["policy"] == "bf16-mixed"), None)
    for r in rows:
        r["speed_vs_bf16"] = base / r["step_time_s"] if base else None
    out.table(f"Step speed of the GPT LM (d_model {cfg.d_model}, {cfg.n_layers} layers, sequence {cfg.seq}, "
              f"batch {cfg.batch_size}) on this machine", [
                  ("policy", "policy", "text"), ("step_time_s", "step ms", "ms"),
                  ("speed_vs_bf16", "speed vs bf16-mixed", "x"), ("gemm_path", "matmuls ran as", "text")], rows,
              f"Median of {LM_SPEED_ROUNDS} interleaved steps after one warm-up: one step of every policy per "
              "round on the same batch. 'native' GEMMs run on the units built for the format (AMX int8 tiles "
              "here, FP8 tensor cores on GPUs that have them); 'emulated' ones round to the format and multiply "
              "in bf16. benchmarks/bench_train.py measures the same with 300 steps and the final loss.")
    out.numbers["lm_speed"] = rows
    by = {r["policy"]: r for r in rows}
    if base and "int8-mixed" in by:
        out.highlights.append(f"int8-mixed trains the GPT LM at {by['int8-mixed']['speed_vs_bf16']:.2f}x "
                              f"bf16-mixed's step speed here ({by['int8-mixed']['gemm_path']}).")


_CARRIED_UPDATES = {"bf16-pure-sr": "stochastic rounding", "bf16-pure-kahan": "the Kahan compensation"}


def _train_note(results: list[dict]) -> str:
    """The policies table's note, from the policies that ran (a quick run has fewer): which of them
    were emulated here, and in which formats; what their lost updates mean."""
    names = [r["policy"] for r in results]
    emulated = [r for r in results if "emulated" in (r.get("gemm_path") or "")]
    parts = ["step ms: median step time."]
    if emulated:
        formats = sorted({r["policy_detail"][k] for r in emulated for k in ("forward", "backward")
                          if r.get("policy_detail", {}).get(k) not in (None, "fp32", "bf16")})
        parts.append(f"{', '.join(r['policy'] for r in emulated)}: emulated here (matmuls ran as says how): "
                     f"values are rounded exactly to {', '.join(formats) or 'the format'} through fb.round and "
                     "multiplied in a wider type, so these run slower here than on hardware with units for them.")
    parts.append("state: weights, master copies, gradients and optimizer states held. peak growth: of the process's "
                 "resident memory during the run, from a baseline taken after a throwaway warm-up of the same "
                 "policy (so the order of the policies does not change it).")
    carried = [n for n in names if n in _CARRIED_UPDATES]
    if carried:
        parts.append(f"Lost updates under {' and '.join(carried)}: single updates still do not change the bf16 "
                     f"weight, but {' and '.join(_CARRIED_UPDATES[n] for n in carried)} carr"
                     f"{'y' if len(carried) > 1 else 'ies'} them over, so the loss recovers.")
    elif "bf16-pure" in names:
        parts.append("Lost updates under bf16-pure: updates too small to change a weight stored in bf16, which "
                     "has no fp32 master copy to collect them.")
    parts.append("Telemetry samples every 10th step.")
    return " ".join(parts)


def part_train(ctx: StudyContext) -> PartOutput:
    from ..train import Telemetry
    from .charts import save_histogram_figure, save_loss_figure, save_train_numerics_figure
    from .tasks import TaskConfig, run_task

    out = PartOutput()
    policies = TRAIN_POLICIES_QUICK if ctx.quick else TRAIN_POLICIES
    cfg = TaskConfig("mlp", steps=TRAIN_STEPS_QUICK if ctx.quick else TRAIN_STEPS)
    results, histogram_telemetry = [], None
    for i, name in enumerate(policies, 1):
        ctx.say(f"train: {name} ({i}/{len(policies)}), {cfg.steps} steps")
        tel = Telemetry(every=10)
        every = Every(10.0)

        def progress(step, total, loss, name=name, every=every):
            if every.due(step, total):
                ctx.say(f"train: {name} step {step}/{total}, loss {loss:.4f}")
        try:
            r = run_task(name, cfg, telemetry=tel, progress=progress)
        except Exception as exc:  # noqa: BLE001 - one policy failing leaves the others
            out.warnings.append(f"policy {name} failed: {type(exc).__name__}: {exc}")
            continue
        r.pop("_engine", None)
        results.append(r)
        if name == HISTOGRAM_POLICY:
            histogram_telemetry = tel
    if not results:
        raise RuntimeError("every policy failed: " + "; ".join(out.warnings))
    base = results[0]["final_loss"]
    for r in results:
        r["loss_change"] = (r["final_loss"] - base) / base if base and math.isfinite(r["final_loss"]) else None
    task = (f"an MLP (64 → {cfg.hidden} → {cfg.hidden} → 10) classifying scikit-learn's 8×8 digits, AdamW lr "
            f"{cfg.lr:g}, batch {cfg.batch_size}, {cfg.steps} steps, seed {cfg.seed}")
    save_loss_figure(results, ctx.out / "train_loss.png")
    out.figure("train_loss.png", "Loss curves",
               f"Training loss of {task}, as a moving average; the legend gives the final loss (mean of the last 10% "
               "of steps). Same seed, initial weights and batches for every policy, so on the right each step's loss "
               f"is compared with {policies[0]}'s on the same batch.")
    save_train_numerics_figure(results, ctx.out / "train_numerics.png")
    out.figure("train_numerics.png", "What each policy did to the numbers",
               "Final loss relative to the first policy; the fraction of non-zero gradients flushed to zero on "
               "entering the backward matmuls (underflow); the fraction of optimizer updates that left the stored "
               "weight unchanged (lost updates); steps the loss scaler skipped after an overflow.")
    if histogram_telemetry is not None:
        try:
            save_histogram_figure(
                histogram_telemetry, ctx.out / "train_histograms.png",
                title=f"{HISTOGRAM_POLICY}: exponents of the tensors against fp16's range")
            out.figure("train_histograms.png", f"Exponent histograms under {HISTOGRAM_POLICY}",
                       "The binary exponents of sampled values per tensor role against the format's range: "
                       "gradients left of the smallest subnormal become zero. Loss scaling shifts them right.")
        except ValueError as exc:
            out.warnings.append(f"no histogram: {exc}")
    if not ctx.quick:
        _lm_speed_table(ctx, out)
    out.table(f"Policies on the digits MLP ({cfg.steps} steps)", [
        ("policy", "policy", "text"), ("final_loss", "final loss", "f4"), ("loss_change", "vs first", "pct"),
        ("step_time_s", "step ms", "ms"), ("state_bytes", "state", "bytes"),
        ("peak_memory_bytes", "peak growth", "bytes"), ("skipped_steps", "skipped", "int"),
        ("underflow_fraction", "underflow", "pct"), ("lost_update_fraction", "lost updates", "pct"),
        ("saturated_fraction", "saturated", "pct"), ("final_loss_scale", "final loss scale", "num"),
        ("gemm_path", "matmuls ran as", "text")], results, _train_note(results))
    out.numbers["task"] = {"task": cfg.task, "steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr,
                           "seed": cfg.seed, "hidden": cfg.hidden}
    out.numbers["runs"] = results
    by = {r["policy"]: r for r in results}
    if "fp16-mixed-unscaled" in by:
        u = by["fp16-mixed-unscaled"]
        out.highlights.append(f"fp16 without loss scaling flushed {u['underflow_fraction']:.2%} of the gradients "
                              "to zero" + (f"; with dynamic scaling {by['fp16-mixed']['underflow_fraction']:.2%}."
                                           if "fp16-mixed" in by else "."))
    if "bf16-pure" in by:
        p = by["bf16-pure"]
        out.highlights.append(f"bf16 weights without an fp32 master lost {p['lost_update_fraction']:.0%} of the "
                              f"updates (final loss {p['final_loss']:.4f} against fp32's {base:.4f}).")
    return out


# ---------------------------------------------------------------------------------------------
# the whole study
# ---------------------------------------------------------------------------------------------
PART_FUNCTIONS: dict[str, Callable[[StudyContext], PartOutput]] = {
    "formats": part_formats, "memory": part_memory, "speed": part_speed, "quant": part_quant, "train": part_train,
}
PART_TITLES = {
    "formats": "Number formats: what each can hold",
    "memory": "Memory: per format and per training policy",
    "speed": "Speed on this machine",
    "quant": "Quantization of real models",
    "train": "Training under precision policies",
}
HOW_TO_READ = {
    "formats": "A format spends its bits on a sign, an exponent (range: how large and how small) and a mantissa "
               "(precision: how many values per power of two). 8-bit floats trade one for the other: e4m3 keeps "
               "precision and reaches 448, e5m2 reaches 57344 with half the values. Integers and NF4 have no "
               "exponent: a quantizer gives them a scale. The table's eps and digits measure precision, max and "
               "min normal the range.",
    "memory": "Bars are predictions made before running, from the model's shapes alone; diamonds are what torch's "
              "allocator actually held at the peak of the same run. Inference memory is mostly weights, so the "
              "format shrinks it almost in proportion to bits. A training step holds far more than the weights: "
              "gradients, optimizer states and saved activations. Mixed precision makes the maths faster, not "
              "smaller; the state shrinks only with pure low-precision weights or 8-bit optimizer states.",
    "speed": "Ratios to fp32 are what to compare: they say what a precision buys on this machine. A matmul is "
             "bandwidth-bound below the ridge point (few tokens at a time, e.g. generating text), where fewer bytes "
             "per weight speed it up, and compute-bound above it (large batches), where the dtype's arithmetic "
             "throughput decides. Rounding throughput says what emulating a format costs.",
    "quant": "Each point is a whole model quantized under one scheme and evaluated on real text. Left is smaller, "
             "and quality should stay close to the fp32 line: the schemes on the upper-left frontier (cosine) or "
             "lower-left (perplexity) are the ones worth using. Scale overhead is counted, so int4 with groups of "
             "128 costs 4.25 bits, not 4.",
    "train": "The same model, data and seed under each policy. Curves that track fp32 mean the policy is safe for "
             "this task. Underflow counts gradients too small for the format (fp16 without loss scaling); lost "
             "updates count optimizer steps too small to change a weight stored in bf16 (pure bf16 without an "
             "fp32 master copy); skipped steps are the loss scaler backing off after an overflow.",
}


def parse_parts(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """'formats,quant' -> ('formats', 'quant') in the study's order; ValueError for unknown names."""
    if text is None:
        return PARTS
    names = [n.strip().lower() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if not names:
        raise ValueError(f"--only needs at least one part: {', '.join(PARTS)}")
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(map(repr, unknown))}; choose from {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in names)


def check_model_path(path: str) -> str:
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(f"--model {path}: not a Hugging Face model directory (no config.json there)")
    return str(p)


def _command(quick: bool, parts: Sequence[str], out: Path, model: str | None) -> str:
    cmd = ["fewbits study"]
    if quick:
        cmd.append("--quick")
    if tuple(parts) != PARTS:
        cmd.append(f"--only {','.join(parts)}")
    if model:
        cmd.append(f"--model {model}")
    cmd.append(f"--out {out}")
    return " ".join(cmd)


def _short_traceback(exc: BaseException, lines: int = 25) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_part(name: str, ctx: StudyContext) -> dict:
    """One part, timed; a failure becomes {'status': 'failed', 'error': ..., 'traceback': ...}."""
    t0 = time.perf_counter()
    part = {"name": name, "title": PART_TITLES[name], "how_to_read": HOW_TO_READ[name]}
    try:
        result = PART_FUNCTIONS[name](ctx).as_dict()
        part.update(result, status="ok")
    except Exception as exc:  # noqa: BLE001 - the report says what failed; the other parts go on
        hint = ""
        if isinstance(exc, ImportError):
            hint = " (an optional package is missing: install it and run the study again)"
        part.update(status="failed", error=f"{type(exc).__name__}: {exc}{hint}", traceback=_short_traceback(exc),
                    figures=[], tables=[], numbers={}, notes=[], warnings=[], highlights=[], order=[])
        # figures a part wrote before failing are not listed; files stay but the page shows none
    part["seconds"] = time.perf_counter() - t0
    return part


class _InterruptWatch:
    """Counts SIGINTs (Ctrl-C) while the study runs, so that an interrupt always stops it.

    Its handler raises KeyboardInterrupt, as Python's own does. But code under a part may swallow the
    KeyboardInterrupt (a library's bare `except:` or `except BaseException`, a finalizer, which
    Python runs with errors ignored) or turn it into an ordinary exception (typing_extensions on
    Python 3.11 re-raises it as a RuntimeError; run_part then records a failed part and the study
    ran on). check() raises it again wherever the study reaches: every progress message and the
    end of every part. Installed only from the main thread and only over Python's default
    handler (a program that handles SIGINT itself keeps its handler); restored afterwards.
    (Before the study starts, torch's C extension swallowed an interrupt raised while it loaded
    numpy; fewbits/__init__ loads numpy first for that.)"""

    def __init__(self):
        self.count = 0
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False

    def _handler(self, signum, frame):
        self.count += 1
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.count:
            raise KeyboardInterrupt


def run_study(out: str | os.PathLike = DEFAULT_OUT, quick: bool = False, parts: Sequence[str] = PARTS,
              model: str | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Run the parts, write out/report.html, out/results.json and the figures; return the study
    dict (as written to results.json, with 'report' the path of report.html).

    Ctrl-C (KeyboardInterrupt) stops the study, however the code under a part handled it: the
    report is written with what finished, says that the run was interrupted and where
    (study['interrupted']), and the KeyboardInterrupt propagates (`fewbits study` exits 130)."""
    with _InterruptWatch() as watch:
        return _run_study(out, quick, parts, model, progress, watch)


def _run_study(out, quick: bool, parts: Sequence[str], model: str | None, progress, watch: _InterruptWatch) -> dict:
    from ..hardware import machine_info

    parts = parse_parts(parts)
    if model is not None:
        model = check_model_path(model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report_to = progress or Progress()

    def say(message: str) -> None:
        watch.check()  # an interrupt that code under a part swallowed stops the study here
        report_to(message)

    ctx = StudyContext(out=out, quick=quick, model=model, say=say)
    t0 = time.perf_counter()
    study = {
        "title": "fewbits study" + (" (quick)" if quick else ""),
        "fewbits_version": __version__,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": _command(quick, parts, out, model),
        "options": {"quick": quick, "parts": list(parts), "model": model, "out": str(out)},
        "machine": machine_info(),
        "parts": [],
    }
    say(f"{'quick' if quick else 'full'} study of {', '.join(parts)} -> {out}/report.html")
    current, started = None, t0
    try:
        for i, name in enumerate(parts, 1):
            say(f"part {i}/{len(parts)}: {name}")
            current, started = name, time.perf_counter()
            part = run_part(name, ctx)
            watch.check()  # the part swallowed an interrupt, or recorded it as its failure
            current = None
            study["parts"].append(part)
            if part["status"] == "ok":
                say(f"part {i}/{len(parts)}: {name} done in {part['seconds']:.1f} s")
            else:
                say(f"part {i}/{len(parts)}: {name} FAILED after {part['seconds']:.1f} s: {part['error']}")
            study["seconds"] = time.perf_counter() - t0
            write_report(study, out)  # after every part: an interrupted run still leaves a report
    except KeyboardInterrupt:
        _record_interrupt(study, current, started, parts, t0)
        path = write_report(study, out)
        study["report"] = str(path)
        report_to(f"interrupted{f' during part {current}' if current else ''}: partial report {path}")
        raise
    study["seconds"] = time.perf_counter() - t0
    path = write_report(study, out)
    study["report"] = str(path)
    say(f"wrote {path} in {study['seconds']:.0f} s")
    return study


def _record_interrupt(study: dict, current: str | None, started: float, parts: Sequence[str], t0: float) -> None:
    """Mark the study as interrupted: the part that was running (its figures are not listed), and
    a line at the top of the report naming it and the parts that did not run."""
    if current is not None:
        study["parts"].append({
            "name": current, "title": PART_TITLES[current], "how_to_read": HOW_TO_READ[current],
            "status": "interrupted", "error": "interrupted (Ctrl-C) before it finished",
            "seconds": time.perf_counter() - started, "figures": [], "tables": [], "numbers": {}, "notes": [],
            "warnings": [], "highlights": [], "order": []})
    done = {p["name"] for p in study["parts"]} - {current}
    not_run = [p for p in parts if p not in done and p != current]
    study["interrupted"] = {"part": current, "not_run": not_run}
    study["title"] += " (interrupted)"
    study["seconds"] = time.perf_counter() - t0
    where = f"during part {current}" if current else "between parts"
    study["intro"] = (f"This run was interrupted (Ctrl-C) {where}: the report holds only the parts that "
                      "finished before" + (f"; not run: {', '.join(not_run)}." if not_run else "."))
