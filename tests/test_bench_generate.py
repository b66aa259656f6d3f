"""benchmarks/bench_generate.py's verdicts (the timing itself is the benchmark's, never a test's):
which rows the issue's targets read and how they are judged."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_generate as bg  # noqa: E402


def _verdicts(rates, threads=1):
    got = {k: None for k in rates}

    def rate(key, kind):
        return rates[key][0 if kind == "prefill" else 1]

    fp32 = rates[("fp32", "")]
    q40 = rates.get(("llama-q4_0", ""), (float("nan"), float("nan")))[1]
    return bg.targets(got, rate, threads, fp32[1], fp32[0], q40)


def test_int4_and_w4a8_decode_targets_and_prefill_of_fewbits_rows_only():
    rates = {("fp32", ""): (500.0, 20.0), ("int4", ""): (900.0, 45.0), ("w4a8", "compile"): (800.0, 55.0),
             ("bnb-nf4", ""): (300.0, 30.0), ("llama-q4_0", ""): (480.0, 100.0)}
    v = _verdicts(rates)
    assert "FAIL: fewbits int4 decode >= 0.5x llama.cpp Q4_0 at 1 thread: 0.45x (goal >= 1x: not met)" in v
    assert "PASS: fewbits int4 decode >= 2x transformers fp32 eager: 2.25x" in v
    assert "PASS: fewbits w4a8 +compile decode >= 0.5x llama.cpp Q4_0 at 1 thread: 0.55x (goal >= 1x: not met)" in v
    # bitsandbytes prefills slower than fp32, but it is a peer: the prefill target passes
    assert "PASS: prefill of every fewbits variant >= transformers fp32" in v


def test_a_slow_fewbits_prefill_fails_and_two_threads_skip_the_llama_ratio():
    rates = {("fp32", ""): (500.0, 20.0), ("w4a8", ""): (450.0, 50.0), ("llama-q4_0", ""): (480.0, 100.0)}
    v = _verdicts(rates, threads=2)
    assert not any("llama.cpp Q4_0 at 1 thread" in line for line in v)
    assert "FAIL: prefill >= fp32 for every fewbits variant; below: fewbits w4a8 0.90x" in v
