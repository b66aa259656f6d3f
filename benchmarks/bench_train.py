"""Speed and loss of a mixed-precision training step: fewbits policies beside torch autocast,
torch fp32 and torchao's float8 training, on a GPT-style LM.

    python benchmarks/bench_train.py                       # CPU: the README's LM, 300 steps
    python benchmarks/bench_train.py --model 4x            # ~4x the parameters (d_model 1024)
    python benchmarks/bench_train.py --model quick         # d_model 256, sequence 128 (= --quick)
    python benchmarks/bench_train.py --device cuda --model gpt-350m   # the GPU set, 200 steps
    python benchmarks/bench_train.py --device cuda --model gpt-350m --compile torchao
    python benchmarks/bench_train.py --only int8-mixed,bf16-mixed --steps 50 --json train.json

Models (--model; --d-model/--layers/--heads/--seq/--batch override any of them): byte vocabulary,
learned positions, pre-norm blocks (fewbits.study.tasks.GPT, the model of `fewbits train --task lm`),
AdamW; the data are the pydoc text of fewbits.study.tasks.Task (seeded batches).

  readme     d_model 512,  4 layers,  8 heads, sequence 256,  batch 16   (~13.0M parameters)
  4x         d_model 1024, 4 layers, 16 heads, sequence 256,  batch 16   (~51.2M)
  quick      d_model 256,  4 layers,  8 heads, sequence 128,  batch 16   (~3.3M)
  gpt-350m   d_model 1024, 24 layers, 16 heads, sequence 2048, batch 4   (~305M)
  gpt-1.3b   d_model 2048, 24 layers, 16 heads, sequence 2048, batch 2   (~1.2B)

Every configuration trains its own copy of the same initial model (the same seed) on the same
batches for --steps steps (default 300 on a CPU, 200 on CUDA). The first --warmup steps (default
3 on a CPU, 5 on CUDA; they compile fewbits' fused kernels, torch.compile's graphs and pick
cuBLAS's algorithms) are trained but not timed. Reported: the median step time, the final loss
(the mean loss of the last 10 steps, or of all of them if fewer), both as ratios to fewbits
bf16-mixed, peak memory on CUDA, and for each fewbits configuration `engine.gemm_path` (which
path its GEMMs took) and how many of its GEMMs ran natively / emulated. The loss is computed in
float32 from the logits for every configuration.

Schedules (--schedule):
  interleaved  (default on a CPU) all models live at once; each round runs one step of every
               configuration back to back, so drift on a shared machine hits all alike.
  sequential   (default on CUDA) one configuration at a time: its model is built, trained for all
               the steps and freed (dynamo's caches reset) before the next is built. A 1.3B model
               takes ~24 GB of weights, masters, gradients and AdamW states and ~10-20 GB of
               activations per configuration: the GPU set of 7-9 configurations does not fit in
               one H200's 139 GiB at once, and one at a time also makes each configuration's peak
               memory its own (torch.cuda.max_memory_allocated, reset per configuration). A GPU
               has the machine to itself, so interleaving buys nothing there.

Configurations (default sets; --all runs every one; --only NAMES picks by name or policy):
  CPU set  torch autocast bf16, fewbits bf16-mixed, fewbits int8-mixed, fewbits int8-mixed-gw8
  GPU set  fewbits bf16-mixed, fewbits fp8-hybrid (delayed scaling), torchao float8 tensorwise,
           torchao float8 rowwise, torch autocast bf16, fewbits fp8-hybrid-current, fp8-rowwise
  others   fp32 (plain torch), fewbits bf16-mixed + telemetry, fewbits fp8-hybrid on a CPU
           (emulated there), fewbits fp16-mixed, torchao float8 tensorwise (bf16 model)

  torch autocast bf16     torch.autocast(device, bfloat16) around the forward: fp32 weights and
                          AdamW, recast to bf16 at every matmul of every step
  fewbits <policy>        fewbits.train.Engine(model, AdamW, policy, gemm=--gemm)
  torchao float8 <recipe> torchao.float8.convert_to_float8_training(model,
                          config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=every
                          nn.Linear whose dimensions are multiples of 16, as torchao's example does)
                          on the fp32 model, trained under torch.autocast(bfloat16) (Float8Linear
                          handles autocast itself): fp32 weights and AdamW, as bf16-mixed and torch
                          autocast keep them. "(bf16 model)": the model in bf16 as in torchao's
                          README example (bf16 weights and AdamW states, no autocast). torchao's
                          documented usage compiles the model: --compile torchao adds those rows.
  --compile [WHICH]       also a torch.compile'd copy of each configuration (WHICH: all, or a comma
                          list of kinds torch/autocast/fewbits/torchao, names or policies);
                          --compiled-only: the compiled copies instead of the eager ones

Targets, printed as met / NOT met from the ratios of this run:
  CPU (issue 16)  int8-mixed (and -gw8) >= 1.3x fewbits bf16-mixed's step speed, final loss within
                  1% of bf16-mixed's
  GPU (issue 16)  each fewbits fp8 policy >= 1.3x bf16-mixed, >= the fastest torchao float8
                  configuration of the run, final loss within 1% of bf16-mixed's
  issue 4         bf16-mixed >= 1.8x fp32 (when fp32 runs)

A configuration that cannot run (torchao not installed, no FP8 GEMMs, out of memory) is reported
with the reason and the others go on. --max-seconds stops a run before it outgrows its budget:
interleaved, all configurations stop at the same step; sequential, a configuration that would
end past the budget (guessed from the longest one so far of its kind) is not started and is
reported as not run. --json FILE keeps every sample, every loss and the environment
(rewritten after each configuration of a sequential run).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from fewbits.hardware import machine_info  # noqa: E402
from fewbits.study.tasks import GPT, Task, TaskConfig  # noqa: E402
from fewbits.train import Engine, Telemetry  # noqa: E402

VOCAB = 256
MODELS = {  # name: (d_model, layers, heads, sequence, batch, AdamW learning rate)
    "readme": dict(d_model=512, layers=4, heads=8, seq=256, batch=16, lr=1e-3),
    "4x": dict(d_model=1024, layers=4, heads=16, seq=256, batch=16, lr=1e-3),
    "quick": dict(d_model=256, layers=4, heads=8, seq=128, batch=16, lr=1e-3),
    "gpt-350m": dict(d_model=1024, layers=24, heads=16, seq=2048, batch=4, lr=3e-4),
    "gpt-1.3b": dict(d_model=2048, layers=24, heads=16, seq=2048, batch=2, lr=2e-4),
}
SPEED_TARGET = 1.3  # issue 16: x bf16-mixed's step speed
LOSS_TARGET = 0.01  # issue 16: final loss within 1% of bf16-mixed's
BASELINE = "fewbits bf16-mixed"
LOSS_TAIL = 10


@dataclass(frozen=True)
class Config:
    name: str
    kind: str                 # torch (fp32) | autocast | fewbits | torchao
    policy: str | None = None  # fewbits preset
    recipe: str | None = None  # torchao Float8LinearRecipeName value
    bf16_model: bool = False   # torchao: the model itself in bf16 (their README's example), no autocast
    telemetry: bool = False
    compiled: bool = False


CONFIGS = [
    Config("fp32", "torch"),
    Config("torch autocast bf16", "autocast"),
    Config("fewbits bf16-mixed", "fewbits", "bf16-mixed"),
    Config("fewbits bf16-mixed + telemetry", "fewbits", "bf16-mixed", telemetry=True),
    Config("fewbits int8-mixed", "fewbits", "int8-mixed"),
    Config("fewbits int8-mixed-gw8", "fewbits", "int8-mixed-gw8"),
    Config("fewbits fp8-hybrid", "fewbits", "fp8-hybrid"),
    Config("fewbits fp8-hybrid-current", "fewbits", "fp8-hybrid-current"),
    Config("fewbits fp8-rowwise", "fewbits", "fp8-rowwise"),
    Config("fewbits fp16-mixed", "fewbits", "fp16-mixed"),
    Config("torchao float8 tensorwise", "torchao", recipe="tensorwise"),
    Config("torchao float8 rowwise", "torchao", recipe="rowwise"),
    Config("torchao float8 tensorwise (bf16 model)", "torchao", recipe="tensorwise", bf16_model=True),
]
# default sets, in the order they run (sequentially the targets' configurations come first, so a
# time budget that runs out loses the others)
SETS = {
    "cpu": ("torch autocast bf16", "fewbits bf16-mixed", "fewbits int8-mixed", "fewbits int8-mixed-gw8"),
    "gpu": ("fewbits bf16-mixed", "fewbits fp8-hybrid", "torchao float8 tensorwise", "torchao float8 rowwise",
            "torch autocast bf16", "fewbits fp8-hybrid-current", "fewbits fp8-rowwise"),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _float8_filter(module, fqn):
    """torchao's example filter: convert the nn.Linear layers whose dimensions are multiples of 16."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def count_parameters(spec: dict) -> int:
    with torch.device("meta"):
        model = GPT(VOCAB, spec["d_model"], spec["layers"], spec["heads"], spec["seq"])
    return sum(p.numel() for p in model.parameters())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class Runner:
    """One configuration: its own model (built lazily by build()), optimizer and, for fewbits,
    Engine; step() trains one step and returns its wall time."""

    def __init__(self, config: Config, spec: dict, device: torch.device, gemm: str = "auto", seed: int = 0):
        self.config, self.name, self.kind = config, config.name, config.kind
        self.spec, self.device, self.gemm, self.seed = spec, device, gemm, seed
        self.model = self.forward = self.opt = self.engine = None
        self.times: list[float] = []
        self.losses: list[float] = []
        self.error: str | None = None
        self.peak_bytes: int | None = None
        self.gemm_path: str | None = None
        self.gemm_counts: dict | None = None
        self._base_bytes = 0

    # -----------------------------------------------------------------------------------------
    def build(self) -> None:
        c, s, dev = self.config, self.spec, self.device
        if dev.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            self._base_bytes = torch.cuda.memory_allocated(dev)
        torch.manual_seed(self.seed)
        with dev:  # built where it trains; the same seed gives every configuration the same weights
            model = GPT(VOCAB, s["d_model"], s["layers"], s["heads"], s["seq"])
        if c.kind == "torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            if c.bf16_model:
                model = model.bfloat16()
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(c.recipe),
                                       module_filter_fn=_float8_filter)
            where = "torch._scaled_mm" + (" (the CPU's reference kernel)" if dev.type == "cpu" else "")
            self.gemm_path = (f"torchao Float8Linear, {c.recipe} scaling: {where}; "
                              + ("bf16 model" if c.bf16_model else "fp32 weights under torch.autocast(bfloat16)"))
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=s["lr"])
        if c.kind == "fewbits":
            self.engine = Engine(model, self.opt, c.policy, telemetry=Telemetry(every=2) if c.telemetry else None,
                                 gemm=self.gemm)
            self.gemm_path = self.engine.gemm_path
        elif c.kind == "autocast":
            self.gemm_path = "bf16 GEMMs (torch.autocast)"
        elif c.kind == "torch":
            self.gemm_path = "fp32 GEMMs"
        self.forward = torch.compile(model) if c.compiled else model

    def _autocast(self) -> bool:
        return self.kind == "autocast" or (self.kind == "torchao" and not self.config.bf16_model)

    def step(self, x, y) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        if self.kind == "fewbits":
            loss = F.cross_entropy(self.forward(x).float().reshape(-1, VOCAB), y.reshape(-1))
            self.engine.train_step(loss)
        else:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast()):
                logits = self.forward(x)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        dt = time.perf_counter() - t0
        self.losses.append(float(loss.detach()))
        return dt

    def finish(self) -> None:
        """Record what the run leaves to read (peak memory, GEMM counts)."""
        if self.device.type == "cuda" and self.model is not None:
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base_bytes
        if self.engine is not None and self.engine.gemm_route is not None:
            self.gemm_counts = dict(self.engine.gemm_route.counts)

    def free(self) -> None:
        compiled = self.config.compiled
        self.model = self.forward = self.opt = self.engine = None
        if compiled:
            torch._dynamo.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def fail(self, exc: BaseException | str) -> None:
        self.error = exc if isinstance(exc, str) else _first_line(exc)
        print(f"  {self.name}: could not run: {self.error}", flush=True)
        self.free()

    # -----------------------------------------------------------------------------------------
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times and self.error is None else None

    def final_loss(self) -> float | None:
        if self.error is not None or not self.losses:
            return None
        tail = self.losses[-min(LOSS_TAIL, len(self.losses)):]
        return sum(tail) / len(tail)


