"""Fuzz fewbits' files: single-bit flips and truncations of fb.save files and training checkpoints.

    python benchmarks/fuzz_files.py                      # --size small: 220 trials, ~10 s
    python benchmarks/fuzz_files.py --size large         # 4000 trials, a few minutes
    python benchmarks/fuzz_files.py --json fuzz.json     # every group's counts (and each failure)
    python benchmarks/fuzz_files.py --kinds "checkpoint,fb model"   # some file kinds only

The files (written once per run, in a temporary directory):
  fb model       fb.save of a small quantized model: embedding (int4 asym, groups of 32), nf4 with
                 double quantization, int8, w8a8 and a float head, a LayerNorm and a buffer
  fb qtensor     fb.save of one QuantizedTensor (mxfp4)
  fb tensor      fb.save of a dict holding one plain float tensor
  checkpoint     save_checkpoint of an Engine (MLP, AdamW, bf16-mixed) after two steps
  checkpoint 8b  the same under bf16-mixed-8bit-adam (packed 8-bit optimizer states)

Each trial writes one corrupted copy -- one bit flipped at one position, or the file cut to one
length; positions and lengths are drawn a quarter from the first 512 bytes (the headers), a
quarter from the last 512 (a zip's central directory) and half from anywhere -- and loads it into a
fresh target: a float skeleton of the model for fb.load(path, model=...), nothing for the tensor
files, a fresh Engine of the same model, optimizer and policy for load_checkpoint.

Every such load must raise the documented error -- FileFormatError for fb.load, the checkpoint
module's error class for load_checkpoint (CheckpointError; ValueError where it has none) -- and
leave the target exactly as it was. The table counts, per file kind and corruption:
  raised     the documented error, target unchanged
  silent     no error at all: the corrupted file loaded (same state as the intact file or not)
  crashed    the interpreter died (a signal) or hung past --trial-timeout seconds
  partial    the documented error, but the target was changed first (a partial overwrite)
  other      another exception type escaped
The trials run in a worker process; when it dies, the trial it was running counts as crashed and
a new worker resumes with the next trial. The exit status is 1 when any trial was not "raised".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading

SIZES = {"small": {"flip": 32, "truncate": 12}, "large": {"flip": 600, "truncate": 200}}
KINDS = ("fb model", "fb qtensor", "fb tensor", "checkpoint", "checkpoint 8b")
CORRUPTIONS = ("flip", "truncate")
OUTCOMES = ("raised", "silent", "crashed", "partial", "other")
_FILES = {"fb model": "model.safetensors", "fb qtensor": "qtensor.safetensors", "fb tensor": "tensor.safetensors",
          "checkpoint": "engine.ckpt", "checkpoint 8b": "engine-8bit.ckpt"}
_POLICIES = {"checkpoint": "bf16-mixed", "checkpoint 8b": "bf16-mixed-8bit-adam"}
_EDGE = 512


# ---------------------------------------------------------------------------------------------
# the plan (no torch needed: the parent process stays light)
# ---------------------------------------------------------------------------------------------
def _spots(rng: random.Random, size: int, count: int, lo: int = 0) -> list[int]:
    """`count` offsets in [lo, size): a quarter among the first 512 bytes, a quarter among the
    last 512, half anywhere."""
    out = []
    for i in range(count):
        band = i % 4
        if band == 0:
            out.append(rng.randrange(lo, min(size, lo + _EDGE)))
        elif band == 1:
            out.append(rng.randrange(max(lo, size - _EDGE), size))
        else:
            out.append(rng.randrange(lo, size))
    return out


def make_plan(sizes: dict[str, int], size: str, seed: int, kinds=KINDS) -> list[dict]:
    """Trials: {"kind", "corruption", "at" (offset or length), "bit"}; the first truncations of
    each kind are the edge lengths 0, 1, 8 and size - 1. A kind's trials do not depend on which
    other kinds are fuzzed."""
    counts = SIZES[size]
    plan = []
    for index, kind in enumerate(KINDS):
        if kind not in kinds:
            continue
        rng = random.Random(seed * 1000 + index)
        n = sizes[kind]
        for at in _spots(rng, n, counts["flip"]):
            plan.append({"kind": kind, "corruption": "flip", "at": at, "bit": rng.randrange(8)})
        edges = [0, 1, 8, n - 1]
        lengths = edges + _spots(rng, n, max(0, counts["truncate"] - len(edges)))
        for at in lengths[:counts["truncate"]]:
            plan.append({"kind": kind, "corruption": "truncate", "at": at, "bit": None})
    return plan


def corrupted(data: bytes, trial: dict) -> bytes:
    if trial["corruption"] == "truncate":
        return data[:trial["at"]]
    out = bytearray(data)
    out[trial["at"]] ^= 1 << trial["bit"]
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# the worker: builds the originals once, then runs trials from --start, one JSON line each
# ---------------------------------------------------------------------------------------------
def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Targets:
    """Builds the originals and fresh targets, loads files, fingerprints states (torch here)."""

    def __init__(self, workdir: str, kinds=KINDS):
        import torch
        from torch import nn

        import fewbits as fb
        from fewbits.quant import quantize
        from fewbits.files import FileFormatError
        from fewbits.quant.model import quantize_model
        from fewbits.train import Engine, load_checkpoint, save_checkpoint
        from fewbits.train import checkpoint as ckpt
        torch.set_num_threads(1)
        self.torch, self.nn, self.fb, self.Engine = torch, nn, fb, Engine
        self.quantize_model, self.load_checkpoint = quantize_model, load_checkpoint
        self.fb_error = FileFormatError
        self.ckpt_error = getattr(ckpt, "CheckpointError", ValueError)
        self.workdir = workdir
        paths = {k: os.path.join(workdir, _FILES[k]) for k in kinds}
        g = torch.Generator().manual_seed(1)
        for kind, path in paths.items():  # a worker resumed after a crash finds them written
            if os.path.exists(path):
                continue
            if kind == "fb model":
                model = self._model(seed=0)
                quantize_model(model, {"up": "nf4_dq", "down": "int8", "mid": "w8a8", "emb": "int4_asym_g32",
                                       "head": None}, embeddings=True)
                fb.save(model, path)
            elif kind == "fb qtensor":
                fb.save(quantize(torch.randn(32, 64, generator=g), "mxfp4"), path)
            elif kind == "fb tensor":
                fb.save({"weight": torch.randn(48, 40, generator=g)}, path)
            else:
                engine = self._engine(_POLICIES[kind])
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
                for _ in range(2):
                    engine.train_step(nn.functional.cross_entropy(engine.model(x), y))
                save_checkpoint(engine, path)
        self.data = {}
        for kind, path in paths.items():
            with open(path, "rb") as f:
                self.data[kind] = f.read()
        self.reference = {k: self._fingerprint(*self._load(k, paths[k])) for k in kinds}

    def _model(self, seed: int):
        nn, torch = self.nn, self.torch

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(40, 64, padding_idx=0)
                self.up = nn.Linear(64, 96)
                self.norm = nn.LayerNorm(96)
                self.down = nn.Linear(96, 64, bias=False)
                self.mid = nn.Linear(64, 64)
                self.head = nn.Linear(64, 12)
                self.register_buffer("offset", torch.linspace(-1, 1, 64))

        torch.manual_seed(seed)
        return Tiny()

    def _engine(self, policy: str):
        torch, nn = self.torch, self.nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 10))
        return self.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy, seed=3)

    def fresh(self, kind: str):
        if kind == "fb model":
            return self._model(seed=1)
        if kind in _POLICIES:
            return self._engine(_POLICIES[kind])
        return None

    def _load(self, kind: str, path: str, target=None):
        """(kind, what the load produced): the target it filled, or the loaded object."""
        target = self.fresh(kind) if target is None else target
        if kind == "fb model":
            return kind, self.fb.load(path, model=target)
        if kind in _POLICIES:
            self.load_checkpoint(target, path)
            return kind, target
        return kind, self.fb.load(path)

    def expected_error(self, kind: str):
        return self.ckpt_error if kind in _POLICIES else self.fb_error

    # --- fingerprints: a SHA-256 over every tensor and value a load can change -----------------
    def _fingerprint(self, kind: str, obj) -> str:
        h = hashlib.sha256()
        if obj is None:
            return "none"
        if kind == "fb model":
            for name, m in obj.named_modules():
                h.update(f"{name}:{type(m).__name__};".encode())
                if getattr(m, "qweight", None) is not None:
                    h.update(m.qweight.scheme.label.encode())
                    self._walk(m.qweight.state_dict(), h)
            self._walk(obj.state_dict(), h)
        elif kind in _POLICIES:
            e = obj
            self._walk(e.model.state_dict(), h)
            self._walk([(x.master, x.compensation) for x in e.entries], h)
            self._walk(e.optimizer.state_dict(), h)
            self._walk([e.scaler.state_dict(), e.step_count, list(e.overflows)], h)
            self._walk({k: g.get_state() for k, g in e.generators.items()}, h)
        else:
            self._walk(obj.state_dict() if hasattr(obj, "state_dict") else obj, h)
        return h.hexdigest()

    def _walk(self, obj, h) -> None:
        torch = self.torch
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"{")
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                self._walk(obj[k], h)
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[")
            for v in obj:
                self._walk(v, h)
            h.update(b"]")
        elif hasattr(obj, "to_dict"):  # PackedState and the like
            self._walk(obj.to_dict(), h)
        else:
            h.update(repr(obj).encode())

    def trial(self, trial: dict) -> tuple[str, str]:
        """(outcome, detail) of one corrupted load."""
        kind = trial["kind"]
        path = os.path.join(self.workdir, "corrupted-" + _FILES[kind])
        with open(path, "wb") as f:
            f.write(corrupted(self.data[kind], trial))
        target = self.fresh(kind)
        before = self._fingerprint(kind, target)
        try:
            self._load(kind, path, target)
        except self.expected_error(kind) as e:
            after = self._fingerprint(kind, target)
            if after != before:
                return "partial", f"{type(e).__name__} after changing the target: {str(e)[:160]}"
            return "raised", ""
        except Exception as e:  # noqa: BLE001 - the fuzzer's point: which errors escape
            return "other", f"{type(e).__name__}: {str(e)[:200]}"
        same = self._fingerprint(kind, target if target is not None else self._load(kind, path)[1])
        return "silent", ("loaded the intact file's state" if same == self.reference[kind]
                          else "loaded a different state")


def worker(workdir: str, size: str, seed: int, kinds: tuple, start: int, sabotage: dict) -> None:
    """Run the plan's trials from `start`, one JSON line before and after each. `sabotage`
    ({trial: "crash" | "hang"}) makes the worker itself die or stall at that trial: the test
    of the fuzzer's own crash accounting."""
    import signal
    import time
    import warnings
    warnings.simplefilter("ignore")
    targets = _Targets(workdir, kinds)
    plan = make_plan({k: len(d) for k, d in targets.data.items()}, size, seed, kinds)
    _emit({"event": "plan", "trials": len(plan), "sizes": {k: len(d) for k, d in targets.data.items()},
           "errors": {"fb": targets.fb_error.__name__, "checkpoint": targets.ckpt_error.__name__}})
    for i in range(start, len(plan)):
        _emit({"event": "start", "trial": i})
        if sabotage.get(i) == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if sabotage.get(i) == "hang":
            time.sleep(3600)
        outcome, detail = targets.trial(plan[i])
        _emit({"event": "result", "trial": i, "outcome": outcome, "detail": detail})
    _emit({"event": "done"})


