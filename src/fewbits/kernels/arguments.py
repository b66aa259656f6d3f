"""Checks of fb.round / fb.encode / fb.decode arguments that must pass before anything is computed
or written: the generator, dense (strided) tensors, and an `out=` that is safe to write into.

out= safety: the kernels read x and write out element by element, so an out that shares memory
with x without being x itself would overwrite inputs not yet read (torch refuses this too), and a
read-only numpy array (a `bytes` buffer, a read-only mmap, setflags(write=False)) must never be
written: torch.from_numpy only warns about it, and writing into a read-only mmap kills the process.
"""
from __future__ import annotations

import numpy as np
import torch

# numpy's exact overlap solver gives up (TooHardError) past this much work; we then refuse
_OVERLAP_MAX_WORK = 1 << 16
_TooHardError = getattr(np, "exceptions", np).TooHardError  # np.exceptions from numpy 1.25


def check_generator(generator):
    """Stochastic rounding draws its seed from a torch.Generator (or torch's global RNG for None)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        hint = ("; a numpy Generator cannot seed it: use torch.Generator().manual_seed(n)"
                if isinstance(generator, (np.random.Generator, np.random.RandomState)) else
                "; for a seed n use torch.Generator().manual_seed(n)")
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}{hint}")


def check_dense(t: torch.Tensor, what: str = "x"):
    """Sparse, mkldnn and nested tensors have no element-by-element memory the kernels can read."""
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        raise TypeError(f"{what} is a {kind} tensor; fewbits rounds dense tensors: convert it with "
                        f"{what}.to_dense() (for sparse values alone, round {what}.values())")


def _memory(a):
    """(device, address of element 0, shape, byte strides, itemsize) of a tensor or numpy array."""
    if isinstance(a, torch.Tensor):
        size = a.element_size()
        return a.device, a.data_ptr(), tuple(a.shape), tuple(s * size for s in a.stride()), size
    return torch.device("cpu"), a.__array_interface__["data"][0], a.shape, a.strides, a.itemsize


class _Layout:
    """Only the memory layout of an array, for numpy's overlap solver (the memory is never read)."""

    def __init__(self, ptr, shape, strides, itemsize):
        self.__array_interface__ = {"version": 3, "data": (ptr, True), "shape": tuple(shape),
                                    "strides": tuple(strides), "typestr": f"|V{itemsize}"}


def _byte_range(ptr, shape, strides, itemsize) -> tuple[int, int]:
    lo = ptr + sum(st * (n - 1) for n, st in zip(shape, strides) if st < 0)
    hi = ptr + sum(st * (n - 1) for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi


def check_out(x, out):
    """Refuse an out= that fewbits must not write: a read-only numpy array, one whose elements share
    memory with each other (an expand()ed or broadcast view), or one that shares memory with x
    without being exactly x (same address, shape and strides: in place, which stays allowed)."""
    if isinstance(out, torch.Tensor):
        check_dense(out, "out")
    elif not isinstance(out, np.ndarray):
        return  # not an array: the caller's type check names it
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out is a read-only numpy array (flags.writeable is False: it is backed by a bytes "
                         "object or a read-only mmap, or was made read-only); pass a writable array, or "
                         "use the returned value instead of out=")
    dev_o, ptr_o, shape_o, strides_o, size_o = _memory(out)
    if any(st == 0 and n > 1 for n, st in zip(shape_o, strides_o)):
        raise ValueError("out has elements that share memory (an expand()ed or broadcast view, stride 0); "
                         "pass a tensor with one memory location per element")
    dev_x, ptr_x, shape_x, strides_x, size_x = _memory(x)
    if dev_x != dev_o or 0 in shape_o or 0 in shape_x:
        return
    if (ptr_x, tuple(shape_x), tuple(strides_x)) == (ptr_o, tuple(shape_o), tuple(strides_o)):
        return  # out is x: rounding in place
    lo_x, hi_x = _byte_range(ptr_x, shape_x, strides_x, size_x)
    lo_o, hi_o = _byte_range(ptr_o, shape_o, strides_o, size_o)
    if hi_x <= lo_o or hi_o <= lo_x:
        return
    try:
        shared = np.shares_memory(np.asarray(_Layout(ptr_x, shape_x, strides_x, size_x)),
                                  np.asarray(_Layout(ptr_o, shape_o, strides_o, size_o)),
                                  max_work=_OVERLAP_MAX_WORK)
    except _TooHardError:
        shared = True
    if shared:
        raise ValueError("out shares memory with x without being x itself (it partly overlaps x, or views "
                         "the same memory with other strides): writing the result would overwrite inputs "
                         "not yet read; pass x itself to round in place, or a separate out")