# ---------------------------------------------------------------------------------------------
# arguments and configurations
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default=None, help="model size (default readme)")
    ap.add_argument("--quick", action="store_true", help="the same as --model quick")
    ap.add_argument("--d-model", type=int, help="override the model's d_model")
    ap.add_argument("--layers", type=int, help="override the number of blocks")
    ap.add_argument("--heads", type=int, help="override the number of attention heads")
    ap.add_argument("--seq", type=int, help="override the sequence length")
    ap.add_argument("--batch", type=int, help="override the batch size")
    ap.add_argument("--lr", type=float, help="override AdamW's learning rate")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300 on a CPU, 200 on CUDA)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 3 on a CPU, 5 on CUDA)")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps (old spelling: steps = warmup + rounds)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--set", dest="config_set", choices=list(SETS), default=None,
                    help="default configurations: cpu or gpu (default: the device's)")
    ap.add_argument("--only", default=None, help="comma-separated configuration names or policies")
    ap.add_argument("--all", action="store_true", help="every configuration")
    ap.add_argument("--compile", nargs="?", const="all", default=None, metavar="WHICH",
                    help="also torch.compile'd copies (all, or kinds/names/policies, comma-separated)")
    ap.add_argument("--compiled-only", action="store_true",
                    help="with --compile: the compiled copies replace the eager configurations they match")
    ap.add_argument("--gemm", default="auto", choices=("auto", "native", "emulated"),
                    help="fewbits Engine(gemm=...): where the linear layers' low-precision GEMMs run")
    ap.add_argument("--schedule", choices=("interleaved", "sequential"), default=None,
                    help="interleaved (default on a CPU) or sequential (default on CUDA); see the docstring")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop before the run outgrows this budget")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="write every sample, loss and the environment")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    if args.quick and args.model not in (None, "quick"):
        ap.error("--quick is --model quick")
    args.model = "quick" if args.quick else (args.model or "readme")
    args.config_set = args.config_set or ("gpu" if cuda else "cpu")
    args.schedule = args.schedule or ("sequential" if cuda else "interleaved")
    if args.warmup is None:
        args.warmup = 5 if cuda else 3
    if args.rounds is not None:
        if args.steps is not None:
            ap.error("give --steps or --rounds, not both")
        args.steps = args.warmup + args.rounds
    if args.steps is None:
        args.steps = 200 if cuda else 300
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    args.warmup = min(args.warmup, args.steps - 1)  # at least one timed step
    return args


