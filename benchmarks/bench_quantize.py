"""Streaming quantization at scale: time and peak memory of quantizing synthetic Llama models
(random bf16 weights, the shapes of SmolLM2-135M, Llama-3.2-1B/3B and Llama-3.1-8B) from a
Hugging Face directory on disk to a quantized one, with fewbits.files.streaming.quantize_pretrained.

Each run is a fresh process, so its peak resident memory (ru_maxrss) is that run's alone; the
float model is never built (see the streaming module's docstring for the bound). Methods: RTN
int4 (groups of 128), GPTQ int4 (calibration: random token ids), RTN Q4_K.

    python benchmarks/bench_quantize.py                       # 135m, 1b, 3b
    python benchmarks/bench_quantize.py --sizes 135m,1b,3b,8b --methods rtn-int4,rtn-q4_k
    python benchmarks/bench_quantize.py --dir /big/disk --keep   # models stay for the next run

Prints the CPU, then a table (size, parameters, source GB, method, seconds, peak RSS GB, output
GB, bits/param) and writes JSON with --json FILE.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

METHODS = {"rtn-int4": ("rtn", "int4"), "gptq-int4": ("gptq", "int4"), "rtn-q4_k": ("rtn", "q4_k"),
           "gptq-q4_k": ("gptq", "q4_k")}

_CHILD = r"""
import json, sys, torch
from fewbits.files.streaming import quantize_pretrained
src, out, method, scheme, batches, seq = sys.argv[1:7]
calibration = None
if method == "gptq":
    g = torch.Generator().manual_seed(0)
    vocab = json.load(open(src + "/config.json"))["vocab_size"]
    calibration = [{"input_ids": torch.randint(0, vocab, (1, int(seq)), generator=g), "use_cache": False}
                   for _ in range(int(batches))]
s = quantize_pretrained(src, out, scheme, method=method, calibration=calibration)
print(json.dumps(s.to_dict()))
"""


def cpu_name() -> str:
    """The CPU's model name, as fewbits.hardware reports it."""
    from fewbits.hardware import machine_info

    return machine_info("cpu")["name"]


def run_one(src: str, out: str, method: str, scheme: str, batches: int, seq: int) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, src, out, method, scheme, str(batches), str(seq)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{method} {scheme} on {src} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["wall_seconds"] = wall
    return summary


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    from fewbits.models.synthetic import LLAMA_SHAPES, synthetic_llama_config, write_synthetic_llama

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="135m,1b,3b", help=f"comma-separated, of {', '.join(LLAMA_SHAPES)}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--dir", default=None, help="where the synthetic models are written (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic models (and reuse them)")
    ap.add_argument("--batches", type=int, default=4, help="GPTQ calibration batches (default 4)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per calibration batch (default 256)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; methods: {', '.join(METHODS)}")
    root = args.dir or tempfile.mkdtemp(prefix="fewbits-bench-quantize-")
    os.makedirs(root, exist_ok=True)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); models in {root}", flush=True)
    rows = []
    try:
        for size in sizes:
            src = os.path.join(root, f"llama-{size}")
            if not os.path.isdir(src):
                t0 = time.perf_counter()
                info = write_synthetic_llama(src, synthetic_llama_config(size))
                print(f"wrote {src}: {info['parameters'] / 1e9:.2f} B parameters, {info['bytes'] / 1e9:.2f} GB "
                      f"in {time.perf_counter() - t0:.0f} s", flush=True)
            src_bytes = dir_bytes(src)
            params = None
            for m in methods:
                method, scheme = METHODS[m]
                out = os.path.join(root, f"out-{size}-{m}")
                shutil.rmtree(out, ignore_errors=True)
                s = run_one(src, out, method, scheme, args.batches, args.seq)
                params = s["parameters"]
                row = {"size": size, "parameters": params, "source_bytes": src_bytes, "method": m,
                       "seconds": s["seconds"], "peak_rss_bytes": s["peak_rss_bytes"], "out_bytes": dir_bytes(out),
                       "bits_per_param": s["bits_per_param"]}
                rows.append(row)
                print(f"{size:>5} {m:<10} {row['seconds']:8.1f} s  peak RSS {row['peak_rss_bytes'] / 1e9:5.2f} GB  "
                      f"out {row['out_bytes'] / 1e9:5.2f} GB  {row['bits_per_param']:.3f} bits/param", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(src, ignore_errors=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print("| model | parameters | source (bf16) | method | time | peak RSS | output | bits/param |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| synthetic Llama {r['size']} | {r['parameters'] / 1e9:.2f} B | {r['source_bytes'] / 1e9:.2f} GB | "
              f"{r['method']} | {r['seconds']:.0f} s | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
              f"{r['out_bytes'] / 1e9:.2f} GB | {r['bits_per_param']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
