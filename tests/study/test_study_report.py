"""The report writer: formatting, escaping, files written, every shown number in results.json."""
from __future__ import annotations

import html
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


# the page's content box: main's max-width 1180 px less 2 x 32 px of padding
CONTENT_PX = 1180 - 2 * 32
CHAR_PX, CELL_PAD_PX, WRAP_MIN_PX = 7.5, 16, 12 * 13  # 13 px text; a wrapping cell is at least 12em


def _table_min_width(table_html: str) -> float:
    """The narrowest this table can be laid out (an estimate: 7.5 px a character, which errs wide for
    13 px text): a cell that cannot wrap needs its whole text; a wrapping cell (class "wrap") its
    12em; a header wraps at its spaces."""
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table_html)
    widths: dict[int, float] = {}
    for row in rows:
        for j, (tag, attrs, text) in enumerate(re.findall(r"<(t[hd])([^>]*)>(.*?)</t[hd]>", row)):
            text = html.unescape(text)
            if tag == "th":
                need = max(len(w) for w in text.split() or [""]) * CHAR_PX
            elif "wrap" in attrs:
                need = WRAP_MIN_PX
            else:
                need = len(text) * CHAR_PX
            widths[j] = max(widths.get(j, 0), need + CELL_PAD_PX)
    return sum(widths.values())


def test_wide_tables_fit_the_page(tmp_path):
    """Every format (specials), a value in every format (its bits and code) and the training policies
    (matmuls ran as) were wider than the page and cut off: their long text cells wrap now, so each
    fits; any table still wider than the page scrolls inside its own overflow-x:auto box."""
    from fewbits.study import run as study_run

    ctx = study_run.StudyContext(out=tmp_path, quick=True, model=None, say=lambda m: None)
    formats = study_run.part_formats(ctx).as_dict()
    gemm = ("linear layers: fp8 row-wise GEMMs, emulated (FP8 GEMMs need FP8 tensor cores (CUDA compute capability "
            "8.9+); this CPU's torch._scaled_mm is a slow reference); other matmuls: bfloat16")
    policies = {"title": "Policies", "note": "", "rows": [
        {"policy": "fp8-rowwise", "final_loss": 0.1234, "loss_change": -0.0123, "step_time_s": 0.0123,
         "state_bytes": 1_530_000, "peak_memory_bytes": 4_190_000, "skipped_steps": 0, "underflow_fraction": 0.0123,
         "lost_update_fraction": 0.456, "saturated_fraction": 0.0, "final_loss_scale": 65536.0, "gemm_path": gemm}],
        "columns": [{"key": k, "label": lab, "format": f} for k, lab, f in (
            ("policy", "policy", "text"), ("final_loss", "final loss", "f4"), ("loss_change", "vs first", "pct"),
            ("step_time_s", "step ms", "ms"), ("state_bytes", "state", "bytes"),
            ("peak_memory_bytes", "peak growth", "bytes"), ("skipped_steps", "skipped", "int"),
            ("underflow_fraction", "underflow", "pct"), ("lost_update_fraction", "lost updates", "pct"),
            ("saturated_fraction", "saturated", "pct"), ("final_loss_scale", "final loss scale", "num"),
            ("gemm_path", "matmuls ran as", "text"))]}
    train = _part("train", tables=[policies])
    page = write_report(_study([dict(_part(), **formats), train]), tmp_path).read_text()
    tables = re.findall(r'<div class="table-wrap">(<table>.*?</table>)</div>', page, re.S)
    assert len(tables) == page.count("<table") == 3
    widths = {title: _table_min_width(t) for title, t in zip(("Every format", "0.3952", "Policies"), tables)}
    assert all(w <= CONTENT_PX for w in widths.values()), widths
    # the long cells are the ones that wrap; numbers never do
    assert "NaN (no subnormals, no zero, unsigned)</td>" in page
    for long_text in ("NaN (no subnormals, no zero, unsigned)", gemm.replace("'", "&#x27;")):
        assert f'<td class="wrap">{long_text}</td>' in page
    css = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    assert re.search(r"td\.wrap \{[^}]*white-space:normal", css)
    assert re.search(r"\.table-wrap \{[^}]*overflow-x:auto", css)