def model_spec(args) -> dict:
    spec = dict(MODELS[args.model])
    for key, attr in (("d_model", "d_model"), ("layers", "layers"), ("heads", "heads"), ("seq", "seq"),
                      ("batch", "batch"), ("lr", "lr")):
        if getattr(args, attr) is not None:
            spec[key] = getattr(args, attr)
    if spec["d_model"] % spec["heads"]:
        raise SystemExit(f"d_model {spec['d_model']} is not a multiple of {spec['heads']} heads")
    return spec


def _matches(c: Config, words: set[str]) -> bool:
    return "all" in words or c.name in words or c.policy in words or c.kind in words


def select_configs(args) -> list[Config]:
    by_name = {c.name: c for c in CONFIGS}
    if args.only:
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        chosen = []
        for w in words:
            hits = [c for c in CONFIGS if w in (c.name, c.policy, c.kind) and c not in chosen]
            if not hits and not any(w in (c.name, c.policy, c.kind) for c in CONFIGS):
                raise SystemExit(f"--only: no configuration {w!r}; choose from: {', '.join(by_name)}")
            chosen += hits
    elif args.all:
        chosen = list(CONFIGS)
    else:
        chosen = [by_name[n] for n in SETS[args.config_set]]
    if args.compile:
        words = {w.strip() for w in args.compile.split(",") if w.strip()}
        out = []
        for c in chosen:
            if not (args.compiled_only and _matches(c, words)):
                out.append(c)
            if _matches(c, words):
                out.append(dataclasses.replace(c, name=f"{c.name} (compiled)", compiled=True))
        chosen = out
    return chosen


