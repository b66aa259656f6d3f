"""The loss scaler's trace equals torch.amp.GradScaler's on the same sequence of overflows."""
import math
import warnings

import pytest
import torch

from fewbits.train import LossScaler, Policy


def gradscaler_trace(overflows, **kw):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", **kw)
    trace = []
    for bad in overflows:
        scaler.scale(torch.ones(()))
        p.grad = torch.full((3,), math.inf if bad else 1.0)
        trace.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    trace.append(scaler.get_scale())
    return trace


def fewbits_trace(overflows, **kw):
    s = LossScaler("dynamic", **kw)
    trace = []
    for bad in overflows:
        g = torch.full((3,), math.inf if bad else 1.0)
        trace.append(s.scale)
        found = s.unscale_([g])
        assert found == bad
        s.update(found)
    trace.append(s.scale)
    return trace, s


@pytest.mark.parametrize("kw", [{}, {"growth_interval": 3}, {"init_scale": 2.0 ** 24, "growth_interval": 2,
                                                            "growth_factor": 3.0, "backoff_factor": 0.25}])
def test_trace_equals_gradscaler(kw):
    rng = torch.Generator().manual_seed(1)
    overflows = [bool(v) for v in (torch.rand(300, generator=rng) < 0.15)]
    overflows[:5] = [True] * 5
    overflows[100:140] = [False] * 40
    expected = gradscaler_trace(overflows, **kw)
    got, s = fewbits_trace(overflows, **kw)
    assert got == expected
    assert s.skipped_steps == sum(overflows)
    assert s.history == expected[:-1]


def test_defaults_match_torch_and_policy():
    s = LossScaler()
    g = torch.amp.GradScaler("cpu")
    assert s.scale == g.get_scale() == 2.0 ** 16
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (
        g.get_growth_factor(), g.get_backoff_factor(), g.get_growth_interval())
    p = Policy.preset("fp16-mixed")
    assert (p.loss_scaling, p.init_scale, p.growth_factor, p.backoff_factor, p.growth_interval) == (
        "dynamic", 2.0 ** 16, 2.0, 0.5, 2000)


def test_growth_stops_at_float32_max():
    s = LossScaler("dynamic", init_scale=2.0 ** 127, growth_interval=1)
    s.update(False)
    assert s.scale == 2.0 ** 127  # 2^128 is inf in float32: not taken, as GradScaler


def test_unscale_divides_and_detects_nan():
    s = LossScaler("static", init_scale=8.0)
    a, b = torch.tensor([8.0, 16.0]), torch.tensor([4.0], dtype=torch.bfloat16)
    assert s.unscale_([a, b]) is False
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [0.5]
    assert s.unscale_([torch.tensor([float("nan")])]) is True
    s.update(True)
    assert s.scale == 8.0 and s.skipped_steps == 1


def test_bad_mode():
    with pytest.raises(ValueError, match="loss scaling mode"):
        LossScaler("sometimes")
