"""Per-layer sensitivity to quantization, and mixed-precision bit allocation under a budget.

layer_sensitivity() quantizes one layer at a time under each candidate scheme (only that layer's
weight is swapped for its quantize-dequantize values; the model is otherwise untouched and the
original weight is put back) and measures on calibration data the model output's SQNR against
the float output and, given a loss function, the loss increase. It also records every layer's
bytes under each scheme: stored (QuantScheme.nbytes: codes, scales and zero points, what a
file holds) and held (what the quantized module keeps in memory on this machine, including its
kernel's extras, e.g. the bfloat16 scale copies torch's int4/int8 matmuls read).

allocate_bits() then picks one scheme per layer minimizing the summed quality loss subject to a
byte budget: a multiple-choice knapsack, solved by dynamic programming over the bytes above the
cheapest choice (exact when that axis fits the resolution; otherwise sizes are rounded up, so the
plan always fits, and a local repair spends the slack). A Lagrangian lower bound on the optimum
comes with every plan. The additive model behind it: layer losses add up (loss metric), and
independent noises add in power (SQNR metric: cost = 10^(-SQNR/10), the noise-to-signal ratio).

apply_allocation() quantizes the model with the plan and reports predicted against measured size
and quality.
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from ..progress import counter
from .model import model_nbytes, quantize_model
from .plan import calibration_batches, call_model, is_quantized, quantized_module, resolve_plan
from .qat import fake_quantize
from .scheme import QuantScheme, get_scheme
from .tensor import quantize

METRICS = ("loss", "sqnr")
SIZES = ("stored", "held")
FLOAT = "float"  # the label of the "keep this layer in float" choice


# ---------------------------------------------------------------------------------------------
# running a model on calibration batches
# ---------------------------------------------------------------------------------------------
def output_tensor(out) -> torch.Tensor:
    """The tensor an output stands for: itself, `.logits`, `.last_hidden_state`, or the first
    element of a tuple/list/dict."""
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("logits", "last_hidden_state"):
        t = getattr(out, attr, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, Mapping):
        for key in ("logits", "last_hidden_state"):
            if isinstance(out.get(key), torch.Tensor):
                return out[key]
        out = list(out.values())
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}; pass output_fn=")


class _Evaluator:
    """Runs the model on fixed batches; SQNR of the outputs against the float reference, mean loss."""

    def __init__(self, model, batches, loss_fn, output_fn, input_fn=None):
        self.model, self.batches, self.loss_fn = model, batches, loss_fn
        self.output_fn = output_fn or output_tensor
        self.input_fn = input_fn or (lambda batch: batch)
        self.reference: list[torch.Tensor] | None = None

    def run(self, keep: bool = False):
        """(sqnr_db or None when no reference yet, mean loss or None)."""
        signal = noise = 0.0
        losses = []
        kept = []
        with torch.no_grad():
            for i, batch in enumerate(self.batches):
                out = call_model(self.model, self.input_fn(batch))
                y = self.output_fn(out)
                if not isinstance(y, torch.Tensor):
                    raise TypeError(f"output_fn must return a tensor, got {type(y).__name__}")
                y = y.detach().to(torch.float32)
                if self.loss_fn is not None:
                    losses.append(float(self.loss_fn(out, batch)))
                if keep:
                    kept.append(y.cpu())
                elif self.reference is not None:
                    ref = self.reference[i]
                    if ref.shape != y.shape:
                        raise ValueError(f"batch {i}: output shape {tuple(y.shape)} differs from the float "
                                         f"output's {tuple(ref.shape)}")
                    signal += float(ref.double().square().sum())
                    noise += float((y.cpu().double() - ref.double()).square().sum())
        if keep:
            self.reference = kept
        loss = sum(losses) / len(losses) if losses else None
        if keep or self.reference is None:
            return None, loss
        return sqnr_db(signal, noise), loss


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """10 log10(signal / noise); inf when there is no noise."""
    if noise_power == 0:
        return math.inf
    if signal_power == 0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


def _finite_or_none(v):
    return v if v is None or math.isfinite(v) else None


# ---------------------------------------------------------------------------------------------
# sensitivity
# ---------------------------------------------------------------------------------------------
@dataclass
class SensitivityRecord:
    """One layer under one scheme (only that layer quantized)."""

    layer: str
    scheme: str
    params: int
    nbytes: int            # stored: codes, scales, zero points (QuantScheme.nbytes)
    bits_per_param: float  # stored
    weight_sqnr_db: float
    output_sqnr_db: float
    loss_increase: float | None = None
    held_nbytes: int | None = None  # held by the quantized module here (kernel extras included)

    def size(self, kind: str = "stored") -> int:
        return self.nbytes if kind == "stored" or self.held_nbytes is None else self.held_nbytes


@dataclass
class LayerInfo:
    name: str
    shape: tuple
    params: int
    float_nbytes: int


@dataclass
class SensitivityTable:
    """Every layer under every candidate scheme. `records` in layer order, then scheme order.

    SQNRs are in dB (inf: the quantized layer is exact); to_dict() writes inf as null.
    """

    layers: list[LayerInfo]
    schemes: dict[str, QuantScheme]
    records: list[SensitivityRecord]
    base_loss: float | None = None
    batches: int = 0
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def record(self, layer: str, scheme) -> SensitivityRecord:
        if not self._index:
            self._index.update({(r.layer, r.scheme): r for r in self.records})
        label = scheme if isinstance(scheme, str) else get_scheme(scheme).label
        try:
            return self._index[(layer, label)]
        except KeyError:
            raise KeyError(f"no record for layer {layer!r} under scheme {label!r}") from None

    @property
    def has_loss(self) -> bool:
        return bool(self.records) and all(r.loss_increase is not None for r in self.records)

    def to_dict(self) -> dict:
        def rec(r):
            d = asdict(r)
            d["weight_sqnr_db"] = _finite_or_none(d["weight_sqnr_db"])
            d["output_sqnr_db"] = _finite_or_none(d["output_sqnr_db"])
            return d
        return {
            "layers": [{"name": li.name, "shape": list(li.shape), "params": li.params,
                        "float_nbytes": li.float_nbytes} for li in self.layers],
            "schemes": {k: s.to_dict() for k, s in self.schemes.items()},
            "base_loss": self.base_loss,
            "batches": self.batches,
            "records": [rec(r) for r in self.records],
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kw)

    def format(self, max_rows: int | None = None) -> str:
        head = ["layer", "params", "scheme", "bits/param", "bytes", "held bytes", "weight SQNR dB", "output SQNR dB"]
        if self.has_loss:
            head.append("loss increase")
        rows = []
        for r in self.records[:max_rows] if max_rows else self.records:
            row = [r.layer, str(r.params), r.scheme, f"{r.bits_per_param:.3f}", str(r.nbytes), str(r.size("held")),
                   f"{r.weight_sqnr_db:.2f}", f"{r.output_sqnr_db:.2f}"]
            if self.has_loss:
                row.append(f"{r.loss_increase:+.5f}")
            rows.append(row)
        text = _format_rows(head, rows)
        if self.base_loss is not None:
            text += f"\nfloat loss {self.base_loss:.5f} over {self.batches} batches"
        return text

    def __str__(self) -> str:
        return self.format()


def _format_rows(head, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _weight_sqnr(w: torch.Tensor, wq: torch.Tensor) -> float:
    w64 = w.detach().double()
    return sqnr_db(float(w64.square().sum()), float((wq.double() - w64).square().sum()))


def _candidates(candidates) -> dict[str, QuantScheme]:
    if isinstance(candidates, (str, QuantScheme)):
        candidates = [candidates]
    out: dict[str, QuantScheme] = {}
    for c in candidates:
        s = get_scheme(c)
        if s.label in out:
            raise ValueError(f"two candidate schemes share the label {s.label!r}: name them apart")
        if s.label == FLOAT:
            raise ValueError(f"{FLOAT!r} is reserved for keeping a layer in float")
        out[s.label] = s
    if not out:
        raise ValueError("no candidate schemes given")
    return out


def _activation_quantizer(act_scheme: QuantScheme):
    """A forward pre-hook quantizing a Linear's input per token (w8a8-style dynamic activations)."""
    def hook(module, args):
        x = args[0]
        xq = fake_quantize(x.reshape(-1, x.shape[-1]), act_scheme).reshape(x.shape)
        return (xq,) + tuple(args[1:])
    return hook


