"""Charts of the study report and of `fewbits train`: memory breakdowns, matmul and rounding
throughput, and the numerics of training policies.

Drawn with matplotlib's object interface on the Agg canvas (no pyplot, no global backend
switch), like fewbits.study.figures, so they work headless and leave the caller's state alone.

    save_memory_figure(groups, path)      stacked estimated components per precision, measured peak marked
    save_matmul_figure(matmuls, path)     GFLOP/s per dtype with the ratio to fp32
    save_rounding_figure(rows, path)      fb.round throughput per format beside torch's cast and a copy
    save_train_numerics_figure(rows, path) underflow, lost updates and skipped steps per policy
    save_loss_figure(runs, path)          loss curves of several policies, and each relative to the first
    save_histogram_figure(telemetry, path) exponent histograms per tensor role against the format's range
"""
from __future__ import annotations

import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..formats import get_format
from ..train.telemetry import EXP_HI, EXP_LO

COMPONENT_COLORS = {
    "weights": "#1f77b4", "master_weights": "#aec7e8", "gradients": "#ff7f0e", "optimizer_states": "#ffbb78",
    "activations": "#2ca02c", "kv_cache": "#98df8a", "workspace": "#c5b0d5",
}
COMPONENT_LABELS = {
    "weights": "weights (scales included)", "master_weights": "master weights", "gradients": "gradients",
    "optimizer_states": "optimizer states", "activations": "activations", "kv_cache": "KV cache",
    "workspace": "workspace",
}


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path):
    fig.savefig(path, bbox_inches="tight")
    return path


def _clean(ax):
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def save_memory_figure(groups: list[dict], path, title: str = ""):
    """groups: [{'title': str, 'rows': [{'label', 'at_peak': {component: bytes}, 'measured': bytes|None}]}],
    one panel per group: a horizontal bar per row, stacked from what is alive at the estimated peak,
    with the measured peak as a black diamond (MB, decimal)."""
    groups = [g for g in groups if g["rows"]]
    if not groups:
        raise ValueError("no memory rows to plot")
    heights = [0.9 + 0.34 * len(g["rows"]) for g in groups]
    fig = _new_figure(10, sum(heights) + 0.6)
    gs = fig.add_gridspec(len(groups), 1, height_ratios=heights, hspace=0.55)
    shown: set[str] = set()
    for i, g in enumerate(groups):
        ax = fig.add_subplot(gs[i])
        rows = g["rows"]
        for y, r in enumerate(rows):
            left = 0.0
            for comp, color in COMPONENT_COLORS.items():
                mb = r["at_peak"].get(comp, 0) / 1e6
                if mb <= 0:
                    continue
                ax.barh(-y, mb, left=left, color=color, height=0.62,
                        label=COMPONENT_LABELS[comp] if comp not in shown else None)
                shown.add(comp)
                left += mb
            label = f"  {left:,.1f}"
            if r.get("measured"):
                ax.plot([r["measured"] / 1e6], [-y], marker="D", color="black", markersize=5, linestyle="none",
                        label="measured peak" if "measured" not in shown else None)
                shown.add("measured")
                label += f" (measured {r['measured'] / 1e6:,.1f})"
            # after the bar and the diamond, whichever ends further right
            ax.text(max(left, (r.get("measured") or 0) / 1e6), -y, label, va="center", fontsize=7.5, color="#333333")
        ax.set_yticks([-y for y in range(len(rows))])
        ax.set_yticklabels([r["label"] for r in rows], fontsize=8.5)
        ax.set_title(g["title"], fontsize=10, loc="left")
        ax.set_xlabel("MB at the estimated peak (10^6 bytes)", fontsize=8.5)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        _clean(ax)
    handles, labels = [], []
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1.0 + 0.35 / fig.get_figheight()))
    if title:
        fig.suptitle(title, fontsize=12, y=1.0 + 0.75 / fig.get_figheight())
    return _save(fig, path)


