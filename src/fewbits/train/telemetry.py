"""Numerics telemetry: where precision is lost, per layer and tensor role, cheap enough to leave on.

Every `every`-th step the engine shows this object the tensors it casts (matmul inputs in the
forward pass, gradients of matmul outputs in the backward pass), the weights and their gradients
at the update, and the update itself. Each tensor is looked at through a strided subsample of at
most `max_samples` values, so a sampled step costs a few small reductions per tensor.

Per (step, layer, role):
  amax        largest magnitude (of the whole tensor, not the subsample)
  underflow   of the non-zero values, the fraction the format turned into zero
  saturated   of the non-zero values, the fraction at or beyond the top of the format's range
              (after any scaling): clamped to max, or overflowed to inf
  sqnr_db     (when sqnr=True) 10 log10(sum x^2 / sum (x - cast(x))^2), the cast's signal to
              quantization noise against the unrounded fp32/bf16 values
  lost        (role 'update') of the elements the optimizer changed, the fraction whose stored
              value did not change (the update vanished in the storage format)
Exponent histograms (floor(log2 |x|) of the unrounded values, per role) are accumulated for the
plot in the style of Micikevicius et al. 2018, Figure 3, with the format's range marked, that
fewbits.study.charts.save_histogram_figure draws (this module draws nothing).

Recording never waits for the device: the figures of a cast stay tensors (on the tensor's
device) until someone reads them (`rows`, `hist`, `hist_zeros`, the summaries), and
then all pending ones are copied at once. On a GPU this turns several synchronisations per cast
into one per read.
"""
from __future__ import annotations

import math

import torch

from ..formats import get_format
from .casts import round_to

EXP_LO, EXP_HI = -160, 130  # histogram range of floor(log2 |x|); beyond is clamped


def _next_prime(n: int) -> int:
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


