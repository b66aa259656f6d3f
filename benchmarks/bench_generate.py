"""Generation speed at batch 1: transformers (float, fewbits-quantized, bitsandbytes), its compiled
static-cache path, and llama.cpp on GGUFs of the same model, in one run, as ratios.

    python benchmarks/bench_generate.py                          # smollm2 at 1 and 2 threads (~5 min)
    python benchmarks/bench_generate.py --quick                  # smoke run: 16 new tokens, fewer variants
    python benchmarks/bench_generate.py --models 1b --prepare-only --work W   # write the synthetic 1B, its GGUFs
    python benchmarks/bench_generate.py --models 1b --threads 2 --new-tokens 32 --work W
    python benchmarks/bench_generate.py --variants fp32,int4,llama-q4_0 --compiled int4 --json gen.json
    python benchmarks/bench_generate.py --profile                # + where each eager variant's decode time goes

Models: SmolLM2-135M (fewbits.models.smollm2_directory(): the packaged model as a Hugging Face
directory; its weights are the GGUF Q4_1 file's, dequantized) and "1b", a Llama-3.2-1B-shaped
model with RANDOM weights (fewbits.models.synthetic, written once into --work): its text is
garbage, its speed is real. The prompt: the first --prompt-tokens tokens of the pydoc eval text
(SmolLM2's tokenizer; the 1B model gets the same ids), then --new-tokens greedy tokens (argmax,
no stop at EOS), batch 1.

Variants (one row each, every row in the same run; --variants picks):
- transformers eager, the model as loaded: fp32, bf16 (model.to(bfloat16));
- fewbits: fb.quantize_model(fp32 model, scheme) with scheme int8 (weight-only, per channel),
  w8a8 (int8 weights + dynamic per-token int8 activations), int4 (g128), w4a8 (Q4_0's weights +
  dynamic int8 activations in blocks of 32: llama.cpp's q4_0 x q8_0 arithmetic), nf4 (g64). The tied
  lm_head is quantized too (tied="untie", as llama.cpp quantizes its output matrix; the
  embedding lookup stays float); "int4-head32" keeps it in fp32 (fewbits' default, tied="keep");
- bitsandbytes through transformers' BitsAndBytesConfig: bnb-nf4 (4-bit NF4, compute dtype
  bfloat16) and bnb-int8 (LLM.int8()); where one cannot load or run here the row says why;
- compiled (--compiled picks which of the above): fewbits.models.generation.CompiledGenerator:
  transformers' StaticCache plus torch.compile of the forward (inductor, --compile-mode; the
  decode step compiled, the prompt's forward run eagerly into the same static cache, unless
  --compile-prefill). fewbits' QuantLinear is one torch.library custom op under the compiler
  (fewbits.quant.modules), so a quantized model compiles as one graph; any graph break
  (torch._dynamo's counters while compiling) is reported, per row and by reason, never hidden;
- decoder (--decoder picks which of fp32 / bf16 / the fewbits variants):
  fewbits.models.decoder.LlamaDecoder on the same model: the forward written out in torch ops
  over the model's modules with a KV cache allocated once (transformers' logits bit for bit),
  and for quantized models whose every projection has a one-row C kernel the decode steps in
  one C call each (kernels/csrc/decode.c; the prompt still in torch ops); the note says which
  path ran;
- llama.cpp (llama-cpp-python, benchmarks/setup_llama_cpp.sh) on GGUFs of the same weights:
  Q8_0, Q4_0, Q4_1 made by llama.cpp's own quantizer (llama_model_quantize, --pure) from an F32
  (SmolLM2) or BF16 (1B) GGUF that fewbits' write_gguf writes; n_threads = n_threads_batch = the
  thread count; n_batch = --n-batch (whole prompt in one batch by default). Before timing, a
  child process evaluates the prompt with that n_batch: if it crashes (as llama.cpp's AMX build
  did on one machine for batches > 1), the row runs with n_batch=1 and says so.

Timing (fewbits.models.generation's definition, the same for llama.cpp): prefill = wall time of
the prompt's forward and the first token's argmax; decode = wall time of the other new tokens,
one forward + argmax each (llama.cpp: Llama.eval([token]) and the argmax of its logits).
prefill tok/s = prompt tokens / prefill s, decode tok/s = (new tokens - 1) / decode s. Each
variant is warmed up first (a short generation; for compiled rows it compiles: "compile s").
Prefill is also timed alone --prefill-repeats times
after each generation (the prompt only), and the fastest prefill counts. With --rounds R every variant is measured R times, interleaved (SmolLM2: all variants held at
once; 1B: one variant in memory at a time, freed before the next), and the best round counts.
"= fp32" is how many leading tokens equal transformers fp32's.

Ratios in the same run: decode over llama.cpp Q4_0's and over transformers fp32 eager; prefill
over fp32. The issue's targets (15, item 4) are printed PASS/FAIL: fewbits int4 (and w4a8)
decode >= 0.5x llama.cpp Q4_0 at one thread (goal >= 1x) and >= 2x transformers fp32; prefill
of every fewbits variant >= fp32 (bitsandbytes' rows are peers, not held to it). On a shared
machine the times are indicative; read the ratios.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gguf import cpu_flags, llama_quantize, quiet_fds, tensor_mapping  # noqa: E402

FEWBITS_SCHEMES = {"int8": "int8", "w8a8": "w8a8", "int4": "int4", "w4a8": "w4a8", "nf4": "nf4", "int4-head32": "int4"}
FLOAT = ("fp32", "bf16")
BNB = ("bnb-nf4", "bnb-int8")
LLAMA = {"llama-q8_0": "q8_0", "llama-q4_0": "q4_0", "llama-q4_1": "q4_1"}
TORCH_VARIANTS = FLOAT + tuple(FEWBITS_SCHEMES) + BNB
ALL_VARIANTS = TORCH_VARIANTS + tuple(LLAMA)
DEFAULT_COMPILED = ("fp32", "bf16", "int8", "int4", "w4a8")
DEFAULT_DECODER = ("fp32", "int8", "w8a8", "int4", "w4a8", "nf4")
QUICK_VARIANTS = ("fp32", "bf16", "int8", "int4", "w4a8", "nf4", "bnb-nf4", "llama-q4_0")
QUICK_COMPILED = ("fp32", "int4")
QUICK_DECODER = ("fp32", "int4")
MODELS = ("smollm2", "1b")


def log(*args):
    print(*args, flush=True)


SUFFIX = {"": "", "compile": " +compile", "decoder": " +decoder"}


def label(variant: str, mode: str = "") -> str:
    if variant in LLAMA:
        return f"llama.cpp {LLAMA[variant].upper()}"
    if variant in FLOAT:
        name = f"transformers {variant}"
    elif variant in BNB:
        name = f"bitsandbytes {variant[4:]}"
    elif variant == "int4-head32":
        name = "fewbits int4 (fp32 head)"
    else:
        name = f"fewbits {variant}"
    return name + SUFFIX[mode]


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
def model_directory(name: str, work: str) -> str:
    if name == "smollm2":
        from fewbits.models import smollm2_directory

        return str(smollm2_directory())
    from fewbits.models.synthetic import write_synthetic_llama

    path = os.path.join(work, "synthetic-llama-1b")
    if not os.path.exists(os.path.join(path, "config.json")):
        t0 = time.perf_counter()
        info = write_synthetic_llama(path, "1b", overwrite=True)
        log(f"wrote the synthetic 1B model ({info['parameters'] / 1e9:.2f} B parameters, random bf16 weights) to "
            f"{path} in {time.perf_counter() - t0:.0f} s")
    return path


def prompt_ids(n: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from fewbits.models import smollm2_directory
    from fewbits.models.text import pydoc_split

    tok = AutoTokenizer.from_pretrained(str(smollm2_directory()))
    ids = tok(pydoc_split().eval[: 20 * n], add_special_tokens=False)["input_ids"][:n]
    if len(ids) < n:
        raise SystemExit(f"the pydoc eval text gave only {len(ids)} tokens")
    return torch.tensor([ids])


def load_float(directory: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def build_torch(variant: str, directory: str):
    """The model of a transformers/fewbits/bitsandbytes variant, in eval mode."""
    if variant == "fp32":
        return load_float(directory)
    if variant == "bf16":
        return load_float(directory, torch.bfloat16)
    if variant in FEWBITS_SCHEMES:
        import fewbits as fb

        model = load_float(directory)
        fb.quantize_model(model, FEWBITS_SCHEMES[variant], tied="keep" if variant == "int4-head32" else "untie")
        return model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if variant == "bnb-nf4":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, device_map="cpu",
                                                dtype=torch.bfloat16 if variant == "bnb-nf4" else torch.float32).eval()


def kernels_of(model) -> str:
    from fewbits.quant.plan import is_quantized

    counts = Counter(getattr(m, "kernel", type(m).__name__) for m in model.modules() if is_quantized(m))
    return " ".join(f"{k}:{c}" for k, c in sorted(counts.items()))


# ---------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------
def write_gguf_files(name: str, directory: str, work: str, types, threads: int) -> dict:
    """{recipe: path}: an F32 (SmolLM2) or BF16 (1B) GGUF by fewbits' write_gguf, then
    llama.cpp's quantizer per type."""
    from fewbits.files.gguf_file import write_gguf

    if not types:
        return {}
    src_type = "f32" if name == "smollm2" else "bf16"
    src = os.path.join(work, f"gen-{name}-{src_type}.gguf")
    paths = {t: os.path.join(work, f"gen-{name}-llamacpp-{t}.gguf") for t in types}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    t0 = time.perf_counter()
    model = load_float(directory, torch.float32 if src_type == "f32" else torch.bfloat16)
    tokenizer = None
    if name == "smollm2":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
    write_gguf(src, tensor_mapping(model), model.config, tokenizer, overwrite=True, file_type=src_type)
    del model
    gc.collect()
    for t, p in paths.items():
        llama_quantize(src, p, t, threads)
    os.remove(src)
    log(f"GGUFs ({', '.join(types)}) from a {src_type.upper()} GGUF by llama.cpp's quantizer in "
        f"{time.perf_counter() - t0:.0f} s" + ("" if tokenizer is not None else " (no tokenizer: ids fed directly)"))
    return paths


