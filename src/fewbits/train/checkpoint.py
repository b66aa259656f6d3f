"""Checkpoint and resume: everything a step depends on, so that a resumed run is bit-identical
to an uninterrupted one — model (working weights), master weights, optimizer states (in their
packed form, as stored), loss scaler, FP8 amax histories, Kahan compensation buffers, the
stochastic-rounding generators and the step counter.

File layout (version 2): a header, then the bytes torch.save wrote for the state:
  MAGIC            b"fewbits-train-checkpoint\\0" (25 bytes)
  version          uint32, little-endian (2)
  payload length   uint64, little-endian
  digest           SHA-256 (32 bytes) of the two fields above and the payload
  payload          torch.save(state): a zip of pickled containers and tensor bytes
torch's zip holds no reliable check of its contents (of 160 single-bit flips in a version-1 file,
65 loaded as a different state), so the digest covers every byte after the magic: a flipped bit
or a truncation anywhere is a CheckpointError. The digest guards against corruption, not
against someone who can write the file (anyone can compute a SHA-256): that is what
torch.load(weights_only=True) is for, which runs no pickled code.

Memory: saving streams torch.save into the file (the payload length and digest are filled into
the header afterwards, the digest from one chunked read of what was written) over a state that
references the live tensors instead of copying them; loading hashes the file in chunks, then
torch.load reads the payload from the same open file. Neither holds a second copy of the state.
The file is opened once for both: a save replacing the path meanwhile (a rename) does not
change what this open file reads; a writer changing the very file in place between the hash and
the load could slip in other bytes, but could as well write a file with a valid digest.

Loading then checks the state against the engine in full — policy, optimizer class, every model
tensor's key, shape and dtype, masters, compensation buffers, the optimizer's groups and states,
packed optimizer states, scaler, generators, FP8 slots, telemetry — before it copies anything in:
a checkpoint that does not fit raises CheckpointError and leaves the model, the optimizer and
the engine as they were. Saving never changes the engine, and the state it returns is a copy.

Under FSDP2 (fully_shard_with_policy) the parameters and optimizer states are DTensors: each
rank saves its own shards (give every rank its own path, e.g. f"ckpt-rank{rank}.pt") with their
global shapes, and loads them back into the DTensors of a model sharded the same way.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import io
import os
import struct

import torch

from ..atomic import replacing
from .fp8 import ScaledCast
from .optim import PackedState, check_packed_dict
from .scaler import LossScaler
from .shards import is_dtensor, local
from .telemetry import Telemetry

FORMAT_TAG = "fewbits-train-checkpoint-v2"
MAGIC = b"fewbits-train-checkpoint\0"
VERSION = 2
_FIELDS = struct.Struct("<IQ")  # version, payload length
_DIGEST_SIZE = 32
HEADER_SIZE = len(MAGIC) + _FIELDS.size + _DIGEST_SIZE
# Policy fields newer than the first checkpoints, with the values those checkpoints ran under
_LATER_POLICY_FIELDS = {"matmuls": "all", "grad_weight": None}
_KEYS = ("format", "policy", "optimizer_kind", "step_count", "model", "shards", "masters", "compensation",
         "optimizer", "packed_states", "scaler", "generators", "slots", "telemetry", "overflows")
_OPTIONAL_KEYS = ("extra",)
_LISTED = 5


class CheckpointError(ValueError):
    """A training checkpoint that cannot be loaded: not a fewbits training checkpoint, corrupted
    (digest mismatch, truncated), of a version this fewbits does not read, or not matching the
    engine (another model, policy or optimizer). Raised before anything is changed."""

    def __init__(self, problem: str, path=None):
        self.path = os.fspath(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)


# ---------------------------------------------------------------------------------------------
# the state
# ---------------------------------------------------------------------------------------------
def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def engine_state(engine, copy_tensors: bool = True) -> dict:
    """Everything a step depends on; the engine and its optimizer are left as they are. A copy
    (Engine.state_dict's promise: later steps do not change it); with copy_tensors=False the
    containers are new but the tensors are the live ones, for save_checkpoint to serialise
    right away without a second copy of the state in memory."""
    snap = _snapshot if copy_tensors else _referenced
    opt = engine.optimizer.state_dict()  # its per-parameter dicts are the live ones: never edit them
    states: dict = {}
    packed: dict = {}
    for idx, st in opt["state"].items():
        own = {}
        for k, v in st.items():
            if isinstance(v, PackedState):
                packed.setdefault(idx, {})[k] = snap(v.to_dict())
                own[k] = None
            else:
                own[k] = snap(v)
        states[idx] = own
    return {
        "format": FORMAT_TAG,
        "policy": engine.policy.to_dict(),
        "optimizer_kind": optimizer_kind(engine.optimizer),
        "step_count": engine.step_count,
        "model": {k: snap(v) for k, v in engine.model.state_dict().items()},
        "shards": {k: list(v.shape) for k, v in engine.model.state_dict().items() if is_dtensor(v)},
        "masters": [snap(e.master) for e in engine.entries],
        "compensation": [snap(e.compensation) for e in engine.entries],
        "optimizer": {"state": states, "param_groups": copy.deepcopy(opt["param_groups"])},
        "packed_states": packed,
        "scaler": engine.scaler.state_dict(),
        "generators": {k: g.get_state() for k, g in engine.generators.items()},
        "slots": [[list(k), copy.deepcopy(s.state_dict())] for k, s in engine.slots.items()],
        "telemetry": copy.deepcopy(engine.telemetry.state_dict()) if engine.telemetry is not None else None,
        "overflows": copy.deepcopy(engine.overflows),
    }


def load_engine_state(engine, state: dict, path=None, _owned: bool = False) -> None:
    """Check `state` against the engine in full (check_engine_state), then restore it. The engine
    keeps copies of the caller's tensors; `_owned` (load_checkpoint: a state nobody else holds)
    lets it take them over instead."""
    check_engine_state(engine, state, path)
    _apply(engine, state, _owned)


def check_engine_state(engine, state, path=None) -> None:
    """Raise CheckpointError naming the first problem if `state` does not fit `engine`."""
    def fail(problem):
        raise CheckpointError(problem, path)

    if not isinstance(state, dict):
        fail(f"not a fewbits training checkpoint (its state is a {type(state).__name__}, not a dict)")
    if state.get("format") != FORMAT_TAG:
        fail(f"not a fewbits training checkpoint of this version (format {state.get('format')!r}, "
             f"expected {FORMAT_TAG!r})")
    missing = [k for k in _KEYS if k not in state]
    unexpected = [k for k in state if k not in _KEYS + _OPTIONAL_KEYS]
    if missing or unexpected:
        fail(f"checkpoint keys: missing {missing}, unexpected {unexpected}")
    policy = state["policy"]
    if isinstance(policy, dict):  # written before the policy had these fields: their defaults
        policy = {**_LATER_POLICY_FIELDS, **policy}
    if policy != engine.policy.to_dict():
        name = policy.get("name") if isinstance(policy, dict) else policy
        fail(f"checkpoint was written under policy {name!r}, this engine runs {engine.policy.name!r} "
             "with different settings")
    if state["optimizer_kind"] != optimizer_kind(engine.optimizer):
        fail(f"checkpoint holds the state of a {state['optimizer_kind']!r} optimizer, this engine's "
             f"optimizer is {optimizer_kind(engine.optimizer)!r}")
    if not _is_int(state["step_count"]) or state["step_count"] < 0:
        fail(f"step_count {state['step_count']!r} is not a non-negative integer")
    if "extra" in state and not isinstance(state["extra"], dict):
        fail("'extra' is not a dict")
    _check_model(engine, state["model"], state["shards"], fail)
    _check_masters(engine, state["masters"], state["compensation"], fail)
    _check_optimizer(engine, state["optimizer"], state["packed_states"], fail)
    _check_rest(engine, state, fail)


def _check_model(engine, saved, shards, fail) -> None:
    current = engine.model.state_dict()
    if not isinstance(saved, dict) or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        fail("'model' is not a dict of tensors")
    if not isinstance(shards, dict):
        fail("'shards' is not a dict")
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        fail(f"checkpoint does not match the model (another model?): missing {missing[:_LISTED]}, "
             f"unexpected {unexpected[:_LISTED]}")
    problems = []
    for k, target in current.items():
        v = saved[k]
        if is_dtensor(target):
            if shards.get(k) != list(target.shape):
                fail(f"{k}: checkpoint holds {'a shard of ' + str(shards[k]) if k in shards else 'a full tensor'}, "
                     f"the model a shard of {tuple(target.shape)}")
            want = tuple(target.to_local().shape)
        else:
            if k in shards:
                fail(f"{k}: checkpoint holds a shard of {shards[k]}, the model a full tensor")
            want = tuple(target.shape)
        if tuple(v.shape) != want or v.dtype != target.dtype:
            problems.append(f"{k}: {v.dtype} {tuple(v.shape)} in the checkpoint, {target.dtype} {want} in the model")
    extra_shards = [k for k in shards if k not in current]
    if extra_shards:
        fail(f"'shards' names tensors the model does not have: {extra_shards[:_LISTED]}")
    if problems:
        more = f" (and {len(problems) - _LISTED} more)" if len(problems) > _LISTED else ""
        fail("checkpoint does not match the model (another model?): " + "; ".join(problems[:_LISTED]) + more)


def _check_masters(engine, masters, compensation, fail) -> None:
    n = len(engine.entries)
    if not isinstance(masters, list) or len(masters) != n:
        fail(f"checkpoint has {len(masters) if isinstance(masters, list) else 'no list of'} master weights, "
             f"the engine manages {n} parameters")
    if not isinstance(compensation, list) or len(compensation) != n:
        fail(f"checkpoint's compensation buffers are not a list of {n}")
    for e, m, c in zip(engine.entries, masters, compensation):
        if not isinstance(m, torch.Tensor) or m.shape != e.master.shape or m.dtype != e.master.dtype:
            got = f"{m.dtype} {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
            fail(f"{e.name}: checkpoint master is {got}, expected {e.master.dtype} {tuple(e.master.shape)}")
        want = e.compensation
        if (c is None) != (want is None) or (c is not None and (not isinstance(c, torch.Tensor) or c.shape != want.shape
                                                              or c.dtype != want.dtype)):
            fail(f"{e.name}: checkpoint compensation buffer does not match this policy's")


def _step_shapes(engine) -> dict:
    """id(optimizer parameter) -> the shape of the tensor the optimizer steps (this rank's shard)."""
    shapes = {id(e.master): tuple(e.stored().shape) for e in engine.entries}
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            shapes.setdefault(id(p), tuple(local(p.data).shape))
    return shapes


def _check_optimizer(engine, saved, packed, fail) -> None:
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        fail("'optimizer' is not an optimizer state_dict (keys state, param_groups)")
    groups, live_groups = saved["param_groups"], engine.optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        fail(f"checkpoint's optimizer has {len(groups) if isinstance(groups, list) else 'no list of'} "
             f"parameter groups, this one {len(live_groups)}")
    ids = []
    for i, (g, lg) in enumerate(zip(groups, live_groups)):
        if not (isinstance(g, dict) and isinstance(g.get("params"), list) and all(_is_int(x) for x in g["params"])):
            fail(f"optimizer parameter group {i} is malformed")
        if len(g["params"]) != len(lg["params"]):
            fail(f"optimizer parameter group {i} has {len(g['params'])} parameters in the checkpoint, "
                 f"{len(lg['params'])} here")
        ids += g["params"]
    if len(set(ids)) != len(ids):
        fail("optimizer parameter groups list a parameter twice")
    _check_group_settings(engine.optimizer, groups, fail)
    params = dict(zip(ids, [p for lg in live_groups for p in lg["params"]]))
    shapes = _step_shapes(engine)
    states = saved["state"]
    if not isinstance(states, dict):
        fail("optimizer 'state' is not a dict")
    for idx, st in states.items():
        if idx not in params:
            fail(f"optimizer state for parameter {idx!r}, which no parameter group lists")
        if not isinstance(st, dict) or not all(isinstance(k, str) for k in st):
            fail(f"optimizer state of parameter {idx} is malformed")
        p = params[idx]
        shape, sharded = shapes[id(p)], is_dtensor(p)
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                if v.dim() > 0 and not _fits(tuple(v.shape), shape, exact=sharded):
                    fail(f"optimizer state {k!r} of parameter {idx} has shape {tuple(v.shape)}, "
                         f"the parameter {shape} (another model?)")
            elif not _plain(v):
                fail(f"optimizer state {k!r} of parameter {idx} is a {type(v).__name__}")
    if not isinstance(packed, dict):
        fail("'packed_states' is not a dict")
    if packed and not engine.states.active:
        fail("checkpoint holds packed optimizer states, this policy keeps them in fp32")
    for idx, entries in packed.items():
        if not isinstance(entries, dict) or idx not in states:
            fail(f"packed optimizer states of parameter {idx!r} have no optimizer state")
        for k, d in entries.items():
            if k not in states[idx] or states[idx][k] is not None:
                fail(f"packed optimizer state {k!r} of parameter {idx} has no place in the optimizer state")
            problem = check_packed_dict(d, engine.states.fmt_name, shapes[id(params[idx])])
            if problem is not None:
                fail(f"packed optimizer state {k!r} of parameter {idx}: {problem}")


def _check_group_settings(optimizer, groups: list, fail) -> None:
    """Every setting the optimizer's groups have (lr, betas, ...) must come back from the saved
    groups, once the optimizer class has filled in the defaults of settings it added later (its
    __setstate__): tried on a scratch optimizer of the same class, when it can be built from its
    defaults alone."""
    live = optimizer.param_groups
    scratch_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [torch.zeros(1) for _ in g["params"]]}
                      for g in live]
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        scratch = type(optimizer)(scratch_groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except Exception:  # noqa: BLE001 - an optimizer class with arguments of its own: no trial
        return
    try:
        scratch.load_state_dict({"state": {}, "param_groups": copy.deepcopy(groups)})
    except Exception as exc:  # noqa: BLE001 - what the optimizer says of the saved groups
        fail(f"optimizer parameter groups: {type(exc).__name__}: {exc}")
    for i, (g, lg) in enumerate(zip(scratch.param_groups, live)):
        lacking = sorted(str(k) for k in lg if k not in g)
        if lacking:
            fail(f"optimizer parameter group {i} lacks the settings {lacking[:_LISTED]}")


def _check_rest(engine, state, fail) -> None:
    """Scaler, generators, slots and telemetry: each loaded into a scratch object first, by the
    same load_state_dict that will load it into the engine's."""
    def trial(what, load):
        try:
            load()
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
            fail(f"{what}: {type(exc).__name__}: {exc}")

    trial("loss scaler state", lambda: LossScaler(engine.scaler.mode).load_state_dict(state["scaler"]))
    gens = state["generators"]
    if not isinstance(gens, dict) or set(gens) != set(engine.generators):
        fail(f"checkpoint's generators are not {sorted(engine.generators)}")
    for k, g in engine.generators.items():
        if not isinstance(gens[k], torch.Tensor) or gens[k].dtype != torch.uint8:
            fail(f"generator {k!r}: its state is not a uint8 tensor")
        trial(f"generator {k!r}", lambda g=g, s=gens[k]: torch.Generator(device=g.device).set_state(s.cpu()))
    slots = state["slots"]
    if not isinstance(slots, list):
        fail("'slots' is not a list")
    for item in slots:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (list, tuple))
                and item[0] and item[0][-1] in ("forward", "backward")
                and all(isinstance(x, str) or _is_int(x) for x in item[0])):
            fail(f"FP8 slot {str(item)[:80]} is malformed")
        trial(f"FP8 slot {item[0]}", lambda s=item[1]: ScaledCast(engine.policy.forward).load_state_dict(s))
    if state["telemetry"] is not None:
        trial("telemetry state", lambda: Telemetry().load_state_dict(state["telemetry"]))
    if not (isinstance(state["overflows"], list) and all(isinstance(o, dict) for o in state["overflows"])):
        fail("'overflows' is not a list of dicts")


