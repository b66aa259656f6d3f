"""`fewbits formats`: every number format in a table, or one format in depth."""
from __future__ import annotations

import math

from ..formats import get_format, list_formats
from ..formats.explanation import binade_table, code_table, exact_decimal, format_summary, value_formula
from .common import check_plot, emit_json, render_table, wrote


_CODE_TABLE_BITS = 8


def add_parser(sub) -> None:
    p = sub.add_parser("formats", help="table of every number format, or one format in depth",
                       description="Every number format: layout, range, precision, specials and storage. "
                                   "With NAME: one format in depth, every code for formats of 8 bits or fewer.")
    p.add_argument("name", nargs="?", metavar="NAME", help="a format name or alias (e.g. e4m3, bf16, nf4, int4)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the bit layouts and where the values lie")
    p.set_defaults(func=run)


def run(args, out) -> int:
    check_plot(args)
    if args.name:
        fmt = get_format(args.name)
        detail = _format_detail(fmt)
        if args.json:
            emit_json(detail, out)
        else:
            print(_format_detail_text(fmt, detail), file=out)
        if args.plot:
            from ..study.figures import save_format_figure

            save_format_figure(fmt, args.plot)
            wrote(args, out)
        return 0
    fmts = list_formats()
    summaries = [format_summary(f) for f in fmts]
    if args.json:
        emit_json(summaries, out)
    else:
        print(_formats_table(summaries), file=out)
    if args.plot:
        from ..study.figures import save_formats_figure

        save_formats_figure(fmts, args.plot)
        wrote(args, out)
    return 0


def compact(v, width: int = 9) -> str:
    """A short rendering of a number: exact where short (448, 57344, 0.015625), else two
    significant digits (5.7e+04 style: 3.4e+38, 1.5e-05). None -> '—'."""
    if v is None:
        return "—"
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    s = repr(v)
    if s.endswith(".0"):
        s = s[:-2]
    if "e" not in s and len(s.lstrip("-")) <= width:
        return s
    return f"{v:.1e}"


def detailed(v) -> str:
    """A number in full: its exact decimal when that is short, else the shortest float64 repr;
    powers of two also as 2^k."""
    if v is None:
        return "—"
    v = float(v)
    if not math.isfinite(v) or v == 0:
        return exact_decimal(v)
    ex = exact_decimal(v)
    s = ex if len(ex) <= 24 else repr(v)
    m, e = math.frexp(v)
    if m == 0.5 and not (v.is_integer() and v < 2 ** 20):  # 0.015625 (2^-6), not 8 (2^3)
        s += f"  (2^{e - 1})"
    return s


def storage(bytes_per_billion: float) -> str:
    """Bytes for 1e9 values: '1.00 GB', '750 MB' (decimal units: GB = 10^9 bytes)."""
    if bytes_per_billion >= 1e9:
        return f"{bytes_per_billion / 1e9:.2f} GB"
    return f"{bytes_per_billion / 1e6:.0f} MB"


def _formats_table(summaries) -> str:
    headers = ["format", "bits", "layout", "max", "min normal", "min subnormal", "eps", "digits",
               "per 1e9 values", "specials"]
    rows = []
    for s in summaries:
        rows.append([
            s["name"], s["bits"], s["layout"], compact(s["max"]), compact(s["min_normal"]),
            compact(s["min_subnormal"]), compact(s["eps"]),
            "—" if s["decimal_digits"] is None else f"{s['decimal_digits']:.1f}",
            storage(s["bytes_per_billion"]), s["specials_description"],
        ])
    notes = (
        "layout: sign-exponent-mantissa bits; int/uint: integers (a quantizer adds the scale); "
        "codebook: index into a table.\n"
        "min normal: for int and codebook formats, the smallest positive value. digits: decimal digits "
        "of precision.\nper 1e9 values: storage of 10^9 values without scales (GB = 10^9 bytes). "
        "— : none.  `fewbits formats NAME` shows one format in depth."
    )
    return render_table(headers, rows, right={1, 3, 4, 5, 6, 7, 8}) + "\n\n" + notes