_PROBE = r"""
import sys, llama_cpp
path, n_batch, ids = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
llm = llama_cpp.Llama(path, n_ctx=len(ids) + 8, n_batch=n_batch, n_ubatch=n_batch, n_threads=1, n_threads_batch=1,
                      verbose=False)
llm.eval(ids)
print("ok", llm.n_tokens)
"""


def probe_n_batch(path: str, ids: list[int], n_batch: int) -> tuple[int, str]:
    """(n_batch that runs, note): the prompt evaluated in a child process, so a crash is seen."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, path, str(n_batch), ",".join(map(str, ids))],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0 and "ok" in proc.stdout:
        return n_batch, f"n_batch={n_batch} ran"
    why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
    if n_batch == 1:
        return 0, f"n_batch=1 failed too ({why}: {tail})"
    return 1, f"n_batch={n_batch} FAILED ({why}: {tail}); n_batch=1 used"


class LlamaRunner:
    def __init__(self, path: str, threads: int, n_ctx: int, n_batch: int):
        import llama_cpp

        with quiet_fds():
            self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                                       n_threads_batch=threads, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, ids: list[int], new: int) -> dict:
        llm = self.llm
        llm.reset()
        out = []
        t0 = time.perf_counter()
        llm.eval(ids)
        out.append(self._argmax())
        t1 = time.perf_counter()
        for _ in range(new - 1):
            llm.eval([out[-1]])
            out.append(self._argmax())
        t2 = time.perf_counter()
        return {"tokens": out, "prefill_s": t1 - t0, "decode_s": t2 - t1}

    def close(self):
        self.llm.close()


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
def short_reasons(breaks: dict) -> dict:
    """{first line of the reason, its explanation and op: count}, dynamo's reasons being paragraphs."""
    out = Counter()
    for reason, count in breaks.items():
        lines = [s.strip() for s in str(reason).splitlines() if s.strip()]
        head = lines[0] if lines else str(reason)
        why = next((s.split(":", 1)[1].strip() for s in lines if s.startswith("Explanation:")), "")
        target = next((s.split("target:", 1)[1].strip() for s in lines if "target:" in s), "")
        out[head + (f": {why}" if why else "") + (f" [{target}]" if target else "")] += count
    return dict(out)


