"""Figures of number formats: bit layouts, where the values lie, and what one number becomes.

Drawn with matplotlib's object interface on the Agg canvas (no pyplot, no global backend
switch), so they work headless and leave the caller's matplotlib state alone.

    plot_bit_layouts(formats, ax)      sign / exponent / mantissa boxes, one row per format
    plot_value_ranges(formats, ax)     positive values on a log axis, one row per format
    plot_code_values(fmt, ax)          value of every code (sampled for wide formats)
    plot_explain(records, ax)          relative error of x in each format (from formats.explanation)
    save_formats_figure(formats, path) layouts beside value ranges
    save_format_figure(fmt, path)      one format: layout, code -> value, value distribution
    save_explain_figure(records, path)
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from ..formats import FloatFormat, IntFormat, LookupFormat, get_format

FIELD_COLORS = {
    "sign": "#5b9bd5",
    "exponent": "#70ad47",
    "mantissa": "#ed7d31",
    "integer": "#9e7cc1",
    "index": "#a5a5a5",
}
STATUS_COLORS = {
    "exact": "#2e7d32",
    "rounded": "#1f77b4",
    "saturated": "#ff7f0e",
    "underflow→0": "#9467bd",
    "overflow→inf": "#d62728",
    "overflow→nan": "#8c564b",
    "nan": "#7f7f7f",
}
_ENUMERATE_BITS = 16  # formats up to this width are drawn from all their values
_TICK_BITS = 8  # up to this width every value is drawn as its own tick
_MAX_SPAN_DECADES = 40  # wider formats do not set the automatic x range of the value plot


def _formats(formats):
    return [get_format(f) for f in formats]


# ---------------------------------------------------------------------------------------------
# bit layouts
# ---------------------------------------------------------------------------------------------
def _fields(fmt):
    """[(field kind, number of bits, label)], most significant first."""
    if isinstance(fmt, FloatFormat):
        fields = [("sign", 1, "S")] if fmt.signed else []
        fields.append(("exponent", fmt.exp_bits, f"exponent {fmt.exp_bits}"))
        if fmt.man_bits:
            fields.append(("mantissa", fmt.man_bits, f"mantissa {fmt.man_bits}"))
        return fields
    if isinstance(fmt, IntFormat):
        return [("integer", fmt.bits, "signed integer" if fmt.signed else "unsigned integer")]
    return [("index", fmt.bits, f"index → {fmt.num_values} values")]


def _chars_per_unit(ax, units: float, fontsize: float) -> float:
    """How many characters of `fontsize` fit in one data unit of x (for fitting labels)."""
    width_px = ax.get_window_extent().width
    char_px = 0.62 * fontsize * ax.figure.dpi / 72
    return width_px / units / char_px


def _fit_label(label: str, kind: str, nbits: int, room: float) -> str:
    """The longest of label, a short form and nothing that fits in `room` characters."""
    short = {"exponent": f"E{nbits}", "mantissa": f"M{nbits}", "index": "idx", "sign": "S",
             "integer": "uint" if label.startswith("unsigned") else "int"}.get(kind, label)
    for text in (label, short):
        if len(text) <= room:
            return text
    return ""


def _layout_note(fmt) -> str:
    if isinstance(fmt, FloatFormat):
        return f"bias {fmt.bias}"
    return ""


def plot_bit_layouts(formats, ax, show_bit_numbers: bool | None = None, max_field_bits: int = 12):
    """One row per format (top to bottom in the given order): a box per bit, coloured by field,
    most significant bit on the left, every row on the same scale. A field longer than
    max_field_bits (fp32's and fp64's mantissas) is drawn shortened, with a break mark, so the
    8-bit formats stay legible; its label gives the true length."""
    fmts = _formats(formats)
    shown = [sum(min(n, max_field_bits) for _, n, _ in _fields(f)) for f in fmts]
    width = max(shown)
    xmax = width * 1.3 + 3
    ax.set_xlim(0, xmax)
    fontsize = 7.5
    room_per_bit = _chars_per_unit(ax, xmax, fontsize)
    if show_bit_numbers is None:
        show_bit_numbers = len(fmts) == 1
    for row, fmt in enumerate(fmts):
        y = -row
        x = 0
        bit = fmt.bits
        for kind, nbits, label in _fields(fmt):
            color = FIELD_COLORS[kind]
            cut = nbits > max_field_bits
            boxes = min(nbits, max_field_bits)
            for b in range(boxes):
                ax.add_patch(Rectangle((x + b, y - 0.36), 1, 0.72, facecolor=color, edgecolor="white",
                                       linewidth=0.6))
                if show_bit_numbers and not cut:
                    ax.text(x + b + 0.5, y - 0.42, str(bit - 1 - b), ha="center", va="top", fontsize=6.5,
                            color="#555555")
            ax.add_patch(Rectangle((x, y - 0.36), boxes, 0.72, fill=False, edgecolor="#333333", linewidth=0.8))
            if cut:  # a white zigzag: bits left out
                mid = x + boxes * 0.72
                ax.plot([mid - 0.25, mid + 0.25, mid - 0.25, mid + 0.25], [y - 0.45, y - 0.15, y + 0.15, y + 0.45],
                        color="white", linewidth=2.2, solid_capstyle="butt", clip_on=False)
                ax.plot([mid - 0.25, mid + 0.25, mid - 0.25, mid + 0.25], [y - 0.45, y - 0.15, y + 0.15, y + 0.45],
                        color="#333333", linewidth=0.6, clip_on=False)
            text = _fit_label(label, kind, nbits, room_per_bit * (boxes * (0.7 if cut else 1.0)) - 0.5)
            if text:
                center = x + (boxes * 0.36 if cut else boxes / 2)
                ax.text(center, y, text, ha="center", va="center", fontsize=fontsize, color="black")
            x += boxes
            bit -= nbits
        note = f"{fmt.bits} bits" + (f" · {_layout_note(fmt)}" if _layout_note(fmt) else "")
        ax.text(x + 0.5, y, note, ha="left", va="center", fontsize=fontsize, color="#333333")
    ax.set_ylim(-len(fmts) + 0.4 - (0.25 if show_bit_numbers else 0), 0.6)
    ax.set_yticks([-i for i in range(len(fmts))])
    ax.set_yticklabels([f.name for f in fmts])
    ax.set_xticks([])
    cut_note = f"; fields over {max_field_bits} bits shortened (≈)" if any(
        n > max_field_bits for f in fmts for _, n, _ in _fields(f)) else ""
    ax.set_xlabel(f"one box per bit, most significant first{cut_note}")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    kinds = []
    for f in fmts:
        for kind, _, _ in _fields(f):
            if kind not in kinds:
                kinds.append(kind)
    names = {"sign": "sign", "exponent": "exponent", "mantissa": "mantissa (fraction)",
             "integer": "integer bits", "index": "codebook index"}
    ax.legend(handles=[Patch(facecolor=FIELD_COLORS[k], edgecolor="#333333", label=names[k]) for k in kinds],
              loc="lower right" if len(fmts) > 1 else "center right", fontsize=8, framealpha=0.95)
    ax.set_title("Bit layouts")
    return ax


# ---------------------------------------------------------------------------------------------
# where the values lie
# ---------------------------------------------------------------------------------------------
def positive_values(fmt) -> np.ndarray | None:
    """Every positive finite value of a format of at most 16 bits (ascending, float64); None
    for wider formats. Uses the fast decoder over all codes."""
    if isinstance(fmt, LookupFormat):
        v = np.asarray(fmt.table, dtype=np.float64)
        return v[v > 0]
    if fmt.bits > _ENUMERATE_BITS:
        return None
    import torch

    from ..kernels import decode

    vals = decode(torch.arange(2 ** fmt.bits, dtype=torch.int64), fmt, dtype=torch.float64).numpy()
    vals = vals[np.isfinite(vals) & (vals > 0)]
    return np.unique(vals)


def _min_positive(fmt) -> float:
    if isinstance(fmt, FloatFormat):
        return fmt.min_positive
    return fmt.min_normal


def _auto_xlim(fmts):
    def span(f):
        return math.log10(f.max) - math.log10(_min_positive(f))

    chosen = [f for f in fmts if f.bits <= _ENUMERATE_BITS and span(f) <= _MAX_SPAN_DECADES] or fmts
    lo = min(_min_positive(f) for f in chosen)
    hi = max(f.max for f in chosen)
    return 10 ** (math.floor(math.log10(lo)) - 0.3), 10 ** (math.ceil(math.log10(hi)) + 0.3)


def plot_value_ranges(formats, ax, xlim=None, legend_outside: bool | None = None):
    """One row per format (same order as plot_bit_layouts): the positive values on a log axis.
    Formats of ≤8 bits: one tick per value; ≤16 bits: the density of values (values per binade,
    each row scaled to its own peak); wider formats: a bar from the smallest subnormal to max.
    Markers show the smallest subnormal, the smallest normal and the largest value. Ranges that
    leave the plotted window end in an arrow labelled with the true end."""
    fmts = _formats(formats)
    xlo, xhi = xlim or _auto_xlim(fmts)
    for row, fmt in enumerate(fmts):
        y = -row
        vals = positive_values(fmt)
        normal = fmt.min_normal
        if vals is not None and vals.size and (fmt.bits <= _TICK_BITS or vals.size <= 256):
            sub = vals[vals < normal] if isinstance(fmt, FloatFormat) else vals[:0]
            nor = vals[vals >= normal] if isinstance(fmt, FloatFormat) else vals
            ax.vlines(nor, y - 0.3, y + 0.3, color="#1f4e79", linewidth=0.7, alpha=0.85)
            if sub.size:
                ax.vlines(sub, y - 0.3, y + 0.3, color="#6fa8dc", linewidth=0.7, alpha=0.85)
        elif vals is not None and vals.size:
            # values per binade; height ~ log(count) so a binade of one subnormal still shows
            lv = np.log2(vals)
            bins = np.arange(math.floor(lv.min()), math.floor(lv.max()) + 1.0001, 1.0)
            is_sub = vals < normal if isinstance(fmt, FloatFormat) else np.zeros(vals.shape, bool)
            peak = math.log2(np.histogram(lv, bins=bins)[0].max() + 1)
            for part, color in ((~is_sub, "#1f4e79"), (is_sub, "#6fa8dc")):
                if not part.any():
                    continue
                counts, edges = np.histogram(lv[part], bins=bins)
                hs = np.repeat(np.log2(counts + 1) / peak, 2) * 0.36
                xs = np.repeat(2.0 ** edges, 2)[1:-1]
                ax.fill_between(xs, y - hs, y + hs, where=np.repeat(counts > 0, 2), color=color, alpha=0.85,
                                linewidth=0)
        else:
            # clipped to just beyond the window: log axes overflow on ends such as 1.8e308
            lo, top = max(_min_positive(fmt), xlo / 10), min(fmt.max, xhi * 10)
            mid = min(max(normal, lo), top)
            if isinstance(fmt, FloatFormat) and fmt.min_subnormal:
                ax.add_patch(Rectangle((lo, y - 0.18), mid - lo, 0.36, color="#6fa8dc", alpha=0.8, linewidth=0))
            ax.add_patch(Rectangle((mid, y - 0.3), top - mid, 0.6, color="#1f4e79", alpha=0.75, linewidth=0))
        # markers and clipping
        sub_min = fmt.min_subnormal if isinstance(fmt, FloatFormat) else None
        for v, marker, color in ((sub_min, "<", "#6fa8dc"), (normal, "|", "black"), (fmt.max, ">", "#c00000")):
            if v is not None and xlo <= v <= xhi:
                ax.plot([v], [y + 0.42], marker=marker, color=color, markersize=5 if marker != "|" else 7,
                        markeredgewidth=1.5, linestyle="none", clip_on=False)
        if _min_positive(fmt) < xlo:
            ax.annotate(f"← {_short(_min_positive(fmt))}", (xlo, y), xytext=(3, 0), textcoords="offset points",
                        fontsize=7, va="center", ha="left", color="#333333",
                        bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85))
        if fmt.max > xhi:
            ax.annotate(f"{_short(fmt.max)} →", (xhi, y), xytext=(-3, 0), textcoords="offset points",
                        fontsize=7, va="center", ha="right", color="#333333",
                        bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85))
    ax.set_xscale("log")
    ax.set_xlim(xlo, xhi)
    ax.set_ylim(-len(fmts) + 0.4, 0.6)
    ax.set_yticks([-i for i in range(len(fmts))])
    ax.set_yticklabels([f.name for f in fmts])
    ax.axvline(1.0, color="#999999", linestyle=":", linewidth=0.8, zorder=0)
    ax.grid(axis="x", which="major", color="#e0e0e0", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    ax.set_xlabel("positive values (log scale); negatives mirror them in signed formats")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    any_float = any(isinstance(f, FloatFormat) for f in fmts)
    any_sub = any(isinstance(f, FloatFormat) and f.min_subnormal for f in fmts)
    only_small = all(f.bits <= _TICK_BITS or isinstance(f, LookupFormat) for f in fmts)
    how = ": a tick each" if only_small else ": a tick each (≤ 8 bits), or height ~ log(values per binade)"
    handles = [Line2D([], [], color="#1f4e79", linewidth=2,
                      label=("normal values" if any_float else "values") + how)]
    if any_sub:
        handles += [Line2D([], [], color="#6fa8dc", linewidth=2, label="subnormal values"),
                    Line2D([], [], marker="<", color="#6fa8dc", linestyle="none", label="min subnormal")]
    handles += [
        Line2D([], [], marker="|", color="black", markeredgewidth=1.5, linestyle="none",
               label=("min normal" + (" (int/codebook: min positive)" if not all(
                   isinstance(f, FloatFormat) for f in fmts) else "")) if any_float else "min positive"),
        Line2D([], [], marker=">", color="#c00000", linestyle="none", label="max"),
    ]
    if legend_outside is None:
        legend_outside = len(fmts) < 4
    if legend_outside:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, framealpha=0.95)
    else:
        ax.legend(handles=handles, loc="lower left", fontsize=7.5, framealpha=0.95)
    ax.set_title("Where the positive values lie")
    return ax


def _number_text(v: float) -> str:
    text = repr(v)
    return text[:-2] if text.endswith(".0") else text


def _short(v: float) -> str:
    if v >= 1e5 or v < 1e-3:
        return f"{v:.1e}"
    return f"{v:g}"


def plot_code_values(fmt, ax, max_points: int = 4096):
    """The value of each code (x: code, y: value on a symmetric log scale); NaN and inf codes
    marked along the top. Formats wider than 12 bits are sampled at max_points evenly spaced codes."""
    fmt = get_format(fmt)
    n = fmt.num_values if isinstance(fmt, LookupFormat) else 2 ** fmt.bits
    if n <= max_points:
        codes = np.arange(n)
    else:  # evenly spaced codes plus the special ones, so inf and NaN are not missed
        special = []
        if isinstance(fmt, FloatFormat):
            special = [fmt.nan_code(neg) for neg in (False, True) if fmt.has_nan]
            special += [fmt.inf_code(neg) for neg in (False, True) if fmt.has_inf]
        codes = np.unique(np.concatenate([np.linspace(0, n - 1, max_points).astype(np.int64),
                                          np.asarray(special, dtype=np.int64)]))
    values = np.array([fmt.decode_code(int(c)) for c in codes], dtype=np.float64)
    finite = np.isfinite(values)
    ax.plot(codes[finite], values[finite], ".", markersize=3 if n <= 256 else 1.5, color="#1f4e79",
            label="finite value")
    finite_abs = np.abs(values[finite])
    if isinstance(fmt, FloatFormat) and np.any(finite_abs > 0):
        # a float's values span many decades: symmetric log, linear only below the smallest value
        tiny = float(finite_abs[finite_abs > 0].min())
        ax.set_yscale("symlog", linthresh=tiny, linscale=2.0)
        lo_dec, hi_dec = math.log10(tiny), math.ceil(math.log10(finite_abs.max()))
        stride = max(1, math.ceil((hi_dec - lo_dec) / 6))
        decades = [k for k in range(hi_dec, math.floor(lo_dec), -stride) if k >= lo_dec + 0.5]
        ax.set_yticks(sorted([10.0 ** k for k in decades] + [0.0] + [-(10.0 ** k) for k in decades]))
    top = float(np.nanmax(np.abs(values[finite]))) if finite.any() else 1.0
    for kind, color, marker in (("nan", "#7f7f7f", "x"), ("inf", "#d62728", "^")):
        if kind == "nan":
            sel = np.isnan(values)
        else:
            sel = np.isinf(values)
        if sel.any():
            ax.plot(codes[sel], np.full(sel.sum(), top * 1.8), marker, color=color, markersize=5,
                    linestyle="none", label=f"{kind} code", clip_on=False)
    ax.set_xlabel("code (bit pattern as an unsigned integer)" + (", sampled" if n > max_points else ""))
    ax.set_ylabel("value (symmetric log scale)" if isinstance(fmt, FloatFormat) else "value")
    ax.grid(color="#e6e6e6", linewidth=0.6)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{fmt.name}: code → value")
    return ax


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------
def plot_explain(records, ax):
    """Horizontal bars: the relative error of x in each format (log scale), coloured by status,
    labelled with the value x became. Exact results sit at the left edge, overflow at the right;
    when x is 0 (relative error undefined) the absolute error is drawn instead."""
    records = list(records)
    if not records:
        raise ValueError("no records to plot")
    x = records[0]["x"]
    use_abs = all(r["rel_error"] is None for r in records)
    key = "abs_error" if use_abs else "rel_error"
    modes = list(dict.fromkeys(r["mode"] for r in records))
    errs = [r[key] for r in records]
    finite = [e for e in errs if e is not None and 0 < e < math.inf]
    lo = 10 ** (math.floor(math.log10(min(finite))) - 1) if finite else 1e-20
    hi = 10 ** (math.ceil(math.log10(max(finite))) + 1) if finite else 10.0
    labels = []
    for i, r in enumerate(records):
        y = -i
        e = r[key]
        color = STATUS_COLORS.get(r["status"], "#1f77b4")
        if e is None or (isinstance(e, float) and math.isnan(e)):
            ax.text(lo * 1.3, y, "undefined (NaN)", va="center", fontsize=7.5, color=color)
        elif e == 0:
            ax.plot([lo], [y], "o", color=color, markersize=5, clip_on=False)
        else:
            end = hi if math.isinf(e) else e
            ax.barh(y, end - lo, left=lo, height=0.7, color=color, alpha=0.85)
        text = _number_text(r["value"])
        if r["alternative"] is not None:
            text += f" ({r['probability']:.0%}) or {_number_text(r['alternative']['value'])}"
        anchor = lo if (e is None or e == 0) else (hi if math.isinf(e) else e)
        ax.annotate(f"→ {text}", (anchor, y), xytext=(6, 0), textcoords="offset points", va="center",
                    fontsize=7, color="#222222", annotation_clip=False)
        labels.append(r["format"] + (f" · {r['mode']}" if len(modes) > 1 else ""))
    ax.set_xscale("log")
    ax.set_xlim(lo, hi * 30)
    ax.set_ylim(-len(records) + 0.4, 0.6)
    ax.set_yticks([-i for i in range(len(records))])
    ax.set_yticklabels(labels, fontsize=8 if len(records) <= 40 else 6)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    what = "absolute error (x = 0)" if use_abs else "relative error |value − x| / |x|"
    ax.set_xlabel(f"{what}, log scale; dot = exact")
    statuses = list(dict.fromkeys(r["status"] for r in records))
    ax.legend(handles=[Patch(color=STATUS_COLORS.get(s, "#1f77b4"), label=s) for s in statuses],
              loc="lower right", fontsize=8, title="status", title_fontsize=8, framealpha=0.95)
    mode_text = modes[0] if len(modes) == 1 else f"{len(modes)} modes"
    ax.set_title(f"x = {x!r}: the value in each format ({mode_text}) and its error")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


# ---------------------------------------------------------------------------------------------
# whole figures
# ---------------------------------------------------------------------------------------------
def _new_figure(width, height):
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path):
    fig.savefig(path, bbox_inches="tight")
    return path


def save_formats_figure(formats, path):
    """Bit layouts (left) beside where the values lie (right), one row per format."""
    fmts = _formats(formats)
    height = 1.6 + 0.34 * len(fmts)
    fig = _new_figure(16, height)
    gs = fig.add_gridspec(1, 2, width_ratios=[1, 1.5], wspace=0.04, top=1 - 0.75 / height)
    ax_layout = fig.add_subplot(gs[0, 0])
    ax_values = fig.add_subplot(gs[0, 1], sharey=ax_layout)
    plot_bit_layouts(fmts, ax_layout)
    plot_value_ranges(fmts, ax_values)
    ax_values.tick_params(axis="y", labelleft=False)
    fig.suptitle("fewbits number formats: bit layouts and value ranges", fontsize=13, y=1 - 0.1 / height)
    return _save(fig, path)


def save_format_figure(fmt, path):
    """One format: its bit layout, the value of every code, and where its positive values lie."""
    fmt = get_format(fmt)
    fig = _new_figure(13, 8)
    gs = fig.add_gridspec(3, 1, height_ratios=[0.55, 2.6, 0.8], hspace=0.55)
    plot_bit_layouts([fmt], fig.add_subplot(gs[0]))
    plot_code_values(fmt, fig.add_subplot(gs[1]))
    plot_value_ranges([fmt], fig.add_subplot(gs[2]))
    return _save(fig, path)


def save_explain_figure(records, path):
    records = list(records)
    fig = _new_figure(12, 1.4 + 0.28 * len(records))
    plot_explain(records, fig.add_subplot(1, 1, 1))
    return _save(fig, path)
