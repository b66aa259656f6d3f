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
plot in the style of Micikevicius et al. 2018, Figure 3, with the format's range marked.
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
        self.rows: list[dict] = []
        self.hist: dict[str, torch.Tensor] = {}
        self.hist_zeros: dict[str, int] = {}
        self.hist_format: dict[str, str] = {}

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
        n_nonzero = int(nonzero.sum())
        flushed = int((nonzero & (qs == 0)).sum())
        top = fmt.max if top is None else top
        sat = int((nonzero & ((qs.abs() >= top) | ~torch.isfinite(qs))).sum())
        row = {"step": step, "layer": layer, "role": role, "format": fmt.name,
               "amax": float(before.detach().abs().amax()) if before.numel() else 0.0,
               "underflow": flushed / n_nonzero if n_nonzero else 0.0,
               "saturated": sat / n_nonzero if n_nonzero else 0.0,
               "nonzero": n_nonzero}
        if self.sqnr:
            noise = float(((xs - qs) ** 2).sum())
            signal = float((xs ** 2).sum())
            if noise == 0:
                row["sqnr_db"] = math.inf
            elif not math.isfinite(noise) or signal == 0:
                row["sqnr_db"] = -math.inf
            else:
                row["sqnr_db"] = 10 * math.log10(signal / noise)
        self.rows.append(row)
        if self.histograms:
            self._histogram(role, fmt.name, xs)

    def _histogram(self, role: str, fmt_name: str, xs: torch.Tensor) -> None:
        finite = xs[torch.isfinite(xs)]
        nz = finite[finite != 0]
        self.hist_zeros[role] = self.hist_zeros.get(role, 0) + int(finite.numel() - nz.numel())
        e = (torch.frexp(nz).exponent - 1).clamp(EXP_LO, EXP_HI) - EXP_LO
        counts = torch.bincount(e, minlength=EXP_HI - EXP_LO + 1)
        self.hist[role] = self.hist.get(role, torch.zeros_like(counts)) + counts
        self.hist_format[role] = fmt_name

    def record_lost_updates(self, step: int, layer: str, changed_intended: int, changed_stored: int) -> None:
        self.rows.append({"step": step, "layer": layer, "role": "update",
                          "lost": 1.0 - changed_stored / changed_intended if changed_intended else 0.0,
                          "intended": changed_intended})

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

    def plot_histograms(self, path: str, title: str = "") -> None:
        """Exponent histograms per role with the format's range (subnormal, normal, max) marked."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        roles = [r for r in ("forward", "backward", "weight_grad", "weights") if r in self.hist]
        if not roles:
            raise ValueError("no histograms recorded (telemetry sampled no step)")
        fig, axes = plt.subplots(len(roles), 1, figsize=(9, 2.4 * len(roles)), squeeze=False)
        xs = list(range(EXP_LO, EXP_HI + 1))
        for ax, role in zip(axes[:, 0], roles):
            counts = self.hist[role].double()
            total = float(counts.sum()) + self.hist_zeros.get(role, 0)
            frac = (counts / total).tolist() if total else counts.tolist()
            nz = [i for i, c in enumerate(frac) if c > 0]
            lo, hi = (xs[nz[0]] - 4, xs[nz[-1]] + 4) if nz else (-40, 20)
            fmt = get_format(self.hist_format[role])
            marks = [("min subnormal", getattr(fmt, "min_subnormal", None), "tab:red"),
                     ("min normal", fmt.min_normal, "tab:orange"), ("max", fmt.max, "tab:green")]
            for label, v, color in marks:
                if v:
                    e = math.floor(math.log2(v))
                    lo, hi = min(lo, e - 2), max(hi, e + 2)
                    ax.axvline(e, color=color, linestyle="--", linewidth=1, label=f"{fmt.name} {label} 2^{e}")
            ax.bar(xs, frac, width=1.0, color="tab:blue")
            ax.set_xlim(max(lo, EXP_LO), min(hi, EXP_HI))
            ax.set_yscale("log")
            zeros = self.hist_zeros.get(role, 0)
            ax.set_title(f"{role}: log2|x| ({zeros / total:.1%} zeros)" if total else role, fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
        axes[-1, 0].set_xlabel("floor(log2 |value|)")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def state_dict(self) -> dict:
        return {"rows": list(self.rows), "hist": dict(self.hist), "hist_zeros": dict(self.hist_zeros),
                "hist_format": dict(self.hist_format)}

    def load_state_dict(self, state: dict) -> None:
        self.rows = list(state["rows"])
        self.hist = dict(state["hist"])
        self.hist_zeros = dict(state["hist_zeros"])
        self.hist_format = dict(state["hist_format"])
