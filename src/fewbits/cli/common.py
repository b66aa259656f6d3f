"""What the commands share: tables and JSON on stdout, output paths checked before the work
starts, the number parser of the command line, and the check that a MODEL exists."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from fractions import Fraction

from ..formats.explanation import jsonable


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


def emit_json(obj, out):
    json.dump(jsonable(obj), out, indent=2, allow_nan=False, ensure_ascii=False)
    out.write("\n")


# ---------------------------------------------------------------------------------------------
# output paths: checked before the work, so that a bad one fails in a second, not after the run
# ---------------------------------------------------------------------------------------------
def probe_writable(directory: str, option: str, given: str) -> None:
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
    probe_writable(existing, option, path)


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
    probe_writable(parent, option, path)
    return path


def check_plot(args, attr: str = "plot", option: str = "--plot") -> None:
    if getattr(args, attr, None):
        setattr(args, attr, plot_path(getattr(args, attr), option))


def wrote(args, out):
    print(f"wrote {args.plot}", file=sys.stderr if args.json else out)


# ---------------------------------------------------------------------------------------------
# arguments
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


def model_found(spec: str, builtins: tuple[str, ...]) -> None:
    """A MODEL that is neither built in nor on disk: "file not found", before anything is read."""
    if spec in builtins or os.path.exists(os.path.expanduser(spec)):
        return
    raise ValueError(f"{spec}: file not found (no such file or directory; the built-in models are "
                     f"{', '.join(builtins)})")
