"""The roofline figure of `fewbits bench --plot`: this machine's measured ceilings per dtype with
the benchmarked matmul shapes on them, beside the published ceilings of known accelerators.

Drawn with matplotlib's object interface on the Agg canvas (no pyplot, no global backend switch).

    plot_local_roofline(result, ax)        measured bandwidth x intensity, capped by each dtype's peak
    plot_accelerator_rooflines(result, ax) bf16 (dashed: fp8) ceilings of a few accelerators
    roofline_figure(result) / save_roofline_figure(result, path)   titled with what it shows and the machine
"""
from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DTYPE_COLORS = {"fp32": "#1f77b4", "tf32": "#17becf", "bf16": "#2ca02c", "fp16": "#ff7f0e", "fp8": "#d62728",
                "int8": "#9467bd"}
SHAPE_MARKERS = ("o", "s", "^", "D", "v", "P")
CONTEXT_ACCELERATORS = ("A100 SXM 80GB", "H100 SXM", "H200 SXM", "MI300X", "L4")
_INTENSITY = np.logspace(-2, 4, 400)


def plot_local_roofline(result, ax):
    bw = result.bandwidth.copy_gbs
    shapes = sorted({r["shape"] for r in result.shapes}, key=lambda s: [int(x) for x in s.split("x")])
    for d, m in result.matmuls.items():
        if not m.available:
            continue
        color = DTYPE_COLORS.get(d, "k")
        ax.plot(_INTENSITY, np.minimum(m.gflops, _INTENSITY * bw), color=color, lw=1.8,
                label=f"{d}: {m.gflops:.3g} GFLOP/s peak")
    for row in result.shapes:
        color = DTYPE_COLORS.get(row["dtype"], "k")
        marker = SHAPE_MARKERS[shapes.index(row["shape"]) % len(SHAPE_MARKERS)]
        ax.plot(row["intensity"], row["attainable_gflops"], marker=marker, ms=8, mfc="none", mec=color, mew=1.5)
        if row.get("measured_gflops"):
            ax.plot(row["intensity"], row["measured_gflops"], marker=marker, ms=7, color=color)
    for i, s in enumerate(shapes):
        ax.plot([], [], marker=SHAPE_MARKERS[i % len(SHAPE_MARKERS)], ls="none", color="gray",
                label=f"shape {s} (hollow: roofline, filled: measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (operations per byte moved)")
    ax.set_ylabel("GFLOP/s (int8: GOP/s)")
    name = result.machine.get("name", "this machine")
    ax.set_title(f"this machine: {name}, {result.machine.get('threads')} threads\n"
                 f"memory copy bandwidth {bw:.3g} GB/s", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left")


def plot_accelerator_rooflines(result, ax):
    names = [a for a in result.accelerators if a.name in CONTEXT_ACCELERATORS]
    palette = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    for a, color in zip(names, palette):
        bw = a.bandwidth_gbs / 1e3  # TB/s: TFLOP/s per (FLOP/byte)
        if a.bf16:
            ax.plot(_INTENSITY, np.minimum(a.bf16, _INTENSITY * bw), color=color, lw=1.6,
                    label=f"{a.name} bf16 {a.bf16:g} TFLOP/s, {a.bandwidth_gbs:g} GB/s")
        if a.fp8:
            ax.plot(_INTENSITY, np.minimum(a.fp8, _INTENSITY * bw), color=color, lw=1.0, ls="--")
    seen = set()
    for row in result.shapes:
        if row["dtype"] != "bf16" or row["shape"] in seen:
            continue
        seen.add(row["shape"])
        ax.axvline(row["intensity"], color="gray", lw=0.8, ls=":")
        ax.text(row["intensity"], 0.98, f"{row['shape']} bf16 ", rotation=90, va="top", ha="right",
                fontsize=7, color="gray", transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (operations per byte moved)")
    ax.set_ylabel("TFLOP/s (dense)")
    ax.set_title("published accelerator ceilings (solid bf16, dashed fp8)", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")


def roofline_title(result) -> str:
    """What the figure shows, and where it was measured."""
    m = result.machine
    where = m.get("name") or "this machine"
    if m.get("threads"):
        where += f", {m['threads']} threads"
    return (f"Matmul rooflines of {where}, measured (left), beside known accelerators' published ceilings "
            "(right)\nthe throughput a matrix product can reach for its arithmetic intensity: bandwidth-bound "
            "below the ridge, compute-bound above")


def roofline_figure(result) -> Figure:
    fig = Figure(figsize=(14, 6), dpi=110, layout="constrained")  # the two-line title clears the axes' titles
    FigureCanvasAgg(fig)
    plot_local_roofline(result, fig.add_subplot(1, 2, 1))
    plot_accelerator_rooflines(result, fig.add_subplot(1, 2, 2))
    fig.suptitle(roofline_title(result), fontsize=12)
    return fig


def save_roofline_figure(result, path):
    roofline_figure(result).savefig(path, bbox_inches="tight")
    return path
