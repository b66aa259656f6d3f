"""When to run the fused (torch.compile) kernels and when plain eager torch ops.

Compiling costs seconds once per process (less with inductor's on-disk cache) and then runs the
rounding as one fused loop. Small inputs run eagerly. FEWBITS_COMPILE=0 turns compilation off,
FEWBITS_COMPILE=always compiles whatever the size; `use_backend()` does the same in code.

Trust in the compiler. Inductor picks a vector ISA (ATEN_CPU_CAPABILITY or cpp.simdlen can make it
narrower than the CPU's) and compiles its C++ with that ISA's flags plus -march=native. Where the
ISA is narrower than the CPU's, two torch/compiler defects give silently wrong results (torch
2.13, GCC 12.2, seen on an AVX-512 Xeon with ATEN_CPU_CAPABILITY=avx2; both reproduced in
tests/kernels/test_compile_isa.py):
- GCC 12 miscompiles ATen's AVX2 vector code once -march=native enables AVX512VL+BW: the NOT of
  `~cmpgt` feeding a blend is dropped, so every integer `>=`, `<=`, `!=` in a `torch.where`
  picks the wrong side.
- inductor's FX graph cache key ignores the ISA: a graph compiled under one ISA is loaded under
  the other and its C++ rebuilt with the other's vector width, leaving lanes unwritten (wrong
  results that vary run to run) or writing past the buffers (heap corruption).
Our kernels are therefore compiled for the picked ISA's level instead of -march=native there,
and under cache keys that tell vector widths and these settings apart (`inductor_options`; the
default process too, so that it never loads a graph an AVX2 process wrote); and before the first
compiled kernel runs on a CPU, a small self-check compares compiled with eager results of the
operations the kernels are made of (`compiler_is_trusted`): on a mismatch fewbits runs eager
kernels (or raises, under FEWBITS_COMPILE=always). A CPU whose widest ISA is AVX2 (AMD Zen 1-3)
keeps -march=native: it enables no AVX-512 there, and GCC 12 compiles that code right.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
import warnings

import torch

COMPILE_MIN_NUMEL = 1 << 15
_state = threading.local()
_failed = False


def _setting() -> str:
    return getattr(_state, "backend", None) or os.environ.get("FEWBITS_COMPILE", "auto").lower()


@contextlib.contextmanager
def use_backend(name: str):
    """Run fewbits kernels with backend 'auto' (default), 'eager' or 'compiled' inside the block."""
    if name not in ("auto", "eager", "compiled"):
        raise ValueError(f"unknown backend {name!r}; choose auto, eager or compiled")
    old = getattr(_state, "backend", None)
    _state.backend = {"compiled": "always", "eager": "0"}.get(name, "auto")
    try:
        yield
    finally:
        _state.backend = old


def default_backend() -> bool:
    """Whether the kernels run under the default backend ("auto": no use_backend() block, no
    FEWBITS_COMPILE setting), where fewbits picks the fastest path itself."""
    return _setting() == "auto"


def want_compiled(numel: int) -> bool:
    setting = _setting()
    if _failed or setting in ("0", "off", "false", "no", "eager"):
        return False
    if setting in ("always", "1", "on", "true", "yes", "compiled"):
        return True
    return numel >= COMPILE_MIN_NUMEL


def compiled(fn):
    """Wrap fn(*tensors, **static) so that it runs compiled when wanted (one compiled graph per
    set of static arguments) and falls back to eager if compiling fails."""
    cache: dict = {}

    def run(numel: int, *args, **static):
        global _failed
        if want_compiled(numel):
            try:
                if compiler_is_trusted(_device_type(args)):
                    key = tuple(sorted(static.items()))
                    if key not in cache:
                        cache[key] = torch.compile(_bind(fn, static), fullgraph=True,
                                                   options=inductor_options() or None)
                        _variants[0] += 1
                    for a in args:
                        if isinstance(a, torch.Tensor) and a.dim() == 1 and a.numel() == numel:
                            torch._dynamo.maybe_mark_dynamic(a, 0)
                    return _call(cache[key], args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eagerly
                if _setting() in ("always",):
                    raise
                _failed = True
                warnings.warn(f"fewbits: torch.compile failed ({type(exc).__name__}: {exc}); "
                              "running eager kernels (slower, same results)", RuntimeWarning, stacklevel=3)
        return fn(*args, **static)

    return run


_variants = [0]  # compiled variants made in this process, all kernels together


def _device_type(args) -> str:
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")


def inductor_options() -> dict:
    """Inductor settings for fewbits' kernels on x86 (see the module docstring for why):
    cpp.march: -march=native where the vector ISA inductor picked is the CPU's widest, else the
        x86-64 level of the picked ISA (v3 for AVX2, v4 for AVX-512, v2 without vectors), so that
        GCC emits only what that ISA's code was written for;
    cpp.simdlen: the picked ISA's vector width, which changes nothing in the code but keys our
        graphs in inductor's cache by width and by the setting above, apart from each other and
        from graphs written with inductor's defaults by any process of another ISA.
    A setting the user made (TORCHINDUCTOR_CPP_MARCH, cpp.simdlen) is kept. Empty on other
    architectures."""
    return dict(_options())


# x86-64 micro-architecture levels by vector width: v3 = AVX2+FMA+F16C+BMI, v4 adds AVX-512 F/BW/DQ/VL
_MARCH_BY_WIDTH = {0: "x86-64-v2", 256: "x86-64-v3", 512: "x86-64-v4"}


@functools.cache
def _options() -> tuple:
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return ()
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    valid = cpu_vec_isa.valid_vec_isa_list()
    picked = cpu_vec_isa.pick_vec_isa()
    width = picked.bit_width() if picked else 0
    widest = not valid or str(picked) == str(valid[0])
    options = []
    if hasattr(inductor_config.cpp, "march") and inductor_config.cpp.march is None:
        options.append(("cpp.march", "native" if widest else _MARCH_BY_WIDTH.get(width, "")))
    if inductor_config.cpp.simdlen is None:
        options.append(("cpp.simdlen", width))
    return tuple(options)


_trusted: dict[str, bool] = {}
_trust_lock = threading.Lock()


def compiler_is_trusted(device_type: str) -> bool:
    """Whether compiled kernels may run on this device type. On a CPU, checked once per process:
    a small graph of the operations the kernels are made of (integer comparisons into
    torch.where, shifts, masks, float<->int bit views, rounding), compiled with our options,
    must give eager's results. A mismatch warns once and runs eager kernels from then on; under
    FEWBITS_COMPILE=always (use_backend("compiled")) it raises instead. Other devices: True."""
    if device_type != "cpu":
        return True
    with _trust_lock:
        if device_type not in _trusted:
            inputs = _probe_inputs()
            got = _compiled_probe()(*inputs)
            _trusted[device_type] = all(torch.equal(g, w) for g, w in zip(got, _probe(*inputs), strict=True))
            if not _trusted[device_type] and _setting() not in ("always",):
                warnings.warn(f"fewbits: torch.compile's CPU kernels gave wrong results in a self-check "
                              f"({_compiler_description()}); running eager kernels (slower, same results)",
                              RuntimeWarning, stacklevel=4)
    if not _trusted[device_type] and _setting() in ("always",):
        raise RuntimeError(f"fewbits: torch.compile's CPU kernels gave wrong results in a self-check "
                           f"({_compiler_description()}); compiled kernels are refused (FEWBITS_COMPILE=0 "
                           "or use_backend('eager') runs the eager ones)")
    return _trusted[device_type]


def _compiled_probe():
    _variants[0] += 1
    compiled_probe = torch.compile(_probe, fullgraph=True, options=inductor_options() or None)
    return lambda *args: _call(compiled_probe, args)


def _probe_inputs():
    i32 = torch.arange(-24, 40, dtype=torch.int32)  # 64 lanes: whole vectors of every width
    f32 = (i32.to(torch.float32) * 0.375).contiguous()
    return i32, i32.to(torch.int64), f32


def _probe(i32, i64, f32):
    """The operations the rounding kernels are built from; GCC 12's miscompile (AVX2 code with
    AVX-512 enabled) turns the first three of each integer type around."""
    out = []
    for t in (i32, i64):
        out += [torch.where(t >= 3, t - 1, 7), torch.where(t <= 3, t + 1, 7), torch.where(t != 3, t << 1, 7),
                torch.where(t > 3, t >> 1, 7), torch.where(t < 3, t & 5, t | 8), torch.where(t == 3, -t, t)]
    bits = f32.view(torch.int32)
    out.append(torch.where(bits >= (127 << 23), (bits + (1 << 22)) & -(1 << 23), bits).view(torch.float32))
    out.append(torch.round(f32 * 3.0))
    return tuple(out)


def _compiler_description() -> str:
    try:
        from torch._inductor import cpu_vec_isa
        isa = str(cpu_vec_isa.pick_vec_isa()) or "none"
    except ImportError:
        isa = "unknown"
    return f"inductor vector ISA {isa!r}, options {inductor_options()}, torch {torch.__version__}"


def _call(compiled_fn, args):
    """compiled_fn(*args) with dynamo's recompile limits raised to cover fewbits' variants. Some
    torch versions (2.11 seen on CUDA) compile every torch.compile'd function through one shared
    wrapper code object, so our variants (one per format range, mode and kernel) count against
    that object's limit of 8 and the 9th fails; the limits are raised only during our call."""
    cfg = torch._dynamo.config
    need = 4 * _variants[0] + 8  # a variant may be compiled more than once (static, then dynamic sizes)
    saved = {name: getattr(cfg, name) for name in _LIMITS
             if hasattr(cfg, name) and getattr(cfg, name) < need}
    if not saved:
        return compiled_fn(*args)
    for name in saved:
        setattr(cfg, name, need)
    try:
        return compiled_fn(*args)
    finally:
        for name, value in saved.items():
            setattr(cfg, name, value)


_LIMITS = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit")


def _bind(fn, static: dict):
    """fn with its static arguments as constants, in a function with a code object of its own:
    dynamo caches compiled graphs per code object, so each static key gets its own cache and its
    constants are never turned into symbols by a recompile. Tensors as long as the data (the
    input, `out`) are marked dynamic along dim 0, so one graph serves every length; small
    parameter tensors keep their fixed size."""
    namespace = {"fn": fn, "static": dict(static)}
    key = ", ".join(f"{k}={v}" for k, v in sorted(static.items()))
    source = "def bound(*args):\n    return fn(*args, **static)\n"
    exec(compile(source, f"<fewbits {fn.__name__}: {key}>", "exec"), namespace)
    return namespace["bound"]
