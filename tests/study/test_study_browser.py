"""The report in a real headless browser (Debian's chromium): it loads with no console errors,
every image renders, and a screenshot is taken.

The default run loads a `fewbits study --quick --only formats` report (seconds). The slow test
runs the whole quick study (a few minutes); with FEWBITS_UPDATE_DOCS=1 it also refreshes
docs/report.png, the README's picture of the report (tests write nothing into the repo otherwise).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from study_browser import Browser, chromium_path

from fewbits.cli import main
from fewbits.study import run as study_run

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(chromium_path() is None,
                                reason="chromium is not installed (apt-get install -y chromium; .ci/run does it)")


def _check_page(report: Path, shot: Path):
    with Browser() as browser:
        page = browser.load(report.resolve().as_uri(), screenshot=shot)
    assert page.errors == [], page.errors
    assert page.cut_tables == [], page.cut_tables  # every table fits the page (specials, codes were cut off)
    assert page.images, "the report has no images"
    assert page.broken_images == [], page.broken_images
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    return page


def test_quick_formats_report_in_chromium(tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["study", "--quick", "--only", "formats", "--out", str(out), "--quiet"])
    capsys.readouterr()
    assert code == 0
    page = _check_page(out / "report.html", tmp_path / "report.png")
    assert page.title == "fewbits study (quick)"
    figures = json.loads((out / "results.json").read_text())["parts"]["formats"]["figures"]
    assert sorted(Path(i["src"]).name for i in page.images) == sorted(f["file"] for f in figures)


def test_failed_part_renders_in_chromium(tmp_path, monkeypatch):
    def broken(ctx):
        raise ImportError("loading a Hugging Face model needs transformers: pip install transformers")

    monkeypatch.setitem(study_run.PART_FUNCTIONS, "quant", broken)
    study_run.run_study(tmp_path / "report", quick=True, parts=["formats", "quant"],
                        progress=study_run.Progress(enabled=False))
    _check_page(tmp_path / "report" / "report.html", tmp_path / "failed.png")
    assert "pip install transformers" in (tmp_path / "report" / "report.html").read_text()


@pytest.mark.slow
def test_whole_quick_study_in_chromium(tmp_path, capsys, monkeypatch):
    """Every part on the real models (minutes); FEWBITS_UPDATE_DOCS=1 refreshes docs/report.png."""
    monkeypatch.chdir(tmp_path)  # the page shows the command: `--out fewbits-report`, not a tmp path
    out = tmp_path / "fewbits-report"
    code = main(["study", "--quick", "--out", "fewbits-report"])
    capsys.readouterr()
    data = json.loads((out / "results.json").read_text())
    assert code == 0, {k: v.get("error") for k, v in data["parts"].items()}
    assert [p for p in data["parts"]] == list(study_run.PARTS)
    page = _check_page(out / "report.html", tmp_path / "report.png")
    assert len(page.images) == sum(len(p["figures"]) for p in data["parts"].values())
    if os.environ.get("FEWBITS_UPDATE_DOCS") == "1":
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copyfile(tmp_path / "report.png", REPO / "docs" / "report.png")
