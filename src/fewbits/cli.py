"""The `fewbits` command: parses arguments, calls the library, prints tables or JSON.

Exit codes: 0 success; 2 bad input (unknown format, scheme, mode or device, not a number,
impossible option, a broken model directory) or a missing optional package (the message carries
the pip command); 1 a file that cannot be written (output paths are checked before the work
starts), a `study` part that failed (its report is still written), or an unexpected error;
130 interrupted (Ctrl-C). Every error is one line on stderr, never a traceback
(FEWBITS_TRACEBACK=1 shows the traceback of an unexpected error).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from fractions import Fraction

from ._version import __version__
from .formats import MODES, OVERFLOW_POLICIES, OVERFLOW_PRESETS, get_format, list_formats
from .formats.explanation import (
    binade_table, code_table, exact_decimal, explain, format_summary, jsonable, value_formula,
)
from .models.decoder import PATHS as DECODE_PATHS
from .progress import Every, Lines

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
# output paths: checked before the work, so that a bad one fails in a second, not after the run
# ---------------------------------------------------------------------------------------------
def _probe_writable(directory: str, option: str, given: str) -> None:
    """Create and remove a file in `directory`: the one test of writability that holds for root,
    read-only file systems and ACLs alike."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".fewbits-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(f"{option} {given}: cannot write in {directory} ({exc.strerror or exc})") from None


