"""The study's orchestration: part selection, failures kept inside their part, the CLI, and the
formats part for real (the other parts run minutes on real models: see test_browser.py's slow test)."""
from __future__ import annotations

import io
import json

import pytest

from fewbits.cli import main
from fewbits.study import run as study_run
from fewbits.study.run import PARTS, PartOutput, Progress, parse_parts, run_study


def _png(path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1), dpi=50)
    FigureCanvasAgg(fig)
    fig.savefig(path)


def _ok_part(ctx):
    out = PartOutput()
    _png(ctx.out / "ok.png")
    out.figure("ok.png", "ok figure", "made by a fake part")
    out.table("ok table", [("k", "key", "text"), ("v", "value", "f2")], [{"k": "a", "v": 1.2345}])
    out.numbers["answer"] = 42
    out.highlights.append("the fake part ran")
    return out


def _failing_part(ctx):
    raise RuntimeError("boom in the middle")


def _missing_dependency_part(ctx):
    raise ImportError("loading a Hugging Face model needs transformers: pip install transformers")


@pytest.fixture
def fake_parts(monkeypatch):
    monkeypatch.setitem(study_run.PART_FUNCTIONS, "formats", _ok_part)
    monkeypatch.setitem(study_run.PART_FUNCTIONS, "memory", _failing_part)
    monkeypatch.setitem(study_run.PART_FUNCTIONS, "speed", _missing_dependency_part)
    monkeypatch.setitem(study_run.PART_FUNCTIONS, "quant", _ok_part)
    monkeypatch.setitem(study_run.PART_FUNCTIONS, "train", _ok_part)


def test_parse_parts():
    assert parse_parts(None) == PARTS
    assert parse_parts("quant, formats") == ("formats", "quant")  # the study's order, not the user's
    assert parse_parts(["TRAIN"]) == ("train",)
    with pytest.raises(ValueError, match="unknown part.*'fromats'"):
        parse_parts("fromats,quant")
    with pytest.raises(ValueError, match="at least one part"):
        parse_parts(" , ")


def test_a_failing_part_does_not_stop_the_others(tmp_path, fake_parts):
    log = io.StringIO()
    study = run_study(tmp_path, quick=True, progress=Progress(log))
    status = {p["name"]: p["status"] for p in study["parts"]}
    assert status == {"formats": "ok", "memory": "failed", "speed": "failed", "quant": "ok", "train": "ok"}
    memory = next(p for p in study["parts"] if p["name"] == "memory")
    assert memory["error"] == "RuntimeError: boom in the middle" and "_failing_part" in memory["traceback"]
    speed = next(p for p in study["parts"] if p["name"] == "speed")
    assert "pip install transformers" in speed["error"] and "optional package is missing" in speed["error"]
    page = (tmp_path / "report.html").read_text()
    assert "boom in the middle" in page and "pip install transformers" in page and "the fake part ran" in page
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["parts"]["train"]["numbers"] == {"answer": 42}
    assert data["parts"]["memory"]["status"] == "failed"
    assert data["options"] == {"quick": True, "parts": list(PARTS), "model": None, "out": str(tmp_path)}
    # progress was shown throughout: every part started and ended
    text = log.getvalue()
    for name in PARTS:
        assert f": {name}" in text
    assert "FAILED" in text and "wrote" in text


def test_only_runs_the_selected_parts(tmp_path, fake_parts):
    study = run_study(tmp_path, parts=["train"], progress=Progress(enabled=False))
    assert [p["name"] for p in study["parts"]] == ["train"]
    assert study["command"].startswith("fewbits study --only train")


