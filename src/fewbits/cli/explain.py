"""`fewbits explain X`: what a number becomes in every format."""
from __future__ import annotations

import math
from fractions import Fraction

from ..formats import MODES, OVERFLOW_POLICIES, OVERFLOW_PRESETS
from ..formats.explanation import exact_decimal, explain
from .common import check_plot, emit_json, parse_number, render_table, wrote


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="what a number becomes in every format",
                       description="The nearest value of x in every format (exact), its bits split as "
                                   "sign|exponent|mantissa, absolute and relative error, and what happened.")
    p.add_argument("x", type=parse_number, metavar="X",
                   help="the number (0.3952, -1.5e-3, 0x1.8p-2, 1/3, inf, nan); read as float64")
    p.add_argument("--mode", action="append", choices=MODES, metavar="MODE",
                   help=f"rounding mode, repeatable: {', '.join(MODES)} (default nearest_even)")
    p.add_argument("--all-modes", action="store_true", help="every rounding mode")
    p.add_argument("--formats", action="append", metavar="A,B,C", help="only these formats (comma-separated)")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES + OVERFLOW_PRESETS, metavar="POLICY",
                   help="overflow policy or preset for every format: "
                        f"{', '.join(OVERFLOW_POLICIES + OVERFLOW_PRESETS)} "
                        "(default: each format's own)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot the relative error in each format")
    p.set_defaults(func=run)


def run(args, out) -> int:
    check_plot(args)
    if args.all_modes:
        modes = list(MODES)
    else:
        modes = args.mode or ["nearest_even"]
    formats = None
    if args.formats:
        formats = [n.strip() for chunk in args.formats for n in chunk.split(",") if n.strip()]
    records = explain(args.x, formats, modes, overflow=args.overflow)
    if args.json:
        emit_json(records, out)
    else:
        print(_explain_text(args.x, records, modes), file=out)
    if args.plot:
        from ..study.figures import save_explain_figure

        save_explain_figure(records, args.plot)
        wrote(args, out)
    return 0


def error_str(v) -> str:
    if v is None:
        return "—"
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf"
    return f"{v:.2e}"


def _explain_text(x: float, records, modes) -> str:
    lines = [f"x = {x!r}"]
    ex = exact_decimal(x)
    if math.isfinite(x) and Fraction(repr(x)) != Fraction(x):  # the decimal typed is not a float64
        lines[0] += f"  (read as float64: exactly {ex})"
    lines.append("")
    many_modes = len(modes) > 1
    headers = ["format"] + (["mode"] if many_modes else []) + ["value", "abs error", "rel error", "status",
                                                               "code", "bits"]
    rows = []
    for r in records:
        value = _value_text(r["value"])
        if r["alternative"] is not None:
            alt = r["alternative"]
            value = f"{value} ({r['probability']:.1%}) or {_value_text(alt['value'])} ({alt['probability']:.1%})"
        row = [r["format"]] + ([r["mode"]] if many_modes else [])
        row += [value, error_str(r["abs_error"]), error_str(r["rel_error"]), r["status"],
                r["hex"] or "—", _bits_text(r)]
        rows.append(row)
    first = 2 if many_modes else 1  # value, abs error, rel error are right-aligned
    lines.append(render_table(headers, rows, right={first, first + 1, first + 2}))
    lines += ["", "bits: sign|exponent|mantissa for floats; integers and codebooks show the plain code "
              "(nf4: the table index). Integer formats have no scale here: a quantizer divides by one first."]
    if any(r["mode"] == "stochastic" for r in records):
        lines.append("stochastic: the likelier neighbour with its probability, then the other one.")
    return "\n".join(lines)


def _value_text(v: float) -> str:
    s = repr(v)
    return s[:-2] if s.endswith(".0") else s


def _bits_text(r) -> str:
    if r["bits"] is None:
        return "—"
    if r["index"] is not None:
        return f"{r['bits']} (index {r['index']})"
    return r["bits"]
