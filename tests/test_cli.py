"""The `fewbits` command: formats, explain, --json, --plot, errors."""
import json
import subprocess
import sys

import pytest

import fewbits as fb
from fewbits.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def strict_json(text):
    def reject(const):
        raise ValueError(f"non-standard JSON constant {const}")

    return json.loads(text, parse_constant=reject)


def row(out, name):
    """The table line whose first cell is `name`."""
    lines = [ln for ln in out.splitlines() if ln.split() and ln.split()[0] == name]
    assert len(lines) == 1, (name, lines)
    return lines[0].split()


def test_formats_table(capsys):
    code, out, err = run(capsys, "formats")
    assert code == 0 and err == ""
    for fmt in fb.list_formats():
        assert row(out, fmt.name)
    e4m3 = row(out, "fp8_e4m3")
    assert e4m3[:4] == ["fp8_e4m3", "8", "1-4-3", "448"] and "1.00" in e4m3 and "GB" in e4m3
    assert row(out, "fp8_e5m2")[3] == "57344"
    assert row(out, "fp8_e4m3_ieee")[3] == "240"
    assert row(out, "fp32")[3] == "3.4e+38"
    assert row(out, "fp8_e5m2")[5] == "1.5e-05"
    assert "750" in row(out, "fp6_e3m2") and "500" in row(out, "fp4_e2m1")
    assert row(out, "int4")[2] == "int" and row(out, "nf4")[2] == "codebook"


def test_formats_json(capsys):
    code, out, _ = run(capsys, "formats", "--json")
    assert code == 0
    data = strict_json(out)
    assert [d["name"] for d in data] == [f.name for f in fb.list_formats()]
    e4m3 = next(d for d in data if d["name"] == "fp8_e4m3")
    assert e4m3["max"] == 448 and e4m3["layout"] == "1-4-3" and e4m3["min_subnormal"] == 2 ** -9
    assert e4m3["bytes_per_billion"] == 1e9 and e4m3["specials_description"] == "NaN"


def test_one_format_lists_every_code(capsys):
    code, out, _ = run(capsys, "formats", "e4m3")
    assert code == 0
    assert "OCP FP8 E4M3" in out and "bias 7" in out and "0.001953125" in out
    codes = [ln.split() for ln in out.splitlines() if ln.startswith("0x")]
    assert len(codes) == 256
    assert codes[0x7F][:4] == ["0x7f", "0|1111|111", "nan", "nan"]
    assert codes[0x7E][:3] == ["0x7e", "0|1111|110", "448"]
    assert codes[0x01][-1] == "subnormal" and codes[0x01][2] == "0.001953125"

    code, out, _ = run(capsys, "formats", "float8_e4m3fn", "--json")
    data = strict_json(out)
    assert data["name"] == "fp8_e4m3" and len(data["codes"]) == 256
    assert data["codes"][0x7F]["kind"] == "nan" and data["codes"][0x7F]["value"] == "nan"


def test_wide_format_shows_binades(capsys):
    code, out, _ = run(capsys, "formats", "fp16")
    assert code == 0 and "31 binades" in out and "65504" in out
    data = strict_json(run(capsys, "formats", "bf16", "--json")[1])
    assert "codes" not in data and len(data["binades"]) == 255


def test_explain(capsys):
    code, out, err = run(capsys, "explain", "0.3952")
    assert code == 0 and err == ""
    e4m3 = row(out, "fp8_e4m3")
    assert e4m3[1] == "0.40625" and e4m3[-1] == "0|0101|101" and "rounded" in e4m3
    bf16 = row(out, "bf16")
    assert bf16[1] == "0.39453125" and bf16[-1] == "0|01111101|1001010"
    assert row(out, "int8")[1] == "0" and "underflow→0" in row(out, "int8")
    assert row(out, "fp64")[1] == "0.3952" and "exact" in row(out, "fp64")
    for fmt in fb.list_formats():
        assert row(out, fmt.name)