# ---------------------------------------------------------------------------------------------
# the parent: runs workers, counts, prints the table
# ---------------------------------------------------------------------------------------------
def _lines(proc, q) -> None:
    for line in proc.stdout:
        q.put(line)
    q.put(None)


def run(size: str, seed: int, trial_timeout: float, workdir: str, kinds=KINDS, sabotage=(), log=print) -> dict:
    results: dict[int, tuple[str, str]] = {}
    plan_info = None
    start = 0
    while True:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--size", size, "--seed", str(seed),
               "--workdir", workdir, "--start", str(start), "--kinds", ",".join(kinds)]
        cmd += [a for s in sabotage for a in ("--sabotage", s)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc, q), daemon=True).start()
        current, done, hung = None, False, False
        while True:
            timeout = trial_timeout if current is not None else max(trial_timeout, 300)
            try:
                line = q.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                hung = True
                break
            if line is None:
                break
            msg = json.loads(line)
            if msg["event"] == "plan":
                plan_info = msg
            elif msg["event"] == "start":
                current = msg["trial"]
            elif msg["event"] == "result":
                results[msg["trial"]] = (msg["outcome"], msg["detail"])
                current = None
            elif msg["event"] == "done":
                done = True
        rc = proc.wait()
        if done:
            break
        if current is None:
            raise RuntimeError(f"the fuzz worker failed outside any trial (exit status {rc}); see its stderr")
        why = f"hung for more than {trial_timeout:g} s" if hung else f"exit status {rc}"
        results[current] = ("crashed", why)
        log(f"trial {current}: the worker died ({why}); resuming with the next trial")
        start = current + 1
        if start >= plan_info["trials"]:
            break
    sizes = plan_info["sizes"]
    plan = make_plan(sizes, size, seed, kinds)
    groups = {(k, c): {o: 0 for o in ("trials",) + OUTCOMES} for k in KINDS if k in kinds for c in CORRUPTIONS}
    failures = []
    for i, trial in enumerate(plan):
        outcome, detail = results[i]
        g = groups[(trial["kind"], trial["corruption"])]
        g["trials"] += 1
        g[outcome] += 1
        if outcome != "raised":
            failures.append({**trial, "outcome": outcome, "detail": detail})
    return {"size": size, "seed": seed, "file_sizes": sizes, "errors": plan_info["errors"],
            "groups": [{"kind": k, "corruption": c, **v} for (k, c), v in groups.items()],
            "failures": failures}


