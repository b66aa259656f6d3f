"""fewbits.progress: the one way fewbits reports progress (the bar, message lines, throttling)."""
from __future__ import annotations

import io

import pytest

from fewbits import progress as P


def test_counter_draws_a_bar_in_place_and_ends_the_line(capsys):
    report = P.counter(True, 2, "quantize")
    report(1, "layers.0.mlp.down_proj")
    report(2, "lm_head")
    err = capsys.readouterr().err
    assert err == ("\rquantize [###############...............] 1/2 " + f"{'layers.0.mlp.down_proj':<40}"
                   + "\rquantize [##############################] 2/2 " + f"{'lm_head':<40}" + "\n")


def test_counter_calls_back_or_stays_silent(capsys):
    seen = []
    P.counter(lambda done, total, name: seen.append((done, total, name)), 3, "gptq")(1, "a")
    assert seen == [(1, 3, "a")]
    for off in (None, False):
        P.counter(off, 3, "gptq")(1, "a")
    assert capsys.readouterr().err == ""


def test_lines_with_and_without_the_clock():
    stream = io.StringIO()
    P.Lines("fewbits", stream)("loading")
    P.Lines("fewbits study", stream, clock=True)("formats: done")
    P.Lines("fewbits", stream, enabled=False)("hidden")
    assert stream.getvalue() == "[fewbits] loading\n[fewbits study 0:00] formats: done\n"


def test_every_lets_one_report_through_per_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: now[0])
    every = P.Every(2.0, last=True)
    answers = []
    for t, step in ((1.0, 1), (2.5, 2), (3.0, 3), (4.6, 4)):
        now[0] = 100.0 + t
        answers.append(every.due(step, 10))
    assert answers == [False, True, False, True] and every.elapsed == pytest.approx(4.6)
    now[0] = 105.0
    assert every.due(10, 10)  # the end of a run that took 2 s or more shows
    quick = P.Every(2.0, last=True)
    now[0] = 106.0
    assert not quick.due(10, 10)  # a run shorter than that shows nothing


def test_quiet_native_stderr_drops_the_profilers_usdt_lines_and_keeps_the_rest(capfd):
    """torch's profiler (kineto) prints 'USDT: ... profiler_start' / 'profiler_stop' on fd 2 at every
    start and stop (ten of them in a quick study's progress output); they are dropped, other
    lines written inside the block (by Python or C) come out at its end, in order."""
    import os
    import sys

    import torch
    from torch.profiler import ProfilerActivity, profile

    def profiled():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            torch.ones(8).add_(1)

    profiled()
    if "USDT:" not in capfd.readouterr().err:
        pytest.skip("this torch's profiler prints no USDT lines")
    print("before", file=sys.stderr, flush=True)
    with P.quiet_native_stderr():
        print("inside", file=sys.stderr)
        profiled()
        os.write(2, b"from C\n  USDT: indented noise\n")
    print("after", file=sys.stderr, flush=True)
    assert capfd.readouterr().err == "before\ninside\nfrom C\nafter\n"
