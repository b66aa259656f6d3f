"""The report writer: formatting, escaping, files written, every shown number in results.json."""
from __future__ import annotations

import json
import math
import re

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fewbits.study.report import format_bytes, format_value, render_html, write_report


def _png(path):
    fig = Figure(figsize=(2, 1), dpi=50)
    FigureCanvasAgg(fig)
    fig.add_subplot(1, 1, 1).plot([0, 1], [1, 0])
    fig.savefig(path)


def _study(parts):
    return {"title": "fewbits study", "fewbits_version": "0", "created": "now", "command": "fewbits study",
            "options": {"quick": True}, "machine": {"name": "cpu", "threads": 2, "torch": "x"}, "seconds": 1.0,
            "parts": parts}


def _part(name="formats", **kw):
    p = {"name": name, "title": f"{name} title", "how_to_read": "read me", "status": "ok", "seconds": 0.5,
         "figures": [], "tables": [], "numbers": {}, "notes": [], "warnings": [], "highlights": [], "order": []}
    p.update(kw)
    return p


@pytest.mark.parametrize("value, kind, text", [
    (None, "num", "—"), (True, "num", "yes"), ("inf", "num", "inf"), (float("nan"), "f3", "nan"),
    (float("-inf"), "num", "−inf"), (1234567, "int", "1,234,567"), (0.123456, "f3", "0.123"),
    (0.0123, "pct", "1.23 %"), (1.846, "x", "1.85×"), (0.00053, "x", "0.00053×"), (4e9, "bytes", "4.00 GB"), (105_300_000, "bytes", "105 MB"),
    (0.0123, "ms", "12.3"), (448.0, "num", "448"), (1.7976931348623157e308, "num", "1.80e+308"),
    (2 ** -24, "num", "5.96e-08"), (0.0009765625, "num", "0.0009766"), ("e4m3", "text", "e4m3"),
])
def test_format_value(value, kind, text):
    assert format_value(value, kind) == text


def test_format_bytes_units():
    assert [format_bytes(v) for v in (512, 12_300, 45_400_000, 2e9, 3.5e12)] == \
        ["512 B", "12.3 kB", "45.4 MB", "2.00 GB", "3.50 TB"]


def test_report_files_and_numbers(tmp_path):
    _png(tmp_path / "a.png")
    rows = [{"format": "fp8_e4m3", "max": 448.0, "eps": 0.125, "weights": 1_000_000_000, "ratio": 1.8512},
            {"format": "<b>x</b>", "max": math.inf, "eps": None, "weights": 500_000_000, "ratio": None}]
    part = _part(figures=[{"file": "a.png", "title": "A & B", "caption": "caption <i>"}],
                 tables=[{"title": "T", "columns": [
                     {"key": k, "label": k, "format": f} for k, f in
                     (("format", "text"), ("max", "num"), ("eps", "num"), ("weights", "bytes"), ("ratio", "x"))],
                     "rows": rows, "note": "n"}],
                 numbers={"extra": [1.5, float("nan")]}, notes=["a note"], highlights=["found 1.85×"],
                 order=[["table", 0], ["figure", 0]])
    path = write_report(_study([part]), tmp_path)
    assert path == tmp_path / "report.html"
    page = path.read_text()
    # escaped, never interpreted
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page and "caption &lt;i&gt;" in page
    # shown as formatted; order respected (the table before the figure)
    assert "448" in page and "1.00 GB" in page and "500 MB" in page and "1.85×" in page and "inf" in page
    assert page.index("<table") < page.index('<img src="a.png"')
    assert "found 1.85×" in page and "read me" in page and "a note" in page
    # nothing outside the directory: no scripts, no remote resources
    assert "<script" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    data = json.loads((tmp_path / "results.json").read_text())
    shown = data["parts"]["formats"]["tables"][0]["rows"]
    assert shown[0]["max"] == 448.0 and shown[0]["weights"] == 1_000_000_000 and shown[0]["ratio"] == 1.8512
    assert shown[1]["max"] == "inf"  # non-finite numbers as strings: strict JSON
    assert data["parts"]["formats"]["numbers"]["extra"] == [1.5, "nan"]
    assert "order" not in data["parts"]["formats"]
    assert (tmp_path / "report.html").stat().st_mode & 0o044  # readable by others: a report is shared


def test_failed_part_shows_error(tmp_path):
    part = _part("quant", status="failed", error="ImportError: no module named transformers",
                 traceback="Traceback...\nImportError: no module named transformers")
    page = write_report(_study([_part(), part]), tmp_path).read_text()
    assert page.count('class="badge failed"') == 2  # contents and section
    assert "This part failed" in page and "no module named transformers" in page


def test_missing_figure_is_an_error(tmp_path):
    part = _part(figures=[{"file": "missing.png", "title": "t", "caption": ""}])
    with pytest.raises(FileNotFoundError, match="missing.png"):
        write_report(_study([part]), tmp_path)
    assert not (tmp_path / "report.html").exists()


def test_render_without_order_lists_figures_then_tables():
    part = _part(figures=[{"file": "f.png", "title": "F", "caption": ""}],
                 tables=[{"title": "T", "columns": [{"key": "a", "label": "a", "format": "int"}], "rows": [{"a": 3}],
                          "note": ""}])
    page = render_html(_study([part]))
    assert page.index('src="f.png"') < page.index("<table")
