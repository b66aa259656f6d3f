"""How much calibration text each importance-aware quantizer needs: held-out KL divergence
against calibration tokens, for llama.cpp + `llama-imatrix`, fewbits `--method imatrix` and fewbits
`--method gptq`, on one GGUF type (issue 31's calibration curve).

    python benchmarks/bench_calibration.py                         # Q4_0, 1..64 windows of 256 tokens
    python benchmarks/bench_calibration.py --type q4_k_m --windows 2,8,32 --finetune 20 --plot c.png

The same setting as bench_quality.py (whose helpers it uses; llama.cpp's C++ tools from
setup_llama_tools.sh, Debian's `fortunes` downloaded once): SmolLM2-135M (packaged, or
--finetune STEPS off its Q4_1 grid), calibration the first N windows of --length tokens of
Python's pydoc topics, the same text and amount for every maker (llama.cpp: `llama-imatrix -c
LENGTH --chunks N`), evaluation 32 windows of 512 tokens of the prose sections of `fortunes`,
scored by llama.cpp's `llama-perplexity` against the F32 model's logits. Prints the CPU and a table
(calibration tokens × maker: KLD, and KLD ÷ llama.cpp + imatrix at that amount); --json keeps the
points after every one, --plot draws KLD against calibration tokens (log-log).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_gguf_decode import tools_dir  # noqa: E402
from bench_quality import (TYPES, cpu_name, f32_gguf, file_stats, kl_scores, kld_plot, log,  # noqa: E402
                           model_directory, run, write_texts)

MAKERS = ("llama.cpp + imatrix", "fewbits imatrix", "fewbits gptq")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--type", default="q4_0", help=f"a GGUF type of bench_quality ({', '.join(TYPES)})")
    p.add_argument("--windows", default="1,2,4,8,16,32,64", help="calibration windows, comma-separated")
    p.add_argument("--length", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--makers", default=",".join(MAKERS))
    p.add_argument("--eval-chunks", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--finetune", type=int, default=0, metavar="STEPS")
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--tools")
    p.add_argument("--work", default=None, help="default: ~/.cache/fewbits/bench-quality, or bench-quality-ft with "
                   "--finetune (the directories the README's runs of bench_quality used: their cached files)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.type not in TYPES:
        raise SystemExit(f"--type: unknown {args.type!r}; known: {', '.join(TYPES)}")
    makers = [m.strip() for m in args.makers.split(",") if m.strip()]
    for m in makers:
        if m not in MAKERS:
            raise SystemExit(f"--makers: unknown {m!r}; known: {', '.join(MAKERS)}")
    try:
        windows = sorted({int(w) for w in args.windows.split(",") if w.strip()})
    except ValueError:
        raise SystemExit(f"--windows takes whole numbers, got {args.windows!r}") from None
    if not windows or windows[0] < 1 or args.length < 16:
        raise SystemExit("--windows must be >= 1 and --length >= 16")
    work = args.work or os.path.expanduser("~/.cache/fewbits/bench-quality" + ("-ft" if args.finetune else ""))
    os.makedirs(work, exist_ok=True)
    bins = tools_dir(args.tools)
    log(f"CPU: {cpu_name()}; llama.cpp tools: {bins}")
    calib, evaluation = write_texts(work)
    tag = f"smollm2-ft{args.finetune}-lr{args.finetune_lr:g}" if args.finetune else "smollm2"
    directory = model_directory(work, args.finetune, args.finetune_lr)
    f32 = f32_gguf(work, directory, tag)
    base = os.path.join(work, f"{tag}-base-{args.eval_chunks}.kld")
    if not os.path.exists(base):
        run([os.path.join(bins, "llama-perplexity"), "-m", f32, "-f", evaluation, "-c", "512", "--chunks",
             str(args.eval_chunks), "-t", str(args.threads), "--kl-divergence-base", base + ".part"], "the base logits")
        os.replace(base + ".part", base)
    ltype, pure, scheme = TYPES[args.type]
    points = []
    result = {"cpu": cpu_name(), "model": tag, "type": args.type, "length": args.length, "points": points}
    for n in windows:
        for maker in makers:
            path = os.path.join(work, f"{tag}-calib-{args.type}-{n}x{args.length}-{maker.replace(' ', '_').replace('+', 'plus')}.gguf")
            t0 = time.perf_counter()
            if maker.startswith("llama.cpp"):
                imatrix = os.path.join(work, f"{tag}-imatrix-{n}x{args.length}.gguf")
                if not os.path.exists(imatrix):
                    run([os.path.join(bins, "llama-imatrix"), "-m", f32, "-f", calib, "-c", str(args.length), "--chunks",
                         str(n), "-t", str(args.threads), "-o", imatrix], "llama-imatrix")
                run([os.path.join(bins, "llama-quantize")] + (["--pure"] if pure else []) +
                    ["--imatrix", imatrix, f32, path, ltype, str(args.threads)], f"llama-quantize {ltype}")
            else:
                method = maker.split()[-1]
                run([sys.executable, "-m", "fewbits.cli", "quantize", directory, "--scheme", scheme, "--format", "gguf",
                     "--method", method, "--out", path, "--overwrite", "--quiet", "--calibration", calib,
                     "--calibration-samples", str(n), "--calibration-length", str(args.length)],
                    f"fewbits quantize --method {method}")
            seconds = time.perf_counter() - t0
            row = {"windows": n, "tokens": n * args.length, "maker": maker, "seconds": seconds,
                   "bits_per_param": file_stats(path)["bits_per_param"], **kl_scores(bins, path, base, args.threads)}
            points.append(row)
            log(f"{n * args.length:6d} tokens  {maker:20s} KLD {row['kld']:.4f}  PPL {row['ppl']:.3f}  ({seconds:.0f} s)")
            if args.json:
                with open(args.json + ".part", "w") as f:
                    json.dump(result, f, indent=1)
                os.replace(args.json + ".part", args.json)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    return 0


def print_table(result: dict) -> None:
    points = result["points"]
    makers = list(dict.fromkeys(p["maker"] for p in points))
    ref = {p["tokens"]: p["kld"] for p in points if p["maker"] == "llama.cpp + imatrix"}
    print(f"# CPU: {result['cpu']}. {result['model']} in {result['type']}; calibration: pydoc in windows of "
          f"{result['length']} tokens; evaluation: fortunes; mean KL divergence to F32 by llama-perplexity")
    print("| calibration tokens | " + " | ".join(makers) + " |")
    print("|---:|" + "---:|" * len(makers))
    for tokens in sorted({p["tokens"] for p in points}):
        cells = []
        for m in makers:
            hit = [p for p in points if p["tokens"] == tokens and p["maker"] == m]
            if not hit:
                cells.append("—")
                continue
            k = hit[0]["kld"]
            cells.append(f"{k:.4f}" + (f" ({k / ref[tokens]:.2f}×)" if tokens in ref and m != "llama.cpp + imatrix" else ""))
        print(f"| {tokens} | " + " | ".join(cells) + " |")


def plot(result: dict, path: str) -> None:
    kld_plot(result["points"], "tokens", path, "calibration tokens (pydoc)",
             "mean KL divergence to F32 on fortunes (log)",
             f"{result['model']} {result['type']}: held-out quality against calibration", xlog2=True)


if __name__ == "__main__":
    sys.exit(main())