def torch_round(model, ids, new: int, compiled_gen=None) -> dict:
    from fewbits.models.generation import greedy_generate

    r = compiled_gen.generate(ids, new) if compiled_gen is not None else greedy_generate(model, ids, new)
    return {"tokens": r.tokens[0].tolist(), "prefill_s": r.prefill_seconds, "decode_s": r.decode_seconds}


def best(rounds: list[dict]) -> dict:
    return {"tokens": rounds[0]["tokens"], "prefill_s": min(r["prefill_s"] for r in rounds),
            "decode_s": min(r["decode_s"] for r in rounds), "rounds": len(rounds)}


def linear_layers_ms(model, iters: int = 4) -> tuple[float, int]:
    """(ms, layers): the batch-1 forward of every linear layer of the model (nn.Linear, fewbits'
    QuantLinear, bitsandbytes' Linear4bit / Linear8bitLt: any leaf with in/out_features), called
    one after the other as a decode step calls them (so each weight comes from memory, not from a
    cache kept warm by repeating one layer), per sweep: what one decode step spends in its matmul
    layers, without the model's Python and ops around them."""
    dtype = model.get_input_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    layers = [m for m in model.modules() if not list(m.children()) and hasattr(m, "in_features")
              and hasattr(m, "out_features")]
    inputs = [torch.randn(1, 1, m.in_features, dtype=dtype) for m in layers]
    with torch.inference_mode():
        for m, x in zip(layers, inputs):
            m(x)
        t0 = time.perf_counter()
        for _ in range(iters):
            for m, x in zip(layers, inputs):
                m(x)
        seconds = (time.perf_counter() - t0) / iters
    return 1e3 * seconds, len(layers)


