"""Transparent huge pages under the weights the one-row kernels read at every call.

A matrix-vector product at batch 1 (a decode step) streams each weight's codes once per call,
from memory for a model larger than the caches. With 4 KiB pages an 8 MiB weight spans 2048
pages: a TLB miss and a page walk every 64 cache lines in each of the kernel's row streams. On
2 MiB pages the same weight spans four. Measured on an Intel Xeon (4 x 4096 x 4096 int4 g128, the
codes read from memory, lut4.c's one-row kernel): 11% faster at one thread and 15% at two with
every page huge; 9% / 16% through QuantLinear (5% / 7% when writes flush the caches), where the
whole 2 MiB pages inside each weight's bytes (6 of its 8 MiB) are huge.

`collapse(t)` asks Linux (MADV_COLLAPSE, kernel 6.1 or later) to move the whole 2 MiB-aligned
pages inside a tensor's bytes onto huge pages, synchronously, keeping their contents: the
tensor's values, address and size do not change, and no byte outside it is touched. It is best
effort: on another OS, an older kernel, with transparent huge pages set to `never`, for
file-backed memory (a tensor read by safetensors' safe_open or torch.load(mmap=True) is a private
mapping of its file, which the kernel refuses unless built with CONFIG_READ_ONLY_THP_FOR_FS), or
when no huge page is free, nothing happens. Its cost is a copy of the bytes it moves (0.2-0.8 ms
per MiB measured here), paid once when a weight is prepared; the kernel may reclaim or compact
memory to find huge pages, and memory shared copy-on-write with a forked process is copied (the
collapsed pages become this process's own). FEWBITS_HUGE_PAGES=0 (or off / false / no) turns it
off."""
from __future__ import annotations

import ctypes
import os
import sys

import torch


def _pmd_size() -> int:
    """The kernel's transparent huge page size: 2 MiB on x86-64 and on arm64 with 4 KiB pages, but
    32 MiB with 16 KiB pages and 512 MiB with 64 KiB ones."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            size = int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20
    return size if size > 0 else 2 << 20


HUGE_PAGE = _pmd_size()
MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1

_madvise = None
_unsupported = False  # no madvise in this process's C library: not looked for again


def enabled() -> bool:
    """Whether collapse() may act here: Linux, and FEWBITS_HUGE_PAGES is not 0."""
    flag = os.environ.get("FEWBITS_HUGE_PAGES", "1").strip().lower()
    return sys.platform.startswith("linux") and flag not in ("0", "off", "false", "no")


def _libc_madvise():
    global _madvise
    if _madvise is None:
        f = ctypes.CDLL(None, use_errno=True).madvise
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
        _madvise = f
    return _madvise


def huge_range(t: torch.Tensor) -> tuple[int, int]:
    """The whole 2 MiB-aligned pages inside a contiguous tensor's bytes: (start address, length),
    length 0 if none (and for a tensor that is not contiguous, whose bytes are not one span)."""
    if not t.is_contiguous():
        return (0, 0)
    a = t.data_ptr()
    n = t.numel() * t.element_size()
    lo = -(-a // HUGE_PAGE) * HUGE_PAGE
    hi = (a + n) // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi > lo else (lo, 0)


def collapse(t: torch.Tensor) -> int:
    """Put the whole 2 MiB pages inside a contiguous CPU tensor's bytes on transparent huge pages
    (see the module's docstring); returns the bytes on huge pages after the call (those that
    already were count too), 0 where the call did not succeed for all of them (turned off, not
    Linux, not a contiguous CPU tensor, no whole huge page inside it, or the kernel declined for
    one or more: some may have moved)."""
    global _unsupported
    if _unsupported or not enabled() or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return 0
    start, length = huge_range(t)  # length 0 for a tensor that is not contiguous
    if length == 0:
        return 0
    try:
        madvise = _libc_madvise()
    except (OSError, AttributeError):
        _unsupported = True
        return 0
    # a refusal (EINVAL: no MADV_COLLAPSE in this kernel, THP 'never', memory of a kind it cannot
    # collapse; EAGAIN / ENOMEM: no huge page free) leaves the pages as they were
    return length if madvise(start, length, MADV_COLLAPSE) == 0 else 0