class Telemetry:
    def __init__(self, every: int = 10, max_samples: int = 1 << 14, sqnr: bool = False, histograms: bool = True):
        if every < 1:
            raise ValueError(f"telemetry every must be >= 1, got {every}")
        self.every, self.max_samples, self.sqnr, self.histograms = every, max_samples, sqnr, histograms
        self._rows: list[dict] = []
        self._pending: list[tuple[dict, torch.Tensor, str]] = []  # (row, figures on the device, kind)
        self._hist: dict[str, torch.Tensor] = {}
        self._hist_zeros: dict[str, int | torch.Tensor] = {}
        self.hist_format: dict[str, str] = {}

    # --- what has been recorded (read: the pending figures are fetched first) ------------------
    @property
    def rows(self) -> list[dict]:
        self._flush()
        return self._rows

    @rows.setter
    def rows(self, value: list[dict]) -> None:
        self._pending.clear()
        self._rows = value

    @property
    def hist(self) -> dict[str, torch.Tensor]:
        """Per role: counts of floor(log2 |x|) over EXP_LO..EXP_HI (int64, on the CPU)."""
        self._flush()
        return self._hist

    @property
    def hist_zeros(self) -> dict[str, int]:
        self._flush()
        return self._hist_zeros

    def _flush(self) -> None:
        """Fill in the pending rows and histograms: one copy per device."""
        if self._pending:
            by_device: dict = {}
            for i, (_, fig, _) in enumerate(self._pending):
                by_device.setdefault(fig.device, []).append(i)
            values: list = [None] * len(self._pending)
            for idx in by_device.values():
                rows = torch.stack([self._pending[i][1] for i in idx]).tolist()
                for i, v in zip(idx, rows):
                    values[i] = v
            for (row, _, kind), v in zip(self._pending, values):
                _fill(row, kind, v)
            self._pending.clear()
        for role, z in self._hist_zeros.items():
            if isinstance(z, torch.Tensor):
                self._hist_zeros[role] = int(z)
        for role, h in self._hist.items():
            if h.device.type != "cpu":
                self._hist[role] = h.cpu()

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def _sample(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        if flat.numel() > self.max_samples:
            # a prime stride: regular patterns in the data (every 4th value, a row length) do not alias
            flat = flat[:: _next_prime(math.ceil(flat.numel() / self.max_samples))]
        return flat.float()

    def record_cast(self, step: int, layer: str, role: str, fmt, before: torch.Tensor,
                    after: torch.Tensor | None = None, top: float | None = None) -> None:
        """Stats of one cast: `before` the unrounded tensor, `after` its rounded values (computed
        here on the subsample if not given); `top` the magnitude that counts as saturated
        (default the format's max; fmt.max / scale for scaled casts)."""
        fmt = get_format(fmt)
        xs = self._sample(before)
        qs = self._sample(after) if after is not None else round_to(xs, fmt)
        nonzero = xs != 0
        top = fmt.max if top is None else top
        b = before.detach()
        amax = b.abs().amax().double() if b.numel() else torch.zeros((), dtype=torch.float64, device=b.device)
        figures = [nonzero.sum().double(), (nonzero & (qs == 0)).sum().double(),
                   (nonzero & ((qs.abs() >= top) | ~torch.isfinite(qs))).sum().double(), amax]
        if self.sqnr:  # float32 sums, as float64 (exact)
            figures += [((xs - qs) ** 2).sum().double(), (xs ** 2).sum().double()]
        row = {"step": step, "layer": layer, "role": role, "format": fmt.name}
        self._rows.append(row)
        self._pending.append((row, _padded(torch.stack(figures).to(b.device)), "cast_sqnr" if self.sqnr else "cast"))
        if self.histograms:
            self._histogram(role, fmt.name, xs)

    def _histogram(self, role: str, fmt_name: str, xs: torch.Tensor) -> None:
        finite = torch.isfinite(xs)
        nonzero = finite & (xs != 0)
        nbins = EXP_HI - EXP_LO + 1
        e = (torch.frexp(xs).exponent - 1).clamp(EXP_LO, EXP_HI) - EXP_LO
        e = torch.where(nonzero, e, nbins).to(torch.int64)  # zeros, inf and NaN: an extra bin, dropped
        counts = torch.zeros(nbins + 1, dtype=torch.int64, device=xs.device)
        counts.scatter_add_(0, e, torch.ones_like(e))
        counts = counts[:nbins]
        self._hist[role] = counts if role not in self._hist else self._hist[role].to(counts.device) + counts
        zeros = (finite & ~nonzero).sum()
        self._hist_zeros[role] = zeros if role not in self._hist_zeros else self._hist_zeros[role] + zeros
        self.hist_format[role] = fmt_name

    def record_lost_updates(self, step: int, layer: str, changed_intended, changed_stored) -> None:
        """Of `changed_intended` elements the optimizer changed, `changed_stored` changed in
        storage (ints, or 0-d tensors: read later, without waiting for the device now)."""
        row = {"step": step, "layer": layer, "role": "update"}
        self._rows.append(row)
        if isinstance(changed_intended, torch.Tensor) or isinstance(changed_stored, torch.Tensor):
            dev = changed_intended.device if isinstance(changed_intended, torch.Tensor) else changed_stored.device
            fig = torch.stack([torch.as_tensor(changed_intended, device=dev).double(),
                               torch.as_tensor(changed_stored, device=dev).double()])
            self._pending.append((row, _padded(fig), "update"))
        else:
            _fill(row, "update", [changed_intended, changed_stored])

    # -----------------------------------------------------------------------------------------
    def fraction(self, role: str, key: str) -> float:
        """A role's `key` ('underflow', 'saturated') averaged over all samples, weighted by
        the number of non-zero values; 0.0 when nothing was recorded."""
        num = den = 0.0
        for r in self.rows:
            if r["role"] == role and key in r:
                num += r[key] * r["nonzero"]
                den += r["nonzero"]
        return num / den if den else 0.0

    def lost_update_fraction(self) -> float:
        num = den = 0.0
        for r in self.rows:
            if r["role"] == "update":
                num += r["lost"] * r["intended"]
                den += r["intended"]
        return num / den if den else 0.0

    def layers(self) -> list[dict]:
        """Per (layer, role): max amax, mean underflow and saturation over the sampled steps."""
        acc: dict = {}
        for r in self.rows:
            if r["role"] == "update":
                k = (r["layer"], "update")
                a = acc.setdefault(k, {"layer": r["layer"], "role": "update", "lost": [], "n": 0})
                a["lost"].append(r["lost"])
                continue
            k = (r["layer"], r["role"])
            a = acc.setdefault(k, {"layer": r["layer"], "role": r["role"], "format": r["format"],
                                   "amax": 0.0, "underflow": [], "saturated": [], "sqnr_db": []})
            a["amax"] = max(a["amax"], r["amax"])
            a["underflow"].append(r["underflow"])
            a["saturated"].append(r["saturated"])
            if "sqnr_db" in r:
                a["sqnr_db"].append(r["sqnr_db"])
        out = []
        for a in acc.values():
            for key in ("underflow", "saturated", "sqnr_db", "lost"):
                if key in a:
                    vals = a[key]
                    a[key] = sum(vals) / len(vals) if vals else None
            out.append(a)
        return out

    def summary(self) -> dict:
        return {"underflow_fraction": self.fraction("backward", "underflow"),
                "forward_underflow_fraction": self.fraction("forward", "underflow"),
                "saturated_fraction": max(self.fraction("forward", "saturated"),
                                          self.fraction("backward", "saturated")),
                "weight_grad_underflow_fraction": self.fraction("weight_grad", "underflow"),
                "lost_update_fraction": self.lost_update_fraction()}

    def state_dict(self) -> dict:
        return {"rows": list(self.rows), "hist": dict(self.hist), "hist_zeros": dict(self.hist_zeros),
                "hist_format": dict(self.hist_format)}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s output; ValueError (before any change) if it is malformed."""
        def names(d, ok):
            return isinstance(d, dict) and all(isinstance(k, str) and ok(v) for k, v in d.items())
        count = lambda v: isinstance(v, torch.Tensor) or (isinstance(v, int) and not isinstance(v, bool))  # noqa: E731
        if not (isinstance(state, dict) and set(state) == {"rows", "hist", "hist_zeros", "hist_format"}
                and isinstance(state["rows"], list) and all(isinstance(r, dict) for r in state["rows"])
                and names(state["hist"], lambda v: isinstance(v, torch.Tensor))
                and names(state["hist_zeros"], count) and names(state["hist_format"], lambda v: isinstance(v, str))):
            raise ValueError("a telemetry state is {'rows': [dicts], 'hist': {role: tensor}, "
                             "'hist_zeros': {role: count}, 'hist_format': {role: format name}}")
        self.rows = list(state["rows"])
        self._hist = dict(state["hist"])
        self._hist_zeros = dict(state["hist_zeros"])
        self.hist_format = dict(state["hist_format"])


_FIGURES = 6  # the longest figure vector (a cast with sqnr); shorter ones are padded to stack


def _padded(fig: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(fig, (0, _FIGURES - fig.numel()))


def _fill(row: dict, kind: str, v: list) -> None:
    """Complete a row from its fetched figures (see Telemetry.record_cast / record_lost_updates)."""
    if kind == "update":
        intended, stored = int(v[0]), int(v[1])
        row["lost"] = 1.0 - stored / intended if intended else 0.0
        row["intended"] = intended
        return
    n_nonzero, flushed, sat, amax = int(v[0]), int(v[1]), int(v[2]), float(v[3])
    row["amax"] = amax
    row["underflow"] = flushed / n_nonzero if n_nonzero else 0.0
    row["saturated"] = sat / n_nonzero if n_nonzero else 0.0
    row["nonzero"] = n_nonzero
    if kind == "cast_sqnr":
        noise, signal = v[4], v[5]
        if noise == 0:
            row["sqnr_db"] = math.inf
        elif not math.isfinite(noise) or signal == 0:
            row["sqnr_db"] = -math.inf
        else:
            row["sqnr_db"] = 10 * math.log10(signal / noise)