def make_batches(spec: dict, steps: int, seed: int, device: torch.device) -> list:
    # the data sampler of `fewbits train --task lm` at this sequence length and batch size; its own
    # model is built at the smallest size (each configuration builds its own)
    cfg = TaskConfig("lm", d_model=8, n_layers=1, n_heads=1, seq=spec["seq"], batch_size=spec["batch"], seed=seed)
    task = Task(cfg)
    return [tuple(t.to(device) for t in task.batch()) for _ in range(steps)]


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
def run_interleaved(runners, batches, warmup, max_seconds) -> int | None:
    """One step of every configuration per round. Returns the step count if the budget cut it."""
    for r in runners:
        try:
            r.build()
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            r.fail(exc)
    start = time.perf_counter()
    every = max(1, len(batches) // 30)
    for i, (x, y) in enumerate(batches):
        this_round = []
        for r in runners:
            if r.error is not None:
                continue
            try:
                dt = r.step(x, y)
            except Exception as exc:  # noqa: BLE001
                r.fail(exc)
                continue
            this_round.append(f"{r.name} {dt * 1e3:.0f}ms {r.losses[-1]:.3f}")
            if i >= warmup:
                r.times.append(dt)
        if i < warmup or (i + 1) % every == 0 or i + 1 == len(batches):
            print(f"  step {i + 1}/{len(batches)}{' (warm-up)' if i < warmup else ''}: " + ", ".join(this_round),
                  file=sys.stderr, flush=True)
        if max_seconds is not None and time.perf_counter() - start > max_seconds and i + 1 < len(batches) \
                and i >= warmup:
            print(f"  time budget ({max_seconds:.0f}s) spent: every configuration stops after step {i + 1}",
                  flush=True)
            for r in runners:
                if r.error is None:
                    r.finish()
            return i + 1
    for r in runners:
        if r.error is None:
            r.finish()
    return None


def run_sequential(runners, batches, warmup, max_seconds, after_each=None) -> None:
    start = time.perf_counter()
    every = max(1, len(batches) // 10)
    took = {False: [], True: []}  # seconds per configuration so far, eager / compiled
    for n, r in enumerate(runners):
        if max_seconds is not None and n > 0:  # the first always runs
            # would this one end past the budget? Guess its time from the longest one so far of
            # its kind (compiled or eager; a first compiled one: twice the longest eager one)
            same = took[r.config.compiled]
            guess = max(same) if same else 2 * max(took[False] + took[True])
            elapsed = time.perf_counter() - start
            if elapsed + guess > max_seconds:
                r.error = (f"not run: the time budget ({max_seconds:.0f}s) would be spent "
                           f"({elapsed:.0f}s gone, ~{guess:.0f}s more for this one)")
                print(f"  {r.name}: {r.error}", flush=True)
                continue
        t_cfg = time.perf_counter()
        try:
            r.build()
            print(f"  {r.name}: {r.gemm_path}", file=sys.stderr, flush=True)
            for i, (x, y) in enumerate(batches):
                dt = r.step(x, y)
                if i >= warmup:
                    r.times.append(dt)
                if i < warmup or (i + 1) % every == 0:
                    print(f"  {r.name} step {i + 1}/{len(batches)}{' (warm-up)' if i < warmup else ''}: "
                          f"{dt * 1e3:.1f}ms loss {r.losses[-1]:.4f}", file=sys.stderr, flush=True)
            r.finish()
            r.free()
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            r.fail(exc)
        took[r.config.compiled].append(time.perf_counter() - t_cfg)
        if r.error is None:
            print(f"  {r.name}: median {r.median() * 1e3:.1f} ms/step, final loss {r.final_loss():.4f} "
                  f"({took[r.config.compiled][-1]:.0f}s)", flush=True)
        if after_each is not None:
            after_each()


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def evaluate_targets(runners) -> list[dict]:
    """The issues' targets from the ratios of this run (see the module docstring)."""
    ok = {r.name: r for r in runners if r.error is None and r.median() is not None}
    base = ok.get(BASELINE)
    out = []

    def add(what, value, met):
        out.append({"target": what, "value": value, "met": met})

    for r in runners:
        pol = r.config.policy or ""
        if r.kind != "fewbits" or not (pol.startswith("int8") or pol.startswith("fp8")):
            continue
        if r.name not in ok or base is None:
            why = r.error if r.name not in ok else f"{BASELINE} did not run"
            add(f"{r.name} step speed >= {SPEED_TARGET}x {BASELINE}", why, None)
            continue
        speed = base.median() / r.median()
        dloss = r.final_loss() / base.final_loss() - 1
        add(f"{r.name} step speed >= {SPEED_TARGET}x {BASELINE}", f"{speed:.2f}x", speed >= SPEED_TARGET)
        if pol.startswith("fp8"):
            aos = [a for a in ok.values() if a.kind == "torchao"]
            if aos:
                fastest = min(aos, key=lambda a: a.median())
                rel = fastest.median() / r.median()
                add(f"{r.name} step speed >= the fastest torchao float8 ({fastest.name})", f"{rel:.2f}x",
                    rel >= 1.0)
            else:
                why = next((a.error for a in runners if a.kind == "torchao" and a.error),
                           "no torchao float8 configuration in this run")
                add(f"{r.name} step speed >= the fastest torchao float8", why, None)
        add(f"{r.name} final loss within {LOSS_TARGET:.0%} of {BASELINE}", f"{dloss:+.2%}",
            abs(dloss) <= LOSS_TARGET)
    if base is not None and "fp32" in ok:
        s = ok["fp32"].median() / base.median()
        add(f"{BASELINE} step speed >= 1.8x fp32 (issue 4)", f"{s:.2f}x", s >= 1.8)
    return out


def derived_figures(runners, warmup) -> dict:
    ok = {r.name: r for r in runners if r.error is None and r.median() is not None}
    base = ok.get(BASELINE)
    d = {}
    if base is None:
        return d
    b = base.median()
    if "torch autocast bf16" in ok:
        d["bf16_mixed_vs_autocast"] = ok["torch autocast bf16"].median() / b
    if "fp32" in ok:
        d["bf16_mixed_speedup_vs_fp32"] = ok["fp32"].median() / b
    fp8 = ok.get("fewbits fp8-hybrid")
    if fp8 is not None:
        d["fp8_hybrid_step_vs_bf16_mixed"] = fp8.median() / b - 1
    tel = ok.get("fewbits bf16-mixed + telemetry")
    if tel is not None:  # it samples every 2nd step; the overhead at the default (every 10) from both medians
        sampled = [t for i, t in enumerate(tel.times) if (warmup + i) % 2 == 0]
        plain = [t for i, t in enumerate(tel.times) if (warmup + i) % 2 == 1]
        if sampled and plain:
            t_s, t_p = statistics.median(sampled), statistics.median(plain)
            d["telemetry_sampled_step_extra_s"] = t_s - t_p
            d["telemetry_overhead"] = ((t_s - t_p) / 10 + t_p) / b - 1
    return d


def _fmt_ms(s):
    return f"{s * 1e3:.1f}" if s is not None else "-"


def print_table(runners, device) -> None:
    ok = {r.name: r for r in runners if r.error is None and r.median() is not None}
    base = ok.get(BASELINE)
    print(f"\n{'configuration':44s} {'step (ms)':>10s} {'speed vs bf16-mixed':>20s} {'final loss':>10s} "
          f"{'loss vs bf16-mixed':>19s}" + (f" {'peak mem (GiB)':>15s}" if device.type == "cuda" else ""))
    for r in runners:
        if r.name not in ok:
            print(f"{r.name:44s} {'-':>10s} {'-':>20s} {'-':>10s} {'-':>19s}   ({r.error or 'no timed step'})")
            continue
        speed = f"{base.median() / r.median():.2f}x" if base else "-"
        dloss = f"{r.final_loss() / base.final_loss() - 1:+.2%}" if base else "-"
        mem = (f" {r.peak_bytes / 2 ** 30:15.2f}" if r.peak_bytes is not None else f" {'-':>15s}") \
            if device.type == "cuda" else ""
        print(f"{r.name:44s} {_fmt_ms(r.median()):>10s} {speed:>20s} {r.final_loss():10.4f} {dloss:>19s}{mem}")
    print("\nwhich path each configuration's GEMMs took:")
    for r in runners:
        if r.gemm_path is None:
            continue
        counts = ""
        if r.gemm_counts is not None:
            counts = f" [GEMMs run natively {r.gemm_counts['native']}, emulated {r.gemm_counts['emulated']}]"
        print(f"  {r.name}: {r.gemm_path}{counts}")


def environment(args, spec) -> dict:
    info = machine_info(str(args.device))
    env = {"machine": info, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "device": str(args.device), "model": args.model, "spec": spec, "parameters": count_parameters(spec),
           "steps": args.steps, "warmup": args.warmup, "schedule": args.schedule, "gemm": args.gemm,
           "compile": args.compile, "seed": args.seed}
    if args.device.type == "cuda":
        env["cuda_capability"] = list(torch.cuda.get_device_capability(args.device))
        env["cuda_memory_bytes"] = torch.cuda.get_device_properties(args.device).total_memory
    try:
        import torchao
        env["torchao"] = torchao.__version__
    except Exception as exc:  # noqa: BLE001
        env["torchao"] = f"not importable: {_first_line(exc)}"
    return env


def write_json(path, env, runners, targets, derived, partial=False, stopped_at=None) -> None:
    rows = []
    for r in runners:
        rows.append({"name": r.name, "kind": r.kind, "policy": r.config.policy, "recipe": r.config.recipe,
                     "compiled": r.config.compiled, "error": r.error, "median_step_s": r.median(),
                     "final_loss": r.final_loss(), "samples_s": r.times, "losses": r.losses,
                     "peak_memory_bytes": r.peak_bytes, "gemm_path": r.gemm_path, "gemm_counts": r.gemm_counts})
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows, "targets": targets, "derived": derived,
                   "partial": partial, "stopped_at_step": stopped_at}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_spec(args)
    device = args.device
    configs = select_configs(args)
    env = environment(args, spec)
    info = env["machine"]
    where = info.get("name", str(device))
    if device.type == "cuda":
        where += f" (compute capability {'.'.join(map(str, env['cuda_capability']))}, " \
                 f"{env['cuda_memory_bytes'] / 2 ** 30:.0f} GiB)"
    else:
        where += f" ({info.get('cpu_capability')}; {', '.join(info.get('matmul_flags', [])) or 'no AVX flags'})"
    print(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}; "
          f"torchao {env['torchao']}")
    overridden = [k for k in ("d_model", "layers", "heads", "seq", "batch", "lr") if getattr(args, k) is not None]
    label = args.model + (f" ({', '.join(overridden)} overridden)" if overridden else "")
    print(f"model {label}: d_model {spec['d_model']}, {spec['layers']} layers, {spec['heads']} heads, "
          f"seq {spec['seq']}, batch {spec['batch']}, {env['parameters'] / 1e6:.1f}M parameters, AdamW lr "
          f"{spec['lr']:g}; {args.steps} steps ({args.warmup} warm-up, untimed), {args.schedule}, "
          f"final loss = mean of the last {min(LOSS_TAIL, args.steps)}", flush=True)
    batches = make_batches(spec, args.steps, args.seed, device)
    runners = [Runner(c, spec, device, args.gemm, args.seed) for c in configs]
    stopped_at = None
    if args.schedule == "interleaved":
        stopped_at = run_interleaved(runners, batches, args.warmup, args.max_seconds)
    else:
        partial = (lambda: write_json(args.json, env, runners, [], {}, partial=True)) if args.json else None
        run_sequential(runners, batches, args.warmup, args.max_seconds, partial)
    print_table(runners, device)
    targets = evaluate_targets(runners)
    derived = derived_figures(runners, args.warmup)
    if stopped_at is not None:
        print(f"\n(stopped by the time budget after {stopped_at} of {args.steps} steps)")
    if derived:
        print()
        if "bf16_mixed_vs_autocast" in derived:
            print(f"{BASELINE} vs torch autocast bf16: {derived['bf16_mixed_vs_autocast']:.2f}x")
        if "fp8_hybrid_step_vs_bf16_mixed" in derived:
            print(f"fewbits fp8-hybrid's step vs bf16-mixed's: {derived['fp8_hybrid_step_vs_bf16_mixed']:+.0%}")
        if "telemetry_overhead" in derived:
            print(f"telemetry: a sampled step costs {derived['telemetry_sampled_step_extra_s']:+.3f}s more; "
                  f"overhead at the default sampling (every 10 steps): {derived['telemetry_overhead']:+.1%}")
    if targets:
        print()
        for t in targets:
            print(f"target: {t['target']}: {t['value']} -> {_verdict(t['met'])}")
    if args.json:
        write_json(args.json, env, runners, targets, derived, stopped_at=stopped_at)
    return 0


if __name__ == "__main__":
    sys.exit(main())
