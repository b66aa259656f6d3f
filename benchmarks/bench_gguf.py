"""fewbits' GGUF files against llama.cpp's own quantizer, measured by llama.cpp itself.

    python benchmarks/bench_gguf.py                                   # both models, ~10-15 min here
    python benchmarks/bench_gguf.py --models minilm --types q4_0,q4_k_m
    python benchmarks/bench_gguf.py --models smollm2 --methods rtn --tokens 2048 --no-generate
    python benchmarks/bench_gguf.py --keep /tmp/gguf --json gguf.json

Needs llama-cpp-python (benchmarks/setup_llama_cpp.sh builds it for this CPU). For each model:

1. fewbits writes the float model as an F32 GGUF (fewbits.files.gguf_file.write_gguf) and llama.cpp
   must reproduce the float model from it (printed: cosine of llama.cpp's embeddings to the fp32
   reference, or llama.cpp's perplexity beside torch's on the same windows).
2. Per GGUF type (a recipe of fewbits.files.gguf_file.gguf_recipe: uniform q8_0, q4_0, ... or
   llama.cpp's mixes q4_k_m, q5_k_m, q4_k_s), three files of the same tensor types and so the
   same size:
   - llama.cpp: `llama_cpp.llama_model_quantize` of that F32 GGUF (no importance matrix; for a
     uniform type with `pure`, as `llama-quantize --pure`, which is what the uniform recipes are;
     the mixes with llama.cpp's own rules, which gguf_recipe reproduces);
   - fewbits RTN and fewbits GPTQ: `fb.quantize_model(model, gguf_recipe(type, config),
     embeddings=True, tied="untie")` in memory, then write_gguf. (The token embedding is
     quantized, as llama.cpp does; for a tied model it is also the output head in llama.cpp, and
     write_gguf writes no lm_head.)
   Every quantized file's tensor types are checked to equal the llama.cpp file's, tensor by
   tensor (column "types"); bits/param are the tensor data bytes in the file (GGUFReader) over
   the parameters, size is the whole file. For RTN the column "= llama.cpp" counts the
   quantized tensors whose bytes equal llama.cpp's (the legacy types are llama.cpp's reference
   arithmetic: all of them).
3. Quality is computed BY LLAMA.CPP from each file:
   - all-MiniLM-L6-v2 (genuine fp32 weights): sentence embeddings (Llama(embedding=True), the mean
     pooling the GGUF declares, normalized) of --eval pydoc sentences, cosine to the fp32
     reference (fewbits.models.minilm.embed: sentence-transformers' recipe on the torch model),
     mean and minimum. GPTQ calibrates on --calib other pydoc sentences (disjoint).
   - SmolLM2-135M: perplexity on the first --tokens tokens of the pydoc eval text, windows of
     --seq-len tokens overlapping by one (fewbits.models.smollm2.perplexity_windows: the same
     windows for every file and for torch), from llama.cpp's logits (logits_all=True); the token
     ids are the Hugging Face tokenizer's, fed to llama.cpp as ids. GPTQ calibrates on
     --calib-batches windows of 256 tokens of the pydoc train text (disjoint topics).
     CAVEAT: SmolLM2's packaged weights are GGUF Q4_1 dequantized (fewbits.models.Q4_1_CAVEAT):
     4-bit results on it are flattered; MiniLM's are the evidence.
4. Generation (SmolLM2, --no-generate skips it): the fewbits GPTQ q4_k_m file, prompt and greedy
   continuation by llama.cpp (beside the F32 file's); transformers loads the same file with
   gguf_file= and continues greedily too, and its logits are compared with fewbits' dequantized
   model's.

"quantize s" is fewbits' quantize_model plus write_gguf, or llama.cpp's llama_model_quantize
(reading the F32 GGUF, writing the file); the F32 GGUF's own writing time is printed apart.
On a shared machine the times are indicative only.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import torch

# recipe -> (llama.cpp ftype constant, pure): the uniform recipes are llama-quantize --pure
LLAMA_TYPES = {
    "q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", True),
    "q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", True),
    "q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", True),
    "q5_0": ("LLAMA_FTYPE_MOSTLY_Q5_0", True),
    "q5_1": ("LLAMA_FTYPE_MOSTLY_Q5_1", True),
    "q4_k": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", True),
    "q5_k": ("LLAMA_FTYPE_MOSTLY_Q5_K_S", True),
    "q6_k": ("LLAMA_FTYPE_MOSTLY_Q6_K", True),
    "q4_k_s": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", False),
    "q4_k_m": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
    "q5_k_m": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", False),
}
METHODS = ("rtn", "gptq")
PROMPTS = ("The capital of France is", "Python is a programming language that")


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU's model name, as fewbits.hardware reports it."""
    from fewbits.hardware import machine_info

    return machine_info("cpu")["name"]


