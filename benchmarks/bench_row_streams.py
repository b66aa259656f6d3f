"""The row order of the one-row matmuls (csrc/rowwalk.h) against the single stream it replaced.

Builds the native library three times into a private temporary directory, from the same
sources with different -D settings of rowwalk.h:
  1 stream     ROW_STREAMS=1, ROW_PREFETCH_WEIGHTS=16384: each thread walks its rows in order
               and prefetches 16384 weights ahead: four 4096-wide rows, as the kernels did
               before rowwalk.h on the 4096 layers (they prefetched four rows of any width: on
               SmolLM2's 576 / 1536-wide rows this build prefetches 28 / 10.7 rows ahead)
  4 streams    the default (ROW_STREAMS=4, ROW_PREFETCH_WEIGHTS=2048)
  8 streams    ROW_STREAMS=8
and times the one-row C call of fewbits' QuantLinear layers (int4 g128, nf4, w4a8, int8: the
lut4, w4a8 and int8w kernels) through each build, interleaved round by round, with the weights
first evicted from the caches by reading a buffer larger than the last-level cache (--flush-mb;
0: weights left in the caches). Every build must give the same bits (checked). Prints the CPU,
median ms per forward of the stack and each build's speed as a ratio to "1 stream".

    python benchmarks/bench_row_streams.py                       # 4 x 4096^2 and SmolLM2 shapes, 1 and 2 threads
    python benchmarks/bench_row_streams.py --flush-mb 0 --threads 1
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fewbits.hardware import machine_info
from fewbits.kernels import native
from fewbits.quant.modules import QuantLinear

BUILDS = {"1 stream": ["-DROW_STREAMS=1", "-DROW_PREFETCH_WEIGHTS=16384"], "4 streams": [], "8 streams": ["-DROW_STREAMS=8"]}
ROW_FUNCTIONS = ("fb_lut4_row", "fb_w4a8_row", "fb_int8w_row")
SHAPES = {"4x4096": [(4096, 4096)] * 4,  # (out, in) per layer
          "smollm2x8": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 8}


def cpu_name() -> str:
    return machine_info("cpu")["name"]


def build(out_dir: Path, name: str, defines: list[str]) -> ctypes.CDLL:
    src = native.SOURCE_DIR
    out = out_dir / f"lib_{name.replace(' ', '_')}.so"
    cmd = ["gcc", *native.CFLAGS, *native.OPENMP_FLAGS, *defines, "-o", str(out), *(str(src / s) for s in native.SOURCES), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    for f in ROW_FUNCTIONS:
        getattr(lib, f).restype = ctypes.c_int32
    return lib


def row_call(q: QuantLinear) -> tuple[str, int]:
    """(the C function's name, its argument address) of a layer's one-row call"""
    rk = q.row_kernel()
    if rk is None:
        raise SystemExit(f"{q}: no one-row C kernel on this CPU")
    lib = native.library()
    name = next(f for f in ROW_FUNCTIONS if native.function_address(lib, f) == rk.function)
    return name, rk.args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="int4,nf4,w4a8,int8")
    ap.add_argument("--shapes", default="4x4096,smollm2x8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--flush-mb", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=21)
    a = ap.parse_args()
    print(f"# {cpu_name()}; torch {torch.__version__}; flush {a.flush_mb} MB read before each timed forward; "
          f"median of {a.rounds} rounds, builds interleaved")
    flush = torch.ones(max(a.flush_mb, 1) * (1 << 20) // 4)
    with tempfile.TemporaryDirectory(prefix="fewbits-rowwalk-") as tmp:
        libs = {name: build(Path(tmp), name, d) for name, d in BUILDS.items()}
        names = list(libs)
        print(f"| shape | scheme | threads | " + " | ".join(f"{n} ms" for n in names) + " | " +
              " | ".join(f"{n} ×" for n in names[1:]) + " |")
        print("|---" * (3 + 2 * len(names) - 1) + "|")
        torch.manual_seed(0)
        for shape in a.shapes.split(","):
            for scheme in a.schemes.split(","):
                layers = [QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), scheme) for n, k in SHAPES[shape]]
                calls = [row_call(q) for q in layers]
                xs = {k: torch.randn(k) for _, k in SHAPES[shape]}
                ys = {name: [torch.empty(n) for n, _ in SHAPES[shape]] for name in names}
                fns = {name: [getattr(lib, c[0]) for c in calls] for name, lib in libs.items()}
                for t in (int(v) for v in a.threads.split(",")):
                    torch.set_num_threads(t)  # the builds share torch's OpenMP runtime (native.py)
                    times = {name: [] for name in names}
                    for _ in range(a.rounds):
                        for name in names:
                            if a.flush_mb:
                                flush.sum()
                            t0 = time.perf_counter()
                            for (fn_name, args), fn, (n, k), y in zip(calls, fns[name], SHAPES[shape], ys[name]):
                                if fn(ctypes.c_void_p(args), ctypes.c_void_p(xs[k].data_ptr()), ctypes.c_void_p(y.data_ptr())):
                                    raise SystemExit(f"{fn_name} failed")
                            times[name].append(time.perf_counter() - t0)
                    for name in names[1:]:
                        if not all(torch.equal(u, v) for u, v in zip(ys[names[0]], ys[name])):
                            raise SystemExit(f"{name} gave other bits than {names[0]} ({shape}, {scheme})")
                    med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
                    print(f"| {shape} | {scheme} | {t} | " + " | ".join(f"{med[n] * 1e3:.3f}" for n in names) + " | " +
                          " | ".join(f"{med[names[0]] / med[n]:.2f}×" for n in names[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
