"""Speed, weight bytes and error of quantized Linear layers on this CPU: fewbits' variants beside
the tools a user would pick instead, each at its documented fast path, measured in one run,
interleaved, at several thread counts and batch sizes, with issue 15's targets checked as ratios.

Shapes (`--shapes`):
  4096      4 x Linear(4096, 4096): 256 MiB of float32 weights, more than the caches (`--layers`;
            any other integer N is 4 x Linear(N, N))
  smollm2   8 decoder blocks of SmolLM2-135M's real Linears, in a forward's order: q/o 576x576,
            k/v 192x576, gate/up 1536x576, down 576x1536 (14 MB of float32 a block; `--blocks`)

Variants (fewbits.study.layer_speed builds them all; `fewbits bench` and the study use the same):
  fewbits   fp32 (MKL), bf16, w8a8 (and w8a8 with torch ops / torch._int_mm), int8, int4 g128 /
            g32, nf4, mxfp4, nvfp4, fp4 (fp8 with --variants all): QuantLinear.from_linear(m, scheme),
            kernel "auto" (the kernel each picked is printed)
  peers     torch quantize_dynamic (fbgemm, qint8); bitsandbytes Linear4bit nf4 / fp4 and
            Linear8bitLt in eval mode under torch.inference_mode() (its CPU fast path: in
            training mode it dequantizes the whole weight per call); every torchao 0.18 config that
            could run on a CPU, on the stack in bfloat16 and torch.compile'd, as torchao documents
            (int8 weight-only, int8 dynamic, int4 weight-only with the CPU packing and the others,
            da8w4, w4a8 intx packed, fp8 dynamic; with --peers all also the two that run through
            unfused reference paths: w4a8 intx unpacked, fp8 weight-only). A peer that is not
            installed, or does not build or run here, is listed with the reason (its error's first
            line).

Timing: per (shape, threads, batch), after warm-up rounds (which also compile the torchao
variants for the batch shape), the variants run round-robin, one forward of the whole stack each
per round, the order rotating every round, for at least --min-rounds rounds and until --budget
seconds have passed (at most --rounds). Columns: median and minimum ms; `x fp32` = fp32's time over
the variant's (median, or min with --stat min); weight bytes as held (codes, scales, kernel-side
tensors; biases excluded); `rel err` = ||y - y_fp32|| / ||y_fp32|| of the stack's output; `ref err`
(fewbits) = the same against QuantLinear.reference_forward, F.linear(x, qweight.dequantize(), bias)
(w8a8: activations quantized and dequantized too): what the fast path computes against what it
claims to equal.

Targets (issue 15), as ratios in this run, PASS/FAIL:
  (a) nf4, mxfp4, nvfp4, fp4 at batch 1 at least as fast as bitsandbytes nf4 (eval), per thread count
  (b) int4 g128 >= 5x fp32 at batch 1
  (c) weight-only 4- and 8-bit layers >= 2x fp32 at batches >= 16 (bf16's ratio beside: the goal)

Caches: one variant's weights (36-256 MiB for the 4096 stack) can fit a large L3 (this Xeon reports
480 MiB): a loop over one variant alone then reads them from L3. Here the other variants run in
between and evict them, as the other layers of a model do, so each call reads its weights mostly
from memory; the rotating order gives every variant the same conditions on average. Hot-loop
figures of a single layer are therefore faster than these.

On a machine whose cores are busy with other work, two-thread times measure the scheduler more
than the kernels: the load average is printed; compare with --threads 1, or use --stat min.

    python benchmarks/bench_linear.py                        # threads 1,2; batches 1,16,64,256; both shapes
    python benchmarks/bench_linear.py --quick                # smoke run: one shape, few rounds
    python benchmarks/bench_linear.py --threads 1 --batches 1,64 --shapes 4096
    python benchmarks/bench_linear.py --variants nf4,int4_g128 --peers "bnb nf4" --json linear.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from fewbits.hardware import machine_info
from fewbits.study import layer_speed as ls


SLOW_VARIANTS = ("fp8",)  # fewbits' fp8 runs the float32 dequant path: timed on request (--variants all)


def _stack(spec: str, layers: int, blocks: int) -> ls.Stack:
    if spec == "smollm2":
        return ls.smollm2_stack(blocks)
    try:
        dim = int(spec)
    except ValueError:
        raise SystemExit(f"unknown shape {spec!r}: 'smollm2' or a width such as 4096") from None
    return ls.linear_stack(dim, layers)


def _label(arg: str) -> str:
    """'int4_g128' -> 'int4 g128' (labels have spaces; the shell likes underscores)."""
    return arg.strip().replace("_", " ") if arg.strip().replace("_", " ") in ls.FEWBITS_VARIANTS else arg.strip()


def _table(built, cell, stat) -> str:
    rows = ls.cell_rows(built, cell, stat)
    head = (f"{'variant':<29}{'from':<13}{'kernel':<34}{'median ms':>10}{'min ms':>9}{'x fp32':>8}{'MiB':>8}"
            f"{'/fp32':>8}{'rel err':>10}{'ref err':>10}")
    lines = [head]
    for r in rows:
        err = "—" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        ref = "—" if r["ref_err"] is None else f"{r['ref_err']:.2e}"
        if r["median_ms"] is None:
            lines.append(f"{r['label']:<29}{r['kind']:<13}{r['kernel'][:33]:<34}  {r['failed']}")
            continue
        lines.append(f"{r['label']:<29}{r['kind']:<13}{r['kernel'][:33]:<34}{r['median_ms']:10.3f}{r['min_ms']:9.3f}"
                     f"{r['x_fp32']:7.2f}x{r['bytes'] / 2 ** 20:8.1f}{r['bytes_vs_fp32']:8.4f}{err:>10}{ref:>10}")
    return "\n".join(lines)


def _targets(results, stat) -> list[dict]:
    """issue 15's targets from the cells: [{"target", "pass", "detail"}]."""
    checks = []

    def check(name, ratios: dict, need: float, beside: str = ""):
        ok = bool(ratios) and all(r >= need for r in ratios.values())
        detail = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + beside
        checks.append({"target": name, "pass": ok, "detail": detail, "ratios": ratios})

    for shape, res in results.items():
        for c in res["cells"]:
            cell = c["cell"]
            t, b = cell.threads, cell.batch
            ok = [k for k in cell.samples]
            where = f"{shape}, {t} thr, batch {b}"
            if b == 1 and "bnb nf4" in ok:
                r = {k: cell.ratio(k, over="bnb nf4", stat=stat) for k in ls.LOOKUP_4BIT if k in ok}
                if r:
                    check(f"(a) 4-bit lookup >= bnb nf4 eval: {where}", r, 1.0, " of bnb nf4's speed")
            if b == 1 and "int4 g128" in ok:
                check(f"(b) int4 g128 >= 5x fp32: {where}", {"int4 g128": cell.ratio("int4 g128", stat=stat)}, 5.0)
            if b >= 16:
                r = {k: cell.ratio(k, stat=stat) for k in ls.WEIGHT_ONLY_LOWBIT if k in ok}
                goal = f"; bf16 {cell.ratio('bf16', stat=stat):.2f}x (goal)" if "bf16" in ok else ""
                if r:
                    check(f"(c) weight-only 4/8-bit >= 2x fp32: {where}", r, 2.0, goal)
    return checks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated (default 1,2)")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--shapes", default="4096,smollm2", help="4096 (or any width N: --layers x Linear(N, N)) "
                   "and/or smollm2 (default both)")
    p.add_argument("--layers", type=int, default=4, help="layers of the square stack (default 4)")
    p.add_argument("--blocks", type=int, default=8, help="SmolLM2 decoder blocks (default 8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per cell (after the error check, which "
                   "already ran each variant once at the batch shape; default 1)")
    p.add_argument("--min-rounds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=11, help="at most this many timed rounds per cell")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timed rounds per cell, past --min-rounds")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="statistic the ratios and targets use (min: the least disturbed round)")
    p.add_argument("--variants", default=None, help="fewbits variants, comma-separated, or all (fp32 always "
                   f"runs; default all but {', '.join(SLOW_VARIANTS)}: {', '.join(ls.FEWBITS_VARIANTS)})")
    p.add_argument("--peers", default=None, help="peers, comma-separated, all or none (default: all but the "
                   f"slow reference paths {', '.join(p.label for p in ls.PEERS if not p.default)}; "
                   f"all: {', '.join(ls.PEERS_BY_LABEL)})")
    p.add_argument("--quick", action="store_true", help="smoke run: the first shape only, batches 1 and 64, "
                   "1 warm-up and 3 timed rounds")
    p.add_argument("--json", default=None, help="write every sample and the environment here")
    args = p.parse_args(argv)

    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.quick:
        shapes, batches = shapes[:1], ([1, 64] if args.batches == p.get_default("batches") else batches)
        args.min_rounds, args.rounds, args.budget = 3, 3, 0.0
    fewbits = (list(ls.FEWBITS_VARIANTS) if args.variants == "all" else [_label(v) for v in args.variants.split(",")]) \
        if args.variants else [v for v in ls.FEWBITS_VARIANTS if v not in SLOW_VARIANTS]
    if args.peers in ("all", "none"):
        peers = list(ls.PEERS_BY_LABEL) if args.peers == "all" else []
    else:
        peers = [s.strip() for s in args.peers.split(",")] if args.peers else [p.label for p in ls.PEERS if p.default]
    unknown = [v for v in fewbits if v not in ls.FEWBITS_VARIANTS] + [v for v in peers if v not in ls.PEERS_BY_LABEL]
    if unknown:
        print(f"unknown variants or peers: {', '.join(unknown)}", file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    info = machine_info()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"# {info['name']}; torch {torch.__version__}, cpu capability {info.get('cpu_capability')} "
          f"({', '.join(info.get('matmul_flags', []))}); fewbits C kernels: {info.get('native_kernels')}")
    print(f"# threads {','.join(map(str, threads))} of {os.cpu_count()} cpus; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.stat} times; batches {','.join(map(str, batches))}",
          flush=True)
    left_out = [v for v in ls.FEWBITS_VARIANTS if v not in fewbits] + [p for p in ls.PEERS_BY_LABEL if p not in peers]
    if left_out:
        print(f"# not in this run (--variants all / --peers all): {', '.join(left_out)}")
    if load[0] > (os.cpu_count() or 1):
        print("# the machine is busy with other work: parallel regions wait for busy cores; compare with "
              "--threads 1 or --stat min", flush=True)

    results, out_json = {}, {"shapes": {}}
    for spec in shapes:
        stack = _stack(spec, args.layers, args.blocks)
        print(f"\n## {stack.description}: {stack.fp32_bytes / 2 ** 20:.1f} MiB of float32 weights", flush=True)
        built, not_run = ls.build_variants(stack, fewbits, peers, progress=lambda m: print(f"# {m}", flush=True))
        for v in built.values():
            print(f"#   {v.label:<29} {v.kernel:<44} {v.what}")
        for n in not_run:
            print(f"#   {n['label']:<29} NOT RUN: {n['reason']}")
        cells = []
        for b in batches:
            x = ls.batch_input(b, stack.in_features)
            errs = ls.errors(built, x)
            for t in threads:
                torch.set_num_threads(t)
                cell = ls.measure(built, x, warmup=args.warmup, min_rounds=args.min_rounds,
                                  max_rounds=args.rounds, budget_s=args.budget, errs=errs)
                cells.append({"cell": cell})
                print(f"\n{stack.name}  threads {t}  batch {b}  (x fp32 from the {args.stat}; "
                      f"{min(len(s) for s in cell.samples.values())} rounds)")
                print(_table(built, cell, args.stat), flush=True)
        results[stack.name] = {"built": built, "cells": cells}
        out_json["shapes"][stack.name] = {
            "description": stack.description, "fp32_bytes": stack.fp32_bytes,
            "variants": [{"label": v.label, "kind": v.kind, "what": v.what, "kernel": v.kernel, "bytes": v.nbytes}
                         for v in built.values()],
            "not_run": not_run,
            "cells": [{"batch": c["cell"].batch, "threads": c["cell"].threads, "samples_s": c["cell"].samples,
                       "rel_err": c["cell"].rel_err, "ref_err": c["cell"].ref_err, "failed": c["cell"].failed,
                       "rows": ls.cell_rows(built, c["cell"], args.stat)} for c in cells]}

    checks = _targets(results, args.stat)
    print(f"\ntargets (issue 15; {args.stat} times, ratios within this run)")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['target']:<58} {c['detail']}")
    print(f"\n# {time.perf_counter() - t_start:.0f} s; load average at the end "
          f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.2f}")
    if args.json:
        out_json.update(environment=dict(info, threads=threads, batches=batches, load_average_at_start=load,
                                         stat=args.stat, warmup=args.warmup, min_rounds=args.min_rounds,
                                         rounds=args.rounds, budget_s=args.budget),
                        targets=checks)
        with open(args.json, "w") as f:
            json.dump(out_json, f, indent=1)
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
