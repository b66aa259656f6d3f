"""When to run the fused (torch.compile) kernels and when plain eager torch ops.

Compiling costs seconds once per process (less with inductor's on-disk cache) and then runs the
rounding as one fused loop. Small inputs run eagerly. FEWBITS_COMPILE=0 turns compilation off,
FEWBITS_COMPILE=always compiles whatever the size; `use_backend()` does the same in code.
"""
from __future__ import annotations

import contextlib
import os
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
            key = tuple(sorted(static.items()))
            if key not in cache:
                cache[key] = torch.compile(_bind(fn, static), fullgraph=True)
                _variants[0] += 1
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() == 1 and a.numel() == numel:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
            try:
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