def _format_detail(fmt) -> dict:
    detail = format_summary(fmt)
    detail["value_formula"] = value_formula(fmt)
    if fmt.bits <= _CODE_TABLE_BITS:
        detail["codes"] = code_table(fmt, _CODE_TABLE_BITS)
    elif detail["kind"] in ("float", "int"):
        detail["binades"] = binade_table(fmt)
    return detail


def _format_detail_text(fmt, d) -> str:
    out = [f"{d['name']} — {d['description']}" if d["description"] else d["name"]]
    if d["aliases"]:
        out.append(f"aliases: {', '.join(d['aliases'])}")
    out.append("")
    if d["kind"] == "float":
        sign = "1 sign, " if d["signed"] else "no sign, "
        layout = (f"{d['layout']}: {sign}{d['exponent_bits']} exponent, {d['mantissa_bits']} mantissa bits; "
                  f"bias {d['bias']}")
    else:
        layout = d["layout_description"]
    props = [
        ("layout", layout),
        ("formula", d["value_formula"]),
        ("max", detailed(d["max"])),
        ("lowest", detailed(d["lowest"])),
        ("min normal" if d["kind"] == "float" else "min positive", detailed(d["min_normal"])),
    ]
    if d["kind"] == "float":
        props.append(("min subnormal", detailed(d["min_subnormal"]) if d["min_subnormal"] else "— (no subnormals)"))
    props += [
        ("eps", detailed(d["eps"]) + ("  (gap between 1 and the next value)" if d["eps"] else "")),
        ("decimal digits", "—" if d["decimal_digits"] is None else f"{d['decimal_digits']:.2f}"),
        ("specials", d["specials_description"]),
        ("finite values", f"{d['num_values']:,}" + ("  (+0 and -0 counted once)" if d["has_negative_zero"] else "")),
        ("overflow", f"{d['default_overflow']} by default"),
        ("storage", f"{storage(d['bytes_per_billion'])} per 10^9 values"),
    ]
    width = max(len(k) for k, _ in props)
    out += [f"{k.ljust(width)}  {v}" for k, v in props]
    if "codes" in d:
        out += ["", f"all {len(d['codes'])} codes:"]
        float_fmt = d["kind"] == "float"
        headers = ["code", "bits", "value"] + (["= significand × 2^e"] if float_fmt else []) + ["kind"]
        rows = []
        for r in d["codes"]:
            row = [r["hex"], r["bits"], _code_value_text(r)]
            if float_fmt:
                row.append(r["binary"] or "")
            rows.append(row + [r["kind"]])
        out.append(render_table(headers, rows, right={2}))
    elif "binades" in d:
        out += ["", _binades_text(d)]
    return "\n".join(out)


def _code_value_text(r) -> str:
    s = r["exact_value"]
    return s if len(s) <= 30 else repr(r["value"])


def _binades_text(d) -> str:
    binades = d["binades"]
    if d["kind"] == "int":
        return f"values: every integer from {compact(d['lowest'])} to {compact(d['max'])} (step 1)"
    headers = ["E field", "exponent", "kind", "from", "to", "step", "values"]
    rows = [[b["exponent_field"], "—" if b["exponent"] is None else b["exponent"], b["kind"], compact(b["first"]),
             compact(b["last"]), compact(b["step"]), f"{b['count']:,}"] for b in binades]
    head = (f"{len(binades)} binades of positive values (each holds {2 ** d['mantissa_bits']:,} values; "
            "negatives mirror them):")
    if len(rows) > 24:
        skipped = len(rows) - 16
        rows = rows[:8] + [["…", "…", f"({skipped} more)", "", "", "", ""]] + rows[-8:]
    return head + "\n" + render_table(headers, rows, right={0, 1, 3, 4, 5, 6})
