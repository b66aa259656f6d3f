"""Speed and weight bytes of quantized Linear layers on this CPU, beside fp32 and torch's
quantize_dynamic, measured back to back in one run.

A stack of `--layers` Linear(dim, dim) layers (default 4 x 4096x4096, 256 MiB of fp32 weights:
more than the caches, as in a real model) runs at batch 1 and batch 64 in each variant:

  fp32              the float stack (MKL sgemm / sgemv)
  quantize_dynamic  torch.ao.quantization.quantize_dynamic(qint8): fbgemm, per-tensor uint8
                    activations, prepacked int8 weights
  w8a8              fewbits "w8a8": int8 per-channel weights, dynamic per-token int8
                    activations (oneDNN prepacked int8 GEMM, exact int32 accumulation)
  w8a8 torch ops    the same, with the activation quantization and rescale as torch ops instead
                    of fewbits' fused C kernels (fewbits.kernels.native; what runs without a C
                    compiler)
  w8a8 _int_mm      the same scheme through torch._int_mm (the fallback without oneDNN)
  int8              int8 per-channel weight-only (aten._weight_int8pack_mm, bf16 activations)
  int4 g128 / g32   int4 weight-only, groups of 128 / 32 (aten._weight_int4pack_mm_for_cpu)
  bf16              bf16 weights (oneDNN bf16 GEMM)
  bitsandbytes nf4  bnb.nn.Linear4bit(quant_type="nf4"), float32 compute, on this CPU (its fast CPU
                    kernel comes from the `kernels` package and the model hub, which this machine
                    cannot reach: what runs is bitsandbytes' own fallback); skipped if bnb is absent
  nf4, mxfp4, nvfp4 the dequant kernel: up to 12 rows of input, fewbits' C matmul that decodes the
                    4-bit codes in registers (fewbits.kernels.native); beyond, blocks of rows
                    decoded to float32 by C and multiplied by MKL

Timing: after warm-up, the variants run round-robin (one forward each per round) so that every
variant sees the same machine load; the median and the minimum of the rounds are shown, in ms per
forward of the whole stack. `speed-up` is fp32's time over the variant's (from the median, or the
minimum with --stat min); `bytes` counts the weights as held (codes, scales, zero points and
kernel-side tensors; biases excluded); `rel err` is ||y - y_fp32|| / ||y_fp32|| of the stack's
output. Finally the targets of issue 3 are checked as ratios within this run, PASS/FAIL.

On a machine whose cores are busy with other work, every parallel region waits for a busy core
(milliseconds each): two-thread times then measure the scheduler more than the kernels. The load
average is printed at the start; compare with --threads 1, or use --stat min.

    python benchmarks/bench_linear.py                  # 2 threads, 4 x 4096, batches 1 and 64
    python benchmarks/bench_linear.py --threads 1 --rounds 15
    python benchmarks/bench_linear.py --variants quantize_dynamic,w8a8 --batches 64 --stat min
    python benchmarks/bench_linear.py --json linear.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch import nn

from fewbits.kernels import native
from fewbits.quant.modules import QuantLinear

VARIANTS = [  # (label, fewbits scheme or None, forced kernel or None)
    ("fp32", None, None),
    ("quantize_dynamic", None, None),
    ("w8a8", "w8a8", None),
    ("w8a8 torch ops", "w8a8", "torch-ops"),
    ("w8a8 _int_mm", "w8a8", "w8a8_int_mm"),
    ("int8", "int8", None),
    ("int4 g128", "int4", None),
    ("int4 g32", "int4_g32", None),
    ("bf16", "bf16", None),
    ("nf4", "nf4", None),
    ("mxfp4", "mxfp4", None),
    ("nvfp4", "nvfp4", None),
    ("bitsandbytes nf4", None, None),
]


def build(fp32: nn.Sequential, label: str, scheme, kernel):
    if label == "fp32":
        return fp32, sum(m.weight.nbytes for m in fp32), "mkl fp32"
    if label == "quantize_dynamic":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {nn.Linear}, dtype=torch.qint8)
        # fbgemm holds one prepacked int8 copy of each weight (plus per-tensor scale/zero point)
        return q, sum(m.weight.numel() for m in fp32), "fbgemm"
    if label == "bitsandbytes nf4":  # bnb.nn.Linear4bit: NF4 in blocks of 64, float32 compute
        import bitsandbytes as bnb
        layers = []
        for m in fp32:
            q = bnb.nn.Linear4bit(m.in_features, m.out_features, quant_type="nf4", compute_dtype=torch.float32)
            q.load_state_dict(m.state_dict())
            layers.append(q.to("cpu"))
        held = sum(q.weight.numel() + q.weight.quant_state.absmax.numel() * 4 for q in layers)
        return nn.Sequential(*layers), held, "bnb cpu"
    if kernel == "torch-ops":
        layers = [QuantLinear.from_linear(m, scheme) for m in fp32]
        return _TorchOps(*layers), sum(m.nbytes for m in layers), layers[0].kernel
    layers = [QuantLinear.from_linear(m, scheme, kernel=kernel or "auto") for m in fp32]
    return nn.Sequential(*layers), sum(m.nbytes for m in layers), layers[0].kernel


class _TorchOps(nn.Sequential):
    """The stack with fewbits' fused C kernels turned off: the steps around the GEMM (activation
    quantization, rescale) run as torch ops, as where no C compiler is found."""

    def forward(self, x):
        with native.turned_off():
            return super().forward(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2: this machine's cores)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=11, help="timed rounds (the median is reported)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="statistic the speed-ups and targets use (min: the least disturbed round, for a "
                        "machine busy with other work)")
    p.add_argument("--variants", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--json", default=None, help="write every sample and the environment here")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    variants = VARIANTS
    if args.variants:
        want = [v.strip() for v in args.variants.split(",")]
        unknown = set(want) - {v[0] for v in VARIANTS}
        if unknown:
            print(f"unknown variants: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        variants = [v for v in VARIANTS if v[0] in want or v[0] == "fp32"]

    torch.manual_seed(0)
    fp32 = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)]).eval()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {args.layers} x Linear({args.dim}, {args.dim}), threads={torch.get_num_threads()}, "
          f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load average {load:.1f} on {os.cpu_count()} cpus", flush=True)
    if load > (os.cpu_count() or 1):
        print("# the machine is busy with other work: parallel regions wait for busy cores, and kernels "
              "with several of them per layer suffer most; compare with --threads 1", flush=True)
    built = {}
    for label, scheme, kernel in variants:
        t = time.perf_counter()
        try:
            built[label] = build(fp32, label, scheme, kernel)
        except ImportError as e:  # an optional comparison (bitsandbytes) that is not installed
            print(f"# skipped {label}: {e}", flush=True)
            continue
        print(f"# built {label:<17} kernel={built[label][2]:<12} in {time.perf_counter() - t:6.1f} s", flush=True)

    fp32_bytes = built["fp32"][1]
    results = {}
    with torch.inference_mode():
        for batch in batches:
            x = torch.randn(batch, args.dim, generator=torch.Generator().manual_seed(batch))
            ref = built["fp32"][0](x)
            errs = {label: float((m(x).float() - ref).norm() / ref.norm()) for label, (m, _, _) in built.items()}
            for _ in range(args.warmup):
                for m, _, _ in built.values():
                    m(x)
            samples = {label: [] for label in built}
            for _ in range(args.rounds):
                for label, (m, _, _) in built.items():
                    t = time.perf_counter()
                    m(x)
                    samples[label].append(time.perf_counter() - t)
            med = {label: statistics.median(s) * 1e3 for label, s in samples.items()}
            best = {label: min(s) * 1e3 for label, s in samples.items()}
            use = med if args.stat == "median" else best
            results[batch] = {"median_ms": med, "min_ms": best, "samples_s": samples, "rel_err": errs}
            print(f"\nbatch {batch}  (speed-up from the {args.stat})")
            print(f"{'variant':<18}{'kernel':<13}{'median ms':>10}{'min ms':>9}{'speed-up':>10}{'MiB':>8}"
                  f"{'bytes/fp32':>12}{'rel err':>10}")
            for label, (_, nbytes, kernel) in built.items():
                print(f"{label:<18}{kernel:<13}{med[label]:10.2f}{best[label]:9.2f}{use['fp32'] / use[label]:9.2f}x"
                      f"{nbytes / 2**20:8.1f}{nbytes / fp32_bytes:12.4f}{errs[label]:10.2e}")

    checks = []

    def check(name, ok, detail):
        checks.append({"target": name, "pass": bool(ok), "detail": detail})

    def ratio(batch, a, b):
        key = "median_ms" if args.stat == "median" else "min_ms"
        return results[batch][key][a] / results[batch][key][b]

    if 64 in results and "w8a8" in built:
        r = ratio(64, "fp32", "w8a8")
        check("w8a8 >= 3x fp32 at batch 64", r >= 3, f"{r:.2f}x")
        if "quantize_dynamic" in built:
            r = ratio(64, "quantize_dynamic", "w8a8")
            check("w8a8 faster than quantize_dynamic at batch 64", r > 1, f"{r:.2f}x")
    if 1 in results and "int4 g128" in built:
        r = ratio(1, "fp32", "int4 g128")
        check("int4 g128 weight-only >= 4x fp32 at batch 1", r >= 4, f"{r:.2f}x")
        frac = built["int4 g128"][1] / fp32_bytes
        check("int4 g128 weight bytes <= 1/6 of fp32", frac <= 1 / 6, f"{frac:.4f} (1/{1 / frac:.2f})")
    if 64 in results and "bf16" in built:
        r = ratio(64, "fp32", "bf16")
        check("bf16 >= 2x fp32 at batch 64", r >= 2, f"{r:.2f}x")
    print(f"\ntargets (issue 3; {args.stat} times)")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['target']:<48} {c['detail']}")
    if args.json:
        env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
               "load_average_at_start": load,
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "layers": args.layers, "dim": args.dim,
               "rounds": args.rounds, "warmup": args.warmup, "stat": args.stat}
        out = {"environment": env, "weight_bytes": {k: v[1] for k, v in built.items()},
               "kernels": {k: v[2] for k, v in built.items()},
               "batches": {str(b): r for b, r in results.items()}, "targets": checks}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
