"""Speed of fb.round beside torch's native casts, ml_dtypes casts and a plain copy, in one run.

    python benchmarks/bench_round.py                 # 2**24 float32 values, every format and mode
    python benchmarks/bench_round.py --quick         # 2**20 values, a few formats
    python benchmarks/bench_round.py --formats fp8_e4m3,bf16 --modes nearest_even,stochastic
    python benchmarks/bench_round.py --json round.json

Throughput is elements per second (Melem/s = 1e6 elements per second) of rounding n float32
values to each format and back to float32:

  fewbits alloc   fb.round(x, fmt, mode)                  (allocates the result)
  fewbits out=    fb.round(x, fmt, mode, out=buf)         (writes into a preallocated buffer)
  torch           x.to(dtype).float()                     (native round trip, round-to-nearest-even)
  ml_dtypes       xn.astype(dt).astype(np.float32)        (numpy round trip, single-threaded)
  copy            buf.copy_(x)                            (the memory-bandwidth limit)
  clone           x.clone()                               (a copy that allocates its result)

The references only round to nearest-even; every mode of a format is compared with the same
reference. Measurements are interleaved: each round runs every callable of one format once, back
to back (copy, clone, torch, ml_dtypes, then fewbits alloc and out= for every mode, and e4m3's
alloc and out= again for the "0.8x of e4m3" target, so that both sides of that ratio are
measured in the same rounds), and the figure reported is the median over rounds (--stat min for
the minimum). The compiled kernels are
warmed up (compiled) before any timing. The input mixes scales 2**-20 .. 2**20 so that normal,
subnormal, underflow and overflow paths are all exercised.

A fewbits callable whose first call predicts more than --slow-s seconds per call at full size
(a slow path, such as an eager codebook kernel) is measured on a prefix of x instead, marked '~'
in the table, and like the single-threaded ml_dtypes casts only --ml-repeats times, so that the
default run stays within a few minutes. Compiling every (mode, kernel) graph the first time costs
a few minutes more on 2 cores; inductor's on-disk cache makes later runs start at once.

Timings use one torch thread by default (--threads): on a small machine shared with other work, a
two-thread parallel region waits for the busy core and the figures become scheduler noise.
The alloc columns (fewbits alloc, torch, clone) are dominated by page faults on fresh 64 MB
buffers unless torch allocates with huge pages: compare with THP_MEM_ALLOC_ENABLE=1.

Then the targets of the speed issue are evaluated, as ratios within this run, for both the
alloc and the out= column.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

import fewbits as fb

try:
    import ml_dtypes
except ImportError:  # the comparison column is then empty
    ml_dtypes = None

E4M3 = "fp8_e4m3"
NEAREST = "nearest_even"

# torch native dtypes whose round trip is compared with a fewbits format
TORCH_DTYPES = {
    "bf16": "bfloat16", "fp16": "float16",
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
    "fp8_e4m3fnuz": "float8_e4m3fnuz", "fp8_e5m2fnuz": "float8_e5m2fnuz",
    "e8m0": "float8_e8m0fnu",
}
# ml_dtypes type -> fewbits format (None: no fewbits format in this benchmark; reference only)
ML_TYPES = {
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e4m3": "fp8_e4m3_ieee",
    "float8_e4m3fnuz": "fp8_e4m3fnuz", "float8_e4m3b11fnuz": "fp8_e4m3b11fnuz",
    "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2fnuz", "float8_e3m4": "fp8_e3m4",
    "float6_e3m2fn": "fp6_e3m2", "float6_e2m3fn": "fp6_e2m3", "float4_e2m1fn": "fp4_e2m1",
    "float8_e8m0fnu": "e8m0", "int4": "int4",
    "int2": None, "uint2": None, "uint4": None, "int1": None, "uint1": None,
}
QUICK_FORMATS = ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp4_e2m1", "e8m0", "int8", "nf4"]


def default_formats() -> list[str]:
    """Every named float format of at most 32 bits, then nf4, int8 and int4."""
    names = [f.name for f in map(fb.get_format, fb.list_formats())
             if isinstance(f, fb.FloatFormat) and f.bits <= 32]
    return names + ["nf4", "int8", "int4"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_input(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 21, (n,), generator=g).float())
    return torch.randn(n, generator=g) * scale


# ---------------------------------------------------------------------------------------------
# callables
# ---------------------------------------------------------------------------------------------
def torch_cast(fmt_name: str, x: torch.Tensor):
    name = TORCH_DTYPES.get(fmt_name)
    dt = getattr(torch, name, None) if name else None
    if dt is None:
        return None, None
    try:
        x[:64].to(dt).float()
    except Exception as exc:  # noqa: BLE001 - a dtype this torch cannot convert: no column
        log(f"  torch {name}: no conversion ({type(exc).__name__})")
        return None, None
    return name, (lambda: x.to(dt).float())


def ml_cast(fmt_name: str, xn: np.ndarray):
    if fmt_name == "fp16":
        def cast():
            with np.errstate(over="ignore"):
                return xn.astype(np.float16).astype(np.float32)
        return "numpy float16", cast
    if ml_dtypes is None:
        return None, None
    for tname, fname in ML_TYPES.items():
        if fname == fmt_name and hasattr(ml_dtypes, tname):
            dt = getattr(ml_dtypes, tname)
            return tname, (lambda: xn.astype(dt).astype(np.float32))
    return None, None


def _sync():
    """Wait for queued device work (CUDA runs kernels asynchronously); nothing on the CPU."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