def save_matmul_figure(matmuls: list[dict], path, title: str = ""):
    """matmuls: [{'dtype', 'available', 'gflops', 'ratio', 'kernel'}]: one bar per available dtype."""
    rows = [m for m in matmuls if m["available"]]
    if not rows:
        raise ValueError("no available matmul dtype to plot")
    fig = _new_figure(8, 0.9 + 0.45 * len(rows))
    ax = fig.add_subplot(1, 1, 1)
    colors = {"fp32": "#1f77b4", "tf32": "#17becf", "bf16": "#2ca02c", "fp16": "#ff7f0e", "fp8": "#d62728",
              "int8": "#9467bd"}
    for y, m in enumerate(rows):
        ax.barh(-y, m["gflops"], color=colors.get(m["dtype"], "#7f7f7f"), height=0.6)
        ratio = f"{m['ratio']:.2f}× fp32" if m.get("ratio") is not None else ""
        value = f"{m['gflops']:,.0f}" if m["gflops"] >= 100 else f"{m['gflops']:.3g}"  # never "0" for 0.04
        ax.text(m["gflops"], -y, f"  {value}  {ratio}", va="center", fontsize=8)
    ax.set_yticks([-y for y in range(len(rows))])
    ax.set_yticklabels([f"{m['dtype']} ({m['kernel']})" if m.get("kernel") else m["dtype"] for m in rows],
                       fontsize=8.5)
    ax.set_xlabel("GFLOP/s (int8: GOP/s), best n × n × n call")
    ax.set_xlim(0, max(m["gflops"] for m in rows) * 1.35)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(title or "matrix multiplication throughput per precision on this machine", fontsize=10)
    _clean(ax)
    return _save(fig, path)


