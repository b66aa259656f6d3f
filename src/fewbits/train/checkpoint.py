"""Checkpoint and resume: everything a step depends on, so that a resumed run is bit-identical
to an uninterrupted one — model (working weights), master weights, optimizer states (in their
packed form, as stored), loss scaler, FP8 amax histories, Kahan compensation buffers, the
stochastic-rounding generators and the step counter. Files are written with torch.save and read
with torch.load(weights_only=True).
"""
from __future__ import annotations

import os

import torch

from .optim import PackedState

FORMAT_TAG = "fewbits-train-checkpoint-v1"


def engine_state(engine) -> dict:
    opt_state = engine.optimizer.state_dict()
    packed: dict = {}
    for idx, st in opt_state["state"].items():
        for k, v in list(st.items()):
            if isinstance(v, PackedState):
                packed.setdefault(idx, {})[k] = v.to_dict()
                st[k] = None
    return {
        "format": FORMAT_TAG,
        "policy": engine.policy.to_dict(),
        "step_count": engine.step_count,
        "model": {k: v.detach().clone() for k, v in engine.model.state_dict().items()},
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
    engine.model.load_state_dict(state["model"])
    with torch.no_grad():
        for e, m, c in zip(engine.entries, state["masters"], state["compensation"]):
            if m.shape != e.master.shape:
                raise ValueError(f"{e.name}: checkpoint master has shape {tuple(m.shape)}, "
                                 f"expected {tuple(e.master.shape)}")
            e.master.data = m.clone()
            if c is not None:
                e.compensation.copy_(c)
    engine.optimizer.load_state_dict(state["optimizer"])
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
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