def test_cli_summary_and_exit_codes(tmp_path, fake_parts, capsys):
    code = main(["study", "--only", "formats,quant", "--out", str(tmp_path / "r"), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert "formats" in out and "quant" in out and "report.html" in out
    code = main(["study", "--only", "memory,train", "--out", str(tmp_path / "j"), "--json", "--quiet"])
    out, _ = capsys.readouterr()
    assert code == 1  # a part failed; the report was still written
    summary = json.loads(out)
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [("memory", "failed"), ("train", "ok")]
    assert summary["parts"][1]["figures"] == ["ok.png"]
    assert (tmp_path / "j" / "report.html").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--only", "formats,nope"], "unknown part(s) 'nope'"),
    (["--model", "/no/such/model"], "not a Hugging Face model directory"),
])
def test_cli_bad_input(tmp_path, capsys, argv, message):
    code = main(["study", "--out", str(tmp_path / "x"), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("fewbits study: error:") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()  # nothing ran


def test_formats_part_for_real(tmp_path):
    ctx = study_run.StudyContext(out=tmp_path, quick=True, model=None, say=lambda m: None)
    out = study_run.part_formats(ctx)
    files = [f["file"] for f in out.figures]
    assert files == ["formats.png", "explain_0_3952.png", "explain_pi.png"]
    for f in files:
        assert (tmp_path / f).stat().st_size > 10_000
    table = {r["format"]: r for r in out.tables[0]["rows"]}
    assert table["fp8_e4m3"]["max"] == 448 and table["fp8_e5m2"]["max"] == 57344 and table["fp16"]["bits"] == 16
    explain_rows = {r["format"]: r for r in out.numbers["explain_0_3952"]}
    assert explain_rows["fp8_e4m3"]["value"] == 0.40625 and explain_rows["bf16"]["value"] == 0.39453125
    assert explain_rows["int8"]["value"] == 0 and "uint3" not in explain_rows
    assert any("0.40625" in h for h in out.highlights)


def _tiny_bert_dir(path):
    """A small random BERT saved as a Hugging Face model directory, with MiniLM's tokenizer."""
    transformers = pytest.importorskip("transformers")
    import shutil

    import torch

    from fewbits.models import minilm_path

    try:
        tokenizer_dir = minilm_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"MiniLM's tokenizer is not installed: {exc}")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, path / name)
    return path


@pytest.mark.slow
def test_model_path_runs_memory_and_quant_on_it(tmp_path, capsys):
    """--model PATH: the memory and quantization parts on the user's own model (about 10 s)."""
    model_dir = _tiny_bert_dir(tmp_path / "tiny-bert")
    out = tmp_path / "report"
    code = main(["study", "--quick", "--only", "memory,quant", "--model", str(model_dir), "--out", str(out),
                 "--quiet"])
    capsys.readouterr()
    data = json.loads((out / "results.json").read_text())
    assert code == 0, {k: p.get("error") for k, p in data["parts"].items()}
    assert data["options"]["model"] == str(model_dir)
    memory, quant = data["parts"]["memory"], data["parts"]["quant"]
    assert memory["numbers"]["tiny_bert"]["model"] == "tiny-bert"
    fp32 = memory["numbers"]["tiny_bert"]["inference"][0]
    assert fp32["precision"] == "fp32" and fp32["measured"] > 0 and abs(fp32["error"]) < 0.25
    schemes = quant["numbers"]["tiny_bert"]["schemes"]
    assert [r["scheme_name"] for r in schemes] == [None, *study_run.QUANT_SCHEMES_QUICK]
    assert quant["numbers"]["tiny_bert"]["quality_metric"] == "cosine"
    assert not any("Q4_1" in n for n in quant["notes"])  # the SmolLM2 caveat belongs to SmolLM2 only
    assert sorted(p.name for p in out.glob("*.png")) == ["memory_tiny_bert.png", "quant_tiny_bert.png"]


def test_lm_step_speed_table_names_the_path_each_policy_took(tmp_path, monkeypatch):
    """The training part's LM speed table: one row per policy, its GEMM path in words (int8-mixed
    native here or through torch._int_mm; fp8-hybrid emulated on a CPU), speeds against bf16-mixed."""
    from fewbits.study.tasks import TaskConfig

    small = TaskConfig("lm", d_model=64, n_layers=1, n_heads=2, seq=32, batch_size=2)
    monkeypatch.setattr("fewbits.study.tasks.TaskConfig", lambda *a, **k: small)
    monkeypatch.setattr(study_run, "LM_SPEED_ROUNDS", 1)
    ctx = study_run.StudyContext(out=tmp_path, quick=False, model=None, say=lambda *_: None)
    out = PartOutput()
    study_run._lm_speed_table(ctx, out)
    assert not out.warnings, out.warnings
    rows = {r["policy"]: r for r in out.numbers["lm_speed"]}
    assert set(rows) == set(study_run.LM_SPEED_POLICIES)
    assert rows["bf16-mixed"]["speed_vs_bf16"] == 1.0
    assert "bfloat16 GEMMs (native dtype)" in rows["bf16-mixed"]["gemm_path"]
    assert "int8 row-wise GEMMs, native" in rows["int8-mixed"]["gemm_path"]
    assert "emulated" in rows["fp8-hybrid"]["gemm_path"]
    assert all(r["step_time_s"] > 0 for r in rows.values())


