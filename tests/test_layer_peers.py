"""fewbits.study.layer_speed: the peers beside fewbits' layers, their structure and how a peer
that is missing or fails is reported. No timing is asserted (speed is the benchmarks' job)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fewbits.cli import main
from fewbits.study import layer_speed as ls


def _missing(stack):
    raise AssertionError("never called: the package is not there")


def _broken(stack):
    raise RuntimeError("boom: no kernel for this CPU\nsecond line")


MISSING = ls.Peer("missing peer", "fewbits_no_such_package", "fewbits-no-such-package", "a peer not installed",
                  _missing)
BROKEN = ls.Peer("broken peer", "torch", "torch", "a peer whose build fails", _broken)


def test_layer_speed_structure_and_missing_peers():
    stack = ls.linear_stack(64, layers=2)
    res = ls.layer_speed(stack, batches=(1, 3), fewbits=("fp32", "int8", "nf4"),
                         peers=("quantize_dynamic", MISSING, BROKEN), min_rounds=1, max_rounds=1, budget_s=0)
    json.dumps(res)
    assert [v["label"] for v in res["variants"]] == ["fp32", "int8", "nf4", "quantize_dynamic"]
    assert res["threads"] == torch.get_num_threads() and res["stack"] == "2 x Linear(64, 64)"
    reasons = {n["label"]: n["reason"] for n in res["not_run"]}
    assert reasons["missing peer"] == "not installed (pip install fewbits-no-such-package)"
    assert reasons["broken peer"] == "does not run here: RuntimeError: boom: no kernel for this CPU"
    assert set(res["batches"]) == {"1", "3"}
    for cell in res["batches"].values():
        rows = {r["label"]: r for r in cell["rows"]}
        assert list(rows) == ["fp32", "int8", "nf4", "quantize_dynamic"]
        assert rows["fp32"]["x_fp32"] == 1.0 and rows["fp32"]["rel_err"] == 0.0
        assert rows["fp32"]["bytes"] == 2 * 64 * 64 * 4 and rows["fp32"]["bytes_vs_fp32"] == 1.0
        for r in rows.values():
            assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] and r["rounds"] == 1
        # fewbits' variants are checked against their own reference (F.linear on dequantize())
        assert rows["nf4"]["ref_err"] < 1e-5 and rows["int8"]["ref_err"] < 2e-2
        assert rows["quantize_dynamic"]["ref_err"] is None and rows["int8"]["kernel"]
        assert rows["nf4"]["bytes"] < rows["fp32"]["bytes"] / 6  # 4-bit codes and their scales
    table = ls.layer_speed_rows(res)
    assert len(table) == 2 * 4 + 2 and table[-1]["batch"] is None and "boom" in table[-1]["kernel"]


def test_smollm2_stack_has_the_real_shapes():
    stack = ls.smollm2_stack(blocks=2)
    shapes = sorted({(m.out_features, m.in_features) for m in stack.linears})
    assert shapes == [(192, 576), (576, 576), (576, 1536), (1536, 576)]
    assert len(stack.linears) == 14 and stack.in_features == 576
    assert stack.fp32_bytes == 2 * 4 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
    y = stack.module(torch.randn(3, 576))
    assert y.shape == (3, 576 + 2 * 192)


def test_fewbits_variants_replace_every_linear():
    stack = ls.smollm2_stack(blocks=1)
    v = ls.build_fewbits(stack, "int4 g128")
    assert not any(isinstance(m, nn.Linear) for m in v.module.modules())
    x = torch.randn(2, 576)
    with torch.inference_mode():
        assert torch.allclose(v.module(x), v.reference(x), rtol=0, atol=1e-2 * v.reference(x).abs().max())


def test_a_variant_failing_at_one_batch_is_reported():
    stack = ls.linear_stack(32, layers=1)
    built, _ = ls.build_variants(stack, ("fp32",), ())

    def fails_on_big_batches(x):
        if x.shape[0] > 2:
            raise ValueError("too many rows for this kernel")
        return stack.module(x)

    built["odd"] = ls.Variant("odd", "test", "fails above 2 rows", fails_on_big_batches, 1, "none")
    cell = ls.measure(built, ls.batch_input(4, 32), warmup=0, min_rounds=1, max_rounds=1, budget_s=0)
    assert cell.failed == {"odd": "fails at batch 4: ValueError: too many rows for this kernel"}
    rows = {r["label"]: r for r in ls.cell_rows(built, cell)}
    assert rows["odd"]["median_ms"] is None and "too many rows" in rows["odd"]["failed"]
    cell = ls.measure(built, ls.batch_input(2, 32), warmup=0, min_rounds=2, max_rounds=2, budget_s=0)
    assert not cell.failed and len(cell.samples["odd"]) == 2


def test_bitsandbytes_runs_in_eval_mode():
    pytest.importorskip("bitsandbytes")
    stack = ls.linear_stack(128, layers=1)
    v = ls.build_peer(stack, ls.PEERS_BY_LABEL["bnb nf4"])
    layers = [m for m in v.module.modules() if type(m).__name__ == "Linear4bit"]
    assert len(layers) == 1 and not layers[0].training
    assert v.nbytes < 128 * 128  # 4-bit codes and absmax, not float weights


def test_cli_bench_layer_section(capsys):
    argv = ["bench", "--budget", "0.01", "--buffer-mb", "8", "--dtypes", "fp32", "--shape", "2x64x64",
            "--layer-dim", "64", "--layer-batches", "1,2", "--layer-peers", "quantize_dynamic"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["layer_speed"]["batches"]["2"]["rows"]
    assert [r["label"] for r in rows] == list(ls.BENCH_FEWBITS) + ["quantize_dynamic"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layer speed: 1 x Linear(64, 64)" in out and "quantize_dynamic" in out and "b2 x fp32" in out
    assert main(["bench", "--no-layers", "--budget", "0.01", "--buffer-mb", "8", "--dtypes", "fp32", "--shape",
                 "2x64x64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layer_speed"] is None


@pytest.mark.parametrize("argv, message", [
    (["--layer-peers", "nope"], "unknown peer(s) 'nope'"),
    (["--layer-batches", "0"], "--layer-batches takes positive integers"),
    (["--layer-dim", "0"], "--layer-dim must be positive"),
])
def test_cli_bench_layer_errors(capsys, argv, message):
    code = main(["bench", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("fewbits bench: error:") and message in err