def cpu_flags() -> list[str]:
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_int8")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


@contextlib.contextmanager
def quiet_fds():
    """llama.cpp's C code logs to stdout/stderr directly: send both to a file, shown on error."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace")[-4000:])
            raise
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def tensor_mapping(model) -> dict:
    """write_gguf's tensor mapping of an in-memory model: '<module>.weight' -> the QuantizedTensor
    of every quantized module, every other state_dict entry (floats, biases) as it is."""
    from fewbits.quant.plan import is_quantized

    quantized = [n for n, m in model.named_modules() if is_quantized(m)]
    out = {f"{n}.weight": model.get_submodule(n).qweight for n in quantized}
    held = tuple(f"{n}.qweight." for n in quantized)
    for key, value in model.state_dict().items():
        if not key.startswith(held):
            out[key] = value
    return out


_READERS: dict = {}


def reader(path: str):
    """gguf.GGUFReader of the file, parsed once (its metadata, the vocabulary, takes seconds)."""
    import gguf

    if path not in _READERS:
        _READERS[path] = gguf.GGUFReader(path)
    return _READERS[path]


def forget(path: str) -> None:
    """Drop the parsed reader of a file about to be rewritten."""
    _READERS.pop(path, None)


def gguf_stats(path: str) -> dict:
    """From the file itself (gguf.GGUFReader): parameters, tensor data bytes, bits/param, file
    size, {tensor: GGML type name}."""
    tensors = reader(path).tensors
    types = {t.name: t.tensor_type.name for t in tensors}
    params = sum(int(t.n_elements) for t in tensors)
    data = sum(int(t.n_bytes) for t in tensors)
    return {"parameters": params, "tensor_bytes": data, "bits_per_param": data * 8 / params,
            "file_bytes": os.path.getsize(path), "types": types}


def same_bytes(path_a: str, path_b: str) -> tuple[int, int]:
    """(quantized tensors whose bytes are equal in both files, quantized tensors)."""
    a = {t.name: t for t in reader(path_a).tensors}
    b = {t.name: t for t in reader(path_b).tensors}
    names = [n for n, t in a.items() if t.tensor_type.name not in ("F32", "F16", "BF16")]
    equal = sum(n in b and np.array_equal(np.asarray(a[n].data).view(np.uint8).ravel(),
                                          np.asarray(b[n].data).view(np.uint8).ravel()) for n in names)
    return equal, len(names)


def type_summary(types: dict) -> str:
    counts = Counter(t for t in types.values() if t != "F32")
    return " ".join(f"{t}:{c}" for t, c in sorted(counts.items())) or "F32"


def llama_quantize(src: str, dst: str, recipe: str, threads: int) -> float:
    import llama_cpp

    ftype, pure = LLAMA_TYPES[recipe]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.pure = pure
    params.nthread = threads
    forget(dst)
    t0 = time.perf_counter()
    with quiet_fds():
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {recipe}) returned {rc}")
    return seconds


def fewbits_quantize(model, recipe: str, method: str, calibration):
    """A quantized copy of the model under gguf_recipe(recipe) and the seconds it took."""
    import fewbits as fb
    from fewbits.files.gguf_file import gguf_recipe

    m = copy.deepcopy(model)
    t0 = time.perf_counter()
    fb.quantize_model(m, gguf_recipe(recipe, m.config), method=method,
                      calibration=calibration if method == "gptq" else None, embeddings=True, tied="untie")
    return m, time.perf_counter() - t0


def write(path: str, model, tokenizer, file_type=None) -> float:
    from fewbits.files.gguf_file import write_gguf

    forget(path)
    t0 = time.perf_counter()
    write_gguf(path, tensor_mapping(model), model.config, tokenizer, overwrite=True, file_type=file_type)
    return time.perf_counter() - t0


def gguf_types_of_model(prefix: str, recipe: str, model, tokenizer, work: str, f32: str, threads: int, methods,
                        calibration, measure, keep_model=None):
    """The rows of one recipe: llama.cpp's file, then fewbits' per method; measure(path) -> quality dict.
    keep_model(recipe, method, quantized model) is called before a quantized model is dropped."""
    rows = []
    ref_path = os.path.join(work, f"{prefix}-llamacpp-{recipe}.gguf")
    seconds = llama_quantize(f32, ref_path, recipe, threads)
    ref = gguf_stats(ref_path)
    rows.append({"file": "llama.cpp", "type": recipe, "path": ref_path, "seconds": seconds, **ref,
                 "types_match": True, "same_bytes": None, **measure(ref_path)})
    for method in methods:
        m, q_seconds = fewbits_quantize(model, recipe, method, calibration)
        path = os.path.join(work, f"{prefix}-fewbits-{method}-{recipe}.gguf")
        w_seconds = write(path, m, tokenizer, file_type=recipe)
        if keep_model is not None:
            keep_model(recipe, method, m)
        del m
        stats = gguf_stats(path)
        mismatched = [n for n in set(stats["types"]) | set(ref["types"])
                      if stats["types"].get(n) != ref["types"].get(n)]
        equal = same_bytes(path, ref_path) if method == "rtn" else None
        rows.append({"file": f"fewbits {method.upper()}", "type": recipe, "path": path,
                     "seconds": q_seconds + w_seconds, **stats, "types_match": not mismatched,
                     "mismatched": sorted(mismatched)[:5], "same_bytes": equal, **measure(path)})
    return rows


# ---------------------------------------------------------------------------------------------
# quality by llama.cpp
# ---------------------------------------------------------------------------------------------
def llama_embeddings(path: str, sentences, threads: int) -> torch.Tensor:
    import llama_cpp

    with quiet_fds():
        llm = llama_cpp.Llama(path, embedding=True, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads,
                              n_threads_batch=threads, verbose=False)
        try:
            emb = llm.embed(list(sentences))
        finally:
            llm.close()
    return torch.nn.functional.normalize(torch.tensor(np.asarray(emb, dtype=np.float32)), dim=1)


def llama_tokens(path: str, texts, **kw) -> list[list[int]]:
    import llama_cpp

    with quiet_fds():
        llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
        try:
            return [llm.tokenize(t.encode(), **kw) for t in texts]
        finally:
            llm.close()


def llama_perplexity(path: str, ids: list[int], seq_len: int, threads: int) -> dict:
    """Perplexity from llama.cpp's logits over perplexity_windows(len(ids), seq_len, seq_len - 1)."""
    import llama_cpp
    from fewbits.models.smollm2 import perplexity_windows

    nll, scored = 0.0, 0
    t0 = time.perf_counter()
    with quiet_fds():
        llm = llama_cpp.Llama(path, n_ctx=seq_len, n_batch=seq_len, n_ubatch=seq_len, logits_all=True,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
        try:
            for begin, end, first in perplexity_windows(len(ids), seq_len, seq_len - 1):
                llm.reset()
                llm.eval(ids[begin:end])
                logits = torch.from_numpy(llm.scores[first - begin - 1:end - begin - 1]).double()
                target = torch.tensor(ids[first:end])
                nll -= torch.log_softmax(logits, dim=-1).gather(1, target[:, None]).sum().item()
                scored += end - first
        finally:
            llm.close()
    dt = time.perf_counter() - t0
    return {"perplexity": math.exp(nll / scored), "tokens": scored, "eval_seconds": dt}


def llama_generate(path: str, prompt: str, tokens: int, threads: int) -> str:
    import llama_cpp

    with quiet_fds():
        llm = llama_cpp.Llama(path, n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
        try:
            out = llm(prompt, max_tokens=tokens, temperature=0.0, top_k=1, echo=False)
        finally:
            llm.close()
    return out["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------
def table(rows, quality_cols) -> str:
    head = ["file", "type", "tensor types", "bits/param", "size MiB", *[c for c, _ in quality_cols], "quantize s",
            "types = llama.cpp", "bytes = llama.cpp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        eq = "" if r.get("same_bytes") is None else f"{r['same_bytes'][0]}/{r['same_bytes'][1]}"
        match = "" if r["file"].startswith(("F32", "llama.cpp")) else ("yes" if r["types_match"] else
                                                                       "NO: " + ", ".join(r["mismatched"]))
        cells = [r["file"], r["type"], type_summary(r["types"]), f"{r['bits_per_param']:.3f}",
                 f"{r['file_bytes'] / 2**20:.1f}", *[fmt(r) for _, fmt in quality_cols],
                 "" if r.get("seconds") is None else f"{r['seconds']:.1f}", match, eq]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(rows, key: str, higher_is_better: bool, reference: float) -> list[str]:
    """Per type: fewbits' error against llama.cpp's (error = distance to the float reference)."""
    out = []
    for recipe in dict.fromkeys(r["type"] for r in rows if r["file"] == "llama.cpp"):
        same = {r["file"]: r for r in rows if r["type"] == recipe}
        base = same["llama.cpp"][key]
        err_base = abs(reference - base)
        parts = []
        for name, r in same.items():
            if name == "llama.cpp":
                continue
            err = abs(reference - r[key])
            if r[key] == base:
                verdict = "equals"
            else:
                verdict = "beats" if (r[key] > base) == higher_is_better else "LOSES TO"
            ratio = err / err_base if err_base else float("nan")
            parts.append(f"{name} {verdict} llama.cpp ({key} {r[key]:.6g} vs {base:.6g}; error "
                         f"{ratio:.2f}x llama.cpp's)")
        out.append(f"{recipe}: " + "; ".join(parts))
    return out


# ---------------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------------
def run_minilm(args, work: str) -> dict:
    from fewbits.models.minilm import embed, embedding_quality, load_minilm
    from fewbits.models.text import pydoc_sentences
    from fewbits.study.quantization import sentence_calibration

    log("\n## all-MiniLM-L6-v2 (genuine fp32 weights): embeddings computed by llama.cpp")
    model, tokenizer = load_minilm()
    sentences = pydoc_sentences(args.eval + args.calib, seed=0)
    evals, calib = sentences[:args.eval], sentences[args.eval:]
    reference = embed(model, tokenizer, evals)
    calibration = sentence_calibration(tokenizer, calib)
    log(f"{len(evals)} evaluation sentences, {len(calib)} calibration sentences (disjoint), pydoc topics; "
        f"reference: the fp32 torch model, mean pooling + L2 norm (sentence-transformers' recipe)")

    f32 = os.path.join(work, "minilm-f32.gguf")
    w_seconds = write(f32, model, tokenizer, file_type="f32")
    hf_ids = [tokenizer(s)["input_ids"] for s in evals]
    same_tok = sum(a == b for a, b in zip(llama_tokens(f32, evals, add_bos=True), hf_ids))
    log(f"F32 GGUF written in {w_seconds:.1f} s; llama.cpp's tokens equal the HF tokenizer's on {same_tok}/"
        f"{len(evals)} sentences")

    def measure(path):
        t0 = time.perf_counter()
        q = embedding_quality(reference, llama_embeddings(path, evals, args.threads))
        return {"mean_cosine": q.mean_cosine, "min_cosine": q.min_cosine, "spearman": q.spearman,
                "eval_seconds": time.perf_counter() - t0}

    rows = [{"file": "F32 (fewbits write_gguf)", "type": "f32", "path": f32, "seconds": None, **gguf_stats(f32),
             **measure(f32)}]
    log(f"llama.cpp on the F32 GGUF vs the fp32 torch model: mean cosine {rows[0]['mean_cosine']:.7f}, "
        f"min {rows[0]['min_cosine']:.7f}")
    for recipe in args.types:
        t0 = time.perf_counter()
        rows += gguf_types_of_model("minilm", recipe, model, tokenizer, work, f32, args.threads, args.methods,
                                    calibration, measure)
        log(f"  {recipe}: done in {time.perf_counter() - t0:.0f} s")
    cols = [("mean cos", lambda r: f"{r['mean_cosine']:.5f}"), ("min cos", lambda r: f"{r['min_cosine']:.5f}"),
            ("1 - mean cos", lambda r: f"{1 - r['mean_cosine']:.2e}")]
    log("")
    log(table(rows, cols))
    log("")
    for line in verdicts(rows, "mean_cosine", True, 1.0):
        log(line)
    return {"rows": rows, "eval": len(evals), "calib": len(calib), "same_tokens": same_tok}


def run_smollm2(args, work: str) -> dict:
    from fewbits.models import Q4_1_CAVEAT, load_smollm2
    from fewbits.models.smollm2 import perplexity
    from fewbits.models.text import pydoc_split
    from fewbits.study.quantization import causal_calibration

    log("\n## SmolLM2-135M: perplexity computed by llama.cpp")
    log(f"CAVEAT: {Q4_1_CAVEAT}")
    model, tokenizer = load_smollm2()
    split = pydoc_split()
    ids = tokenizer(split.eval, add_special_tokens=False, verbose=False)["input_ids"][:args.tokens]
    calibration = causal_calibration(tokenizer, split.train, args.calib_batches, 256)
    torch_ppl = perplexity(model, tokenizer, torch.tensor(ids), seq_len=args.seq_len)
    f32 = os.path.join(work, "smollm2-f32.gguf")
    w_seconds = write(f32, model, tokenizer, file_type="f32")
    sample = split.eval[:2000]
    same_tok = llama_tokens(f32, [sample], add_bos=False, special=False)[0] == \
        tokenizer(sample, add_special_tokens=False)["input_ids"]
    log(f"{len(ids)} eval tokens (pydoc eval topics), windows of {args.seq_len}; GPTQ calibration "
        f"{len(calibration)} x 256 tokens of the train topics; F32 GGUF written in {w_seconds:.1f} s; llama.cpp "
        f"tokenizes the first 2000 characters as the HF tokenizer: {same_tok}")

    def measure(path):
        return llama_perplexity(path, ids, args.seq_len, args.threads)

    rows = [{"file": "F32 (fewbits write_gguf)", "type": "f32", "path": f32, "seconds": None, **gguf_stats(f32),
             **measure(f32)}]
    log(f"perplexity of the fp32 model: torch {torch_ppl.perplexity:.4f}, llama.cpp on the F32 GGUF "
        f"{rows[0]['perplexity']:.4f} ({rows[0]['eval_seconds']:.0f} s)")
    kept = {}

    def keep(recipe, method, m):
        if method == "gptq" and recipe == args.generate_type:
            kept["model"] = m

    for recipe in args.types:
        t0 = time.perf_counter()
        rows += gguf_types_of_model("smollm2", recipe, model, tokenizer, work, f32, args.threads, args.methods,
                                    calibration, measure, keep_model=keep)
        log(f"  {recipe}: done in {time.perf_counter() - t0:.0f} s")
    cols = [("perplexity", lambda r: f"{r['perplexity']:.4f}")]
    log("")
    log(table(rows, cols))
    log("")
    for line in verdicts(rows, "perplexity", False, rows[0]["perplexity"]):
        log(line)
    result = {"rows": rows, "tokens": len(ids), "torch_f32_perplexity": torch_ppl.perplexity}
    if not args.no_generate:
        result["generation"] = generation_check(args, work, model, tokenizer, f32, kept.get("model"), calibration)
    return result


def dequantized_model(original, quantized):
    """A float copy of `original` with every weight fewbits quantized replaced by its
    dequantization (for a tied model the embedding is the output head too, as in the GGUF)."""
    from fewbits.quant.plan import is_quantized

    m = copy.deepcopy(original)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if is_quantized(module):
                m.get_submodule(name).weight.copy_(module.qweight.dequantize(torch.float32))
    return m


def generation_check(args, work, model, tokenizer, f32, quantized, calibration) -> dict:
    from transformers import AutoModelForCausalLM

    recipe = args.generate_type
    log(f"\n## Generation: the fewbits GPTQ {recipe} GGUF of SmolLM2 in llama.cpp and in transformers")
    path = os.path.join(work, f"smollm2-fewbits-gptq-{recipe}.gguf")
    if quantized is None or not os.path.exists(path):
        quantized, _ = fewbits_quantize(model, recipe, "gptq", calibration)
        write(path, quantized, tokenizer, file_type=recipe)
    out = {"file": path, "prompts": []}
    with quiet_fds():
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
    reference = dequantized_model(model, quantized)
    for prompt in PROMPTS:
        fb_text = llama_generate(path, prompt, args.gen_tokens, args.threads)
        f32_text = llama_generate(f32, prompt, args.gen_tokens, args.threads)
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            gen = hf.generate(**enc, max_new_tokens=args.gen_tokens, do_sample=False)
            diff = (hf(**enc).logits - reference(**enc).logits).abs().max().item()
        hf_text = tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        log(f"prompt: {prompt!r}")
        log(f"  llama.cpp, fewbits GPTQ {recipe}: {fb_text!r}")
        log(f"  llama.cpp, F32:                 {f32_text!r}")
        log(f"  transformers gguf_file=, fewbits GPTQ {recipe}: {hf_text!r}")
        log(f"  max |logit difference| transformers(GGUF) vs fewbits' dequantized model: {diff:.3g}")
        out["prompts"].append({"prompt": prompt, "llama_cpp": fb_text, "llama_cpp_f32": f32_text,
                               "transformers": hf_text, "max_logit_diff": diff})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm,smollm2", help="minilm, smollm2 (default: %(default)s)")
    p.add_argument("--types", default="q8_0,q4_0,q4_k_m,q5_k_m",
                   help=f"GGUF recipes, of {', '.join(LLAMA_TYPES)} (default: %(default)s)")
    p.add_argument("--methods", default="rtn,gptq", help="fewbits methods (default: %(default)s)")
    p.add_argument("--eval", type=int, default=256, help="MiniLM evaluation sentences (default: %(default)s)")
    p.add_argument("--calib", type=int, default=128, help="MiniLM calibration sentences (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=4096, help="SmolLM2 eval tokens (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="SmolLM2 perplexity window (default: %(default)s)")
    p.add_argument("--calib-batches", type=int, default=8,
                   help="SmolLM2 GPTQ calibration windows of 256 tokens (default: %(default)s)")
    p.add_argument("--no-generate", action="store_true", help="skip the generation check")
    p.add_argument("--generate-type", default="q4_k_m", help="the recipe of the generation check (default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=24, help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and llama.cpp threads (default: %(default)s; the machine is shared)")
    p.add_argument("--keep", default=None, help="write the GGUF files into this directory and keep them")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    args.types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    args.methods = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for t in args.types + [args.generate_type]:
        if t not in LLAMA_TYPES:
            p.error(f"unknown type {t!r}; choose from {', '.join(LLAMA_TYPES)}")
    for m in args.methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    for m in models:
        if m not in ("minilm", "smollm2"):
            p.error(f"unknown model {m!r}; choose from minilm, smollm2")
    try:
        import llama_cpp
    except ImportError:
        p.error("llama_cpp is not importable: run benchmarks/setup_llama_cpp.sh first")
    torch.set_num_threads(args.threads)

    log(f"CPU: {cpu_name()} ({os.cpu_count()} cores; flags {' '.join(cpu_flags())}); {args.threads} thread(s)")
    log(f"llama-cpp-python {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}")
    log(f"torch {torch.__version__}; types {', '.join(args.types)}; methods {', '.join(args.methods)}")
    work = args.keep or tempfile.mkdtemp(prefix="fewbits-bench-gguf-")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    results = {"cpu": cpu_name(), "threads": args.threads, "llama_cpp": llama_cpp.__version__}
    try:
        if "minilm" in models:
            results["minilm"] = run_minilm(args, work)
        if "smollm2" in models:
            results["smollm2"] = run_smollm2(args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    log(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