def profile_decode(model, ids, steps: int = 16) -> dict:
    """Self CPU time of the ops over `steps` decode steps (after the prompt), against wall time."""
    from torch.profiler import ProfilerActivity, profile

    from fewbits.models.generation import greedy_generate

    greedy_generate(model, ids, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        r = greedy_generate(model, ids, steps + 1)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
    matmul_words = ("mm", "linear", "int4pack", "int8pack", "qlinear", "gemm", "lut4", "matmul", "bnb", "bitsandbytes")
    matmul = sum(e.self_cpu_time_total for e in events if any(w in e.key.lower() for w in matmul_words)) / 1e6
    plain = greedy_generate(model, ids, steps + 1)
    layers_ms, n_layers = linear_layers_ms(model)
    return {"wall_ms_per_token": 1e3 * r.decode_seconds / max(1, r.decode_steps),
            "plain_ms_per_token": 1e3 * plain.decode_seconds / max(1, plain.decode_steps),
            "linear_layers_ms": layers_ms, "linear_layers": n_layers,
            "prefill_ms": 1e3 * r.prefill_seconds,
            "op_ms_per_token": 1e3 * total / (steps + 1), "matmul_ms_per_token": 1e3 * matmul / (steps + 1),
            "top": [(e.key, round(e.self_cpu_time_total / 1e3 / (steps + 1), 3)) for e in top]}


def run_model(name: str, args, work: str) -> dict:
    directory = model_directory(name, work)
    ids = prompt_ids(args.prompt_tokens)
    id_list = ids[0].tolist()
    n_ctx = args.prompt_tokens + args.new_tokens
    log(f"\n## {name}: {directory}" + (" (RANDOM weights: the text is garbage, the speed is real)" if name == "1b"
                                        else " (weights: the packaged GGUF Q4_1, dequantized)"))
    log(f"prompt {args.prompt_tokens} tokens (pydoc eval text), {args.new_tokens} new tokens, greedy, batch 1")
    variants = [v for v in args.variants if v in TORCH_VARIANTS]
    compiled = [v for v in args.compiled if v in variants]
    decoded = [v for v in args.decoder if v in variants]
    llama = [v for v in args.variants if v in LLAMA]
    interleave = name == "smollm2"

    notes, rows, failed = {}, {}, {}
    gguf = write_gguf_files(name, directory, work, [LLAMA[v] for v in llama], max(args.threads))
    n_batch = {}
    for v in llama:
        nb, note = probe_n_batch(gguf[LLAMA[v]], id_list, args.n_batch)
        n_batch[v], notes[v] = nb, note
        log(f"llama.cpp {LLAMA[v].upper()}: {note}")
        if nb == 0:
            failed[v] = note

    if args.prepare_only:
        return {"model": name, "directory": directory, "gguf": gguf, "notes": notes}
    held: dict = {}

    def get_model(v):
        if v in held:
            return held[v]
        t0 = time.perf_counter()
        try:
            with warnings_quiet():
                m = build_torch(v, directory)
        except Exception as e:  # a peer that cannot load here: say why, keep going
            failed[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            log(f"{label(v)}: cannot load: {failed[v]}")
            return None
        notes.setdefault(v, f"built in {time.perf_counter() - t0:.1f} s" + (f"; kernels {kernels_of(m)}"
                                                                             if v in FEWBITS_SCHEMES else ""))
        if interleave:
            held[v] = m
        return m

    # keys: (variant, mode); per thread count: list of rounds
    keys = ([(v, "") for v in variants] + [(v, "compile") for v in compiled] + [(v, "decoder") for v in decoded]
            + [(v, "") for v in llama])
    results = {t: {k: [] for k in keys} for t in args.threads}
    compile_info: dict = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        log(f"\n### {threads} thread(s)")
        gens: dict = {}
        for rnd in range(args.rounds):
            for key in keys:
                v, comp = key
                if v in failed or f"{v}{SUFFIX[comp]}" in failed:
                    continue
                t0 = time.perf_counter()
                try:
                    if v in LLAMA:
                        runner = LlamaRunner(gguf[LLAMA[v]], threads, n_ctx, n_batch[v])
                        try:
                            if rnd == 0:
                                runner.generate(id_list[:8], 4)
                            r = runner.generate(id_list, args.new_tokens)
                            r["prefill_s"] = min([r["prefill_s"]] + [runner.generate(id_list, 1)["prefill_s"]
                                                                     for _ in range(args.prefill_repeats)])
                        finally:
                            runner.close()
                    else:
                        model = get_model(v)
                        if model is None:
                            continue
                        gen = None
                        if comp == "decoder":
                            gen = gens.get(key)
                            if gen is None:
                                from fewbits.models.decoder import LlamaDecoder

                                gen = LlamaDecoder(model)
                                torch_round(model, ids, 4, gen)
                                notes[label(v, comp)] = (f"path {gen.last_path}" + (
                                    f" ({gen.native_reason()})" if gen.last_path != "native" else ""))
                                if interleave:
                                    gens[key] = gen
                        elif comp:
                            gen = gens.get(key)
                            if gen is None:
                                from fewbits.models.generation import CompiledGenerator

                                torch._dynamo.reset()
                                gen = CompiledGenerator(model, n_ctx, mode=args.compile_mode,
                                                        compile_prefill=args.compile_prefill)
                                with warnings_quiet():
                                    gen.warm_up(ids, 4)
                                compile_info[(threads, v, comp)] = {"compile_s": gen.compile_seconds, "graphs": gen.graphs,
                                                              "breaks": gen.graph_breaks}
                                if interleave:
                                    gens[key] = gen
                        elif rnd == 0:
                            torch_round(model, ids, 4)
                        r = torch_round(model, ids, args.new_tokens, gen)
                        r["prefill_s"] = min([r["prefill_s"]] + [torch_round(model, ids, 1, gen)["prefill_s"]
                                                                 for _ in range(args.prefill_repeats)])
                        if not interleave:
                            del gen
                            held.pop(v, None)
                            del model
                            gc.collect()
                except Exception as e:
                    failed[f"{v}{SUFFIX[comp]}"] = why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    log(f"{label(v, comp)}: FAILED: {why}")
                    continue
                results[threads][key].append(r)
                log(f"  round {rnd + 1} {label(v, comp)}: prefill {r['prefill_s']:.3f} s, decode "
                    f"{(args.new_tokens - 1) / r['decode_s']:.1f} tok/s ({time.perf_counter() - t0:.0f} s)")
        gens.clear()
        torch._dynamo.reset()
        rows[threads] = {k: best(v) for k, v in results[threads].items() if v}

    profiles = {}
    if args.profile:
        torch.set_num_threads(args.threads[0])
        for v in variants:
            if v in failed:
                continue
            model = get_model(v)
            if model is None:
                continue
            try:
                profiles[v] = profile_decode(model, ids)
            except Exception as e:
                profiles[v] = {"error": f"{type(e).__name__}: {e}"}
            if not interleave:
                del model
                gc.collect()
    held.clear()
    gc.collect()
    return report(name, args, rows, compile_info, notes, failed, profiles, n_batch)


class warnings_quiet:
    """transformers' and dynamo's repeated warnings, kept off the tables."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------
def same_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report(name, args, rows, compile_info, notes, failed, profiles, n_batch) -> dict:
    out = {"model": name, "threads": {}, "notes": notes, "failed": failed, "profiles": profiles,
           "n_batch": n_batch}
    new, prompt = args.new_tokens, args.prompt_tokens
    for threads, got in rows.items():
        def rate(key, phase):
            r = got.get(key)
            if r is None:
                return float("nan")
            return (prompt / r["prefill_s"]) if phase == "prefill" else ((new - 1) / r["decode_s"])

        fp32_dec, fp32_pre = rate(("fp32", ""), "decode"), rate(("fp32", ""), "prefill")
        q40 = rate(("llama-q4_0", ""), "decode")
        ref_tokens = got.get(("fp32", ""), {}).get("tokens")
        head = ["variant", "prefill tok/s", "decode tok/s", "decode / llama.cpp Q4_0", "decode / fp32",
                "prefill / fp32", "= fp32", "compile s", "graphs / breaks"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        table_rows = []
        for key, r in got.items():
            v, comp = key
            pre, dec = rate(key, "prefill"), rate(key, "decode")
            info = compile_info.get((threads, v, comp))
            breaks = sum(info["breaks"].values()) if info else None
            row = {"variant": label(v, comp), "key": f"{v}{SUFFIX[comp]}", "prefill_tok_s": pre,
                   "decode_tok_s": dec, "decode_over_q4_0": dec / q40, "decode_over_fp32": dec / fp32_dec,
                   "prefill_over_fp32": pre / fp32_pre, "rounds": r["rounds"],
                   "same_as_fp32": same_prefix(r["tokens"], ref_tokens) if ref_tokens else None,
                   "compile_s": info["compile_s"] if info else None, "graphs": info["graphs"] if info else None,
                   "graph_breaks": breaks, "break_reasons": short_reasons(info["breaks"]) if info else None,
                   "break_reasons_full": info["breaks"] if info else None,
                   "prefill_s": r["prefill_s"], "decode_s": r["decode_s"]}
            table_rows.append(row)
            cells = [row["variant"], f"{pre:.1f}", f"{dec:.1f}", f"{row['decode_over_q4_0']:.2f}",
                     f"{row['decode_over_fp32']:.2f}", f"{row['prefill_over_fp32']:.2f}",
                     "" if row["same_as_fp32"] is None else f"{row['same_as_fp32']}/{new}",
                     "" if info is None else f"{info['compile_s']:.0f}",
                     "" if info is None else f"{info['graphs']} / {breaks}"]
            lines.append("| " + " | ".join(cells) + " |")
        log(f"\n### {name}, {threads} thread(s): prompt {prompt}, {new} new tokens, batch 1"
            f" (best of {args.rounds} round(s))")
        log("\n".join(lines))
        for v, why in failed.items():
            log(f"- {v if ' ' in v else label(v)}: did not run: {why}")
        reasons = Counter()
        for row in table_rows:
            for reason, c in (row["break_reasons"] or {}).items():
                reasons[f"{row['variant']}: {reason}"] += c
        if reasons:
            log("graph breaks while compiling (reason: count):")
            for reason, c in reasons.most_common():
                log(f"  {reason}: {c}")
        verdicts = targets(got, rate, threads, fp32_dec, fp32_pre, q40)
        for line in verdicts:
            log(line)
        out["threads"][threads] = {"rows": table_rows, "targets": verdicts}
    if profiles:
        log(f"\n### where decode time goes ({args.threads[0]} thread(s); ms per token): 'decode' = a plain "
            "decode step; 'linear layers' = every linear layer's batch-1 forward, called in turn as in a step (the "
            "rest of a step is attention, norms, rotary, the model's Python); under torch.profiler (16 steps, its "
            "overhead included): 'ops' = self time of all aten/custom ops (fewbits' ctypes C kernels are not "
            "ops: nf4's matmul is outside 'ops')")
        for v, p in profiles.items():
            if "error" in p:
                log(f"- {label(v)}: profiler failed: {p['error']}")
                continue
            top = ", ".join(f"{k} {ms:.2f}" for k, ms in p["top"])
            log(f"- {label(v)}: decode {p['plain_ms_per_token']:.1f}, linear layers {p['linear_layers_ms']:.1f} "
                f"({p['linear_layers']} layers, {p['linear_layers_ms'] / p['plain_ms_per_token']:.0%}); profiled: "
                f"wall {p['wall_ms_per_token']:.1f}, ops {p['op_ms_per_token']:.1f} "
                f"(matmul ops {p['matmul_ms_per_token']:.1f}); top: {top}")
    for v, note in notes.items():
        log(f"  note {label(v) if v in ALL_VARIANTS else v}: {note}")
    return out


def targets(got, rate, threads, fp32_dec, fp32_pre, q40) -> list[str]:
    out = []
    for variant, comp in ((v, c) for v in ("int4", "w4a8") for c in SUFFIX):
        key = (variant, comp)
        if key not in got:
            continue
        dec = rate(key, "decode")
        name = label(variant, comp)
        if threads == 1 and q40 == q40:
            r = dec / q40
            out.append(f"{'PASS' if r >= 0.5 else 'FAIL'}: {name} decode >= 0.5x llama.cpp Q4_0 at 1 thread: "
                       f"{r:.2f}x (goal >= 1x: {'met' if r >= 1 else 'not met'})")
        r = dec / fp32_dec
        out.append(f"{'PASS' if r >= 2 else 'FAIL'}: {name} decode >= 2x transformers fp32 eager: {r:.2f}x")
    slow = []
    ours = [k for k in got if k[0] in FEWBITS_SCHEMES]  # the target is fewbits'; bitsandbytes is a peer
    for v, comp in ours:
        r = rate((v, comp), "prefill") / fp32_pre
        if not r >= 1:
            slow.append(f"{label(v, comp)} {r:.2f}x")
    if ours:
        out.append(("PASS: prefill of every fewbits variant >= transformers fp32" if not slow else
                    "FAIL: prefill >= fp32 for every fewbits variant; below: " + ", ".join(slow)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2", help=f"of {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--threads", default="1,2", help="thread counts, each a table (default: %(default)s)")
    p.add_argument("--variants", default=None, help=f"of {', '.join(ALL_VARIANTS)} (default: all)")
    p.add_argument("--compiled", default=None,
                   help=f"variants also run compiled (default: {','.join(DEFAULT_COMPILED)}; 'none')")
    p.add_argument("--decoder", default=None,
                   help=f"variants also run through LlamaDecoder (default: {','.join(DEFAULT_DECODER)}; 'none')")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode (default: inductor's default; e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--compile-prefill", action="store_true", help="compile the prompt's forward too")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="measurements per variant, interleaved; best counts")
    p.add_argument("--prefill-repeats", type=int, default=3,
                   help="extra prompt-only runs per measurement (prefill is short and noisy); the fastest counts")
    p.add_argument("--n-batch", type=int, default=512, help="llama.cpp n_batch (default: %(default)s)")
    p.add_argument("--profile", action="store_true", help="torch.profiler breakdown of each eager variant's decode")
    p.add_argument("--quick", action="store_true", help="smoke run: smollm2, 16 new tokens, fewer variants")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the synthetic model and the GGUFs into --work, probe llama.cpp's n_batch, time nothing")
    p.add_argument("--work", default=None, help="scratch directory for the synthetic model and the GGUFs (kept)")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.new_tokens = "smollm2", min(args.new_tokens, 16)
        args.variants = args.variants or ",".join(QUICK_VARIANTS)
        args.compiled = args.compiled or ",".join(QUICK_COMPILED)
        args.decoder = args.decoder or ",".join(QUICK_DECODER)
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    args.variants = ([v.strip().lower() for v in args.variants.split(",") if v.strip()] if args.variants
                     else list(ALL_VARIANTS))
    args.compiled = ([] if args.compiled == "none" else
                     [v.strip().lower() for v in args.compiled.split(",") if v.strip()] if args.compiled
                     else list(DEFAULT_COMPILED))
    args.decoder = ([] if args.decoder == "none" else
                    [v.strip().lower() for v in args.decoder.split(",") if v.strip()] if args.decoder
                    else list(DEFAULT_DECODER))
    for v in args.decoder:
        if v not in FLOAT + tuple(FEWBITS_SCHEMES):
            p.error(f"unknown decoder variant {v!r}; choose from {', '.join(FLOAT + tuple(FEWBITS_SCHEMES))}")
    for m in models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for v in args.variants:
        if v not in ALL_VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(ALL_VARIANTS)}")
    for v in args.compiled:
        if v not in TORCH_VARIANTS:
            p.error(f"unknown compiled variant {v!r}; choose from {', '.join(TORCH_VARIANTS)}")
    if any(t < 1 for t in args.threads) or args.prompt_tokens < 1 or args.new_tokens < 2 or args.rounds < 1:
        p.error("threads and prompt tokens must be >= 1, new tokens >= 2, rounds >= 1")
    if any(v in LLAMA for v in args.variants):
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            log("llama.cpp rows skipped: llama_cpp is not importable (run benchmarks/setup_llama_cpp.sh)")
            args.variants = [v for v in args.variants if v not in LLAMA]

    from transformers.utils import logging as hf_logging

    from fewbits.hardware import machine_info

    hf_logging.disable_progress_bar()
    # bitsandbytes' int8 matmul logs "inputs will be cast ... to float16" on every call
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    info = machine_info("cpu")
    log(f"CPU: {info['name']} ({os.cpu_count()} cores; torch capability {info['cpu_capability']}; matmul flags "
        f"{' '.join(info['matmul_flags'])}; native kernels {info['native_kernels']})")
    log(f"torch {torch.__version__}; threads {', '.join(map(str, args.threads))}")
    if any(v in LLAMA for v in args.variants):
        import llama_cpp

        log(f"llama-cpp-python {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}; "
            f"x86 flags {' '.join(cpu_flags())}")
    work = args.work or os.path.join(tempfile.gettempdir(), "fewbits-bench-generate")
    os.makedirs(work, exist_ok=True)
    results = {"cpu": info["name"], "torch": torch.__version__, "threads": args.threads, "models": {}}
    t0 = time.perf_counter()
    for m in models:
        results["models"][m] = run_model(m, args, work)
    log(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
