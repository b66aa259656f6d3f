"""Telemetry figures on tensors whose answers are known."""
import math

import torch

from fewbits.study.charts import save_histogram_figure
from fewbits.train import Telemetry


def test_underflow_saturation_amax_exact():
    t = Telemetry(every=1, sqnr=True)
    x = torch.tensor([0.0, 1e-9, 2e-9, 1.0, 7e4, -1e5, 3.0, 1e-3])  # fp16: 1e-9 and 2e-9 flush; 7e4, -1e5 overflow
    t.record_cast(0, "layer", "backward", "fp16", x)
    r = t.rows[0]
    assert r["amax"] == 1e5 and r["nonzero"] == 7
    assert r["underflow"] == 2 / 7 and r["saturated"] == 2 / 7
    assert r["sqnr_db"] == -math.inf or r["sqnr_db"] < 0  # inf error: no signal left
    t.record_cast(1, "layer", "backward", "bf16", torch.tensor([1.0, 2.0]))
    assert t.fraction("backward", "underflow") == 2 / 9


def test_subsampling_keeps_fractions_and_whole_tensor_amax():
    t = Telemetry(every=1, max_samples=1000)
    x = torch.ones(100_000)
    x[::4] = 1e-9
    x[77777] = 5.0
    t.record_cast(0, "l", "backward", "fp16", x)
    r = t.rows[0]
    assert r["nonzero"] <= 1000 and abs(r["underflow"] - 0.25) < 0.01 and r["amax"] == 5.0


def test_lost_updates_and_layers_summary():
    t = Telemetry(every=5)
    assert t.wants(0) and t.wants(10) and not t.wants(3)
    t.record_lost_updates(0, "w", 100, 25)
    t.record_lost_updates(5, "w", 300, 300)
    assert t.lost_update_fraction() == 75 / 400
    summary = {(r["layer"], r["role"]): r for r in t.layers()}
    assert summary[("w", "update")]["lost"] == (0.75 + 0.0) / 2


def test_histogram_plot(tmp_path):
    t = Telemetry(every=1)
    g = torch.Generator().manual_seed(0)
    t.record_cast(0, "l", "backward", "fp16", torch.randn(5000, generator=g) * 1e-6)
    t.record_cast(0, "l", "forward", "fp8_e4m3", torch.randn(5000, generator=g))
    counts = t.hist["backward"]
    assert int(counts.sum()) == 5000
    path = tmp_path / "h.png"
    save_histogram_figure(t, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
