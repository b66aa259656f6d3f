"""What an OpenMP parallel region costs in torch's process: the fork and join of a region whose
body is empty, one after another with a stretch of single-threaded work between them (the shape
of fewbits' decode step: every projection's one-row kernel is a region of its own, 211 a token for
SmolLM2-135M, with the norms, the rotary embedding and the attention between them), against a
barrier inside one region that lasts the whole loop (what one region per token would pay instead).

A small C file is compiled with the flags of fewbits' native library and loaded after torch, so
that its regions run on torch's own OpenMP runtime and threads (the process has one libgomp), at
torch.get_num_threads() threads. Times are per region (or per barrier), the stretch of serial
work taken off; median of --repeats runs.

    python benchmarks/bench_omp_regions.py
    python benchmarks/bench_omp_regions.py --threads 1,2 --gaps 0,10,50,200
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from fewbits.hardware import machine_info
from fewbits.kernels import native

SOURCE = r"""
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static volatile int sink;
static int team; /* the threads of the last region: the caller checks it is the count it asked for */
int last_team(void) { return team; }
static void serial(double us) { const double t0 = now(); while (now() - t0 < us * 1e-6) sink++; }
/* microseconds per region: `count` empty regions, `gap` us of serial work after each */
double regions(int count, double gap) {
    const double t0 = now();
    for (int r = 0; r < count; r++) {
#pragma omp parallel
        { sink += omp_get_thread_num(); if (omp_get_thread_num() == 0) team = omp_get_num_threads(); }
        serial(gap);
    }
    return (now() - t0) / count * 1e6 - gap;
}
/* microseconds per barrier: one region, `count` barriers, `gap` us of the first thread's work after
 * each (not `single`, whose implied barrier at its end would make it two barriers an iteration) */
double barriers(int count, double gap) {
    const double t0 = now();
#pragma omp parallel
    for (int r = 0; r < count; r++) {
        sink += omp_get_thread_num();
#pragma omp barrier
        if (omp_get_thread_num() == 0) { team = omp_get_num_threads(); serial(gap); }
    }
    return (now() - t0) / count * 1e6 - gap;
}
"""


def cpu_name() -> str:
    return machine_info("cpu")["name"]


def build(out_dir: Path) -> ctypes.CDLL:
    src, out = out_dir / "regions.c", out_dir / "libregions.so"
    src.write_text(SOURCE)
    cmd = ["gcc", *native.CFLAGS, *native.OPENMP_FLAGS, "-o", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    for f in (lib.regions, lib.barriers):
        f.argtypes = [ctypes.c_int, ctypes.c_double]
        f.restype = ctypes.c_double
    lib.last_team.restype = ctypes.c_int
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--gaps", default="0,10,50,200", help="microseconds of serial work between regions")
    ap.add_argument("--count", type=int, default=5000, help="regions per run")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.ones(512, 512) @ torch.ones(512, 512)  # torch's OpenMP threads up, as in a model's run
    print(f"# {cpu_name()}; torch {torch.__version__}; empty OpenMP regions on torch's runtime, "
          f"{a.count} per run, median of {a.repeats} runs; us per region / barrier, serial work excluded")
    print("| threads | serial gap (us) | region fork + join (us) | barrier in one region (us) |")
    print("|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        lib = build(Path(d))
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            for gap in (float(g) for g in a.gaps.split(",")):
                count = a.count if gap <= 50 else max(a.count // 10, 100)
                r = statistics.median(lib.regions(count, gap) for _ in range(a.repeats))
                if lib.last_team() != threads:  # another OpenMP runtime than torch's, or a capped team
                    raise SystemExit(f"regions ran {lib.last_team()} threads, not {threads}")
                b = statistics.median(lib.barriers(count, gap) for _ in range(a.repeats))
                print(f"| {threads} | {gap:g} | {r:.2f} | {b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
