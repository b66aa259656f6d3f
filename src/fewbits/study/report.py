"""The study report: report.html beside its PNG figures, and results.json with every number shown.

    write_report(study, out_dir) -> Path of report.html

`study` is the dictionary fewbits.study.run builds (see there): run information and a list of
parts, each with a status, "how to read this" text, figures (PNG files already in out_dir),
tables and numbers. Tables carry raw values and a display format per column: the HTML shows
the formatted value, results.json the raw one, so every number on the page is in the JSON.

The HTML needs nothing outside its directory: styles are inline, figures are the PNG files
next to it, there is no script and nothing is fetched from the network.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from ..atomic import replacing
from ..formats.explanation import jsonable

REPORT_FILE = "report.html"
RESULTS_FILE = "results.json"

_CSS = """
:root { --ink:#1d2330; --muted:#5b6472; --line:#dfe3ea; --bg:#f7f8fa; --ok:#2e7d32; --bad:#c62828;
        --warn:#ef6c00; --accent:#1f4e79; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
       color:var(--ink); background:#fff; }
header { background:var(--accent); color:#fff; padding:22px 32px 18px; }
header h1 { margin:0 0 4px; font-size:26px; }
header p { margin:2px 0; color:#dbe6f2; font-size:13.5px; }
header code { background:rgba(255,255,255,0.16); color:#fff; }
main { max-width:1180px; margin:0 auto; padding:8px 32px 40px; }
nav { background:var(--bg); border:1px solid var(--line); border-radius:6px; padding:10px 16px; margin:18px 0; }
nav ol { margin:4px 0; padding-left:22px; }
nav li { margin:2px 0; }
section { border-top:1px solid var(--line); padding-top:10px; margin-top:26px; }
h2 { font-size:21px; margin:6px 0 8px; }
h3 { font-size:16px; margin:18px 0 6px; }
.read { background:#eef4fb; border-left:4px solid var(--accent); padding:8px 14px; margin:8px 0 14px;
        font-size:14px; }
.read b { color:var(--accent); }
.note { background:#fff8e1; border-left:4px solid var(--warn); padding:6px 12px; margin:8px 0; font-size:14px; }
.error { background:#fdecea; border-left:4px solid var(--bad); padding:8px 14px; margin:8px 0; }
.error pre { white-space:pre-wrap; font-size:12px; margin:6px 0 0; }
.badge { display:inline-block; padding:0 8px; border-radius:10px; font-size:12px; color:#fff; margin-left:6px;
         vertical-align:middle; }
.badge.ok { background:var(--ok); } .badge.failed { background:var(--bad); }
.meta { color:var(--muted); font-size:13px; }
ul.highlights { margin:6px 0 0; padding-left:22px; }
figure { margin:14px 0 18px; }
figure img { max-width:100%; height:auto; border:1px solid var(--line); border-radius:4px; }
figcaption { color:var(--muted); font-size:13.5px; margin-top:4px; }
.table-wrap { overflow-x:auto; max-width:100%; margin:6px 0 4px; }
table { border-collapse:collapse; font-size:13px; font-variant-numeric:tabular-nums; }
th, td { border-bottom:1px solid var(--line); padding:3px 8px; text-align:left; white-space:nowrap; }
th { background:var(--bg); font-weight:600; white-space:normal; vertical-align:bottom; }
td.wrap { white-space:normal; overflow-wrap:anywhere; min-width:12em; max-width:32em; }
td.num, th.num { text-align:right; }
tr.flag td { background:#fff8e1; }
p.tnote { color:var(--muted); font-size:13px; margin:2px 0 10px; }
footer { color:var(--muted); font-size:13px; border-top:1px solid var(--line); margin-top:34px; padding-top:10px; }
code { background:var(--bg); padding:0 4px; border-radius:3px; font-size:13px; }
"""


# ---------------------------------------------------------------------------------------------
# number formatting (display only; results.json keeps the raw values)
# ---------------------------------------------------------------------------------------------
def format_bytes(n) -> str:
    """Decimal units, as the rest of fewbits: 4.00 GB, 105 MB, 12.3 kB, 512 B."""
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.2f} {unit}" if abs(v) < 10 else f"{v:.1f} {unit}" if abs(v) < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def _significant(v: float, digits: int = 4) -> str:
    if v == 0:
        return "0"
    if 1e-4 <= abs(v) < 1e7:
        text = f"{v:.{digits}g}"
        if "e" not in text:
            return text
    return f"{v:.{max(digits - 2, 1)}e}"


def format_value(v, kind: str = "num") -> str:
    """A cell as text. kind: text, int, num (4 significant digits), f1..f6 (fixed decimals),
    pct (a fraction shown in percent), pct_points (already in percent), x (ratio), bytes, mb,
    ms (seconds shown in ms), s (seconds), sci."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, str):
        return v
    if kind == "text":
        return str(v)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "−inf"
    if kind == "int":
        return f"{v:,.0f}"
    if kind.startswith("f") and kind[1:].isdigit():
        return f"{v:,.{int(kind[1:])}f}"
    if kind == "pct":
        return f"{100 * v:.2f} %" if abs(v) >= 5e-5 else "0.00 %"  # never "-0.00 %"
    if kind == "pct_points":
        return f"{v:+.2f} %"
    if kind == "x":
        return f"{v:.2f}×" if abs(v) >= 0.01 or v == 0 else f"{v:.2g}×"  # a slow kernel: never "0.00×"
    if kind == "bytes":
        return format_bytes(v)
    if kind == "mb":
        return f"{v / 1e6:,.1f}"
    if kind == "ms":
        return f"{v * 1e3:,.1f}"
    if kind == "s":
        return f"{v:,.1f}"
    if kind == "sci":
        return f"{v:.2e}"
    return _significant(v)


_TEXT_KINDS = ("text",)
# a text column with a cell longer than this wraps (td.wrap: at least 12em wide), so that wide
# tables (every format's specials, the bits of a value, how the matmuls ran) fit the page
WRAP_CHARS = 24


# ---------------------------------------------------------------------------------------------
# HTML pieces
# ---------------------------------------------------------------------------------------------
def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _table_html(table: dict) -> str:
    cols = table["columns"]
    head = "".join(f'<th class="{"" if c.get("format", "num") in _TEXT_KINDS else "num"}">{_e(c["label"])}</th>'
                   for c in cols)
    texts = [[format_value(row.get(c["key"]), c.get("format", "num")) for c in cols] for row in table["rows"]]
    wrap = [c.get("format", "num") in _TEXT_KINDS and any(len(t[j]) > WRAP_CHARS for t in texts)
            for j, c in enumerate(cols)]
    body = []
    for row, row_texts in zip(table["rows"], texts):
        cells = []
        for j, c in enumerate(cols):
            cls = ' class="wrap"' if wrap[j] else "" if c.get("format", "num") in _TEXT_KINDS else ' class="num"'
            cells.append(f"<td{cls}>{_e(row_texts[j])}</td>")
        flag = ' class="flag"' if row.get("_flag") else ""
        body.append(f"<tr{flag}>{''.join(cells)}</tr>")
    out = []
    if table.get("title"):
        out.append(f"<h3>{_e(table['title'])}</h3>")
    out.append(f'<div class="table-wrap"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
               "</tbody></table></div>")
    if table.get("note"):
        out.append(f'<p class="tnote">{_e(table["note"])}</p>')
    return "\n".join(out)


def _figure_html(fig: dict) -> str:
    src = _e(fig["file"])
    title = _e(fig.get("title", ""))
    caption = f"<b>{title}.</b> {_e(fig['caption'])}" if fig.get("caption") else f"<b>{title}</b>"
    return (f'<figure><a href="{src}"><img src="{src}" alt="{title}" loading="eager"></a>'
            f"<figcaption>{caption}</figcaption></figure>")


def _part_html(i: int, part: dict) -> str:
    status = part["status"]
    out = [f'<section id="{_e(part["name"])}">',
           f'<h2>{i}. {_e(part["title"])}<span class="badge {_e(status)}">{_e(status)}</span></h2>',
           f'<p class="meta">{part.get("seconds", 0):.1f} s</p>']
    if part.get("how_to_read"):
        out.append(f'<div class="read"><b>How to read this.</b> {_e(part["how_to_read"])}</div>')
    if status == "failed":
        tb = f"<details><summary>traceback</summary><pre>{_e(part['traceback'])}</pre></details>" \
            if part.get("traceback") else ""
        out.append(f'<div class="error"><b>This part failed:</b> {_e(part.get("error") or "unknown error")}'
                   f"{tb}</div>")
    for note in part.get("notes", []):
        out.append(f'<div class="note">{_e(note)}</div>')
    for w in part.get("warnings", []):
        out.append(f'<div class="error">{_e(w)}</div>')
    # figures and tables in the order the part gave them
    for item in part.get("items", []):
        kind, index = item
        if kind == "figure":
            out.append(_figure_html(part["figures"][index]))
        else:
            out.append(_table_html(part["tables"][index]))
    out.append("</section>")
    return "\n".join(out)


def _items(part: dict) -> list[tuple[str, int]]:
    """The display order: part['order'] if given (a list of ('figure'|'table', index)), else the
    figures then the tables."""
    if part.get("order"):
        return [tuple(x) for x in part["order"]]
    return [("figure", i) for i in range(len(part.get("figures", [])))] + \
        [("table", i) for i in range(len(part.get("tables", [])))]


def render_html(study: dict) -> str:
    parts = study["parts"]
    machine = study.get("machine", {})
    opts = study.get("options", {})
    mode = "quick" if opts.get("quick") else "full"
    head = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(study.get('title', 'fewbits study'))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<header>",
        f"<h1>{_e(study.get('title', 'fewbits study'))}</h1>",
        f"<p>What each number format holds, costs and does to real models, measured on this machine "
        f"({_e(machine.get('name', 'unknown CPU'))}, {_e(machine.get('threads', '?'))} threads, "
        f"torch {_e(machine.get('torch', '?'))}).</p>",
        f"<p>{_e(mode)} run · {_e(study.get('created', ''))} · {study.get('seconds', 0):.0f} s · "
        f"fewbits {_e(study.get('fewbits_version', ''))} · <code>{_e(study.get('command', 'fewbits study'))}</code>"
        "</p>",
        "</header><main>",
    ]
    nav = ['<nav><b>Contents</b><ol>']
    for p in parts:
        nav.append(f'<li><a href="#{_e(p["name"])}">{_e(p["title"])}</a>'
                   f'<span class="badge {_e(p["status"])}">{_e(p["status"])}</span>'
                   f'<span class="meta"> {p.get("seconds", 0):.0f} s</span></li>')
    nav.append("</ol>")
    highlights = [h for p in parts for h in p.get("highlights", [])]
    if highlights:
        nav.append("<b>At a glance</b><ul class='highlights'>" +
                   "".join(f"<li>{_e(h)}</li>" for h in highlights) + "</ul>")
    nav.append("</nav>")
    if study.get("intro"):
        nav.append(f'<div class="read">{_e(study["intro"])}</div>')
    body = []
    for i, p in enumerate(parts, 1):
        p = dict(p, items=_items(p))
        body.append(_part_html(i, p))
    foot = [f"<footer><p>{_e(RESULTS_FILE)} next to this page holds every number shown here, raw "
            "(bytes in bytes, fractions as fractions, seconds in seconds), with the run's options and "
            f"machine. Re-run: <code>{_e(study.get('command', 'fewbits study'))}</code>.</p></footer>",
            "</main></body></html>"]
    return "\n".join(head + nav + body + foot) + "\n"


def results_json(study: dict) -> dict:
    """What goes into results.json: the study without display-only fields."""
    def strip(part):
        return {k: v for k, v in part.items() if k not in ("order",)}
    d = dict(study)
    d["parts"] = {p["name"]: strip(p) for p in study["parts"]}
    return jsonable(d)


def _atomic_write(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_report(study: dict, out_dir) -> Path:
    """Write out_dir/report.html and out_dir/results.json (the figures are already there).
    Every figure a part lists must exist in out_dir: a missing file is a bug, not a broken image."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for p in study["parts"]:
        for fig in p.get("figures", []):
            if not (out / fig["file"]).is_file():
                raise FileNotFoundError(f"part {p['name']}: figure {fig['file']} is not in {out}")
    _atomic_write(out / RESULTS_FILE, json.dumps(results_json(study), indent=1, allow_nan=False,
                                                 ensure_ascii=False) + "\n")
    path = out / REPORT_FILE
    _atomic_write(path, render_html(study))
    return path
