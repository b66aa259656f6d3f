"""The study's own charts draw from plain rows, and refuse empty input."""
from __future__ import annotations

import pytest

from fewbits.study.charts import (
    save_loss_figure, save_matmul_figure, save_memory_figure, save_rounding_figure, save_train_numerics_figure,
)


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_memory_figure(tmp_path):
    rows = [{"label": "fp32", "at_peak": {"weights": 90e6, "activations": 12e6}, "measured": 105e6},
            {"label": "nf4_dq", "at_peak": {"weights": 30e6, "activations": 6e6, "workspace": 1e6}, "measured": None}]
    train = [{"label": "bf16-pure", "at_peak": {"weights": 45e6, "gradients": 45e6, "optimizer_states": 90e6},
              "measured": 190e6}]
    path = save_memory_figure([{"title": "inference", "rows": rows}, {"title": "training", "rows": train}],
                              tmp_path / "m.png", title="memory")
    assert _is_png(path)
    with pytest.raises(ValueError, match="no memory rows"):
        save_memory_figure([{"title": "x", "rows": []}], tmp_path / "e.png")


def test_matmul_figure(tmp_path):
    rows = [{"dtype": "fp32", "available": True, "gflops": 46.0, "ratio": 1.0, "kernel": "torch.mm"},
            {"dtype": "bf16", "available": True, "gflops": 330.0, "ratio": 7.1, "kernel": "torch.mm"},
            {"dtype": "tf32", "available": False, "gflops": 0.0, "ratio": None, "kernel": ""}]
    assert _is_png(save_matmul_figure(rows, tmp_path / "mm.png"))
    with pytest.raises(ValueError, match="no available"):
        save_matmul_figure(rows[2:], tmp_path / "e.png")


def test_rounding_figure(tmp_path):
    rows = [{"format": "bf16", "mode": "nearest_even", "melems": 350.0, "torch_melems": 400.0},
            {"format": "bf16", "mode": "stochastic", "melems": 200.0, "torch_melems": 400.0},
            {"format": "nf4", "mode": "nearest_even", "melems": 150.0, "torch_melems": None}]
    assert _is_png(save_rounding_figure(rows, tmp_path / "r.png", copy_melems=900.0))
    with pytest.raises(ValueError):
        save_rounding_figure([], tmp_path / "e.png")


def test_train_numerics_figure(tmp_path):
    rows = [{"policy": "fp32", "final_loss": 0.10, "underflow_fraction": 0.0, "lost_update_fraction": 0.0,
             "skipped_steps": 0},
            {"policy": "fp16-mixed-unscaled", "final_loss": 0.11, "underflow_fraction": 0.035,
             "lost_update_fraction": None, "skipped_steps": 0},
            {"policy": "fp16-mixed", "final_loss": float("nan"), "underflow_fraction": 0.0004,
             "lost_update_fraction": 0.0, "skipped_steps": 3}]
    assert _is_png(save_train_numerics_figure(rows, tmp_path / "t.png"))
    with pytest.raises(ValueError):
        save_train_numerics_figure([], tmp_path / "e.png")


def test_loss_figure(tmp_path):
    runs = [{"policy": f"p{i}", "losses": [2.0 / (1 + s + i) for s in range(60)] + [float("inf")],
             "final_loss": 0.05 + i / 100} for i in range(12)]  # more policies than colours
    runs[0]["final_loss"] = float("nan")
    assert _is_png(save_loss_figure(runs, tmp_path / "l.png"))
    with pytest.raises(ValueError):
        save_loss_figure([], tmp_path / "e.png")


def test_the_quality_figure_leaves_the_callers_backend_alone(tmp_path):
    import types

    import matplotlib

    from fewbits.study import quantization as sq

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's notebook backend, say
    try:
        subject = types.SimpleNamespace(name="m", quality_metric="cosine", higher_is_better=True, note="")
        rows = [{"quality": 1.0, "bits_per_param": 32, "scheme": "fp32"},
                {"quality": 0.9, "bits_per_param": 4.5, "scheme": "nf4"}]
        path = sq.plot_quality_vs_bits(rows, subject, tmp_path / "q.png")
        assert path.stat().st_size > 1000 and matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