def _apply(engine, state: dict, owned: bool = False) -> None:
    """Copy a checked state into the engine (nothing here can fail on a state that passed); an
    `owned` state's tensors are taken over, not copied."""
    snap = _referenced if owned else _snapshot
    _load_model(engine.model, state["model"])
    with torch.no_grad():
        for e, m, c in zip(engine.entries, state["masters"], state["compensation"]):
            e.master.data = m if owned else m.clone()
            if c is not None:
                e.compensation.copy_(c)
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    saved = state["optimizer"]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params))
    # copies: the optimizer never shares a tensor with the caller's state
    engine.optimizer.load_state_dict({"state": snap(saved["state"]),
                                      "param_groups": copy.deepcopy(saved["param_groups"])})
    for p in params:  # this rank's shards of the states back into DTensors like their parameter's
        if is_dtensor(p) and p in engine.optimizer.state:
            live = engine.optimizer.state[p]
            for k, v in list(live.items()):
                if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.dim() > 0:
                    live[k] = _as_shard_of(v, p)
    for idx, entries in state["packed_states"].items():
        st = engine.optimizer.state[by_id[idx]]
        for k, d in entries.items():
            st[k] = PackedState.from_dict(snap(d))
    engine.scaler.load_state_dict(state["scaler"])
    for k, g in engine.generators.items():
        g.set_state(state["generators"][k].cpu())
    engine.slots.clear()
    for key, s in state["slots"]:
        engine._slot_from_checkpoint(tuple(key), s)
    if engine.telemetry is not None and state["telemetry"] is not None:
        engine.telemetry.load_state_dict(copy.deepcopy(state["telemetry"]))
    engine.overflows = copy.deepcopy(state["overflows"])
    engine.step_count = int(state["step_count"])
    engine.zero_grad()


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def save_checkpoint(engine, path: str | os.PathLike, extra: dict | None = None) -> None:
    """Write the engine's state (and `extra`, e.g. the data loader's RNG state: plain Python
    values and tensors) to `path`, atomically (fewbits.atomic.replacing: a killed save leaves
    nothing that looks finished, and the next save of `path` removes its leftovers). The engine
    is not changed."""
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    state = engine_state(engine, copy_tensors=False)  # torch.save only reads the live tensors
    state["extra"] = dict(extra or {})
    with replacing(path) as tmp:
        with open(tmp, "w+b") as f:
            f.write(bytes(HEADER_SIZE))  # filled in once the payload's length is known
            torch.save(state, _Appender(f))
            length = f.tell() - HEADER_SIZE
            fields = _FIELDS.pack(VERSION, length)
            f.seek(HEADER_SIZE)
            digest = _hash_payload(f, fields, length)
            f.seek(len(MAGIC))
            f.write(fields + digest)
            f.seek(0)
            f.write(MAGIC)