def _speed_part(tmp_path, monkeypatch, slow_dtype=None):
    """The speed part for real, on small probes and without the layer table (fast)."""
    import functools

    from fewbits import hardware as hw

    flags = hw.native.cpu_flags() - hw.FP8_CPU_FLAGS  # this machine as one without fp8 units
    monkeypatch.setattr(hw.native, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hw, "run_bench", functools.partial(hw.run_bench, shapes=("2x256x256",), budget_s=0.02,
                                                           buffer_mb=16))
    if slow_dtype:  # a kernel as slow as torch's software fp8 on one Xeon: 0.04 GFLOP/s
        real = hw.measure_matmul

        def measure(dtype, **kw):
            m = real(dtype, **kw)
            if dtype == slow_dtype:
                m.gflops = 0.04
            return m
        monkeypatch.setattr(hw, "measure_matmul", measure)
    monkeypatch.setattr(study_run, "layer_speed_part", lambda ctx: {
        "stack": "Linear 8 x 8", "threads": 1, "batches": {}, "not_run": []})
    ctx = study_run.StudyContext(out=tmp_path, quick=True, model=None, say=lambda m: None)
    out = study_run.part_speed(ctx)
    study = {"title": "t", "options": {"quick": True}, "machine": {}, "seconds": 1.0,
             "parts": [dict(out.as_dict(), name="speed", title="speed", how_to_read="", status="ok")]}
    from fewbits.study.report import render_html
    return out, render_html(study)


def _html_row(page, first_cell):
    import re
    rows = re.findall(r"<tr>(.*?)</tr>", page)
    return [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows if r.startswith(f"<td>{first_cell}</td>")]


def test_speed_part_shows_an_unmeasured_fp8_as_not_measured(tmp_path, monkeypatch):
    """No fake 0.0 for fp8 on a CPU without fp8 units: the matmul table says "not measured" and why,
    JSON holds None, and the roofline table has no fp8 row (no "ridge 0.0")."""
    out, page = _speed_part(tmp_path, monkeypatch)
    fp8 = {m["dtype"]: m for m in out.numbers["matmul"]}["fp8"]
    assert not fp8["available"] and fp8["gflops"] is None and fp8["note"].startswith("not measured")
    (row,) = _html_row(page, "fp8")
    assert row[3] == "—" and row[5].startswith("not measured") and "0.0" not in row
    assert all(r["dtype"] != "fp8" for r in out.numbers["roofline"])


def test_speed_part_shows_a_slow_kernel_with_its_digits(tmp_path, monkeypatch):
    """A real but slow measurement (0.04 GFLOP/s) is shown as such, not rounded to "0.0" (GFLOP/s,
    ridge) or "0.00×"."""
    out, page = _speed_part(tmp_path, monkeypatch, slow_dtype="bf16")
    matmul_row = [r for r in _html_row(page, "bf16") if r[1] == "torch.mm"]
    assert matmul_row and matmul_row[0][3] == "0.04" and matmul_row[0][4] != "0.00×", matmul_row
    (roof_row,) = [r for r in _html_row(page, "2x256x256") if r[1] == "bf16"]
    assert roof_row[3] not in ("0.0", "0") and float(roof_row[3]) > 0, roof_row


def test_quick_train_part_names_only_the_policies_it_ran(tmp_path, monkeypatch):
    """The quick run's training part (fewer steps here): no note, caption or highlight names a policy
    or a format the run did not include (the table's note named bf16-pure-sr, bf16-pure-kahan, fp8 and MX)."""
    import re

    monkeypatch.setattr(study_run, "TRAIN_STEPS_QUICK", 3)
    ctx = study_run.StudyContext(out=tmp_path, quick=True, model=None, say=lambda m: None)
    out = study_run.part_train(ctx)
    ran = [r["policy"] for r in out.numbers["runs"]]
    assert ran == list(study_run.TRAIN_POLICIES_QUICK)
    text = " ".join([*out.notes, *out.highlights, *(t["note"] for t in out.tables), *(t["title"] for t in out.tables),
                     *(f["caption"] for f in out.figures), *(f["title"] for f in out.figures)])
    words = set(re.findall(r"[\w.-]+", text))
    missing = [p for p in study_run.TRAIN_POLICIES if p not in ran]
    assert missing and not words & set(missing), words & set(missing)
    assert "fp8" not in text and "MX" not in text
    note = out.tables[-1]["note"]
    assert "fp16-mixed, fp16-mixed-unscaled" in note and "bf16-pure" in note  # what did run is explained


def test_memory_part_progress_has_no_profiler_lines(tmp_path, capfd):
    """The memory part measures through torch's profiler, whose kineto printed a 'USDT: ...
    profiler_start' / 'profiler_stop' pair per measurement into the study's progress output."""
    model_dir = _tiny_bert_dir(tmp_path / "tiny-bert")
    capfd.readouterr()
    code = main(["study", "--quick", "--only", "memory", "--model", str(model_dir), "--out", str(tmp_path / "r")])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "measuring" in err and "USDT" not in err and "profiler_st" not in err, err
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    assert data["parts"]["memory"]["numbers"]["tiny_bert"]["inference"][0]["measured"] > 0
