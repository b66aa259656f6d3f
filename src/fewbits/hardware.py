"""How fast each precision runs here, and the published peaks of accelerators to compare with.

    res = run_bench()                      # bandwidth, matmul per dtype, rooflines (under a minute)
    res.matmuls["bf16"].gflops, res.matmuls["bf16"].ratio
    roofline(MatmulShape.parse("1x4096x4096"), "bf16", peak_gflops, bandwidth_gbs)
    KNOWN_ACCELERATORS, get_accelerator("H100")

Measurements are wall-clock, best of repeated calls within a time budget (the best call is the
one least disturbed by other work on a shared machine):
  memory bandwidth   dst.copy_(src) of a buffer larger than the caches (bytes read + written),
                     and src.sum() (bytes read)
  matmul throughput  an n x n x n product per dtype: fp32, tf32 and fp8 where this machine has
                     them (a CPU without fp8 units: not measured, with the reason), bf16, fp16,
                     and int8 through torch._int_mm (int32 accumulation);
                     2*n^3 operations per call. n doubles from 256 (up to 2048) while the next
                     size still fits the time budget, so slow dtypes get small sizes.
  roofline           a matmul of shape m x n x k moves at least (m*k + k*n) input values and m*n
                     outputs and does 2*m*n*k operations: its arithmetic intensity (operations per
                     byte). Below the ridge point (peak / bandwidth) it is bandwidth-bound and can
                     reach at most intensity x bandwidth; above, compute-bound at the peak.

The accelerator table holds dense (no structured sparsity) tensor-core peaks from the vendors'
datasheets, in TFLOP/s (TOP/s for int8), and memory bandwidth in GB/s.
"""
from __future__ import annotations

import math
import platform
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .formats import torch_dtype
from .kernels import native

MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
# bytes of one input and one output element of each matmul kind
INPUT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
OUTPUT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "int8": 4}
DEFAULT_SHAPES = ("1x4096x4096", "512x4096x4096")
# /proc/cpuinfo flags of x86 fp8 matrix units (AMX-FP8); a CPU without one is not timed in fp8
FP8_CPU_FLAGS = frozenset({"amx_fp8"})


# ---------------------------------------------------------------------------------------------
# known accelerators
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Accelerator:
    """Dense peak throughput per precision in TFLOP/s (int8: TOP/s; None: no such units) and
    memory bandwidth in GB/s, as the vendor publishes them."""
    name: str
    vendor: str
    memory_gb: float
    bandwidth_gbs: float
    fp32: float | None
    tf32: float | None
    fp16: float | None
    bf16: float | None
    fp8: float | None
    int8: float | None
    note: str = ""

    def peak(self, dtype: str) -> float | None:
        return getattr(self, dtype)

    def ridge(self, dtype: str) -> float | None:
        """Operations per byte above which a kernel in `dtype` is compute-bound."""
        p = self.peak(dtype)
        return None if p is None else p * 1e12 / (self.bandwidth_gbs * 1e9)