class _Appender:
    """The write end of a file for torch.save: appends only (no seek), so the zip lands right
    after the header."""

    def __init__(self, f):
        self._f = f

    def write(self, data) -> int:
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


class _Region(io.RawIOBase):
    """The bytes [start, start + length) of an open binary file, as a seekable read-only file of
    their own (torch.load reads the zip at offset 0 of what it is given)."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n])
        self._pos += got
        return got


_CHUNK = 1 << 20


def _hash_payload(f, fields: bytes, length: int) -> bytes:
    """SHA-256 of `fields` and the next `length` bytes of f, read in chunks (b"" if f ends early)."""
    digest = hashlib.sha256(fields)
    left = length
    while left:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            return b""
        digest.update(chunk)
        left -= len(chunk)
    return digest.digest()


def read_checkpoint(path: str | os.PathLike, map_location=None) -> dict:
    """The state stored in a checkpoint file, its integrity checked (magic, version, length,
    SHA-256) — not yet against an engine (load_checkpoint does that). CheckpointError otherwise;
    FileNotFoundError for a missing file."""
    path_s = os.fspath(path)
    if not os.path.isfile(path_s):
        if os.path.exists(path_s):
            raise CheckpointError("not a regular file", path)
        raise FileNotFoundError(f"no such file: {path_s}")
    with open(path_s, "rb") as f:  # one open file for the hash and the load (see the module docstring)
        return _read_open_checkpoint(f, path, map_location)


def _read_open_checkpoint(f, path, map_location) -> dict:
    header = f.read(HEADER_SIZE)
    payload_size = os.fstat(f.fileno()).st_size - len(header)
    if not header.startswith(MAGIC):
        hint = (" (a plain torch.save file, or a checkpoint of fewbits before version 2, which had no "
                "integrity check)" if header.startswith(b"PK\x03\x04") else "")
        raise CheckpointError(f"not a readable fewbits training checkpoint (no fewbits header){hint}", path)
    if len(header) < HEADER_SIZE:
        raise CheckpointError("not a readable fewbits training checkpoint: truncated inside its header", path)
    fields = header[len(MAGIC):len(MAGIC) + _FIELDS.size]
    version, length = _FIELDS.unpack(fields)
    if version != VERSION:
        raise CheckpointError(f"not a readable fewbits training checkpoint: version {version} "
                              f"(this fewbits reads version {VERSION}; corrupted?)", path)
    if length != payload_size:
        raise CheckpointError(f"not a readable fewbits training checkpoint: {payload_size} bytes of "
                              f"payload, the header says {length} (truncated or corrupted)", path)
    if _hash_payload(f, fields, length) != header[len(MAGIC) + _FIELDS.size:]:
        raise CheckpointError("checksum mismatch: the checkpoint is corrupted", path)
    try:
        state = torch.load(io.BufferedReader(_Region(f, HEADER_SIZE, length), _CHUNK), weights_only=True,
                           map_location=map_location)
    except Exception as exc:  # noqa: BLE001 - a file written by something else with a valid digest
        raise CheckpointError(f"not a readable fewbits training checkpoint ({type(exc).__name__}: {exc})",
                              path) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_TAG:
        raise CheckpointError("not a fewbits training checkpoint (no format tag in its state)", path)
    return state


def load_checkpoint(engine, path: str | os.PathLike) -> dict:
    """Restore the engine from `path`; returns the `extra` dict saved with it. Everything is
    checked first (read_checkpoint, then check_engine_state): on CheckpointError the model,
    optimizer and engine are unchanged."""
    state = read_checkpoint(path, map_location=engine.device)
    load_engine_state(engine, state, path, _owned=True)  # read from the file: nobody else holds it
    return state.get("extra", {})


# ---------------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of t: this rank's shard for a DTensor."""
    return local(t).detach().clone()


