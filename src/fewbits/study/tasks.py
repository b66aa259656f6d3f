"""The built-in training tasks, on real data from installed packages.

  lm   a GPT-style byte-level language model on the text of Python's `pydoc_data` topics (the
       help() pages shipped with CPython); default size d_model 512, 4 layers, 8 heads,
       sequence 256, batch 16, AdamW
  mlp  a multilayer perceptron classifying scikit-learn's 8x8 handwritten digits (1,797 images,
       bundled with scikit-learn)

`run_task` trains one policy and returns its figures; the study, the CLI and the benchmark use
it. This is the study's experiment harness, not library code: it sits on top of `fewbits.train`.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.text import pydoc_text
from ..train import Engine, Policy, Telemetry

TASKS = ("lm", "mlp")


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def pydoc_text_bytes() -> torch.Tensor:
    """The pydoc_data topics text, as shipped, as a uint8 tensor of UTF-8 bytes (about 0.5 MB)."""
    text = pydoc_text(strip=False)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


@functools.lru_cache(maxsize=1)
def digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: (1797, 64) float32 pixels scaled to [0, 1], (1797,) int64 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is a dependency
        raise ValueError("the mlp task needs scikit-learn (pip install scikit-learn)") from exc
    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT: byte embeddings + learned positions, pre-norm blocks, a linear head."""

    def __init__(self, vocab: int = 256, d_model: int = 512, n_layers: int = 4, n_heads: int = 8, seq: int = 256):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_mlp(hidden: int = 256, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# a task = model + batches + loss
# ---------------------------------------------------------------------------------------------
@dataclass
class TaskConfig:
    task: str = "mlp"
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    seq: int = 256
    hidden: int = 256
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        lm = self.task == "lm"
        self.steps = self.steps if self.steps is not None else (20 if lm else 300)
        self.batch_size = self.batch_size if self.batch_size is not None else (16 if lm else 128)
        self.lr = self.lr if self.lr is not None else (1e-3 if lm else 1e-3)
        for k in ("steps", "batch_size", "seq", "d_model", "n_layers", "n_heads", "hidden"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if lm and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


class Task:
    """Model, data sampler and loss of one built-in task; batches are drawn from a seeded
    generator whose state is part of a checkpoint."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if cfg.task == "lm":
            self.data = pydoc_text_bytes()
            self.model = GPT(256, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq)
        else:
            self.x, self.y = digits_data()
            self.model = make_mlp(cfg.hidden)
        self.generator = torch.Generator().manual_seed(cfg.seed + 1)

    def batch(self):
        c = self.cfg
        if c.task == "lm":
            starts = torch.randint(0, self.data.numel() - c.seq - 1, (c.batch_size,), generator=self.generator)
            rows = torch.stack([self.data[s:s + c.seq + 1] for s in starts.tolist()]).long()
            return rows[:, :-1], rows[:, 1:]
        idx = torch.randint(0, self.x.shape[0], (c.batch_size,), generator=self.generator)
        return self.x[idx], self.y[idx]

    def loss(self, out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)


# ---------------------------------------------------------------------------------------------
# running a policy
# ---------------------------------------------------------------------------------------------
def _trim_heap():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


WARMUP_STEPS = 2
_warmed: set[tuple] = set()


def _warm_up(policy: Policy, cfg: TaskConfig) -> None:
    """A throwaway run of WARMUP_STEPS steps of `cfg` under `policy` (with telemetry), once per
    process for each (policy, task shape): it pays the one-time costs (modules imported on first
    use, autograd's and OpenMP's threads, oneDNN's kernels for these shapes, autocast's caches)
    before the measured run, so that they are not charged to whichever policy runs first."""
    key = (repr(sorted(policy.to_dict().items())), cfg.task, cfg.batch_size, cfg.d_model, cfg.n_layers,
           cfg.n_heads, cfg.seq, cfg.hidden)
    if key in _warmed:
        return
    task = Task(cfg)
    engine = Engine(task.model, task.optimizer(), policy, telemetry=Telemetry(every=1), seed=cfg.seed)
    for _ in range(WARMUP_STEPS):
        x, y = task.batch()
        engine.train_step(task.loss(task.model(x), y))
    del engine, task
    _warmed.add(key)


def run_task(policy: Policy | str, cfg: TaskConfig, telemetry: Telemetry | None = None, progress=None,
             engine_hook=None) -> dict:
    """Train `cfg.task` under `policy` for cfg.steps steps; returns the figures of the run:
    policy, losses, final_loss (mean of the last 10% of steps), step_time_s (median),
    peak_memory_bytes (growth of the process's peak resident memory during the run on Linux,
    from a baseline taken after a throwaway warm-up of the same policy, so the order in which
    policies run does not change it), state_bytes (training state held: weights, masters, grads, states),
    skipped_steps, underflow_fraction, lost_update_fraction, telemetry summary, gemm_path (how
    the matmuls ran: natively or emulated, Engine.gemm_path)."""
    policy = Policy.preset(policy) if isinstance(policy, str) else policy
    (pydoc_text_bytes if cfg.task == "lm" else digits_data)()  # loaded (and cached) before measuring
    _warm_up(policy, cfg)
    _trim_heap()
    base_rss = _proc_status("VmRSS")
    can_peak = _reset_peak_rss()
    task = Task(cfg)
    opt = task.optimizer()
    telemetry = telemetry if telemetry is not None else Telemetry(every=10)
    engine = Engine(task.model, opt, policy, telemetry=telemetry, seed=cfg.seed)
    if engine_hook is not None:
        engine_hook(engine, task)
    losses, times = [], []
    for step in range(cfg.steps):
        x, y = task.batch()
        t0 = time.perf_counter()
        loss = task.loss(task.model(x), y)
        engine.train_step(loss)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, cfg.steps, losses[-1])
    peak = _proc_status("VmHWM")
    tail = max(1, cfg.steps // 10)
    finite = [v for v in losses[-tail:] if math.isfinite(v)]
    summary = telemetry.summary()
    result = {
        "policy": policy.name, "task": cfg.task, "steps": cfg.steps,
        "final_loss": sum(finite) / len(finite) if finite else float("nan"),
        "step_time_s": sorted(times)[len(times) // 2],
        "peak_memory_bytes": (peak - base_rss) if (can_peak and peak is not None and base_rss is not None) else None,
        "state_bytes": engine.memory_bytes()["total"],
        "skipped_steps": engine.skipped_steps,
        "underflow_fraction": summary["underflow_fraction"],
        "lost_update_fraction": summary["lost_update_fraction"],
        "saturated_fraction": summary["saturated_fraction"],
        "final_loss_scale": engine.scaler.scale,
        "losses": losses,
        "policy_detail": policy.to_dict(),
        "gemm_path": engine.gemm_path,
    }
    result["_engine"] = engine
    return result



def step_speed(policies, cfg: TaskConfig, rounds: int = 3, warmup: int = 1) -> list[dict]:
    """Median training-step time of `cfg.task` under each policy, measured interleaved: each round
    runs one step of every policy on the same batch (each its own copy of the same model), after
    `warmup` rounds. Returns [{policy, step_time_s, gemm_path}] in the order given."""
    runs = []
    for p in policies:
        pol = Policy.preset(p) if isinstance(p, str) else p
        task = Task(cfg)
        runs.append((pol, task, Engine(task.model, task.optimizer(), pol, seed=cfg.seed), []))
    batches = Task(cfg)
    loss = float("nan")
    for r in range(warmup + rounds):
        x, y = batches.batch()
        for pol, task, engine, times in runs:
            t0 = time.perf_counter()
            loss = task.loss(task.model(x), y)
            engine.train_step(loss)
            if r >= warmup:
                times.append(time.perf_counter() - t0)
    return [{"policy": pol.name, "step_time_s": sorted(times)[len(times) // 2], "gemm_path": engine.gemm_path}
            for pol, task, engine, times in runs]
