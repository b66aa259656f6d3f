"""The `fewbits` command: parses arguments, calls the library, prints tables or JSON.

Exit codes: 0 success; 2 bad input (unknown format or mode, not a number, impossible option);
1 a file that cannot be written.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from fractions import Fraction

from . import __version__
from .formats import MODES, OVERFLOW_POLICIES, OVERFLOW_PRESETS, get_format, list_formats
from .formats.explain import (
    binade_table, code_table, exact_decimal, explain, format_summary, jsonable, value_formula,
)

_CODE_TABLE_BITS = 8


# ---------------------------------------------------------------------------------------------
# number and table formatting
# ---------------------------------------------------------------------------------------------
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


def error_str(v) -> str:
    if v is None:
        return "—"
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf"
    return f"{v:.2e}"


def render_table(headers, rows, right=()) -> str:
    """Columns aligned to their widest cell; columns listed in `right` are right-aligned."""
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _emit_json(obj, out):
    json.dump(jsonable(obj), out, indent=2, allow_nan=False, ensure_ascii=False)
    out.write("\n")


# ---------------------------------------------------------------------------------------------
# fewbits formats
# ---------------------------------------------------------------------------------------------
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


def cmd_formats(args, out) -> int:
    if args.name:
        fmt = get_format(args.name)
        detail = _format_detail(fmt)
        if args.json:
            _emit_json(detail, out)
        else:
            print(_format_detail_text(fmt, detail), file=out)
        if args.plot:
            from .study.figures import save_format_figure

            save_format_figure(fmt, args.plot)
            _wrote(args, out)
        return 0
    fmts = list_formats()
    summaries = [format_summary(f) for f in fmts]
    if args.json:
        _emit_json(summaries, out)
    else:
        print(_formats_table(summaries), file=out)
    if args.plot:
        from .study.figures import save_formats_figure

        save_formats_figure(fmts, args.plot)
        _wrote(args, out)
    return 0


def _wrote(args, out):
    print(f"wrote {args.plot}", file=sys.stderr if args.json else out)


# ---------------------------------------------------------------------------------------------
# fewbits explain
# ---------------------------------------------------------------------------------------------
def parse_number(text: str) -> float:
    """A number from the command line: decimal (0.3952, -1.5e-3), hex float (0x1.8p-2),
    fraction (1/3), inf or nan; read as the nearest float64."""
    s = text.strip()
    parsers = [float, lambda t: float(Fraction(t))]
    if s.lstrip("+-").lower().startswith("0x"):  # hex only when it says so: "abc" is not 2748
        parsers.append(float.fromhex)
    for parse in parsers:
        try:
            value = parse(s)
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
        if math.isinf(value) and "inf" not in s.lower():
            raise argparse.ArgumentTypeError(f"{s!r} is beyond the float64 range (±1.8e308); "
                                             "write inf or -inf for infinity")
        return value
    raise argparse.ArgumentTypeError(
        f"not a number: {s!r} (write e.g. 0.3952, -1.5e-3, 0x1.8p-2, 1/3, inf or nan)")


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


def cmd_explain(args, out) -> int:
    if args.all_modes:
        modes = list(MODES)
    else:
        modes = args.mode or ["nearest_even"]
    formats = None
    if args.formats:
        formats = [n.strip() for chunk in args.formats for n in chunk.split(",") if n.strip()]
    records = explain(args.x, formats, modes, overflow=args.overflow)
    if args.json:
        _emit_json(records, out)
    else:
        print(_explain_text(args.x, records, modes), file=out)
    if args.plot:
        from .study.figures import save_explain_figure

        save_explain_figure(records, args.plot)
        _wrote(args, out)
    return 0


# ---------------------------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fewbits",
        description="Reduced numeric precision made practical: number formats, exactly.",
        epilog="Every command takes --json for machine-readable output (non-finite numbers are written "
               "as the strings \"inf\", \"-inf\", \"nan\").",
    )
    parser.add_argument("--version", action="version", version=f"fewbits {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("formats", help="table of every number format, or one format in depth",
                       description="Every number format: layout, range, precision, specials and storage. "
                                   "With NAME: one format in depth, every code for formats of 8 bits or fewer.")
    p.add_argument("name", nargs="?", metavar="NAME", help="a format name or alias (e.g. e4m3, bf16, nf4, int4)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the bit layouts and where the values lie")
    p.set_defaults(func=cmd_formats)

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
    p.set_defaults(func=cmd_explain)
    return parser


def _protect_negative_numbers(argv: list[str]) -> list[str]:
    """argparse takes '-1e-3' or '-inf' for an option; a leading space keeps it a value
    (parse_number strips it)."""
    protected = []
    for a in argv:
        if a.startswith("-") and not a.startswith("--") and len(a) > 1:
            try:
                parse_number(a)
            except argparse.ArgumentTypeError as exc:
                if "not a number" not in str(exc):  # a number, out of range: let parse_number say so
                    a = " " + a
            else:
                a = " " + a
        protected.append(a)
    return protected


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stdout)
        return 0
    try:
        args = parser.parse_args(_protect_negative_numbers(argv))
    except SystemExit as exc:  # --help, --version, usage errors (already printed by argparse)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command is None:
        parser.print_help(sys.stdout)
        return 0
    try:
        return args.func(args, sys.stdout)
    except ValueError as exc:
        print(f"fewbits {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fewbits formats | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        print(f"fewbits {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