def _referenced(v):
    """v in new containers holding the live tensors themselves (this rank's shard for a DTensor,
    detached): what torch.save reads once, never what a caller keeps."""
    if isinstance(v, torch.Tensor):
        return local(v).detach()
    if isinstance(v, dict):
        return {k: _referenced(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_referenced(x) for x in v)
    return v


def _snapshot(v):
    """v with every tensor in it copied (this rank's shard for a DTensor), containers rebuilt."""
    if isinstance(v, torch.Tensor):
        return _local(v)
    if isinstance(v, dict):
        return {k: _snapshot(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_snapshot(x) for x in v)
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain(v) -> bool:
    """Whether v is a value an optimizer state may hold besides a tensor: None, a number, a
    string, or a list/tuple of those and tensors (L-BFGS keeps lists of directions)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(isinstance(x, torch.Tensor) or _plain(x) for x in v)
    return False


def _fits(state_shape: tuple, param_shape: tuple, exact: bool) -> bool:
    """Whether a state tensor's shape belongs to a parameter's: the same, or (unless exact) the
    same rank with some dimensions reduced to 1 (Adafactor's factored row and column states)."""
    if exact or len(state_shape) != len(param_shape):
        return state_shape == param_shape
    return all(s == p or s == 1 for s, p in zip(state_shape, param_shape))


def _as_shard_of(shard: torch.Tensor, like) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(shard.to(like.dtype), like.device_mesh, like.placements,
                              shape=like.shape, stride=like.stride())


def _load_model(model, saved: dict) -> None:
    """load_state_dict of a checked state, DTensor entries filled shard by shard (each rank its own)."""
    current = model.state_dict()
    plain = {}
    with torch.no_grad():
        for k, v in saved.items():
            target = current[k]
            if is_dtensor(target):
                target.to_local().copy_(v)
            else:
                plain[k] = v
    model.load_state_dict(plain, strict=False)
