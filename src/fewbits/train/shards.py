"""DTensor helpers: what the engine, the loss scaler and checkpoints need of FSDP2's sharded
parameters, gradients and optimizer states (this rank's shard as a plain tensor)."""
from __future__ import annotations

import torch


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing to it writes the DTensor), else t."""
    return t.to_local() if is_dtensor(t) else t


def agreeing_group(tensors):
    """The process group whose ranks hold the other shards of the DTensors among `tensors`: the
    mesh's group for a 1-D mesh, "world" for larger meshes; None when none is a DTensor."""
    for t in tensors:
        if is_dtensor(t):
            mesh = t.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else "world"
    return None
