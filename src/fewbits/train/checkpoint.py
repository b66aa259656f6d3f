"""Checkpoint and resume: everything a step depends on, so that a resumed run is bit-identical
to an uninterrupted one — model (working weights), master weights, optimizer states (in their
packed form, as stored), loss scaler, FP8 amax histories, Kahan compensation buffers, the
stochastic-rounding generators and the step counter. Files are written with torch.save and read
with torch.load(weights_only=True).

Under FSDP2 (fully_shard_with_policy) the parameters and optimizer states are DTensors: each
rank saves its own shards (give every rank its own path, e.g. f"ckpt-rank{rank}.pt") with their
global shapes, and loads them back into the DTensors of a model sharded the same way.
"""
from __future__ import annotations

import os

import torch

from .optim import PackedState
from .shards import is_dtensor, local

FORMAT_TAG = "fewbits-train-checkpoint-v1"


def engine_state(engine) -> dict:
    opt_state = engine.optimizer.state_dict()
    packed: dict = {}
    for idx, st in opt_state["state"].items():
        for k, v in list(st.items()):
            if isinstance(v, PackedState):
                packed.setdefault(idx, {})[k] = v.to_dict()
                st[k] = None
            elif is_dtensor(v):
                st[k] = _local(v)
    return {
        "format": FORMAT_TAG,
        "policy": engine.policy.to_dict(),
        "step_count": engine.step_count,
        "model": {k: _local(v) for k, v in engine.model.state_dict().items()},
        "shards": {k: list(v.shape) for k, v in engine.model.state_dict().items() if is_dtensor(v)},
        "masters": [e.master.detach().clone() for e in engine.entries],
        "compensation": [e.compensation.clone() if e.compensation is not None else None for e in engine.entries],
        "optimizer": opt_state,
        "packed_states": packed,
        "scaler": engine.scaler.state_dict(),
        "generators": {k: g.get_state() for k, g in engine.generators.items()},
        "slots": [[list(k), s.state_dict()] for k, s in engine.slots.items()],
        "telemetry": engine.telemetry.state_dict() if engine.telemetry is not None else None,
        "overflows": list(engine.overflows),
    }


def load_engine_state(engine, state: dict) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT_TAG:
        raise ValueError("not a fewbits training checkpoint")
    if state["policy"] != engine.policy.to_dict():
        raise ValueError(f"checkpoint was written under policy {state['policy']['name']!r}, "
                         f"this engine runs {engine.policy.name!r} with different settings")
    if len(state["masters"]) != len(engine.entries):
        raise ValueError(f"checkpoint has {len(state['masters'])} managed parameters, the model {len(engine.entries)}")
    _load_model(engine.model, state["model"], state.get("shards", {}))
    with torch.no_grad():
        for e, m, c in zip(engine.entries, state["masters"], state["compensation"]):
            if m.shape != e.master.shape:
                raise ValueError(f"{e.name}: checkpoint master has shape {tuple(m.shape)}, "
                                 f"expected {tuple(e.master.shape)}")
            e.master.data = m.clone()
            if c is not None:
                e.compensation.copy_(c)
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    engine.optimizer.load_state_dict(state["optimizer"])
    for p in params:  # this rank's shards of the states back into DTensors like their parameter's
        if is_dtensor(p) and p in engine.optimizer.state:
            live = engine.optimizer.state[p]
            for k, v in list(live.items()):
                if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.dim() > 0:
                    live[k] = _as_shard_of(v, p)
    for idx, entries in state["packed_states"].items():
        st = engine.optimizer.state[params[int(idx)]]
        for k, d in entries.items():
            st[k] = PackedState.from_dict(d)
    engine.scaler.load_state_dict(state["scaler"])
    for k, g in engine.generators.items():
        g.set_state(state["generators"][k])
    engine.slots.clear()
    for key, s in state["slots"]:
        engine._slot_from_checkpoint(tuple(key), s)
    if engine.telemetry is not None and state["telemetry"] is not None:
        engine.telemetry.load_state_dict(state["telemetry"])
    engine.overflows = list(state["overflows"])
    engine.step_count = int(state["step_count"])
    engine.zero_grad()


def save_checkpoint(engine, path: str | os.PathLike, extra: dict | None = None) -> None:
    """Write the engine's state (and `extra`, e.g. the data loader's RNG state) to `path`."""
    state = engine_state(engine)
    state["extra"] = extra or {}
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(engine, path: str | os.PathLike) -> dict:
    """Restore the engine from `path`; returns the `extra` dict saved with it."""
    try:
        state = torch.load(path, weights_only=True, map_location=engine.device)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file
        raise ValueError(f"{path}: not a readable fewbits training checkpoint ({type(exc).__name__}: {exc})") from None
    load_engine_state(engine, state)
    return state.get("extra", {})


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of t: this rank's shard for a DTensor."""
    return local(t).detach().clone()


def _as_shard_of(shard: torch.Tensor, like) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    if tuple(shard.shape) != tuple(like.to_local().shape):
        raise ValueError(f"checkpoint shard has shape {tuple(shard.shape)}, this rank's is "
                         f"{tuple(like.to_local().shape)} (sharded differently?)")
    return DTensor.from_local(shard.to(like.dtype), like.device_mesh, like.placements,
                              shape=like.shape, stride=like.stride())


def _load_model(model, saved: dict, shards: dict) -> None:
    """load_state_dict, with DTensor entries filled shard by shard (each rank its own)."""
    current = model.state_dict()
    plain = {}
    for k, v in saved.items():
        target = current.get(k)
        if target is not None and is_dtensor(target):
            if k not in shards or list(target.shape) != shards[k]:
                raise ValueError(f"{k}: checkpoint holds {'a shard of ' + str(tuple(shards[k])) if k in shards else 'a full tensor'},"
                                 f" the model a shard of {tuple(target.shape)}")
            shard = target.to_local()
            if tuple(shard.shape) != tuple(v.shape):
                raise ValueError(f"{k}: checkpoint shard has shape {tuple(v.shape)}, this rank's is {tuple(shard.shape)}")
            with torch.no_grad():
                shard.copy_(v)
        else:
            plain[k] = v
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(plain, strict=False)