def test_explain_negative_modes_and_formats(capsys):
    code, out, _ = run(capsys, "explain", "-0.3952", "--formats", "e4m3,bf16", "--mode", "toward_zero",
                       "--mode", "up")
    assert code == 0
    lines = [ln.split() for ln in out.splitlines() if ln.startswith(("fp8_e4m3 ", "bf16 "))]
    assert [ln[:3] for ln in lines] == [["fp8_e4m3", "toward_zero", "-0.375"], ["fp8_e4m3", "up", "-0.375"],
                                        ["bf16", "toward_zero", "-0.39453125"], ["bf16", "up", "-0.39453125"]]
    data = strict_json(run(capsys, "explain", "-1e-3", "--formats", "fp4", "--all-modes", "--json")[1])
    assert [d["mode"] for d in data] == list(fb.MODES)
    assert all(d["x"] == -1e-3 for d in data)


def test_explain_json(capsys):
    code, out, _ = run(capsys, "explain", "1e6", "--json", "--formats", "e5m2,e4m3")
    assert code == 0
    data = strict_json(out)
    assert data[0]["value"] == "inf" and data[0]["status"] == "overflow→inf"
    assert data[1]["value"] == 448 and data[1]["bits"] == "0|1111|110"
    for key in ("value", "code", "bits", "abs_error", "rel_error", "status", "format", "mode"):
        assert key in data[1]


@pytest.mark.parametrize("argv", [
    ["formats", "--plot", "{dir}/formats.png"],
    ["formats", "e4m3", "--plot", "{dir}/e4m3.png"],
    ["explain", "0.3952", "--plot", "{dir}/explain.png"],
])
def test_plot_writes_png(capsys, tmp_path, argv):
    argv = [a.format(dir=tmp_path) for a in argv]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    png = tmp_path / argv[-1].rsplit("/", 1)[-1]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert f"wrote {png}" in out


def test_plot_with_json_keeps_stdout_json(capsys, tmp_path):
    code, out, err = run(capsys, "explain", "2", "--formats", "e4m3", "--json", "--plot", str(tmp_path / "e.png"))
    assert code == 0 and strict_json(out)[0]["status"] == "exact" and "wrote" in err