def save_rounding_figure(rows: list[dict], path, copy_melems: float | None = None, title: str = ""):
    """rows: [{'format', 'mode', 'melems', 'torch_melems'|None}]: fb.round throughput per format and
    mode (bars), torch's own cast where it has the dtype (ticks), a plain copy (dashed line)."""
    if not rows:
        raise ValueError("no rounding rows to plot")
    formats = list(dict.fromkeys(r["format"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / len(modes)
    mode_colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    fig = _new_figure(max(7.0, 0.9 * len(formats) + 2), 4.2)
    ax = fig.add_subplot(1, 1, 1)
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, f in enumerate(formats):
            hit = [r for r in rows if r["format"] == f and r["mode"] == mode]
            if hit:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(hit[0]["melems"])
        ax.bar(xs, ys, width=width * 0.95, color=mode_colors[j % len(mode_colors)], label=f"fb.round {mode}")
    torch_label = "torch's own cast (x.to(dtype).float())"
    for i, f in enumerate(formats):
        t = next((r.get("torch_melems") for r in rows if r["format"] == f and r.get("torch_melems")), None)
        if t:
            ax.plot([i - 0.42, i + 0.42], [t, t], color="black", linewidth=2, label=torch_label)
            torch_label = None
    if copy_melems:
        ax.axhline(copy_melems, color="#7f7f7f", linestyle="--", linewidth=1,
                   label=f"float32 copy ({copy_melems:,.0f} M/s): the memory limit")
    ax.set_xticks(range(len(formats)))
    ax.set_xticklabels(formats, fontsize=8.5, rotation=20)
    ax.set_ylabel("million float32 values per second")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=7.5, loc="upper right", framealpha=0.95)
    ax.set_title(title or "rounding float32 tensors to each format (fb.round, out=)", fontsize=10)
    _clean(ax)
    return _save(fig, path)


def save_train_numerics_figure(rows: list[dict], path, title: str = ""):
    """rows: run_task results: per policy, underflow and lost-update fractions (%), skipped steps,
    and the final loss relative to the first row (fp32)."""
    if not rows:
        raise ValueError("no training runs to plot")
    names = [r["policy"] for r in rows]
    fig = _new_figure(13, 0.9 + 0.36 * len(rows))
    panels = [
        ("final loss vs " + names[0] + " (%)", [_rel(r["final_loss"], rows[0]["final_loss"]) for r in rows], "#1f77b4"),
        ("gradients flushed to zero (%)", [100 * (r["underflow_fraction"] or 0) for r in rows], "#9467bd"),
        ("updates lost (%)", [100 * (r["lost_update_fraction"] or 0) for r in rows], "#d62728"),
        ("skipped steps", [r["skipped_steps"] for r in rows], "#7f7f7f"),
    ]
    axes = [fig.add_subplot(1, len(panels), i + 1) for i in range(len(panels))]
    for k, (ax, (label, values, color)) in enumerate(zip(axes, panels)):
        finite = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
        ax.barh([-y for y in range(len(rows))], finite, color=color, height=0.6)
        for y, v in enumerate(values):
            text = "n/a" if v is None or not math.isfinite(v) else (f"{v:+.1f}" if k == 0 else
                                                                     f"{v:.0f}" if k == 3 else f"{v:.2f}")
            ax.text(finite[y], -y, f" {text}", va="center", fontsize=7.5)
        ax.set_yticks([-y for y in range(len(rows))])
        ax.set_yticklabels(names if k == 0 else [], fontsize=8.5)
        ax.set_title(label, fontsize=9)
        ax.axvline(0, color="#333333", linewidth=0.6)
        lo, hi = min(finite + [0.0]), max(finite + [0.0])
        pad = (hi - lo) * 0.3 or 1.0
        ax.set_xlim(lo - (pad if lo < 0 else 0), hi + pad)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        _clean(ax)
    fig.suptitle(title or "what each precision policy did to the numbers", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def _rel(value, reference):
    if value is None or reference is None or not math.isfinite(value) or not math.isfinite(reference) or not reference:
        return None
    return 100.0 * (value - reference) / reference


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc, seen = [], 0.0, []
    for v in values:
        seen.append(v)
        acc += v
        if len(seen) > window:
            acc -= seen.pop(0)
        out.append(acc / len(seen))
    return out


def save_loss_figure(runs: list[dict], path, title: str = ""):
    """runs: [{'policy', 'losses', 'final_loss'}], on the same batches. Left: every policy's loss
    (moving average over ~1/25 of the run); right (with two runs or more): each step's loss
    relative to the first run's on the same batch (moving average over ~1/10), where the
    batch-to-batch noise they share cancels and the policies part."""
    if not runs:
        raise ValueError("no training runs to plot")
    compared = len(runs) > 1
    fig = _new_figure(13 if compared else 8, 4.6)
    ax_all = fig.add_subplot(1, 2 if compared else 1, 1)
    ax_rel = fig.add_subplot(1, 2, 2) if compared else None
    styles = ["-", "--", ":", "-."]

    def finite(values):
        return [v if v is not None and math.isfinite(v) else float("nan") for v in values]

    reference = finite(runs[0]["losses"])
    for i, r in enumerate(runs):
        losses = finite(r["losses"])
        steps = list(range(1, len(losses) + 1))
        style = dict(color=f"C{i % 10}", linestyle=styles[(i // 10) % len(styles)], linewidth=1.4)
        final = r.get("final_loss")
        label = f"{r['policy']} ({final:.4f})" if final is not None and math.isfinite(final) else r["policy"]
        ax_all.plot(steps, _moving_average(losses, max(1, len(losses) // 25)), label=label, **style)
        if ax_rel is None:
            continue
        rel = [100.0 * (v - ref) / ref if ref and math.isfinite(ref) else float("nan")
               for v, ref in zip(losses, reference)]
        ax_rel.plot(steps[:len(rel)], _moving_average(rel, max(1, len(rel) // 10)), **style)
    ax_all.set_xlabel("step")
    ax_all.set_ylabel("training loss (moving average)")
    ax_all.set_title("the whole run", fontsize=10)
    if ax_rel is not None:
        ax_rel.axhline(0, color="#333333", linewidth=0.8)
        ax_rel.set_xlabel("step")
        ax_rel.set_ylabel(f"loss vs {runs[0]['policy']} on the same batch (%)")
        ax_rel.set_title(f"relative to {runs[0]['policy']}: the shared batch noise cancels", fontsize=10)
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        _clean(ax)
    ax_all.legend(fontsize=7.5, title="policy (final loss)", title_fontsize=7.5, framealpha=0.95)
    fig.suptitle(title or "training loss under each precision policy", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def save_histogram_figure(telemetry, path, title: str = ""):
    """A Telemetry's exponent histograms, one panel per tensor role (floor(log2 |x|), as a fraction
    of the role's values, log scale), with the format's min subnormal, min normal and max marked.
    ValueError when the telemetry sampled no step."""
    roles = [r for r in ("forward", "backward", "weight_grad", "weights") if r in telemetry.hist]
    if not roles:
        raise ValueError("no histograms recorded (telemetry sampled no step)")
    fig = _new_figure(9, 2.4 * len(roles))
    xs = list(range(EXP_LO, EXP_HI + 1))
    for i, role in enumerate(roles):
        ax = fig.add_subplot(len(roles), 1, i + 1)
        counts = telemetry.hist[role].double()
        zeros = telemetry.hist_zeros.get(role, 0)
        total = float(counts.sum()) + zeros
        frac = (counts / total).tolist() if total else counts.tolist()
        nz = [j for j, c in enumerate(frac) if c > 0]
        lo, hi = (xs[nz[0]] - 4, xs[nz[-1]] + 4) if nz else (-40, 20)
        fmt = get_format(telemetry.hist_format[role])
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
        ax.set_title(f"{role}: log2|x| ({zeros / total:.1%} zeros)" if total else role, fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        if i == len(roles) - 1:
            ax.set_xlabel("floor(log2 |value|)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)
