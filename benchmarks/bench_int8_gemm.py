"""int8 GEMMs on this CPU: fewbits' AMX kernel against oneDNN's bf16 GEMM and the int8 paths torch offers.

    python benchmarks/bench_int8_gemm.py                  # the GEMMs of bench_train's README LM
    python benchmarks/bench_int8_gemm.py --model 4x       # ... and of its 4x model
    python benchmarks/bench_int8_gemm.py --threads 1

Shapes: a training step of the GPT LM (tokens M = batch x sequence = 4096) runs, per linear layer
of K inputs and N outputs, the forward Y = X W^T (M x K x N), the grad-input dX = dY W (M x N x K)
and the grad-weight dW = dY^T X (N x M x K). Every configuration computes the same int8 x int8
-> int32 sums of random operands (or the bf16 GEMM of the same shape) and returns a bfloat16
[rows, cols] result with a row and a column scale applied, as training needs:

  bf16 (oneDNN)            torch.mm on bfloat16 operands: what bf16-mixed and torch.autocast run
  torch._int_mm + rescale  the int8 GEMM torch exposes (oneDNN's s8s8s32 GEMM API), then the
                           float32 rescale to bf16 (kernels.int8.rescale)
  oneDNN qlinear           torch.ops.onednn.qlinear_pointwise, oneDNN's AMX int8 matmul, on a
                           weight prepacked once outside the timing (its inference use; per-tensor
                           activation scale only, so not what row-wise training needs), and
                           with the prepacking inside (what a weight new at every call costs)
  fewbits AMX              kernels.int8.int8_gemm: B packed into AMX's VNNI panels, 32 x 32
                           blocks in tiles, the rescale fused into the bf16 stores

Timings are interleaved (each round runs every configuration once), the figure the median; the
ratios are against bf16. Prints the CPU and thread count. Without AMX the fewbits column is
torch._int_mm's (the same code path falls back) and says so.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from fewbits.hardware import machine_info  # noqa: E402
from fewbits.kernels import int8, native  # noqa: E402

MODELS = {"readme": 512, "4x": 1024}


def layer_shapes(d: int, tokens: int = 4096) -> list[tuple[str, int, int, int]]:
    """(label, rows, reduction, cols) of the three GEMMs of each distinct linear layer of a GPT
    block with d_model d (qkv d -> 3d, proj d -> d, fc1 d -> 4d, fc2 4d -> d)."""
    out = []
    for name, k, n in (("qkv", d, 3 * d), ("proj", d, d), ("fc1", d, 4 * d), ("fc2", 4 * d, d)):
        out += [(f"{name} fwd", tokens, k, n), (f"{name} dX", tokens, n, k), (f"{name} dW", n, tokens, k)]
    return out


def configurations(m: int, k: int, n: int, g: torch.Generator, qlinear: bool = True) -> dict:
    ab = torch.randn(m, k, generator=g).bfloat16()
    bb = torch.randn(n, k, generator=g).bfloat16()
    qa = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    qb = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    da, db = torch.rand(m, generator=g), torch.rand(n, generator=g)
    cfg = {"bf16 (oneDNN)": lambda: ab @ bb.t(),
           "torch._int_mm + rescale": lambda: int8.int8_gemm(qa, qb, da, db, None, torch.bfloat16, backend="torch")}
    if qlinear and hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_prepack"):
        try:
            packed = torch.ops.onednn.qlinear_prepack(qb, [m, k])
            zeros = torch.zeros(n, dtype=torch.int64)

            def ql(w):
                return torch.ops.onednn.qlinear_pointwise(qa, 1.0, 0, w, db, zeros, None, 1.0, 0, torch.bfloat16,
                                                          "none", [], "")
            ql(packed)
            cfg["oneDNN qlinear (prepacked once)"] = lambda: ql(packed)
            cfg["oneDNN qlinear (prepacked per call)"] = lambda: ql(torch.ops.onednn.qlinear_prepack(qb, [m, k]))
        except RuntimeError as exc:
            print(f"  oneDNN qlinear does not run here: {exc}", file=sys.stderr)
    cfg["fewbits AMX"] = lambda: int8.int8_gemm(qa, qb, da, db, None, torch.bfloat16)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS) + ["all"], default="readme")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.library()
    amx = lib is not None and native.amx_int8_ready(lib)
    info = machine_info()
    print(f"{info.get('name', 'CPU')}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"int8_gemm runs {int8.int8_kernel()}" + ("" if amx else " (no AMX here: the fewbits column is that path)"))
    models = list(MODELS) if args.model == "all" else [args.model]
    g = torch.Generator().manual_seed(0)
    totals: dict[str, dict[str, float]] = {}
    for model in models:
        d = MODELS[model]
        print(f"\n{model} model (d_model {d}), {args.tokens} tokens: ms per GEMM (median of {args.rounds}), x bf16")
        rows = []
        for label, m, k, n in layer_shapes(d, args.tokens):
            cfg = configurations(m, k, n, g)
            for f in cfg.values():
                f()
            times = {name: [] for name in cfg}
            for _ in range(args.rounds):
                for name, f in cfg.items():
                    t0 = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            rows.append((label, m, k, n, med))
            tot = totals.setdefault(model, {})
            for name, v in med.items():
                tot[name] = tot.get(name, 0.0) + v
        names = list(rows[0][4])
        head = f"{'GEMM':10s} {'rows':>5s} {'red.':>5s} {'cols':>5s} " + " ".join(f"{n[:24]:>24s}" for n in names)
        print(head)
        for label, m, k, n, med in rows:
            base = med["bf16 (oneDNN)"]
            cells = [f"{med[x]:8.2f} ({base / med[x]:4.2f}x)" if x != "bf16 (oneDNN)" else f"{med[x]:8.2f}"
                     for x in names]
            print(f"{label:10s} {m:5d} {k:5d} {n:5d} " + " ".join(f"{c:>24s}" for c in cells))
        tot = totals[model]
        base = tot["bf16 (oneDNN)"]
        print(f"{'all 12':10s} {'':5s} {'':5s} {'':5s} " + " ".join(
            f"{(f'{tot[x]:8.2f} ({base / tot[x]:4.2f}x)' if x != 'bf16 (oneDNN)' else f'{tot[x]:8.2f}'):>24s}"
            for x in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