def _held_nbytes(module: nn.Module, w: torch.Tensor, scheme: QuantScheme) -> int:
    """Weight bytes the quantized module of this scheme holds here (it depends on the kernel
    chosen for the scheme and shape, not on the values: built from zeros)."""
    with torch.no_grad():
        qw = quantize(torch.zeros(w.shape, dtype=w.dtype, device=w.device), scheme)
        return int(quantized_module(module, qw).qweight.nbytes)


def layer_sensitivity(model: nn.Module, candidates, calibration: Iterable,
                      loss_fn: Callable | None = None, output_fn: Callable | None = None,
                      progress: bool | Callable | None = None, skip=(), embeddings: bool = False,
                      input_fn: Callable | None = None, tied: str = "keep") -> SensitivityTable:
    """Sensitivity of each quantizable layer to each candidate scheme, one layer at a time.

    candidates: schemes or preset names. calibration: an iterable of model inputs (tensors,
    tuples of positional args, dicts of keyword args); it is run 1 + layers x schemes times.
    loss_fn(model_output, batch) -> scalar: gives the loss increase (mean over batches).
    output_fn(model_output) -> tensor: what SQNR is measured on (default: the output tensor,
    `.logits` or `.last_hidden_state`). skip / embeddings / tied: as in quantize_model (by default
    a layer whose weight another module shares is not a candidate; tied="untie" measures it, each
    layer on a copy of its own, and apply_allocation(..., tied="untie") then quantizes it).
    input_fn(batch) -> the model inputs, when batches carry more (e.g. (inputs, targets) pairs
    with loss_fn=lambda out, b: cross_entropy(out, b[1]) and input_fn=lambda b: b[0]).
    Schemes with an activation scheme (w8a8) also quantize the layer's input, per token.
    The model is run in eval mode; its weights are restored exactly (the same Parameter objects).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"layer_sensitivity() takes an nn.Module, got {type(model).__name__}")
    schemes = _candidates(candidates)
    batches = calibration_batches(calibration)
    first = next(iter(schemes.values()))
    layer_names = list(resolve_plan(model, first, skip, embeddings, tied=tied))
    if not layer_names:
        raise ValueError("no quantizable layer (nn.Linear, or nn.Embedding with embeddings=True) matched")
    ev = _Evaluator(model, batches, loss_fn, output_fn, input_fn)
    was_training = model.training
    model.eval()
    report = counter(progress, len(layer_names) * len(schemes), "sensitivity")
    layers, records = [], []
    held_cache: dict = {}
    try:
        _, base_loss = ev.run(keep=True)
        done = 0
        for name in layer_names:
            module = model.get_submodule(name)
            original = module.weight
            w = original.detach()
            layers.append(LayerInfo(name, tuple(w.shape), w.numel(), w.numel() * w.element_size()))
            for label, scheme in schemes.items():
                wq = fake_quantize(w, scheme)
                # a new Parameter on this module only: a weight tied to another module stays float there
                module._parameters["weight"] = nn.Parameter(wq, requires_grad=False)
                hook = None
                if scheme.activations is not None and isinstance(module, nn.Linear):
                    hook = module.register_forward_pre_hook(_activation_quantizer(scheme.activations))
                try:
                    out_sqnr, loss = ev.run()
                finally:
                    module._parameters["weight"] = original
                    if hook is not None:
                        hook.remove()
                nbytes = scheme.nbytes(w.shape)
                key = (type(module), tuple(w.shape), w.dtype, label, getattr(module, "bias", None) is not None)
                if key not in held_cache:
                    held_cache[key] = _held_nbytes(module, w, scheme)
                records.append(SensitivityRecord(
                    layer=name, scheme=label, params=w.numel(), nbytes=nbytes,
                    bits_per_param=nbytes * 8 / w.numel(), weight_sqnr_db=_weight_sqnr(w, wq),
                    output_sqnr_db=out_sqnr,
                    loss_increase=None if loss is None else loss - base_loss, held_nbytes=held_cache[key]))
                done += 1
                report(done, f"{name} {label}")
    finally:
        model.train(was_training)
    return SensitivityTable(layers, schemes, records, base_loss, len(batches))


# ---------------------------------------------------------------------------------------------
# the multiple-choice knapsack
# ---------------------------------------------------------------------------------------------
@dataclass
class KnapsackSolution:
    choice: list[int]     # option index per group
    cost: float
    size: int
    exact: bool           # True: optimal (sizes were not rounded)
    lower_bound: float    # Lagrangian bound: no choice within the budget costs less


def knapsack_brute_force(costs: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]], budget: int):
    """The reference: every combination; (choice, cost, size) of the cheapest within budget, or None."""
    best = None
    for combo in itertools.product(*[range(len(c)) for c in costs]):
        size = sum(sizes[i][j] for i, j in enumerate(combo))
        if size > budget:
            continue
        cost = math.fsum(costs[i][j] for i, j in enumerate(combo))
        if best is None or cost < best[1]:
            best = (list(combo), cost, size)
    return best


def lagrangian_lower_bound(costs, sizes, budget: int) -> float:
    """max over lambda >= 0 of sum_i min_j (c_ij + lambda s_ij) - lambda budget.

    Any lambda gives a lower bound on the best cost within the budget; the function is concave
    and piecewise linear, so its maximum lies at 0 or at a breakpoint (a slope between two
    options of one group), all of which are tried."""
    c = [np.asarray(ci, dtype=np.float64) for ci in costs]
    s = [np.asarray(si, dtype=np.float64) for si in sizes]
    lams = [0.0]
    for ci, si in zip(c, s):
        dc = ci[:, None] - ci[None, :]
        ds = si[None, :] - si[:, None]
        ok = ds > 0
        slopes = dc[ok] / ds[ok]
        lams.extend(slopes[slopes > 0].tolist())
    lam = np.unique(np.asarray(lams))
    best = -math.inf
    for start in range(0, len(lam), 4096):
        lc = lam[start:start + 4096]
        total = -lc * budget
        for ci, si in zip(c, s):
            total = total + (ci[None, :] + lc[:, None] * si[None, :]).min(axis=1)
        best = max(best, float(total.max()))
    return best


def solve_knapsack(costs: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]], budget: int,
                   resolution: int = 1 << 16) -> KnapsackSolution:
    """Pick one option per group minimizing the summed cost with the summed size <= budget.

    Dynamic programming over the bytes above each group's smallest option, in units of their
    greatest common divisor (exact) or, when that axis is longer than `resolution`, in units of
    1/resolution of the spare budget with sizes rounded up (the result still fits the budget
    for its real sizes; a greedy repair then spends what the rounding left over).
    Raises ValueError if even the smallest options exceed the budget.
    """
    if len(costs) != len(sizes) or any(len(c) != len(s) or not len(c) for c, s in zip(costs, sizes)):
        raise ValueError("costs and sizes must have the same non-empty option lists per group")
    sizes_i = [[int(v) for v in s] for s in sizes]
    if any(v < 0 for s in sizes_i for v in s):
        raise ValueError("sizes must be non-negative")
    costs_f = [[float(v) for v in c] for c in costs]
    if any(math.isnan(v) for c in costs_f for v in c):
        raise ValueError("costs must not be NaN")
    base = [min(s) for s in sizes_i]
    floor_size = sum(base)
    if floor_size > budget:
        raise ValueError(f"budget {budget} is below the smallest feasible size {floor_size}")
    spare = budget - floor_size
    extra = [[v - b for v in s] for s, b in zip(sizes_i, base)]
    unit = 0
    for e in extra:
        for v in e:
            unit = math.gcd(unit, v)
    unit = unit or 1
    exact = spare // unit <= resolution
    if not exact:
        unit = -(-spare // resolution)
    cap = spare // unit
    w = [[-(-v // unit) for v in e] for e in extra]  # exact division when `exact`

    dp = np.zeros(cap + 1, dtype=np.float64)  # best cost with at most c units of spare used
    picks = []
    for ci, wi in zip(costs_f, w):
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int32)
        for j, (cost, wt) in enumerate(zip(ci, wi)):
            if wt > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[wt:] = dp[:cap + 1 - wt] + cost
            better = cand < new
            new = np.where(better, cand, new)
            pick = np.where(better, j, pick)
        dp = new
        picks.append(pick)
    c = cap
    choice = [0] * len(costs_f)
    for i in range(len(costs_f) - 1, -1, -1):
        j = int(picks[i][c])
        choice[i] = j
        c -= w[i][j]
    if not exact:
        choice = _repair(choice, costs_f, sizes_i, budget)
    size = sum(sizes_i[i][j] for i, j in enumerate(choice))
    cost = math.fsum(costs_f[i][j] for i, j in enumerate(choice))
    assert size <= budget
    return KnapsackSolution(choice, cost, size, exact, lagrangian_lower_bound(costs_f, sizes_i, budget))


def _repair(choice, costs, sizes, budget):
    """Greedy local improvement with the real sizes: take the single-group change with the largest
    cost reduction that still fits, until none helps."""
    choice = list(choice)
    size = sum(sizes[i][j] for i, j in enumerate(choice))
    while True:
        best = None
        for i, (ci, si) in enumerate(zip(costs, sizes)):
            cur = choice[i]
            for j in range(len(ci)):
                gain = ci[cur] - ci[j]
                if gain > 0 and size - si[cur] + si[j] <= budget and (best is None or gain > best[0]):
                    best = (gain, i, j)
        if best is None:
            return choice
        _, i, j = best
        size += sizes[i][j] - sizes[i][choice[i]]
        choice[i] = j


# ---------------------------------------------------------------------------------------------
# allocation
# ---------------------------------------------------------------------------------------------
@dataclass
class Allocation:
    """One scheme per layer under a budget, with what the sensitivity table predicts for it.

    plan: {layer name: QuantScheme, or None to keep it in float} (quantize_model rules: pass
    `allocation.rules()` for names that need escaping).
    Sizes count the allocated layers' weights only: stored_bytes (codes, scales, zero points, as
    saved) and held_bytes (what the quantized modules hold here, kernel extras included); the
    budget applies to `sizes` ("stored" or "held"), and bits_per_param = 8 * bytes / parameters.
    predicted_loss_increase: sum of the chosen layers' loss increases (None without a loss).
    predicted_sqnr_db: output SQNR from the summed noise powers of the chosen layers.
    cost / lower_bound: the objective minimized and a bound no plan within the budget beats.
    """

    plan: dict[str, QuantScheme | None]
    choices: dict[str, str]
    metric: str
    sizes: str
    budget_bytes: int
    stored_bytes: int
    held_bytes: int
    params: int
    float_bytes: int
    predicted_loss_increase: float | None
    predicted_sqnr_db: float
    base_loss: float | None
    cost: float
    lower_bound: float
    exact: bool

    @property
    def predicted_bytes(self) -> int:
        """The bytes the budget constrains (stored or held, per `sizes`)."""
        return self.stored_bytes if self.sizes == "stored" else self.held_bytes

    @property
    def bits_per_param(self) -> float:
        return self.predicted_bytes * 8 / self.params

    @property
    def budget_bits_per_param(self) -> float:
        return self.budget_bytes * 8 / self.params

    @property
    def predicted_loss(self) -> float | None:
        if self.base_loss is None or self.predicted_loss_increase is None:
            return None
        return self.base_loss + self.predicted_loss_increase

    def rules(self) -> dict[str, QuantScheme | None]:
        """The plan as quantize_model rules, with glob characters in names escaped."""
        return {_escape(k): v for k, v in self.plan.items()}

    def scheme_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for label in self.choices.values():
            counts[label] = counts.get(label, 0) + 1
        return counts

    def to_dict(self) -> dict:
        return {
            "metric": self.metric,
            "sizes": self.sizes,
            "choices": dict(self.choices),
            "plan": {k: (v.to_dict() if v is not None else None) for k, v in self.plan.items()},
            "budget_bytes": self.budget_bytes,
            "budget_bits_per_param": self.budget_bits_per_param,
            "predicted_bytes": self.predicted_bytes,
            "stored_bytes": self.stored_bytes,
            "held_bytes": self.held_bytes,
            "bits_per_param": self.bits_per_param,
            "params": self.params,
            "float_bytes": self.float_bytes,
            "predicted_loss_increase": self.predicted_loss_increase,
            "predicted_loss": self.predicted_loss,
            "predicted_sqnr_db": _finite_or_none(self.predicted_sqnr_db),
            "cost": self.cost,
            "lower_bound": self.lower_bound,
            "exact": self.exact,
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kw)

    def __str__(self) -> str:
        counts = ", ".join(f"{k} x{v}" for k, v in self.scheme_counts().items())
        lines = [f"allocation ({self.metric}, {self.sizes} bytes): {len(self.plan)} layers, {counts}",
                 f"  bytes {self.predicted_bytes} of budget {self.budget_bytes} "
                 f"({self.bits_per_param:.3f} of {self.budget_bits_per_param:.3f} bits/param; "
                 f"stored {self.stored_bytes}, held {self.held_bytes}, float {self.float_bytes})",
                 f"  predicted output SQNR {self.predicted_sqnr_db:.2f} dB"]
        if self.predicted_loss_increase is not None:
            lines.append(f"  predicted loss increase {self.predicted_loss_increase:+.5f}"
                         + (f" (loss {self.predicted_loss:.5f})" if self.predicted_loss is not None else ""))
        lines.append(f"  cost {self.cost:.6g}, lower bound {self.lower_bound:.6g}"
                     f"{' (exact optimum)' if self.exact else ''}")
        return "\n".join(lines)


def _escape(name: str) -> str:
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


def allocate_bits(sensitivity: SensitivityTable, budget_bits_per_param: float | None = None,
                  budget_bytes: int | None = None, metric: str = "loss", include_float: bool = False,
                  sizes: str = "stored", resolution: int = 1 << 16) -> Allocation:
    """The scheme per layer minimizing the predicted quality loss within a memory budget.

    budget_bits_per_param or budget_bytes (exactly one): for the weights of the table's layers.
    metric: "loss" (sum of loss increases; needs a table measured with loss_fn) or "sqnr" (sum of
    the layers' output noise-to-signal ratios 10^(-SQNR/10)).
    sizes: "stored" (codes, scales and zero points: what a saved file holds) or "held" (what the
    quantized modules hold in memory on this machine, kernel-side extras included).
    include_float: also allow keeping a layer in float (no quality loss, its float bytes).
    Raises ValueError naming the smallest feasible budget when the budget is too small.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if sizes not in SIZES:
        raise ValueError(f"sizes must be one of {', '.join(SIZES)}, got {sizes!r}")
    if not isinstance(sensitivity, SensitivityTable):
        raise TypeError(f"allocate_bits() takes a SensitivityTable, got {type(sensitivity).__name__}")
    if (budget_bits_per_param is None) == (budget_bytes is None):
        raise ValueError("give exactly one of budget_bits_per_param and budget_bytes")
    if metric == "loss" and not sensitivity.has_loss:
        raise ValueError("the sensitivity table has no loss increases (it was measured without loss_fn): "
                         "use metric='sqnr'")
    layers = sensitivity.layers
    params = sum(li.params for li in layers)
    labels = list(sensitivity.schemes)
    options = labels + ([FLOAT] if include_float else [])
    costs, size_table, stored, held, noise, dloss = [], [], [], [], [], []
    for li in layers:
        recs = [sensitivity.record(li.name, label) for label in labels]
        c = [(r.loss_increase if metric == "loss" else 10.0 ** (-r.output_sqnr_db / 10.0)) for r in recs]
        st = [r.nbytes for r in recs]
        hd = [r.size("held") for r in recs]
        n = [10.0 ** (-r.output_sqnr_db / 10.0) for r in recs]
        d = [r.loss_increase for r in recs]
        if include_float:
            c.append(0.0)
            st.append(li.float_nbytes)
            hd.append(li.float_nbytes)
            n.append(0.0)
            d.append(0.0)
        costs.append(c)
        stored.append(st)
        held.append(hd)
        size_table.append(st if sizes == "stored" else hd)
        noise.append(n)
        dloss.append(d)
    if budget_bytes is None:
        if (isinstance(budget_bits_per_param, bool) or not isinstance(budget_bits_per_param, (int, float))
                or not budget_bits_per_param > 0):
            raise ValueError(f"budget_bits_per_param must be a positive number, got {budget_bits_per_param!r}")
        budget = int(math.floor(budget_bits_per_param * params / 8 + 1e-9))
    else:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        budget = int(budget_bytes)
    smallest = sum(min(s) for s in size_table)
    if smallest > budget:
        raise ValueError(
            f"budget of {budget} {sizes} bytes ({budget * 8 / params:.4f} bits/param) is infeasible: the smallest "
            f"feasible budget is {smallest} bytes ({smallest * 8 / params:.4f} bits/param, every layer "
            f"at its smallest candidate)")
    sol = solve_knapsack(costs, size_table, budget, resolution)
    plan, choices = {}, {}
    for li, j in zip(layers, sol.choice):
        label = options[j]
        choices[li.name] = label
        plan[li.name] = None if label == FLOAT else sensitivity.schemes[label]

    def total(table):
        return sum(table[i][j] for i, j in enumerate(sol.choice))

    total_noise = math.fsum(noise[i][j] for i, j in enumerate(sol.choice))
    pred_dloss = (math.fsum(dloss[i][j] for i, j in enumerate(sol.choice)) if sensitivity.has_loss else None)
    return Allocation(
        plan=plan, choices=choices, metric=metric, sizes=sizes, budget_bytes=budget,
        stored_bytes=total(stored), held_bytes=total(held),
        params=params, float_bytes=sum(li.float_nbytes for li in layers),
        predicted_loss_increase=pred_dloss,
        predicted_sqnr_db=math.inf if total_noise == 0 else -10.0 * math.log10(total_noise),
        base_loss=sensitivity.base_loss, cost=sol.cost, lower_bound=sol.lower_bound, exact=sol.exact)


def uniform_allocation(sensitivity: SensitivityTable, scheme, sizes: str = "stored") -> Allocation:
    """Every layer under one scheme (a table label, preset name or QuantScheme), with the
    table's predictions (to compare against)."""
    label = scheme if isinstance(scheme, str) and scheme in sensitivity.schemes else get_scheme(scheme).label
    if label not in sensitivity.schemes:
        raise ValueError(f"scheme {label!r} is not in the sensitivity table")
    nbytes = sum(sensitivity.record(li.name, label).size(sizes) for li in sensitivity.layers)
    metric = "loss" if sensitivity.has_loss else "sqnr"
    table = SensitivityTable(sensitivity.layers, {label: sensitivity.schemes[label]},
                             [r for r in sensitivity.records if r.scheme == label],
                             sensitivity.base_loss, sensitivity.batches)
    return allocate_bits(table, budget_bytes=nbytes, metric=metric, sizes=sizes)


# ---------------------------------------------------------------------------------------------
# applying a plan, predicted against measured
# ---------------------------------------------------------------------------------------------
@dataclass
class AllocationReport:
    """Predicted (from the sensitivity table) against measured, after quantize_model.

    Layer bytes: the allocated layers' weights, stored (codes, scales, zero points) and held
    (by the quantized modules, kernel extras included). Model bytes: model_nbytes() totals,
    which count what quantized modules hold; the predicted one is the float model's total minus
    the float weights replaced plus the predicted held bytes.
    """

    predicted_stored_bytes: int
    measured_stored_bytes: int
    predicted_held_bytes: int
    measured_held_bytes: int
    predicted_model_bytes: int
    measured_model_bytes: int
    float_model_bytes: int
    layer_params: int
    model_bits_per_param: float
    float_loss: float | None = None
    predicted_loss: float | None = None
    measured_loss: float | None = None
    predicted_sqnr_db: float | None = None
    measured_sqnr_db: float | None = None

    @property
    def predicted_bits_per_param(self) -> float:
        return self.predicted_stored_bytes * 8 / self.layer_params

    @property
    def measured_bits_per_param(self) -> float:
        return self.measured_stored_bytes * 8 / self.layer_params

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("predicted_sqnr_db", "measured_sqnr_db"):
            d[k] = _finite_or_none(d[k])
        d["predicted_bits_per_param"] = self.predicted_bits_per_param
        d["measured_bits_per_param"] = self.measured_bits_per_param
        return d

    def __str__(self) -> str:
        rows = [["layer bytes stored", str(self.predicted_stored_bytes), str(self.measured_stored_bytes)],
                ["layer bits/param stored", f"{self.predicted_bits_per_param:.4f}",
                 f"{self.measured_bits_per_param:.4f}"],
                ["layer bytes held", str(self.predicted_held_bytes), str(self.measured_held_bytes)],
                ["model bytes", str(self.predicted_model_bytes), str(self.measured_model_bytes)]]
        if self.measured_sqnr_db is not None:
            rows.append(["output SQNR dB", f"{self.predicted_sqnr_db:.2f}", f"{self.measured_sqnr_db:.2f}"])
        if self.measured_loss is not None and self.predicted_loss is not None:
            rows.append(["loss", f"{self.predicted_loss:.5f}", f"{self.measured_loss:.5f}"])
        text = _format_rows(["", "predicted", "measured"], rows)
        if self.float_loss is not None:
            text += f"\nfloat loss {self.float_loss:.5f}; float model bytes {self.float_model_bytes}"
        return text


def _float_bytes_freed(model: nn.Module, names) -> int:
    """Bytes of the weights that replacing these modules removes from the model: a weight still
    held by another module (tied) stays counted once."""
    names = set(names)
    kept = set()
    for n, m in model.named_modules():
        if n in names:
            continue
        kept.update(id(p) for p in m.parameters(recurse=False))
    freed, seen = 0, set()
    for n in names:
        w = model.get_submodule(n).weight
        if id(w) not in kept and id(w) not in seen:
            seen.add(id(w))
            freed += w.numel() * w.element_size()
    return freed


def _stored_nbytes(qweight) -> int:
    """Bytes of the stored form (codes, scales, zero points), whatever layout a kernel keeps."""
    return sum(t.nbytes for t in qweight.state_dict().values())


def apply_allocation(model: nn.Module, allocation: Allocation, data: Iterable | None = None,
                     loss_fn: Callable | None = None, output_fn: Callable | None = None,
                     progress: bool | Callable | None = None, input_fn: Callable | None = None,
                     **quantize_options) -> AllocationReport:
    """Quantize `model` in place with the allocation's plan (quantize_model; quantize_options such
    as method="gptq", calibration=... pass through) and report predicted against measured sizes
    and, given `data` (batches as for layer_sensitivity), output SQNR against the float model and
    loss (with loss_fn); input_fn as in layer_sensitivity."""
    if not isinstance(allocation, Allocation):
        raise TypeError(f"apply_allocation() takes an Allocation, got {type(allocation).__name__}")
    missing = [n for n in allocation.plan if not _has_module(model, n)]
    if missing:
        raise ValueError(f"the model has no layer named {missing[0]!r} (the allocation is for another model)")
    quantized = [n for n, s in allocation.plan.items() if s is not None]
    already = [n for n in quantized if is_quantized(model.get_submodule(n))]
    if already:
        raise ValueError(f"layer {already[0]!r} is quantized already")
    before = model_nbytes(model)
    freed = _float_bytes_freed(model, quantized)

    def float_bytes(n):
        w = model.get_submodule(n).weight
        return w.numel() * w.element_size()

    float_kept = sum(float_bytes(n) for n, s in allocation.plan.items() if s is None)
    ev = None
    float_loss = None
    if data is not None:
        ev = _Evaluator(model, calibration_batches(data), loss_fn, output_fn, input_fn)
        was_training = model.training
        model.eval()
        try:
            _, float_loss = ev.run(keep=True)
        finally:
            model.train(was_training)
    if quantized:
        embeddings = any(isinstance(model.get_submodule(n), nn.Embedding) for n in quantized)
        quantize_model(model, {_escape(n): allocation.plan[n] for n in quantized}, progress=progress,
                       embeddings=embeddings, **quantize_options)
    after = model_nbytes(model)
    qweights = [model.get_submodule(n).qweight for n in quantized]
    report = AllocationReport(
        predicted_stored_bytes=allocation.stored_bytes,
        measured_stored_bytes=sum(_stored_nbytes(q) for q in qweights) + float_kept,
        predicted_held_bytes=allocation.held_bytes,
        measured_held_bytes=sum(q.nbytes for q in qweights) + float_kept,
        predicted_model_bytes=before["total"] - freed + allocation.held_bytes - float_kept,
        measured_model_bytes=after["total"], float_model_bytes=before["total"],
        layer_params=allocation.params, model_bits_per_param=after["bits_per_param"])
    if ev is not None:
        was_training = model.training
        model.eval()
        try:
            sq, loss = ev.run()
        finally:
            model.train(was_training)
        report.float_loss = float_loss
        report.measured_sqnr_db = sq
        report.predicted_sqnr_db = allocation.predicted_sqnr_db
        if loss is not None:
            report.measured_loss = loss
            if allocation.predicted_loss_increase is not None:
                report.predicted_loss = float_loss + allocation.predicted_loss_increase
    return report


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


__all__ = ["SensitivityRecord", "SensitivityTable", "LayerInfo", "layer_sensitivity", "Allocation",
           "allocate_bits", "uniform_allocation", "apply_allocation", "AllocationReport", "solve_knapsack",
           "knapsack_brute_force", "lagrangian_lower_bound", "KnapsackSolution", "sqnr_db", "call_model",
           "output_tensor", "METRICS", "SIZES", "FLOAT"]
