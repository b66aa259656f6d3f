"""The hardware probe: roofline arithmetic, the accelerator table, the probes and `fewbits bench`.
Speeds are machine-dependent: the tests check what is measured and how it is reported, never how fast."""
import json

import pytest
import torch

from fewbits import hardware as hw
from fewbits.cli import main


def test_shape_parse_and_arithmetic():
    s = hw.MatmulShape.parse("1x4096x4096")
    assert (s.m, s.n, s.k) == (1, 4096, 4096) and str(s) == "1x4096x4096"
    assert hw.MatmulShape.parse(" 8,16*32 ") == hw.MatmulShape(8, 16, 32)
    assert s.flops == 2 * 4096 * 4096
    assert s.bytes_moved("fp32") == (4096 + 4096 * 4096) * 4 + 4096 * 4
    assert s.bytes_moved("int8") == (4096 + 4096 * 4096) + 4096 * 4  # int32 results
    assert s.intensity("bf16") == s.flops / ((4096 + 4096 * 4096) * 2 + 4096 * 2)
    big = hw.MatmulShape(4096, 4096, 4096)
    assert big.intensity("bf16") == pytest.approx(2 * 4096 ** 3 / (3 * 4096 ** 2 * 2))


@pytest.mark.parametrize("text", ["1x2", "0x4x4", "ax4x4", "", "1x2x3x4", "-1x4x4"])
def test_bad_shapes(text):
    with pytest.raises(ValueError, match="MxNxK"):
        hw.MatmulShape.parse(text)


def test_roofline_bounds():
    shape = hw.MatmulShape(100, 100, 100)
    ai = shape.intensity("fp32")  # 2e6 / 120000 = 16.67 op/byte
    r = hw.roofline(shape, "fp32", peak_gflops=1000, bandwidth_gbs=100)  # ridge 10
    assert r["bound"] == "compute" and r["attainable_gflops"] == 1000 and r["ridge"] == 10
    r = hw.roofline(shape, "fp32", peak_gflops=1000, bandwidth_gbs=10)  # ridge 100
    assert r["bound"] == "bandwidth" and r["attainable_gflops"] == pytest.approx(ai * 10)
    with pytest.raises(ValueError):
        hw.roofline(shape, "fp7", 1, 1)
    with pytest.raises(ValueError):
        hw.roofline(shape, "fp32", 0, 1)


def test_known_accelerators():
    a100 = hw.get_accelerator("a100 sxm 80gb")
    assert (a100.fp32, a100.tf32, a100.fp16, a100.bf16, a100.fp8) == (19.5, 156, 312, 312, None)
    h100, h200 = hw.get_accelerator("H100 SXM"), hw.get_accelerator("H200")
    assert (h100.bf16, h100.fp8, h100.bandwidth_gbs) == (989, 1979, 3350)
    assert (h200.bf16, h200.fp8, h200.bandwidth_gbs, h200.memory_gb) == (989, 1979, 4800, 141)
    assert hw.get_accelerator("h100-sxm").ridge("bf16") == pytest.approx(989e12 / 3350e9)
    with pytest.raises(ValueError, match="ambiguous"):
        hw.get_accelerator("h100")
    with pytest.raises(ValueError, match="unknown"):
        hw.get_accelerator("abacus")
    for a in hw.KNOWN_ACCELERATORS:
        assert a.bandwidth_gbs > 0 and a.memory_gb > 0 and (a.bf16 or a.fp16)


def test_probes_report_what_they_measured():
    bw = hw.measure_bandwidth(buffer_mb=16, budget_s=0.1)
    assert bw.copy_gbs > 0 and bw.read_gbs > 0 and bw.buffer_bytes == 16 * 2 ** 20
    for dtype in ("fp32", "bf16", "int8"):
        m = hw.measure_matmul(dtype, budget_s=0.1, max_n=256)
        if m.available:
            assert m.gflops > 0 and m.n == 256 and m.kernel
        else:
            assert m.note
    with pytest.raises(ValueError):
        hw.measure_matmul("fp7")
    assert hw.measure_shape(hw.MatmulShape(4, 64, 64), "fp32", budget_s=0.05) > 0


