"""benchmarks/bench_int8_gemm.py's pieces: the GEMM shapes of a GPT block's three passes, and
that every configuration computes the same GEMM (no timing asserted)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_int8_gemm.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_int8_gemm", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layer_shapes_are_the_three_gemms_of_each_layer():
    mod = _module()
    shapes = mod.layer_shapes(512, tokens=4096)
    assert len(shapes) == 12
    assert ("fc1 fwd", 4096, 512, 2048) in shapes and ("fc1 dX", 4096, 2048, 512) in shapes
    assert ("fc1 dW", 2048, 4096, 512) in shapes
    flops = {label: m * k * n for label, m, k, n in shapes}
    assert flops["qkv fwd"] == flops["qkv dX"] == flops["qkv dW"]


def test_the_int8_configurations_agree_and_main_prints_the_table(capsys, monkeypatch):
    mod = _module()
    g = torch.Generator().manual_seed(1)
    cfg = mod.configurations(64, 128, 96, g)
    outs = {name: f() for name, f in cfg.items() if name != "bf16 (oneDNN)"}
    ref = outs["torch._int_mm + rescale"]
    assert torch.equal(outs["fewbits AMX"].view(torch.int16), ref.view(torch.int16))
    # the table without oneDNN's qlinear, which ran once above: where the CPU has no AMX-INT8 (AMD EPYC)
    # oneDNN takes a reference path, ~0.5 s a call at any size, and 12 GEMMs x 2 x 2 calls made this
    # test a minute of the default run
    full = mod.configurations
    monkeypatch.setattr(mod, "configurations", lambda *a: full(*a, qlinear=False))
    assert mod.main(["--tokens", "64", "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "readme model" in out and "fc2 dW" in out and "all 12" in out and "threads" in out