def table(report: dict) -> str:
    head = f"{'file':<14} {'corruption':<10} {'trials':>6} {'raised':>6} {'silent':>6} {'crashed':>7} " \
           f"{'partial':>7} {'other':>5}"
    rows = [head, "-" * len(head)]
    for g in report["groups"]:
        rows.append(f"{g['kind']:<14} {g['corruption']:<10} {g['trials']:>6} {g['raised']:>6} {g['silent']:>6} "
                    f"{g['crashed']:>7} {g['partial']:>7} {g['other']:>5}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the counts and every failing trial to PATH")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"file kinds to fuzz, comma-separated (default: all: "
                   f"{', '.join(KINDS)})")
    p.add_argument("--trial-timeout", type=float, default=120.0, help="seconds a trial may take (default 120)")
    p.add_argument("--show", type=int, default=10, help="failing trials to list (default 10)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sabotage", action="append", default=[], metavar="crash:N|hang:N",
                   help="make the worker crash (SIGSEGV) or hang at trial N: tests the fuzzer's own accounting")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"unknown file kinds {unknown}; choose from {', '.join(KINDS)}")
    sabotage = {}
    for s in args.sabotage:
        what, _, n = s.partition(":")
        if what not in ("crash", "hang") or not n.isdigit():
            p.error(f"--sabotage takes crash:N or hang:N, got {s!r}")
        sabotage[int(n)] = what
    if args.worker:
        worker(args.workdir, args.size, args.seed, kinds, args.start, sabotage)
        return 0
    with tempfile.TemporaryDirectory(prefix="fewbits-fuzz-") as workdir:
        report = run(args.size, args.seed, args.trial_timeout, workdir, kinds, args.sabotage)
    print(f"fuzz_files --size {args.size} --seed {args.seed}: file sizes "
          + ", ".join(f"{k} {v} B" for k, v in report["file_sizes"].items()))
    print(f"documented errors: fb.load {report['errors']['fb']}, load_checkpoint {report['errors']['checkpoint']}")
    print(table(report))
    for f in report["failures"][:args.show]:
        where = f"bit {f['bit']} of byte {f['at']}" if f["corruption"] == "flip" else f"cut to {f['at']} bytes"
        print(f"  {f['kind']}, {where}: {f['outcome']} ({f['detail']})")
    if len(report["failures"]) > args.show:
        print(f"  ... and {len(report['failures']) - args.show} more")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