KNOWN_ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("V100 SXM2", "NVIDIA", 32, 900, 15.7, None, 125, None, None, 62.8,
                "fp16 on tensor cores; int8 via dp4a"),
    Accelerator("A10", "NVIDIA", 24, 600, 31.2, 62.5, 125, 125, None, 250),
    Accelerator("A100 SXM 40GB", "NVIDIA", 40, 1555, 19.5, 156, 312, 312, None, 624),
    Accelerator("A100 SXM 80GB", "NVIDIA", 80, 2039, 19.5, 156, 312, 312, None, 624),
    Accelerator("L4", "NVIDIA", 24, 300, 30.3, 60, 121, 121, 242, 242),
    Accelerator("L40S", "NVIDIA", 48, 864, 91.6, 183, 362, 362, 733, 733),
    Accelerator("RTX 4090", "NVIDIA", 24, 1008, 82.6, 82.6, 165, 165, 330, 661,
                "GeForce: fp16/bf16/fp8 with fp32 accumulation"),
    Accelerator("H100 PCIe", "NVIDIA", 80, 2000, 51, 378, 756, 756, 1513, 1513),
    Accelerator("H100 SXM", "NVIDIA", 80, 3350, 67, 495, 989, 989, 1979, 1979),
    Accelerator("H200 SXM", "NVIDIA", 141, 4800, 67, 495, 989, 989, 1979, 1979, "H100 compute, HBM3e"),
    Accelerator("B200", "NVIDIA", 180, 8000, 75, 1100, 2250, 2250, 4500, 4500, "HGX B200 figures per GPU; fp4 9000"),
    Accelerator("MI250X", "AMD", 128, 3277, 95.7, None, 383, 383, None, 383, "fp32 on matrix cores"),
    Accelerator("MI300X", "AMD", 192, 5300, 163.4, 653.7, 1307, 1307, 2615, 2615),
    Accelerator("TPU v5e", "Google", 16, 819, None, None, None, 197, None, 394),
    Accelerator("TPU v5p", "Google", 95, 2765, None, None, None, 459, None, 918),
)


def get_accelerator(name: str) -> Accelerator:
    """A known accelerator by name, case- and space-insensitive; a unique prefix is enough
    ("h100" is ambiguous between PCIe and SXM; "h100 sxm", "a100 sxm 80" are not)."""
    key = re.sub(r"[\s_-]+", "", str(name).lower())
    names = {re.sub(r"[\s_-]+", "", a.name.lower()): a for a in KNOWN_ACCELERATORS}
    if key in names:
        return names[key]
    hits = [a for k, a in names.items() if k.startswith(key)]
    if len(hits) == 1:
        return hits[0]
    choices = ", ".join(a.name for a in (hits or KNOWN_ACCELERATORS))
    raise ValueError(f"{'ambiguous' if hits else 'unknown'} accelerator {name!r}; choose one of: {choices}")


# ---------------------------------------------------------------------------------------------
# rooflines
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulShape:
    """(m x k) @ (k x n): m rows of activations (tokens), a k x n weight."""
    m: int
    n: int
    k: int

    @classmethod
    def parse(cls, text: str) -> MatmulShape:
        """'MxNxK' (also with ',' or '*'): 1x4096x4096 is one token through a 4096 x 4096 layer."""
        parts = re.split(r"[x,*×]", str(text).strip().lower())
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            dims = []
        if len(dims) != 3 or min(dims) <= 0:
            raise ValueError(f"bad matmul shape {text!r}: write MxNxK with positive integers, e.g. 1x4096x4096")
        return cls(*dims)

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def bytes_moved(self, dtype: str) -> int:
        return (self.m * self.k + self.k * self.n) * INPUT_BYTES[dtype] + self.m * self.n * OUTPUT_BYTES[dtype]

    def intensity(self, dtype: str) -> float:
        return self.flops / self.bytes_moved(dtype)


def roofline(shape: MatmulShape, dtype: str, peak_gflops: float, bandwidth_gbs: float) -> dict:
    """Where `shape` in `dtype` sits on the roofline of a machine with this peak (GFLOP/s) and
    memory bandwidth (GB/s): intensity, ridge point, bound ("compute" or "bandwidth") and the
    attainable GFLOP/s."""
    if dtype not in INPUT_BYTES:
        raise ValueError(f"unknown matmul dtype {dtype!r}; choose one of {', '.join(MATMUL_DTYPES)}")
    if not (peak_gflops > 0 and bandwidth_gbs > 0):
        raise ValueError("peak and bandwidth must be positive")
    ai = shape.intensity(dtype)
    ridge = peak_gflops / bandwidth_gbs
    bound = "compute" if ai >= ridge else "bandwidth"
    return {"shape": str(shape), "dtype": dtype, "intensity": ai, "ridge": ridge, "bound": bound,
            "attainable_gflops": min(peak_gflops, ai * bandwidth_gbs)}