def test_tf32_availability_means_different_products():
    ok, note = hw.availability("tf32")
    assert isinstance(ok, bool)
    if not ok:
        assert "tf32" in note
    assert torch.backends.mkldnn.matmul.fp32_precision != "tf32"  # the setting is restored


def test_run_bench_structure():
    res = hw.run_bench(shapes=["2x256x256"], dtypes=("fp32", "bf16", "tf32"), budget_s=0.05,
                       buffer_mb=16)
    assert res.matmuls["fp32"].ratio == 1.0
    assert not res.matmuls["tf32"].available or res.matmuls["tf32"].ratio is not None
    rows = [r for r in res.shapes if r["dtype"] == "fp32"]
    assert len(rows) == 1 and rows[0]["bound"] in ("compute", "bandwidth")
    assert rows[0]["accelerators"]["H100 SXM"] == "bandwidth"  # 2 tokens: far below any ridge
    json.dumps(res.as_dict())
    with pytest.raises(ValueError):
        hw.run_bench(dtypes=("fp64",))


def test_cli_bench(capsys, tmp_path):
    plot = tmp_path / "roofline.png"
    code = main(["bench", "--budget", "0.05", "--buffer-mb", "16", "--dtypes", "fp32,bf16", "--shape", "2x128x128",
                 "--plot", str(plot), "--no-layers"])  # the layer section: tests/test_layer_peers.py
    out, err = capsys.readouterr()
    assert code == 0
    assert "memory bandwidth" in out and "x fp32" in out and "H200 SXM" in out and "2x128x128" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    code = main(["bench", "--budget", "0.05", "--buffer-mb", "16", "--dtypes", "fp32", "--shape", "2x128x128",
                 "--json", "--no-layers"])
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert code == 0 and d["matmul"][0]["dtype"] == "fp32" and d["roofline"][0]["shape"] == "2x128x128"
    assert d["bandwidth"]["copy_gbs"] > 0 and len(d["accelerators"]) == len(hw.KNOWN_ACCELERATORS)


@pytest.mark.parametrize("argv", [["--shape", "1x2"], ["--dtypes", "fp7"], ["--budget", "0"], ["--buffer-mb", "0"]])
def test_cli_bench_errors(capsys, argv):
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("fewbits bench: error:")


def test_fp8_on_a_cpu_without_fp8_units_is_not_measured(monkeypatch):
    """A CPU without fp8 matrix units is not timed in fp8: what would be timed is torch's software
    conversion (on one Xeon it printed as "0.0 GFLOP/s" and "ridge 0.0" in the study's report).
    The dtype says why, carries no number (None, not 0.0) and gets no roofline rows."""
    flags = hw.native.cpu_flags() - hw.FP8_CPU_FLAGS
    monkeypatch.setattr(hw.native, "cpu_flags", lambda: flags)
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no fp8 matmul")
    ok, note = hw.availability("fp8")
    assert not ok and note.startswith("not measured") and "fp8" in note
    m = hw.measure_matmul("fp8", budget_s=0.05)
    assert not m.available and m.gflops is None and m.n is None and m.note == note
    res = hw.run_bench(shapes=["2x256x256"], dtypes=("fp32", "fp8"), budget_s=0.05, buffer_mb=16)
    assert [r["dtype"] for r in res.shapes] == ["fp32"]
    assert res.matmuls["fp8"].ratio is None
    assert res.as_dict()["matmul"][1]["gflops"] is None


def test_the_roofline_figure_says_what_it_shows_and_where():
    """Its title was "fewbits bench: rooflines": it names the figure's content and the machine now."""
    from fewbits.study.hardware_figures import roofline_figure

    res = hw.run_bench(shapes=["2x128x128"], dtypes=("fp32",), budget_s=0.02, buffer_mb=16)
    title = roofline_figure(res)._suptitle.get_text()
    assert "fewbits bench" not in title
    assert "roofline" in title.lower() and res.machine["name"] in title and f"{res.machine['threads']} threads" in title
