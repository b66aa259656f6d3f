"""Bytes held: the distinct storages behind tensors, modules, optimizers and the objects holding them."""
from __future__ import annotations

import torch
from torch import nn


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages behind tensors, modules (parameters, buffers, gradients),
    optimizers (parameters, gradients, state) and containers or plain objects holding them."""
    return sum(_storages(objs).values())


def _storages(objs) -> dict[int, int]:
    found: dict[int, int] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor):
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st.nbytes():
            found[st.data_ptr()] = st.nbytes()
        if t.grad is not None:
            add(t.grad)

    def walk(o, depth: int):
        if o is None or id(o) in seen or depth > 6:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            add(o)
        elif isinstance(o, nn.Module):
            for t in o.parameters():
                add(t)
            for t in o.buffers():
                add(t)
        elif isinstance(o, torch.optim.Optimizer):
            for g in o.param_groups:
                for t in g["params"]:
                    add(t)
            walk(list(o.state.values()), depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                walk(v, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o):
            walk(vars(o), depth + 1)  # plain objects holding tensors (fewbits' Engine and its entries)

    for o in objs:
        walk(o, 0)
    return found