# ---------------------------------------------------------------------------------------------
# probes
# ---------------------------------------------------------------------------------------------
BENCH_DEVICES = ("cpu", "cuda")


def check_device(device) -> torch.device:
    """The torch.device the probes run on, or a ValueError naming the problem: a device string
    torch does not know ('tpu'), a kind the probes do not time (only cpu and cuda), CUDA that
    this torch was built without or that this machine does not have, a GPU index out of range."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}: the speed probes run on {' or '.join(BENCH_DEVICES)} "
                         "(e.g. cuda:0)") from None
    if dev.type not in BENCH_DEVICES:
        raise ValueError(f"device {device!r}: the speed probes run on {' or '.join(BENCH_DEVICES)}, not {dev.type}")
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) was built without CUDA")
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], object], budget_s: float, device: torch.device, min_calls: int = 2,
               max_calls: int = 200) -> tuple[float, int]:
    """Best wall time of repeated calls of fn within budget_s (after one warm-up call)."""
    fn()
    _sync(device)
    best, calls, start = math.inf, 0, time.perf_counter()
    while calls < max_calls and (calls < min_calls or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best, calls


@dataclass(frozen=True)
class Bandwidth:
    copy_gbs: float
    read_gbs: float
    buffer_bytes: int
    calls: int


def measure_bandwidth(buffer_mb: int = 256, budget_s: float = 2.0, device: str = "cpu") -> Bandwidth:
    """Memory bandwidth: copy (bytes read + written per second) and read (sum) of a buffer."""
    dev = torch.device(device)
    n = buffer_mb * 2 ** 20 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.zeros_like(src)
    t_copy, c1 = _best_time(lambda: dst.copy_(src), budget_s / 2, dev, min_calls=3)
    t_read, c2 = _best_time(lambda: src.sum(), budget_s / 2, dev, min_calls=3)
    nbytes = n * 4
    return Bandwidth(2 * nbytes / t_copy / 1e9, nbytes / t_read / 1e9, nbytes, c1 + c2)


@dataclass
class MatmulSpeed:
    """One dtype's matmul probe. available=False: not measured here (note says why), and n, seconds
    and gflops are None: an unmeasured dtype has no number, not a 0."""
    dtype: str
    available: bool
    kernel: str = ""
    n: int | None = None
    seconds: float | None = None
    gflops: float | None = None
    ratio: float | None = None      # to fp32 on this machine
    note: str = ""


def _operands(dtype: str, m: int, n: int, k: int, device: torch.device):
    """(kernel name, a zero-argument callable running one product)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(r, c):
        return torch.randn(r, c, generator=gen).to(device)

    if dtype in ("fp32", "tf32"):
        a, b = rnd(m, k), rnd(k, n)
        return "torch.mm", lambda: torch.mm(a, b)
    if dtype in ("bf16", "fp16"):
        dt = torch_dtype(dtype)
        a, b = rnd(m, k).to(dt), rnd(k, n).to(dt)
        return "torch.mm", lambda: torch.mm(a, b)
    if dtype == "int8":
        a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8).to(device)
        b = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8).to(device)
        return "torch._int_mm", lambda: torch._int_mm(a, b)
    if dtype == "fp8":
        a = rnd(m, k).to(torch.float8_e4m3fn)
        b = rnd(n, k).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        return "torch._scaled_mm (e4m3)", lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                                  out_dtype=torch.bfloat16)
    raise ValueError(f"unknown matmul dtype {dtype!r}; choose one of {', '.join(MATMUL_DTYPES)}")