DEVICE = torch.device("cpu")  # set by --device


class Timed:
    """One callable and its samples (seconds per call); n is the element count it processes."""

    def __init__(self, key, fn, n):
        self.key, self.fn, self.n, self.samples, self.slow = key, fn, n, [], False

    def warm(self):
        _sync()
        t0 = time.perf_counter()
        self.fn()
        _sync()
        return time.perf_counter() - t0

    def run(self):
        _sync()
        t0 = time.perf_counter()
        self.fn()
        _sync()
        self.samples.append(time.perf_counter() - t0)

    def seconds(self, stat):
        if not self.samples:
            return None
        return min(self.samples) if stat == "min" else statistics.median(self.samples)

    def rate(self, stat):
        s = self.seconds(stat)
        return None if s is None else self.n / s


def fewbits_callables(fmt, mode, x, out, args):
    """(alloc, out=) Timed pair, run on a prefix of x when the full size would be too slow."""
    n = x.numel()
    probe_n = min(n, 1 << 20)
    xs, os_ = x[:probe_n], out[:probe_n]
    t0 = time.perf_counter()
    fb.round(xs, fmt, mode)              # compiles this (mode, kernel) graph if needed
    fb.round(xs, fmt, mode, out=os_)
    _sync()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fb.round(xs, fmt, mode)
    _sync()
    per_call = (time.perf_counter() - t0) * n / probe_n
    use_n = n
    if per_call > args.slow_s:
        use_n = max(probe_n, 1 << int(math.log2(n * args.slow_s / per_call)))
    xu, ou = x[:use_n], out[:use_n]
    alloc = Timed(("fewbits", fmt, mode, "alloc"), lambda: fb.round(xu, fmt, mode), use_n)
    outp = Timed(("fewbits", fmt, mode, "out"), lambda: fb.round(xu, fmt, mode, out=ou), use_n)
    if use_n < n:
        alloc.slow = outp.slow = True
    return alloc, outp, compile_s


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def measure(args):
    n = args.n
    formats, modes = args.formats, args.modes
    log(f"input: {n} float32 values (randn * 2**randint(-20, 20)); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; ml_dtypes {getattr(ml_dtypes, '__version__', 'absent')}; "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    x = make_input(n, args.seed)
    xn = x.numpy()
    if DEVICE.type != "cpu":  # ml_dtypes runs on the CPU: no column beside device kernels
        x, xn = x.to(DEVICE), None
        log(f"device: {DEVICE} ({torch.cuda.get_device_name(DEVICE) if DEVICE.type == 'cuda' else ''})")
    buf = torch.empty_like(x)
    buf.copy_(x)  # fault its pages in once: out= measures a buffer that already exists

    copy = Timed(("copy",), lambda: buf.copy_(x), n)
    clone = Timed(("clone",), lambda: x.clone(), n)
    for t in (copy, clone):
        t.warm()

    rows, refs_only = [], []
    t_start = time.perf_counter()
    for i, fmt in enumerate(formats):
        log(f"[{i + 1}/{len(formats)}] {fmt} ({time.perf_counter() - t_start:.0f} s elapsed)")
        tname, tfn = torch_cast(fmt, x)
        mname, mfn = ml_cast(fmt, xn) if xn is not None else (None, None)
        group = [copy, clone]
        ref_t = Timed(("torch", fmt), tfn, n) if tfn else None
        ref_m = Timed(("ml_dtypes", fmt), mfn, n) if mfn else None
        group += [t for t in (ref_t, ref_m) if t]
        per_mode, e4m3_refs = {}, {}
        for mode in modes:
            alloc, outp, cs = fewbits_callables(fmt, mode, x, buf, args)
            if cs > 1.0:
                log(f"    {mode}: compiled/warmed in {cs:.1f} s")
            per_mode[mode] = (alloc, outp)
            group += [alloc, outp]
            if fmt != E4M3 and E4M3 in formats:
                # e4m3 again, in this format's rounds: the "0.8x of e4m3" target compares
                # callables measured back to back, not minutes apart on a shared machine
                ra, ro, _ = fewbits_callables(E4M3, mode, x, buf, args)
                e4m3_refs[mode] = (ra, ro)
                group += [ra, ro]
        for t in group[2:]:
            t.warm()
        # ml_dtypes is single-threaded and slow: cap its repeats so it does not dominate the run
        for r in range(args.repeats):
            for t in group:
                if (t is ref_m or t.slow) and r >= args.ml_repeats:
                    continue
                t.run()
        for mode in modes:
            alloc, outp = per_mode[mode]
            ra, ro = e4m3_refs.get(mode, (None, None))
            rows.append(dict(format=fmt, mode=mode, alloc=alloc, out=outp, e4m3_alloc=ra, e4m3_out=ro,
                             torch=ref_t, torch_name=tname, ml=ref_m, ml_name=mname))
    # ml_dtypes types with no fewbits format in this run: reference only
    if ml_dtypes is not None and not args.no_ref_only and xn is not None:
        covered = {r["ml_name"] for r in rows}
        for tname in ML_TYPES:
            if tname in covered or not hasattr(ml_dtypes, tname):
                continue
            dt = getattr(ml_dtypes, tname)
            t = Timed(("ml_dtypes", tname), lambda dt=dt: xn.astype(dt).astype(np.float32), n)
            t.warm()
            for _ in range(args.ml_repeats):
                copy.run()
                t.run()
            refs_only.append((tname, t))
    log(f"measured in {time.perf_counter() - t_start:.0f} s")
    return rows, refs_only, copy, clone


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def mrate(t, stat):
    r = t.rate(stat) if t is not None else None
    return None if r is None else r / 1e6


def fmt_num(v, width, prec=0):
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{prec}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def print_table(rows, refs_only, copy, clone, stat, n):
    c, cl = mrate(copy, stat), mrate(clone, stat)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    print(f"\nfb.round on {n} float32 values, {torch.get_num_threads()} thread(s), {stat} of repeats, Melem/s; "
          f"copy {c:.0f} Melem/s ({c * 8 / 1e3:.1f} GB/s read+write), clone {cl:.0f} Melem/s "
          f"(THP_MEM_ALLOC_ENABLE={thp})")
    hdr = (f"{'format':<16}{'mode':<14}{'fb alloc':>9}{'fb out=':>9}{'torch':>8}{'ml_dt':>8}"
           f"{'a/torch':>8}{'o/torch':>8}{'a/ml':>7}{'o/ml':>7}{'o/copy':>7}{'a/clone':>8}")
    print(hdr)
    print("-" * len(hdr))
    last = None
    for r in rows:
        a, o, t, m = mrate(r["alloc"], stat), mrate(r["out"], stat), mrate(r["torch"], stat), mrate(r["ml"], stat)
        mark = "~" if r["alloc"].n < n else " "
        name = r["format"] if r["format"] != last else ""
        last = r["format"]
        print(f"{name:<16}{r['mode']:<14}{fmt_num(a, 8)}{mark}{fmt_num(o, 8)}{mark}{fmt_num(t, 8)}{fmt_num(m, 8)}"
              f"{fmt_num(ratio(a, t), 8, 2)}{fmt_num(ratio(o, t), 8, 2)}{fmt_num(ratio(a, m), 7, 2)}"
              f"{fmt_num(ratio(o, m), 7, 2)}{fmt_num(ratio(o, c), 7, 2)}{fmt_num(ratio(a, cl), 8, 2)}")
    refs = {}
    for r in rows:
        if r["torch"] is not None:
            refs.setdefault(("torch", r["torch_name"]), r["format"])
        if r["ml"] is not None:
            refs.setdefault(("ml_dtypes", r["ml_name"]), r["format"])
    print("\nreferences: torch " + ", ".join(f"{f}={k[1]}" for k, f in refs.items() if k[0] == "torch")
          + "; ml_dtypes " + ", ".join(f"{f}={k[1]}" for k, f in refs.items() if k[0] == "ml_dtypes"))
    if any(r["alloc"].n < n for r in rows):
        m = {r["alloc"].n for r in rows if r["alloc"].n < n}
        print(f"~ measured on a prefix of {', '.join(str(v) for v in sorted(m))} values (slow path)")
    if refs_only:
        print("ml_dtypes types without a fewbits format here (round trip, Melem/s): "
              + ", ".join(f"{name} {mrate(t, stat):.0f}" for name, t in refs_only))


def evaluate_targets(rows, stat):
    """[(target, label, column, value, threshold, detail)] and the printed lines."""
    by = {(r["format"], r["mode"]): r for r in rows}
    results = []

    def check(target, label, col, value, thr, detail):
        if value is None:
            return
        results.append(dict(target=target, item=label, column=col, ratio=value, threshold=thr,
                            passed=value >= thr, detail=detail))

    cols = (("alloc", "alloc"), ("out=", "out"))
    # 1. fp8 e4m3 vs torch (>= 2x) and ml_dtypes (>= 6x), nearest-even as the references round
    r = by.get((E4M3, NEAREST))
    if r:
        for col, key in cols:
            ours = mrate(r[key], stat)
            t, m = mrate(r["torch"], stat), mrate(r["ml"], stat)
            check("e4m3 >= 2x torch", f"{E4M3} {NEAREST}", col, ratio(ours, t), 2.0,
                  f"{ours:.0f} vs {t:.0f}" if t else "")
            check("e4m3 >= 6x ml_dtypes", f"{E4M3} {NEAREST}", col, ratio(ours, m), 6.0,
                  f"{ours:.0f} vs {m:.0f}" if m else "")
    # 2. every other format >= 0.8x of e4m3 (same mode; e4m3 as measured in that format's rounds)
    for (fmt, mode), r in by.items():
        base = by.get((E4M3, mode))
        if fmt == E4M3 or base is None:
            continue
        for col, key in cols:
            ref = r.get(f"e4m3_{key}") or base[key]
            ours, b = mrate(r[key], stat), mrate(ref, stat)
            check("format >= 0.8x e4m3", f"{fmt} {mode}", col, ratio(ours, b), 0.8, f"{ours:.0f} vs {b:.0f}")
    # 3. stochastic >= 0.5x nearest (same format)
    for (fmt, mode), r in by.items():
        base = by.get((fmt, NEAREST))
        if mode != "stochastic" or base is None:
            continue
        for col, key in cols:
            ours, b = mrate(r[key], stat), mrate(base[key], stat)
            check("stochastic >= 0.5x nearest", fmt, col, ratio(ours, b), 0.5, f"{ours:.0f} vs {b:.0f}")
    # 4. bf16, fp16, e5m2 never slower than torch's own cast
    for fmt in ("bf16", "fp16", "fp8_e5m2"):
        r = by.get((fmt, NEAREST))
        if not r or r["torch"] is None:
            continue
        for col, key in cols:
            ours, t = mrate(r[key], stat), mrate(r["torch"], stat)
            check("bf16/fp16/e5m2 >= torch", f"{fmt} {NEAREST}", col, ratio(ours, t), 1.0, f"{ours:.0f} vs {t:.0f}")
    return results


def print_targets(results):
    print("\ntargets (ratios within this run; Melem/s ours vs baseline)")
    order = []
    for res in results:
        if res["target"] not in order:
            order.append(res["target"])
    for target in order:
        group = [r for r in results if r["target"] == target]
        n_fail = sum(not r["passed"] for r in group)
        print(f"\n  {target}: {'PASS' if n_fail == 0 else 'FAIL'} "
              f"({len(group) - n_fail}/{len(group)} pass)")
        items = []
        for r in group:
            if r["item"] not in items:
                items.append(r["item"])
        for item in items:
            cells = []
            for r in group:
                if r["item"] == item:
                    cells.append(f"{r['column']:<5} {r['ratio']:5.2f}x {'PASS' if r['passed'] else 'FAIL'} "
                                 f"({r['detail']})")
            print(f"    {item:<30} " + "   ".join(f"{cell:<32}" for cell in cells).rstrip())
    n_fail = sum(not r["passed"] for r in results)
    print(f"\n  overall: {len(results) - n_fail}/{len(results)} checks pass")


def to_json(rows, refs_only, copy, clone, results, args):
    def t_json(t):
        if t is None:
            return None
        return dict(n=t.n, samples_s=t.samples, median_s=t.seconds("median"), min_s=t.seconds("min"),
                    melem_s_median=mrate(t, "median"), melem_s_min=mrate(t, "min"))

    return dict(
        n=args.n, stat=args.stat, repeats=args.repeats, load_average=args.load,
        env=dict(torch=torch.__version__, threads=torch.get_num_threads(),
                 thp_mem_alloc_enable=os.environ.get("THP_MEM_ALLOC_ENABLE"),
                 ml_dtypes=getattr(ml_dtypes, "__version__", None), numpy=np.__version__,
                 fewbits=fb.__version__, python=platform.python_version(), machine=platform.machine(),
                 processor=platform.processor(), cpus=os.cpu_count()),
        copy=t_json(copy), clone=t_json(clone),
        rows=[dict(format=r["format"], mode=r["mode"], fewbits_alloc=t_json(r["alloc"]),
                   fewbits_out=t_json(r["out"]), e4m3_alloc_same_rounds=t_json(r["e4m3_alloc"]),
                   e4m3_out_same_rounds=t_json(r["e4m3_out"]), torch_dtype=r["torch_name"], torch=t_json(r["torch"]),
                   ml_dtypes_type=r["ml_name"], ml_dtypes=t_json(r["ml"])) for r in rows],
        ml_dtypes_reference_only={name: t_json(t) for name, t in refs_only},
        targets=results,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="number of float32 values (default 2**24)")
    p.add_argument("--quick", action="store_true", help="2**20 values and a few formats")
    p.add_argument("--formats", help="comma-separated format names (default: all float formats "
                                     "of <= 32 bits, nf4, int8, int4)")
    p.add_argument("--modes", help=f"comma-separated modes (default: all of {', '.join(fb.MODES)})")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per format (default 5)")
    p.add_argument("--ml-repeats", type=int, default=3,
                   help="timed rounds of the slow single-threaded ml_dtypes casts and of slow "
                        "fewbits paths (default 3)")
    p.add_argument("--stat", choices=("median", "min"), default="median")
    p.add_argument("--slow-s", type=float, default=0.5,
                   help="measure a fewbits callable on a prefix of x (and only --ml-repeats times) "
                        "if one full call would take longer than this many seconds (default 0.5; "
                        "0 disables)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a small shared machine a parallel region waits "
                        "for a busy core and timings become scheduler noise; ml_dtypes is "
                        "single-threaded anyway; 0 keeps torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where x lives and fewbits and torch "
                   "round it (ml_dtypes, a CPU library, is then left out)")
    p.add_argument("--no-ref-only", action="store_true",
                   help="skip ml_dtypes types that have no fewbits format in the run "
                        "(implied by --quick and --formats)")
    p.add_argument("--json", metavar="FILE", help="also save every sample and the targets as JSON")
    args = p.parse_args(argv)
    if args.n is None:
        args.n = 1 << 20 if args.quick else 1 << 24
    if args.formats:
        args.formats = [fb.get_format(f).name for f in args.formats.split(",") if f.strip()]
    else:
        args.formats = list(QUICK_FORMATS) if args.quick else default_formats()
    args.modes = [m.strip() for m in args.modes.split(",")] if args.modes else list(fb.MODES)
    for m in args.modes:
        if m not in fb.MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(fb.MODES)}")
    if args.quick or args.formats:
        args.no_ref_only = True
    if args.slow_s <= 0:
        args.slow_s = math.inf
    return args


def main(argv=None):
    args = parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5:
        log(f"note: load average {load:.1f} on {os.cpu_count()} cores; other work competes with the timings")
    args.load = load
    rows, refs_only, copy, clone = measure(args)
    print_table(rows, refs_only, copy, clone, args.stat, args.n)
    results = evaluate_targets(rows, args.stat)
    print_targets(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(rows, refs_only, copy, clone, results, args), f, indent=1)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