def check_output_dir(path: str, option: str = "--out") -> None:
    """An output directory: an existing directory, or one that can be created (its nearest
    existing ancestor is a directory we can write in). Nothing is created here."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise OSError(f"{option} {path}: exists and is not a directory")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OSError(f"{option} {path}: {existing} is a file, not a directory")
    _probe_writable(existing, option, path)


def plot_path(path: str, option: str = "--plot") -> str:
    """The file a figure will really be written to, checked: without an extension matplotlib
    appends .png (so 'DIR' is written as 'DIR.png', and that is the path reported); an extension
    matplotlib cannot write is bad input; the directory must exist and be writable, and the file
    must not be a directory."""
    if path.endswith(("/", os.sep)):
        raise OSError(f"{option} {path}: names a directory; give a file name such as {path}plot.png")
    ext = os.path.splitext(path)[1]
    if not ext:
        path, ext = path + ".png", ".png"
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if ext[1:].lower() not in kinds:
        raise ValueError(f"{option} {path}: matplotlib cannot write {ext} files; use one of "
                         f"{', '.join('.' + k for k in sorted(kinds))}")
    if os.path.isdir(path):
        raise OSError(f"{option} {path}: is a directory; give a file name such as {os.path.join(path, 'plot.png')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OSError(f"{option} {path}: the directory {parent} does not exist")
    _probe_writable(parent, option, path)
    return path


def _check_plot(args, attr: str = "plot", option: str = "--plot") -> None:
    if getattr(args, attr, None):
        setattr(args, attr, plot_path(getattr(args, attr), option))


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
    _check_plot(args)
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
    _check_plot(args)
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
# ---------------------------------------------------------------------------------------------
# fewbits quantize
# ---------------------------------------------------------------------------------------------
_QUANT_DEFAULT_COMPARE = "int8,fp8_channel,mxfp8,int4,int4_asym,nf4,nf4_dq,mxfp4,nvfp4,int3"


def _quant_rows_table(rows, subject) -> str:
    headers = ["scheme", "bits/param", "layer bits", "model MB", subject.quality_metric,
               subject.throughput_unit, "method"]
    table = []
    for r in rows:
        lb = r.get("layer_bits_per_param")
        table.append([r.get("scheme_name") or r["scheme"], f"{r['bits_per_param']:.3f}",
                      f"{lb:.3f}" if lb is not None else "32 (fp32)", f"{r['model_bytes'] / 1e6:.1f}",
                      f"{r['quality']:.5f}" if subject.quality_metric == "cosine" else f"{r['quality']:.3f}",
                      f"{r['throughput']:.1f}", r.get("method", "—")])
    return render_table(headers, table, right=(1, 2, 3, 4, 5))


def _quant_list(args, out) -> int:
    from .quant import get_scheme, list_schemes

    rows = [{"scheme": n, "description": get_scheme(n).describe(),
             "bits_per_value": get_scheme(n).bits_per_value()} for n in list_schemes()]
    if args.json:
        _emit_json(rows, out)
    else:
        print(render_table(["scheme", "bits/value", "what"],
                           [[r["scheme"], f"{r['bits_per_value']:.3f}", r["description"]] for r in rows],
                           right=(1,)), file=out)
    return 0


def _model_found(spec: str, builtins: tuple[str, ...]) -> None:
    """A MODEL that is neither built in nor on disk: "file not found", before anything is read."""
    if spec in builtins or os.path.exists(os.path.expanduser(spec)):
        return
    raise ValueError(f"{spec}: file not found (no such file or directory; the built-in models are "
                     f"{', '.join(builtins)})")


def _quant_source(model: str, tmp: str) -> str:
    """The Hugging Face directory to convert: a built-in model's, the given directory, or a GGUF
    file converted (dequantized by transformers) into `tmp`."""
    from .models import minilm_path, smollm2_directory

    if model == "minilm":
        return str(minilm_path())
    if model == "smollm2":
        return str(smollm2_directory())
    if os.path.isdir(model):
        return model
    if os.path.isfile(model) and model.lower().endswith(".gguf"):
        from .files.gguf_reader import gguf_to_float_pretrained
        return gguf_to_float_pretrained(model, tmp)  # checked first; its RoPE scaling kept
    raise ValueError(f"unknown model {model!r}: use minilm, smollm2, a Hugging Face model directory or a GGUF file")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _quant_convert(args, out, say) -> int:
    """`fewbits quantize MODEL --scheme S --out OUT [--format F]`: write a deployable model.
    Everything that can be checked without reading the model is checked first: the format and
    OUT's name, the scheme (resolved to its canonical name, once, here) against the format, the
    options, the model's existence, the output path."""
    from .files.conversion import convert, float_matrices, output_format, scratch_directory
    from .files.streaming import tokenizer_files
    from .study import quantization as sq

    fmt = output_format(args.out, args.format)
    scheme = sq.conversion_scheme(args.scheme, fmt) if args.scheme else None
    if args.budget is not None and not 1 <= args.budget <= 32:
        raise ValueError(f"--budget is in bits per parameter (1..32), got {args.budget}")
    if args.calibration is not None:
        if args.method != "gptq":
            raise ValueError("--calibration is the text GPTQ calibrates on: it goes with --method gptq")
        if not os.path.isfile(args.calibration):
            raise ValueError(f"--calibration {args.calibration}: file not found")
    if fmt == "gguf" and (args.tied is not None or args.embeddings):
        raise ValueError("--tied and --embeddings go with --format hf or fewbits: for GGUF the recipe gives the "
                         "token embedding its type (and llama.cpp reads a tied output layer from it)")
    _model_found(args.model, ("minilm", "smollm2"))
    if os.path.lexists(args.out) and not args.overwrite:
        raise OSError(f"--out {args.out}: exists; add --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise OSError(f"--out {args.out}: {parent} is not a directory")
    _probe_writable(parent, "--out", args.out)
    if scheme is not None and scheme != args.scheme:
        say(f"--scheme {args.scheme} is {scheme}")
    with scratch_directory(args.out) as tmp:  # a GGUF source's float model (a kill leaves it to the next run)
        say(f"reading {args.model} ...")
        source = _quant_source(args.model, os.path.join(tmp, "model"))
        if fmt == "gguf" and tokenizer_files(source) is None:
            print(f"fewbits quantize: warning: {source} has no tokenizer files: the GGUF gets no vocabulary, so "
                  "llama.cpp can load it but not turn text into tokens", file=sys.stderr)
        plan = sq.conversion_plan(source, scheme, fmt, budget=args.budget, progress=say,
                                  embeddings=args.embeddings, tied=args.tied)
        calibration = None
        if args.method == "gptq":
            calibration = sq.calibration_for_directory(source, args.calibration)
            say(f"GPTQ calibration: {len(calibration)} batches")
        say(f"quantizing into {args.out} ({fmt}) ...")
        summary = convert(source, args.out, plan["rules"], format=fmt, method=args.method, calibration=calibration,
                          embeddings=plan["embeddings"], tied=plan["tied"], overwrite=args.overwrite,
                          progress=not args.quiet)
        floats = float_matrices(args.out) if fmt != "gguf" else []
        tied_source = _ties_embeddings(source)
    result = {"model": args.model, "format": fmt, "scheme": plan["scheme"], **summary.to_dict()}
    notes = []
    result.pop("types")
    if summary.types is not None:
        result["types"] = sq.written_types(summary.types, plan["types"])
    if floats:
        result["float_matrices"] = floats
        notes.append(_float_matrices_note(floats, summary.bytes, tied_source, plan))
    if args.json:
        if notes:
            result["notes"] = notes
        _emit_json(result, out)
    else:
        print(render_table(["layers", "bits/param", "size on disk", "time", "peak memory"],
                           [[str(summary.layers), f"{summary.bits_per_param:.3f}", _gb(summary.bytes),
                             f"{summary.seconds:.1f} s", _gb(summary.peak_rss_bytes)]], right=(0, 1, 2, 3, 4)),
              file=out)
        if "types" in result:
            print(f"GGUF types: {sq.written_types_text(result['types'])}", file=out)
        for note in notes:
            print(f"note: {note}", file=out)
        print(f"wrote {args.out}", file=out)
    return 0


def _ties_embeddings(source: str) -> bool:
    try:
        with open(os.path.join(source, "config.json")) as f:
            return bool(json.load(f).get("tie_word_embeddings", False))
    except (OSError, ValueError, AttributeError):
        return False


_DTYPE_WORDS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _float_matrices_note(floats, total: int, tied: bool, plan) -> str:
    """One sentence on the matrices a conversion left in float: which, their share of the output,
    and the options that quantize them."""
    size = sum(f["bytes"] for f in floats)
    tied = tied and plan["tied"] == "keep"

    def one(f):
        what = f"{f['name']} ({'×'.join(map(str, f['shape']))}, {_DTYPE_WORDS.get(f['dtype'], f['dtype'])})"
        if tied and "embed" in f["name"]:
            what = f"the tied embedding/lm_head {what}"
        return what

    def amount(n):
        return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
    listed = [one(f) for f in floats[:3]] + ([f"{len(floats) - 3} more"] if len(floats) > 3 else [])
    verb = "stays" if len(floats) == 1 else "stay"
    text = f"{', '.join(listed)} {verb} in float: {amount(size)} of {amount(total)} ({size / total:.0%})"
    if any("embed" in f["name"] for f in floats) and not plan["embeddings"]:
        text += ("; --embeddings --tied untie quantizes the embedding and the output layer each (two quantized "
                 "copies of a tied matrix)" if tied else "; --embeddings quantizes the embedding")
    return text


def cmd_quantize(args, out) -> int:
    from .quant import get_scheme
    from .study import quantization as sq

    if args.list:
        return _quant_list(args, out)
    args.model = args.model_path or args.model or "minilm"
    if args.compare is not None and args.scheme:
        raise ValueError("--scheme writes or measures one scheme, --compare measures several: give one of them")
    if args.out and args.compare is None and (args.scheme or args.budget is not None):
        return _quant_convert(args, out, Lines("fewbits", enabled=not args.quiet))
    if args.format or args.overwrite or args.calibration:
        raise ValueError("--format, --overwrite and --calibration go with a conversion: "
                         "--scheme S (or --budget BITS) --out OUT")
    schemes = [s.strip() for s in (args.compare or args.scheme or "").split(",") if s.strip()]
    if not schemes and args.budget is None:
        raise ValueError("give --scheme NAME, --compare A,B,... or --budget BITS")
    for s in schemes:
        get_scheme(s)  # unknown names fail before the model loads
    if args.tied is not None or args.embeddings:
        raise ValueError("--tied and --embeddings go with a conversion: --scheme S --out OUT")
    _model_found(args.model, ("minilm", "smollm2"))
    if args.budget is not None and not 1 <= args.budget <= 32:
        raise ValueError(f"--budget is in bits per parameter (1..32), got {args.budget}")
    if args.out:
        check_output_dir(args.out)
    say = Lines("fewbits", enabled=not args.quiet)
    say(f"loading {args.model} ...")
    subject = sq.get_subject(args.model, quick=args.quick)
    rows = sq.compare(subject, schemes, method=args.method, progress=say) if schemes else \
        [sq.measure(subject, subject.model, "fp32", None)]
    allocation = None
    if args.budget is not None:
        candidates = schemes or list(sq.BUDGET_CANDIDATES)
        allocation = sq.allocate_for_budget(subject, candidates, args.budget, progress=say)
        rows.append(allocation.pop("row"))
    result = {"model": subject.name, "quality_metric": subject.quality_metric, "note": subject.note,
              "schemes": rows}
    if allocation is not None:
        result["allocation"] = allocation
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(jsonable(result), f, indent=1)
        if len(rows) > 2:
            sq.plot_quality_vs_bits(rows, subject, os.path.join(args.out, "quality_vs_bits.png"))
    if args.json:
        _emit_json(result, out)
    else:
        print(f"{subject.name} — quality = {subject.quality_metric} "
              f"({'higher' if subject.higher_is_better else 'lower'} is better)", file=out)
        print(_quant_rows_table(rows, subject), file=out)
        if subject.note:
            print(f"note: {subject.note}", file=out)
        if args.out:
            print(f"wrote {args.out}/results.json" + (" and quality_vs_bits.png" if len(rows) > 2 else ""), file=out)
    return 0


# ---------------------------------------------------------------------------------------------
# fewbits generate
# ---------------------------------------------------------------------------------------------
def _causal_lm(spec: str):
    """(model in eval mode, tokenizer, what was loaded): smollm2, a GGUF file or a Hugging Face
    directory -- fewbits-quantized ones through fb.from_pretrained (quantized weights as stored),
    others through transformers in float32."""
    from .files.hf_quantizer import from_pretrained
    from .study.quantization import _load_part

    if spec == "smollm2":
        from .models import load_smollm2

        model, tokenizer = load_smollm2()
        return model, tokenizer, "SmolLM2-135M-Instruct (packaged)"
    path = os.path.expanduser(spec)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ImportError("generation needs transformers: pip install transformers") from None
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        model = from_pretrained(path)  # checks the file before the tokenizer's reader sees it
        tokenizer = _load_part(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name))
        return model, tokenizer, f"{path} (GGUF)"
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"unknown model {spec!r}: use smollm2, a GGUF file or a Hugging Face model directory")
    try:
        with open(config) as f:
            quant = (json.load(f).get("quantization_config") or {}).get("quant_method")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{config}: unreadable config ({e})") from None
    from .files.hf_dir import read_tensors
    # config.json's values, the shards, the index and the layer count checked before transformers
    # reads any of it (the tokenizer builds the config too)
    read_tensors(path).close()
    tokenizer = _load_part(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(path, local_files_only=True))
    if quant == "fewbits":
        return from_pretrained(path), tokenizer, f"{path} (fewbits-quantized)"
    model, info = _load_part(path, "model", lambda: AutoModelForCausalLM.from_pretrained(
        path, dtype="float32", local_files_only=True, output_loading_info=True))
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers filled them at random
        raise ValueError(f"{config}: the model it describes has weights the directory does not hold: "
                         f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    return model.eval(), tokenizer, path


def _check_prompt(prompt: str) -> None:
    """A prompt that is not text: bytes that are not UTF-8 reach Python's sys.argv as lone
    surrogates ('\\udcff'), which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start:e.end]
        shown = ", ".join(f"0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"U+{ord(c):04X}" for c in bad)
        raise ValueError(f"--prompt is not valid UTF-8 text: the byte{'s' if len(bad) > 1 else ''} {shown} at "
                         f"character {e.start} (give the prompt in UTF-8)") from None


def _refuse_requantizing(model: str, scheme: str, loaded=None) -> None:
    """--scheme on a model that is quantized already: quantize_model would convert only its float
    layers, and the run would be reported as `scheme` while it runs the stored one. Checked from
    config.json before loading (a fewbits directory) and on the loaded model (a quantized GGUF)."""
    kinds = None
    if loaded is None:
        config = os.path.join(os.path.expanduser(model), "config.json")
        try:
            with open(config) as f:
                qc = json.load(f).get("quantization_config") or {}
        except (OSError, ValueError, AttributeError):
            return
        if isinstance(qc, dict) and qc.get("quant_method"):
            schemes = sorted({m.get("scheme") for m in (qc.get("modules") or {}).values()
                              if isinstance(m, dict) and isinstance(m.get("scheme"), str)})
            kinds = f"{qc['quant_method']}" + (f" {', '.join(schemes)}" if schemes else "")
    else:
        from .quant.plan import is_quantized

        schemes = sorted({m.qweight.scheme.label for m in loaded.modules() if is_quantized(m)})
        kinds = ", ".join(schemes) if schemes else None
    if kinds:
        raise ValueError(f"{model} is quantized already ({kinds}): --scheme {scheme} would quantize only its float "
                         "layers and run the rest as stored; drop --scheme to run it as stored, or give the float "
                         "model")


def _check_token_ids(ids, model, tokenizer, what: str) -> None:
    """Token ids the model's embedding has no row for: a tokenizer larger than the model's
    vocabulary (an index error deep in the forward otherwise)."""
    embedding = model.get_input_embeddings()
    rows = int(getattr(embedding, "num_embeddings", 0) or 0)
    top = int(ids.max())
    if rows and top >= rows:
        raise ValueError(f"{what}: the tokenizer gives token id {top} (it has {len(tokenizer)} tokens) but the "
                         f"model's embedding has {rows} rows: the tokenizer does not belong to this model")


def cmd_generate(args, out) -> int:
    import torch

    from .models.decoder import LlamaDecoder
    from .quant import get_scheme, quantize_model

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    _check_prompt(args.prompt)
    scheme = get_scheme(args.scheme).name or args.scheme if args.scheme else None  # unknown: fails before loading
    _model_found(args.model, ("smollm2",))
    if scheme is not None:
        _refuse_requantizing(args.model, scheme)
    say = Lines("fewbits", enabled=not args.quiet)
    say(f"loading {args.model} ...")
    model, tokenizer, what = _causal_lm(args.model)
    if scheme is not None:
        _refuse_requantizing(what, scheme, model)
        say(f"quantizing to {scheme} ...")
        quantize_model(model, scheme, tied="untie")
    # without --threads, the count that runs fastest now (a busy machine's cores make 2 threads slower than 1)
    decoder = LlamaDecoder(model, path=args.path, threads=None if args.threads is not None else "auto")
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    else:
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    _check_token_ids(ids, model, tokenizer, what)
    stop = [] if args.no_stop or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    result = decoder.generate(ids, args.max_new_tokens, stop=stop)
    # the continuation decoded after the prompt, not alone: a tokenizer may drop a leading space
    # of the first new token when it is decoded on its own (Llama 2's and Mistral's do)
    before = tokenizer.decode(ids[0], skip_special_tokens=True)
    whole = tokenizer.decode(torch.cat([ids[0], result.tokens[0]]), skip_special_tokens=True)
    text = whole[len(before):] if whole.startswith(before) else tokenizer.decode(result.tokens[0],
                                                                                 skip_special_tokens=True)
    used = decoder.last_threads or {torch.get_num_threads(): 0}  # {threads: decode steps run at it}
    info = {"model": what, "scheme": scheme, "path": decoder.last_path, "threads": max(used, key=used.get),
            "prompt": args.prompt, "text": text, "prompt_tokens": result.prompt_tokens,
            "new_tokens": int(result.tokens.shape[1]), "prefill_tokens_per_s": result.prefill_tokens_per_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "stopped_at_eos": bool(stop) and int(result.tokens[0, -1]) in stop}
    reason = decoder.native_reason() if decoder.last_path != "native" else None
    if reason is not None:  # None too where no step was left to decode (one new token)
        info["native_reason"] = reason
    if args.json:
        _emit_json(info, out)
        return 0
    print(text if args.chat else args.prompt + text, file=out)
    decode = (f"decode {info['new_tokens'] - 1} tokens at {info['decode_tokens_per_s']:.1f} tok/s"
              if info["new_tokens"] > 1 else "no decode step")
    print(f"\n[{what}, {scheme or 'as stored'}, {info['threads']} thread(s), {decoder.last_path} decode path: "
          f"prefill {info['prompt_tokens']} tokens at {info['prefill_tokens_per_s']:.0f} tok/s, {decode}"
          f"{', stopped at end of sequence' if info['stopped_at_eos'] else ''}]", file=out)
    if "native_reason" in info and args.path == "auto":
        print(f"[the native decode step did not run: {info['native_reason']}]", file=out)
    return 0


# ---------------------------------------------------------------------------------------------
# fewbits train
# ---------------------------------------------------------------------------------------------
def _train_progress(quiet: bool):
    """A progress callback printing to stderr about every 2 s (only runs longer than that show it)."""
    every = Every(2.0, last=True)

    def progress(step, total, loss):
        if not quiet and every.due(step, total):
            print(f"  step {step}/{total}  loss {loss:.4f}  ({every.elapsed:.0f}s)", file=sys.stderr, flush=True)
    return progress


def _train_table(results) -> str:
    def mb(v):
        return "—" if v is None else f"{v / 1e6:.1f}"
    rows = [[r["policy"], f"{r['final_loss']:.4f}", f"{r['step_time_s'] * 1e3:.1f}", mb(r["peak_memory_bytes"]),
             mb(r["state_bytes"]), r["skipped_steps"], f"{r['underflow_fraction']:.2%}",
             f"{r['lost_update_fraction']:.2%}", r.get("gemm_path", "")] for r in results]
    return render_table(["policy", "final loss", "step ms", "peak MB", "state MB", "skipped", "underflow",
                         "lost updates", "matmuls ran as"], rows, right=range(1, 8))


def cmd_train(args, out) -> int:
    from .train import Policy, Telemetry
    from .study.charts import save_histogram_figure, save_loss_figure
    from .study.tasks import TaskConfig, run_task

    names = [n.strip() for n in (args.compare or args.policy or "bf16-mixed").split(",") if n.strip()]
    policies = [Policy.preset(n) for n in names]  # ValueError (exit 2) for an unknown name
    cfg = TaskConfig(args.task, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                     **{k: v for k, v in (("d_model", args.d_model), ("n_layers", args.layers),
                                          ("n_heads", args.heads), ("seq", args.seq)) if v is not None})
    if args.compare and not args.plot and not args.json:  # with --json, a picture only when --plot asks
        args.plot = f"train_compare_{cfg.task}.png"
    _check_plot(args)
    if len(policies) == 1:
        _check_plot(args, "histogram", "--histogram")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    results = []
    for pol in policies:
        if not args.json and not args.quiet:
            print(f"training {cfg.task} under {pol.name} for {cfg.steps} steps", file=sys.stderr, flush=True)
        tel = Telemetry(every=args.telemetry_every)
        r = run_task(pol, cfg, telemetry=tel, progress=_train_progress(args.quiet or args.json))
        r.pop("_engine")
        if args.histogram and len(policies) == 1:
            save_histogram_figure(tel, args.histogram, title=f"{cfg.task} under {pol.name}")
        r["layers"] = tel.layers() if args.layers_detail else None
        results.append(r)
    plot = args.plot
    if plot:
        save_loss_figure(results, plot, title=f"fewbits train --task {cfg.task}: loss by policy")
    if args.json:
        _emit_json(results if args.compare else results[0], out)
    else:
        print(_train_table(results), file=out)
        print("step ms: median step time; peak MB: growth of the process's peak resident memory during the run; "
              "state MB: weights, masters, gradients and optimizer states held; underflow: non-zero gradients "
              "entering the backward matmuls that the format flushed to zero; lost updates: optimizer updates "
              "that did not change the stored weights (sampled every "
              f"{args.telemetry_every} steps).", file=out)
    for path in [p for p in (plot, args.histogram if len(policies) == 1 else None) if p]:
        print(f"wrote {path}", file=sys.stderr if args.json else out)
    return 0


# ---------------------------------------------------------------------------------------------
# fewbits memory, fewbits bench
# ---------------------------------------------------------------------------------------------
_MEMORY_SCHEMES = ("fp32", "bf16", "int8", "int4", "nf4_dq", "mxfp4", "nvfp4")
_MEMORY_POLICIES = ("fp32", "bf16-mixed", "bf16-pure", "fp8-hybrid", "bf16-mixed-8bit-adam")
_MEMORY_LABELS = {"weights": "weights", "master_weights": "master weights", "gradients": "gradients",
                  "optimizer_states": "optimizer states", "activations": "activations",
                  "kv_cache": "kv cache", "workspace": "workspace"}


def _memory_heading(est) -> str:
    what = f"{est.model}: {est.parameters:,} parameters"
    if est.architecture:
        what += f"; {est.architecture}"
    run = f"{est.mode}, batch {est.batch} x {est.seq_len} tokens"
    if est.optimizer:
        run += f", optimizer {est.optimizer}"
    return f"{what}\n{run}"


def _memory_breakdown_text(est) -> str:
    from .memory import format_bytes

    rows = [[_MEMORY_LABELS[k], format_bytes(est.components[k]), format_bytes(est.at_peak[k])]
            for k in _MEMORY_LABELS]
    rows.append(["total (peak)", "", format_bytes(est.total)])
    lines = [_memory_heading(est), f"precision {est.precision}: {est.weight_bits:.3f} bits per parameter "
             "stored, scales included", "", render_table(["component", "size", "at peak"], rows, right={1, 2}),
             "", f"peak: {est.peak_phase}.  phases: " +
             "; ".join(f"{k} {format_bytes(v)}" for k, v in est.phases.items())]
    if any(est.workspace_parts.values()):
        lines.append("workspace: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                               for k, v in est.workspace_parts.items() if v))
    lines += [f"note: {n}" for n in est.notes]
    lines.append("size: each component in full; at peak: what is alive at the peak (they sum to the total). "
                 "GB = 10^9 bytes.")
    return "\n".join(lines)


def _memory_compare_text(ests) -> str:
    from .memory import format_bytes

    training = ests[0].mode == "training"
    keys = [k for k in _MEMORY_LABELS if any(e.components[k] for e in ests)] or ["weights"]
    headers = ["policy" if training else "scheme", "bits/param"] + [_MEMORY_LABELS[k] for k in keys] + \
        ["total (peak)", "peak during"]
    rows = [[e.precision, f"{e.weight_bits:.3f}"] + [format_bytes(e.components[k]) for k in keys] +
            [format_bytes(e.total), e.peak_phase] for e in ests]
    notes = sorted({n for e in ests for n in e.notes})
    return "\n".join([_memory_heading(ests[0]), "", render_table(headers, rows, right=set(range(1, len(keys) + 3)))] +
                     [f"note: {n}" for n in notes] +
                     ["Components in full; the total is the peak of what is alive at once. GB = 10^9 bytes. "
                      "One of them in detail: --scheme NAME or --policy NAME."])


def cmd_memory(args, out) -> int:
    from .memory import estimate_memory

    common = dict(mode=args.mode, optimizer=args.optimizer, batch=args.batch, seq_len=args.seq_len,
                  runtime=args.runtime, device=args.device, rest_format=args.rest_format, logits=args.logits)
    if args.scheme or args.policy:
        est = estimate_memory(args.model, scheme=args.scheme, policy=args.policy, **common)
        if args.json:
            _emit_json(est.as_dict(), out)
        else:
            print(_memory_breakdown_text(est), file=out)
        return 0
    if args.mode == "training":
        ests = [estimate_memory(args.model, policy=p, **common) for p in _MEMORY_POLICIES]
    else:
        ests = [estimate_memory(args.model, scheme=s, **common) for s in _MEMORY_SCHEMES]
    if args.json:
        _emit_json([e.as_dict() for e in ests], out)
    else:
        print(_memory_compare_text(ests), file=out)
    return 0


def _bench_text(res) -> str:
    from .hardware import KNOWN_ACCELERATORS

    m, bw = res.machine, res.bandwidth
    flags = ", ".join(m.get("matmul_flags", [])) or "—"
    lines = [f"this machine: {m['name']}; {m['threads']} threads; torch {m['torch']}"
             + (f"; {m['cpu_capability']} ({flags})" if "cpu_capability" in m else "")
             + (f"; fused C kernels: {m['native_kernels']}" if "native_kernels" in m else ""),
             f"memory bandwidth: {bw.copy_gbs:.3g} GB/s copy (read + write of a {bw.buffer_bytes / 2 ** 20:.0f} MiB "
             f"buffer), {bw.read_gbs:.3g} GB/s read (sum)", ""]
    rows = [[d, s.kernel or "—", s.n or "—", f"{s.gflops:.3g}" if s.available else "—",
             f"{s.ratio:.2f}" if s.ratio is not None else "—", s.note] for d, s in res.matmuls.items()]
    lines += ["matmul throughput, n x n x n, best call:",
              render_table(["dtype", "kernel", "n", "GFLOP/s", "x fp32", "note"], rows, right={2, 3, 4}), ""]
    rows = []
    for r in res.shapes:
        acc = r["accelerators"]
        n_bw = sum(v == "bandwidth" for v in acc.values())
        on_acc = "—" if not acc else ("bandwidth on all" if n_bw == len(acc) else
                                      "compute on all" if n_bw == 0 else f"bandwidth on {n_bw} of {len(acc)}")
        rows.append([r["shape"], r["dtype"], f"{r['intensity']:.3g}", f"{r['ridge']:.3g}", r["bound"],
                     f"{r['attainable_gflops']:.3g}",
                     "—" if r["measured_gflops"] is None else f"{r['measured_gflops']:.3g}", on_acc])
    lines += [f"roofline (shape MxNxK: M tokens through a K x N weight; bandwidth {bw.copy_gbs:.3g} GB/s):",
              render_table(["shape", "dtype", "op/byte", "ridge", "bound here", "roofline GFLOP/s",
                            "measured", "known accelerators"], rows, right={2, 3, 5, 6}), ""]
    rows = [[a.name, f"{a.memory_gb:g}", f"{a.bandwidth_gbs:g}"] +
            ["—" if a.peak(d) is None else f"{a.peak(d):g}" for d in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")]
            + [f"{a.ridge('bf16'):.0f}" if a.bf16 else "—", a.note] for a in KNOWN_ACCELERATORS]
    lines += ["known accelerators: dense peaks in TFLOP/s (int8: TOP/s), memory in GB, bandwidth in GB/s:",
              render_table(["accelerator", "memory", "GB/s", "fp32", "tf32", "fp16", "bf16", "fp8", "int8",
                            "bf16 ridge", "note"], rows, right=set(range(1, 10))),
              "", f"int8 counts integer operations (GOP/s, TOP/s). x fp32: throughput relative to fp32 here. ridge: "
                  f"operations per byte above which a matmul is compute-bound. Measured in {res.seconds:.0f} s."]
    return "\n".join(lines)


def _device_type(device: str) -> str:
    import torch

    return torch.device(device).type


def _layer_batches(args) -> list[int]:
    if args.no_layers:
        return []
    try:
        batches = [int(b) for b in args.layer_batches.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) <= 0:
        raise ValueError(f"--layer-batches takes positive integers such as 1,64, got {args.layer_batches!r}")
    if args.layer_dim <= 0:
        raise ValueError(f"--layer-dim must be positive, got {args.layer_dim}")
    return batches


def _layer_peers(args) -> list[str]:
    from .study.layer_speed import BENCH_PEERS, PEERS_BY_LABEL

    if args.layer_peers is None:
        return list(BENCH_PEERS)
    if args.layer_peers.strip().lower() == "none":
        return []
    peers = [p.strip() for p in args.layer_peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS_BY_LABEL]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(map(repr, unknown))} for --layer-peers; choose from "
                         f"{', '.join(PEERS_BY_LABEL)}")
    return peers


def cmd_bench(args, out) -> int:
    from .hardware import MATMUL_DTYPES, MatmulShape, check_device, run_bench

    shapes = [MatmulShape.parse(s) for s in (args.shape or ["1x4096x4096", "512x4096x4096"])]
    dtypes = [d.strip() for d in (args.dtypes or ",".join(MATMUL_DTYPES)).split(",") if d.strip()]
    if args.budget <= 0 or args.buffer_mb <= 0:
        raise ValueError(f"--budget and --buffer-mb must be positive, got {args.budget} and {args.buffer_mb}")
    check_device(args.device)
    _check_plot(args)
    layer_batches = _layer_batches(args)
    peers = _layer_peers(args)
    say = Lines("fewbits bench", enabled=not args.json)
    res = run_bench(shapes, dtypes, budget_s=args.budget, device=args.device, buffer_mb=args.buffer_mb,
                    progress=say)
    layers = None
    if layer_batches and _device_type(args.device) == "cpu":
        from .study.layer_speed import BENCH_FEWBITS, layer_speed, linear_stack

        layers = layer_speed(linear_stack(args.layer_dim, layers=1), layer_batches, BENCH_FEWBITS, peers,
                             budget_s=args.budget, progress=say)
    if args.json:
        _emit_json(dict(res.as_dict(), layer_speed=layers), out)
    else:
        text = _bench_text(res)
        if layers is not None:
            from .study.layer_speed import layer_speed_text

            text += "\n\n" + layer_speed_text(layers, render_table) + \
                f"\nrel err: ||y - y_fp32|| / ||y_fp32|| at batch {layer_batches[0]}. Measured in {layers['seconds']:.0f} s."
        elif layer_batches:
            text += "\n\nlayer speed: measured on the CPU only (--device cpu)"
        print(text, file=out)
    if args.plot:
        from .study.hardware_figures import save_roofline_figure

        save_roofline_figure(res, args.plot)
        _wrote(args, out)
    return 0


def _add_memory_and_bench(sub) -> None:
    p = sub.add_parser("memory", help="memory of a model in a precision: weights, gradients, optimizer, "
                                      "activations, KV cache",
                       description="Predicted memory of a model (a parameter count such as 7B or 135M, or a "
                                   "Hugging Face config.json) for inference or a training step, per component "
                                   "and at the peak. Without --scheme or --policy: a table of common choices.")
    p.add_argument("model", metavar="MODEL", help="parameter count (7B, 1.5B, 135M, 7000000000) or a config.json "
                                                  "(or its directory) of a llama-like or bert-like model")
    p.add_argument("--mode", choices=("inference", "training"), default="inference")
    p.add_argument("--scheme", metavar="NAME", help="weight storage: a quantization preset as `fewbits quantize` "
                   "stores it, scales included (int8, int4, nf4, nf4_dq, mxfp4, nvfp4, int4_g32, ...; see "
                   "`fewbits quantize --list`), or a float format held plainly (fp32, bf16, fp16, tf32)")
    p.add_argument("--policy", metavar="NAME", help="a training policy preset (fp32, bf16-mixed, bf16-pure, "
                   "fp8-hybrid, ...)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, adamw8bit, lion, sgd, "
                                                        "sgd_momentum, adafactor")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 512, or a bert-like model's "
                                                "positions if fewer)")
    p.add_argument("--runtime", choices=("torch", "fewbits"), default="torch",
                   help="torch: stock PyTorch (autocast for mixed policies); fewbits: fewbits.train.Engine")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="kernels differ (default cpu)")
    p.add_argument("--rest-format", default="bf16", metavar="FMT",
                   help="storage of embeddings and norms under a quantization preset (default bf16)")
    p.add_argument("--logits", choices=("all", "last"), default="all",
                   help="inference: score every position (all, default) or only the last (generation)")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("bench", help="this machine's memory bandwidth and matmul speed per precision, rooflines, "
                                     "quantized layer speed beside bitsandbytes and torchao",
                       description="Measure memory bandwidth and matmul throughput per dtype (fp32, tf32, bf16, "
                                   "fp16, fp8, int8) as ratios to fp32, place matmul shapes on the roofline, "
                                   "list known accelerator peaks, and time a 4096 x 4096 Linear in fewbits' "
                                   "schemes beside the installed peers (one interleaved run, ratios to fp32). "
                                   "About a minute by default.")
    p.add_argument("--shape", action="append", metavar="MxNxK",
                   help="matmul shape(s) to place on the roofline, repeatable (default 1x4096x4096 and "
                        "512x4096x4096)")
    p.add_argument("--dtypes", metavar="A,B", help="only these (fp32,tf32,bf16,fp16,fp8,int8)")
    p.add_argument("--budget", type=float, default=1.5, metavar="SECONDS", help="time per probe (default 1.5)")
    p.add_argument("--buffer-mb", type=int, default=256, metavar="MIB",
                   help="bandwidth probe buffer (default 256; keep it above the caches)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--layer-dim", type=int, default=4096, metavar="N",
                   help="layer speed: a Linear(N, N) in fp32, bf16 and fewbits' schemes beside the installed "
                        "peers (bitsandbytes, torchao, quantize_dynamic) (default 4096)")
    p.add_argument("--layer-batches", default="1,64", metavar="B,B", help="layer speed batch sizes (default 1,64)")
    p.add_argument("--layer-peers", metavar="A,B", help="layer speed peers by label, comma-separated, or none "
                                                         "(default: fewbits.study.layer_speed.BENCH_PEERS)")
    p.add_argument("--no-layers", action="store_true", help="skip the layer speed section")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the rooflines")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_bench)


# ---------------------------------------------------------------------------------------------
# fewbits study
# ---------------------------------------------------------------------------------------------
def cmd_study(args, out) -> int:
    from .study.run import Progress, check_model_path, parse_parts, run_study

    parts = parse_parts(args.only)  # ValueError (exit 2) for an unknown part, before anything runs
    model = check_model_path(args.model) if args.model else None
    check_output_dir(args.out)
    study = run_study(out=args.out, quick=args.quick, parts=parts, model=model,
                      progress=Progress(enabled=not args.quiet))
    failed = [p for p in study["parts"] if p["status"] != "ok"]
    if args.json:
        _emit_json({"report": study["report"], "results": os.path.join(args.out, "results.json"),
                    "seconds": study["seconds"],
                    "parts": [{"name": p["name"], "status": p["status"], "seconds": p["seconds"],
                               "error": p.get("error"), "figures": [f["file"] for f in p["figures"]]}
                              for p in study["parts"]]}, out)
    else:
        rows = [[p["name"], p["status"], f"{p['seconds']:.1f}", len(p["figures"]), len(p["tables"]),
                 p.get("error") or ""] for p in study["parts"]]
        print(render_table(["part", "status", "seconds", "figures", "tables", "error"], rows, right={2, 3, 4}),
              file=out)
        print(f"report: {study['report']} ({study['seconds']:.0f} s); every number in "
              f"{os.path.join(args.out, 'results.json')}", file=out)
    return 1 if failed else 0


def _add_study(sub) -> None:
    p = sub.add_parser("study", help="measure every precision on real models and write a report",
                       description="Run the study offline on the built-in real models: number formats, memory "
                                   "per format and training policy (estimated and measured), speed on this "
                                   "machine, quantization of MiniLM and SmolLM2, training under precision "
                                   "policies. Writes report.html with PNG figures and results.json. Exit code 1 "
                                   "when a part failed (the report says why; the others still ran).")
    p.add_argument("--quick", action="store_true", help="a short run for first contact and CI (minutes)")
    p.add_argument("--only", metavar="PARTS", help="comma-separated parts: formats,memory,speed,quant,train")
    p.add_argument("--out", default="fewbits-report", metavar="DIR", help="report directory (default fewbits-report)")
    p.add_argument("--model", metavar="PATH", help="your Hugging Face model directory for the memory and "
                                                   "quantization parts (instead of MiniLM and SmolLM2)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.set_defaults(func=cmd_study)


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

    p = sub.add_parser("quantize", help="quantize a model: write it for deployment, or measure schemes",
                       description="Quantize a model (MiniLM, SmolLM2, your Hugging Face model directory or a "
                                   "GGUF file). With --scheme S --out OUT: write the quantized model (a Hugging "
                                   "Face directory, a GGUF file or a fewbits file), streamed from disk. With "
                                   "--compare (or --scheme without --out): measure quality, bits per parameter, "
                                   "bytes and throughput against fp32.")
    p.add_argument("model_path", nargs="?", metavar="MODEL",
                   help="minilm, smollm2, a Hugging Face model directory or a GGUF file (default minilm)")
    p.add_argument("--model", metavar="NAME|PATH", help="the same as MODEL")
    p.add_argument("--scheme", metavar="NAME", help="a quantization preset (see `fewbits quantize --list`); with "
                   "--format gguf also a llama.cpp mix: q4_k_m, q4_k_s, q5_k_m")
    p.add_argument("--compare", metavar="A,B,C", nargs="?", const=_QUANT_DEFAULT_COMPARE,
                   help=f"several presets: a comparison table and plot (alone: {_QUANT_DEFAULT_COMPARE})")
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn", help="rounding method (default rtn)")
    p.add_argument("--budget", type=float, metavar="BITS",
                   help="choose a scheme per layer to fit this many bits per parameter")
    p.add_argument("--out", metavar="OUT", help="with --scheme or --budget: write the quantized model there "
                   "(see --format); with --compare: a directory for results.json and quality_vs_bits.png")
    p.add_argument("--format", choices=("fewbits", "hf", "gguf"),
                   help="the written model: hf (a Hugging Face directory), gguf (for llama.cpp) or fewbits (one "
                   "safetensors file); default from OUT: *.gguf, *.safetensors, else hf")
    p.add_argument("--calibration", metavar="FILE", help="a text file of calibration text for --method gptq "
                   "(default: Python's pydoc topics)")
    p.add_argument("--embeddings", action="store_true", help="with --out (hf, fewbits): quantize the token "
                   "embedding too (default: it stays in float); on a tied model add --tied untie")
    p.add_argument("--tied", choices=("keep", "untie"), help="with --out (hf, fewbits): keep (default) leaves a "
                   "layer that shares its weight (a tied lm_head) in float; untie quantizes it on its own")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--quick", action="store_true", help="fewer evaluation sentences/tokens")
    p.add_argument("--list", action="store_true", help="list the quantization presets and exit")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("generate", help="generate text from a model, quantized or not, with the fast decode path",
                       description="Greedy generation from a Llama-architecture causal LM (SmolLM2, a Hugging Face "
                                   "directory -- fewbits-quantized ones as stored -- or a GGUF file), optionally "
                                   "quantized first with --scheme, through fewbits.models.LlamaDecoder: the "
                                   "prompt in torch ops, each new token in one C call where every projection has "
                                   "a one-row kernel. Prints the text and the prefill and decode speed.")
    p.add_argument("model", metavar="MODEL", help="smollm2, a Hugging Face model directory or a GGUF file")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--scheme", metavar="NAME", help="quantize to this preset first (e.g. int4, w4a8, nf4, int8; "
                   "the tied output layer too); default: the model as stored")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--path", choices=DECODE_PATHS, default="auto",
                   help="decode path: native (one C call per token; an error if it cannot run), torch "
                        "(transformers' logits bit for bit), auto (native where it can run; default)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's count, or fewer while other "
                                               "processes keep the cores busy, measured as it decodes)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("train", help="train a built-in task under precision policies",
                       description="Train a small GPT-style LM on Python's pydoc_data text (--task lm) or an "
                                   "MLP on scikit-learn's digits (--task mlp) under a precision policy, or "
                                   "compare several: final loss, step time, memory, skipped steps, underflow "
                                   "and lost updates, with a loss-curve plot.")
    p.add_argument("--policy", metavar="NAME", help="a policy preset (default bf16-mixed): "
                   "fp32, tf32, bf16-mixed, fp16-mixed, fp8-hybrid, fp8-rowwise, mxfp8, int8-mixed, "
                   "int8-mixed-gw8, bf16-pure, bf16-pure-sr, bf16-pure-kahan, ...")
    p.add_argument("--compare", metavar="P1,P2,...", help="several policies: a table and a loss-curve PNG")
    p.add_argument("--task", choices=("lm", "mlp"), default="mlp", help="lm or mlp (default mlp)")
    p.add_argument("--steps", type=int, help="training steps (default: lm 20, mlp 300)")
    p.add_argument("--batch-size", type=int, help="default: lm 16, mlp 128")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, help="lm width (default 512)")
    p.add_argument("--layers", type=int, help="lm layers (default 4)")
    p.add_argument("--heads", type=int, help="lm attention heads (default 8)")
    p.add_argument("--seq", type=int, help="lm sequence length (default 256)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--telemetry-every", type=int, default=10, metavar="N", help="sample numerics every N steps")
    p.add_argument("--plot", metavar="FILE.png", help="loss-curve plot (default with --compare and without "
                                                      "--json: train_compare_TASK.png)")
    p.add_argument("--histogram", metavar="FILE.png", help="exponent histograms of one policy's tensors")
    p.add_argument("--layers-detail", action="store_true", help="per-layer telemetry in the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_train)

    _add_memory_and_bench(sub)
    _add_study(sub)
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
    """Run one command; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "fewbits"
    try:
        parser = build_parser()
        if not argv:
            parser.print_help(sys.stdout)
            return 0
        try:
            args = _parse(parser, _protect_negative_numbers(argv))
        except SystemExit as exc:  # --help, --version, usage errors (already printed by argparse)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if args.command is None:
            parser.print_help(sys.stdout)
            return 0
        command = f"fewbits {args.command}"
        _quiet_library_loggers()
        with _third_party_quiet(getattr(args, "quiet", False)):
            return _run(command, args)
    except KeyboardInterrupt:  # Ctrl-C: no traceback; 130 = 128 + SIGINT, as a shell reports it
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def _did_you_mean(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with a mistyped command or option answered by that command's usage and the
    close names: argparse reports an unknown option of a command with the top-level usage only,
    and suggests nothing."""
    commands = _subparsers(parser)
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is not None and first not in commands and argv.index(first) == 0:
        parser.error(f"unknown command {first!r}{_did_you_mean(first, commands)}; commands: {', '.join(commands)}")
    args, extras = parser.parse_known_args(argv)
    if extras:
        target = commands.get(getattr(args, "command", None) or "", parser)
        options = [o for a in target._actions for o in a.option_strings]  # noqa: SLF001
        hints = [_did_you_mean(e.split("=", 1)[0], options) for e in extras if e.startswith("-")]
        target.error(f"unrecognized arguments: {' '.join(extras)}{''.join(h for h in hints if h)}")
    return args


@contextlib.contextmanager
def _third_party_quiet(enabled: bool):
    """--quiet: no progress bars or warnings from the libraries fewbits calls (tqdm's bars, which
    transformers' and huggingface_hub's are; transformers' logging; Python warnings other than
    fewbits' own; the root logger below ERROR) while the command runs; errors still show.
    Everything is restored afterwards, since the command may run inside a longer process."""
    if not enabled:
        yield
        return
    import functools
    import logging
    import warnings

    undo = []
    try:
        import tqdm.std
    except ImportError:
        pass
    else:
        init = tqdm.std.tqdm.__init__  # subclasses (tqdm.auto, transformers' bars) inherit the default
        tqdm.std.tqdm.__init__ = functools.partialmethod(init, disable=True)
        undo.append(lambda: setattr(tqdm.std.tqdm, "__init__", init))
    had_transformers = "transformers" in sys.modules
    saved_verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers is first imported
    if had_transformers:
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        undo.append(lambda: hf_logging.set_verbosity(level))
    root = logging.getLogger()
    root_level = root.level
    root.setLevel(max(root_level, logging.ERROR))
    undo.append(lambda: root.setLevel(root_level))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"fewbits(\.|$)")  # fewbits' own: news for the user
            yield
    finally:
        for u in reversed(undo):
            u()
        if saved_verbosity is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = saved_verbosity
        if not had_transformers and "transformers.utils.logging" in sys.modules:  # imported during the command
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity(hf_logging._get_default_logging_level())  # noqa: SLF001 - as at import


def _quiet_library_loggers() -> None:
    """transformers imports torchao where it is installed, which logs a warning per CUDA-only
    extension it cannot load on a CPU machine, and torch warns about enum registrations: noise
    on the command line, not news for its user."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _run(command: str, args) -> int:
    def error(message) -> None:
        print(f"{command}: error: {' '.join(str(message).split())}", file=sys.stderr)

    try:
        return args.func(args, sys.stdout)
    except ValueError as exc:
        error(exc)
        return 2
    except ImportError as exc:  # an optional package is missing: the message carries the pip hint
        error(exc)
        return 2
    except BrokenPipeError:  # `fewbits formats | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        error(exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug or a case we did not foresee: one line, not a traceback
        if os.environ.get("FEWBITS_TRACEBACK"):
            raise
        error(f"{type(exc).__name__}: {exc} (unexpected; FEWBITS_TRACEBACK=1 shows where)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