@pytest.mark.parametrize("argv, message", [
    (["formats", "fp9"], "did you mean"),
    (["explain", "1", "--formats", "e4m3,nosuch"], "unknown format 'nosuch'"),
    (["explain", "abc"], "not a number: 'abc'"),
    (["explain", "1e400"], "beyond the float64 range"),
    (["explain", "1", "--mode", "sideways"], "invalid choice"),
    (["explain", "1", "--formats", "e4m3", "--overflow", "inf"], "no infinity"),
])
def test_errors_exit_2_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_version_and_help(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"fewbits {fb.__version__}"
    code, out, _ = run(capsys)
    assert code == 0 and "formats" in out and "explain" in out and "usage" in out


def test_as_a_process():
    """One real process (fewbits imports torch, so each costs seconds): the exit status and
    streams a shell sees for a bad format name."""
    script = "import sys; from fewbits.cli import main; sys.exit(main())"
    bad = subprocess.run([sys.executable, "-c", script, "formats", "e4m4x"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "unknown format 'e4m4x'" in bad.stderr and "did you mean" in bad.stderr
    assert "Traceback" not in bad.stderr


# --- issue 12, item 7: no tracebacks, real paths, outputs checked before the work -----------
def _no_work(monkeypatch, module, name):
    """Make `module.name` fail loudly if called: the command must stop before it."""
    def called(*a, **k):
        raise AssertionError(f"{name} ran although the arguments were bad")
    monkeypatch.setattr(module, name, called)


@pytest.mark.parametrize("device, cuda, available, message", [
    ("tpu", None, False, "unknown device 'tpu'"),
    ("xpu", None, False, "run on cpu or cuda, not xpu"),
    ("cuda", None, False, "was built without CUDA"),
    ("cuda", "12.4", False, "no CUDA device"),
])
def test_bench_bad_device_is_one_line_exit_2(capsys, monkeypatch, device, cuda, available, message):
    import torch

    import fewbits.hardware as hw

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    _no_work(monkeypatch, hw, "measure_bandwidth")
    code, out, err = run(capsys, "bench", "--device", device, "--budget", "0.01", "--buffer-mb", "1")
    assert code == 2 and out == ""
    assert err.startswith("fewbits bench: error:") and message in err and len(err.splitlines()) == 1, err


def test_plot_without_extension_reports_the_file_written(capsys, tmp_path):
    target = tmp_path / "DIR"
    target.mkdir()
    code, out, _ = run(capsys, "formats", "e4m3", "--plot", str(target))
    assert code == 0
    assert (tmp_path / "DIR.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {target}.png" in out


@pytest.mark.parametrize("plot, message, exit_code", [
    ("{dir}/missing/x.png", "does not exist", 1),
    ("{dir}/", "names a directory", 1),
    ("{dir}/isdir.png", "is a directory", 1),
    ("{dir}/x.v2", "cannot write .v2 files", 2),
])
def test_bad_plot_paths_fail_before_the_work(capsys, monkeypatch, tmp_path, plot, message, exit_code):
    import fewbits.formats.explanation as ex
    from fewbits.cli import explain as cli

    (tmp_path / "isdir.png").mkdir()
    _no_work(monkeypatch, cli, "explain")
    _no_work(monkeypatch, ex, "explain")
    code, out, err = run(capsys, "explain", "1", "--plot", plot.format(dir=tmp_path))
    assert code == exit_code and out == ""
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_quantize_out_is_checked_before_the_model_loads(capsys, monkeypatch, tmp_path):
    from fewbits.study import quantization as sq

    afile = tmp_path / "afile"
    afile.write_text("x")
    _no_work(monkeypatch, sq, "get_subject")
    code, out, err = run(capsys, "quantize", "--compare", "int8", "--out", str(afile), "--quiet")
    assert code == 1 and out == "" and "exists and is not a directory" in err
    code, out, err = run(capsys, "quantize", "--compare", "int8", "--out", str(afile / "sub"), "--quiet")
    assert code == 1 and "is a file, not a directory" in err
    # converting: an existing output is refused unless --overwrite, before anything is read
    code, out, err = run(capsys, "quantize", "--scheme", "int8", "--out", str(afile), "--quiet")
    assert code == 1 and out == "" and "exists; add --overwrite" in err
    code, out, err = run(capsys, "quantize", "--scheme", "int8", "--out", str(afile / "sub" / "m"), "--quiet")
    assert code == 1 and "is not a directory" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: a directory nobody can write in")
def test_study_out_that_cannot_be_written_fails_before_the_parts(capsys, monkeypatch):
    from fewbits.study import run as study_run

    _no_work(monkeypatch, study_run, "run_study")
    code, out, err = run(capsys, "study", "--out", "/proc", "--only", "formats", "--quiet")
    assert code == 1 and out == "" and "cannot write in /proc" in err


def test_an_unexpected_error_is_one_line_exit_1(capsys, monkeypatch):
    from fewbits.cli import formats as cli

    def broken(fmt):
        raise KeyError("surprise")
    monkeypatch.setattr(cli, "get_format", broken)
    code, out, err = run(capsys, "formats", "e4m3")
    assert code == 1 and out == ""
    assert err.startswith("fewbits formats: error: KeyError: 'surprise' (unexpected") and len(err.splitlines()) == 1
    monkeypatch.setenv("FEWBITS_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["formats", "e4m3"])


def test_ctrl_c_in_any_command_exits_130_without_a_traceback(capsys, monkeypatch):
    from fewbits.cli import formats as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "list_formats", interrupted)
    code, out, err = run(capsys, "formats")
    assert code == 130 and err == "fewbits formats: interrupted\n"