class _tf32:
    """Turn tf32 matmuls on for the duration (CUDA: allow_tf32; CPU: oneDNN fp32_precision)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self.saved = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            self.saved = torch.backends.mkldnn.matmul.fp32_precision
            torch.backends.mkldnn.matmul.fp32_precision = "tf32"

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.saved
        else:
            torch.backends.mkldnn.matmul.fp32_precision = self.saved
        return False


def _fp32_exact(device: torch.device):
    """A context with tf32 off, so that "fp32" measures full-precision products."""
    class _Off:
        def __enter__(self):
            if device.type == "cuda":
                self.saved = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = False
            return self

        def __exit__(self, *exc):
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = self.saved
            return False
    return _Off()


def availability(dtype: str, device: str = "cpu") -> tuple[bool, str]:
    """Whether this machine has matmul units for `dtype` that torch uses, and why not."""
    dev = torch.device(device)
    if dtype == "tf32":
        # tf32 changes results only where the hardware has it; identical products mean it is absent
        a = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(dev)
        with _fp32_exact(dev):
            exact = a @ a
        try:
            with _tf32(dev):
                reduced = a @ a
        except (RuntimeError, AttributeError) as exc:
            return False, f"no tf32 setting here ({exc})"
        if torch.equal(exact, reduced):
            return False, "no tf32 units: torch's tf32 setting leaves the products unchanged"
        return True, ""
    if dtype == "fp8":
        if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
            return False, "this torch has no fp8 matmul"
        try:
            _, fn = _operands("fp8", 32, 32, 32, dev)
            fn()
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            return False, f"torch._scaled_mm fails here: {str(exc).splitlines()[0][:80]}"
        if dev.type == "cpu" and not native.cpu_flags() & FP8_CPU_FLAGS:
            # what would be timed is torch's software conversion: no ceiling of this machine, and on
            # some CPUs slow enough to print as "0.0 GFLOP/s" and put a "ridge 0.0" on the roofline
            return False, ("not measured: this CPU has no fp8 matmul units (torch._scaled_mm only "
                           "converts in software here)")
        return True, ""
    if dtype == "int8":
        try:
            _, fn = _operands("int8", 32, 32, 32, dev)
            fn()
        except (RuntimeError, NotImplementedError) as exc:
            return False, f"torch._int_mm fails here: {str(exc).splitlines()[0][:80]}"
        return True, ""
    if dtype == "fp16" and dev.type == "cpu" and not native.cpu_flags() & {"avx512_fp16", "amx_fp16"}:
        return True, "no fp16 units in this CPU: a slow fallback"
    return True, ""


def measure_matmul(dtype: str, budget_s: float = 1.0, device: str = "cpu", max_n: int = 2048) -> MatmulSpeed:
    """Throughput of an n x n x n product in `dtype` (GFLOP/s; GOP/s for int8)."""
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"unknown matmul dtype {dtype!r}; choose one of {', '.join(MATMUL_DTYPES)}")
    dev = torch.device(device)
    ok, note = availability(dtype, device)
    if not ok:
        return MatmulSpeed(dtype, False, note=note)
    ctx = _tf32(dev) if dtype == "tf32" else _fp32_exact(dev)
    with ctx:
        n = min(256, max_n)
        while True:  # double n while the next size (8x the work) still fits the budget
            kernel, fn = _operands(dtype, n, n, n, dev)
            one, _ = _best_time(fn, budget_s / 8, dev, min_calls=2, max_calls=3)  # best of a few: load spikes
            if 8 * one > budget_s or n >= max_n:
                break
            n *= 2
        t, _ = _best_time(fn, budget_s, dev)
    return MatmulSpeed(dtype, True, kernel, n, t, 2 * n ** 3 / t / 1e9, note=note)


def measure_shape(shape: MatmulShape, dtype: str, budget_s: float = 1.0, device: str = "cpu",
                  stream_mb: int = 256) -> float:
    """Measured GFLOP/s of one m x n x k product in `dtype`. Calls cycle through enough copies
    of the operands (at least stream_mb in all) that they come from memory, not from a cache that
    holds a small weight between calls, as in a model whose layers each run once per token."""
    dev = torch.device(device)
    copies = max(1, min(16, math.ceil(stream_mb * 2 ** 20 / shape.bytes_moved(dtype))))
    ctx = _tf32(dev) if dtype == "tf32" else _fp32_exact(dev)
    with ctx:
        fns = [_operands(dtype, shape.m, shape.n, shape.k, dev)[1] for _ in range(copies)]
        turn = iter(range(10 ** 9))

        def call():
            return fns[next(turn) % copies]()

        t, _ = _best_time(call, budget_s, dev, min_calls=copies)
    return shape.flops / t / 1e9


# ---------------------------------------------------------------------------------------------
# the whole probe
# ---------------------------------------------------------------------------------------------
def machine_info(device: str = "cpu") -> dict:
    dev = torch.device(device)
    info = {"device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name(dev)
        return info
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["name"] = name
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_fp16")
    info["matmul_flags"] = [f for f in wanted if f in native.cpu_flags()]
    st = native.status()
    info["native_kernels"] = "yes" if st["available"] else f"no ({st['reason']})"
    return info


@dataclass
class BenchResult:
    machine: dict
    bandwidth: Bandwidth
    matmuls: dict[str, MatmulSpeed]
    shapes: list[dict] = field(default_factory=list)
    accelerators: tuple[Accelerator, ...] = KNOWN_ACCELERATORS
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "machine": self.machine,
            "bandwidth": vars(self.bandwidth),
            "matmul": [vars(m) for m in self.matmuls.values()],
            "roofline": self.shapes,
            "accelerators": [vars(a) for a in self.accelerators],
            "seconds": self.seconds,
        }


def run_bench(shapes=DEFAULT_SHAPES, dtypes=MATMUL_DTYPES, budget_s: float = 1.5, device: str = "cpu",
              measure_shapes: tuple[str, ...] = ("fp32", "bf16"), buffer_mb: int = 256,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """Bandwidth, matmul throughput per dtype (ratios to fp32), and the roofline of each shape in
    every available dtype here (measured in `measure_shapes`) and on the known accelerators.
    budget_s is the time given to each probe; the default run takes well under a minute.
    buffer_mb: the bandwidth probe's buffer (keep it well above the caches)."""
    check_device(device)
    if not budget_s > 0:
        raise ValueError(f"the time budget must be positive seconds, got {budget_s}")
    if not (isinstance(buffer_mb, int) and buffer_mb > 0):
        raise ValueError(f"the bandwidth buffer must be a positive number of MiB, got {buffer_mb}")
    t_start = time.perf_counter()
    say = progress or (lambda s: None)
    parsed = [s if isinstance(s, MatmulShape) else MatmulShape.parse(s) for s in shapes]
    for d in dtypes:
        if d not in MATMUL_DTYPES:
            raise ValueError(f"unknown matmul dtype {d!r}; choose one of {', '.join(MATMUL_DTYPES)}")
    say("memory bandwidth")
    bw = measure_bandwidth(buffer_mb=buffer_mb, budget_s=budget_s, device=device)
    mm: dict[str, MatmulSpeed] = {}
    for d in dtypes:
        say(f"matmul {d}")
        mm[d] = measure_matmul(d, budget_s=budget_s, device=device)
    ref = mm.get("fp32")
    for m in mm.values():
        if m.available and ref is not None and ref.available:
            m.ratio = m.gflops / ref.gflops
    rows = []
    for shape in parsed:
        for d, m in mm.items():
            if not m.available:
                continue
            row = roofline(shape, d, m.gflops, bw.copy_gbs)
            row["peak_gflops"] = m.gflops
            row["measured_gflops"] = None
            if d in measure_shapes and shape.flops / max(m.gflops, 1e-9) / 1e9 < budget_s:
                say(f"shape {shape} {d}")
                row["measured_gflops"] = measure_shape(shape, d, budget_s=budget_s / 2, device=device)
            row["accelerators"] = {a.name: ("compute" if shape.intensity(d) >= a.ridge(d) else "bandwidth")
                                   for a in KNOWN_ACCELERATORS if a.peak(d) is not None}
            rows.append(row)
    return BenchResult(machine_info(device), bw, mm, rows, KNOWN_ACCELERATORS, time.perf_counter() - t_start)
