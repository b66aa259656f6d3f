"""`fewbits quantize`: the preset list, bad input, and a real run on MiniLM (slow)."""
from __future__ import annotations

import io
import json

import pytest

from fewbits.cli import main


def run(argv):
    import contextlib
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_list_presets_json():
    rc, out, _ = run(["quantize", "--list", "--json"])
    assert rc == 0
    rows = {r["scheme"]: r for r in json.loads(out)}
    assert rows["nf4_dq"]["bits_per_value"] == pytest.approx(4.127, abs=5e-4)
    assert rows["nvfp4"]["bits_per_value"] == 4.5


@pytest.mark.parametrize("argv, msg", [
    (["quantize", "--scheme", "nf5"], "unknown quantization scheme"),
    (["quantize", "--model", "/nonexistent/dir", "--scheme", "nf4", "--quiet"], "unknown model"),
    (["quantize", "--budget", "0.5", "--quiet"], "--budget"),
    (["quantize"], "give --scheme"),
])
def test_bad_input_exits_2_with_a_message(argv, msg):
    rc, _, err = run(argv)
    assert rc == 2 and msg in err


@pytest.mark.slow
def test_real_minilm_run_json(tmp_path):
    pytest.importorskip("transformers")
    rc, out, _ = run(["quantize", "--model", "minilm", "--compare", "int8,nf4", "--quick", "--quiet",
                      "--json", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads(out)
    rows = {r["scheme"]: r for r in res["schemes"]}
    for r in rows.values():
        for key in ("scheme", "bits_per_param", "model_bytes", "quality", "quality_metric", "throughput"):
            assert key in r
    assert rows["fp32"]["quality"] == pytest.approx(1.0)
    assert rows["int8"]["quality"] > 0.99 > rows["nf4"]["quality"] > 0.9
    assert (tmp_path / "results.json").is_file() and (tmp_path / "quality_vs_bits.png").is_file()
