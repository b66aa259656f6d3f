"""benchmarks/fuzz_files.py at its small size: every bit flip and truncation of an fb.save file or
a training checkpoint raises the documented error, with the target unchanged -- no silent load,
no crash, no partial overwrite (issue 12, "Done when")."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fuzz_files.py")


def fuzz(tmp_path, *args, timeout=600):
    out = tmp_path / "fuzz.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, SCRIPT, "--json", str(out), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    return fuzz(tmp_path_factory.mktemp("fuzz"), "--size", "small")


def groups_of(report, prefix):
    return [g for g in report["groups"] if g["kind"].startswith(prefix)]


def assert_all_raised(groups):
    assert groups
    for g in groups:
        assert g["trials"] >= 12, g
        bad = {k: g[k] for k in ("silent", "crashed", "partial", "other") if g[k]}
        assert not bad and g["raised"] == g["trials"], (g["kind"], g["corruption"], bad)


def test_fb_save_files_survive_the_fuzzer(small_run):
    proc, report = small_run
    assert report["errors"]["fb"] == "FileFormatError"
    assert {g["kind"] for g in groups_of(report, "fb ")} == {"fb model", "fb qtensor", "fb tensor"}
    assert_all_raised(groups_of(report, "fb "))


def test_training_checkpoints_survive_the_fuzzer(small_run):
    proc, report = small_run
    assert report["errors"]["checkpoint"] == "CheckpointError"
    assert_all_raised(groups_of(report, "checkpoint"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "file" in proc.stdout and "partial" in proc.stdout  # the table was printed


def test_the_fuzzer_counts_a_crash_and_a_hang_and_goes_on(tmp_path):
    # the worker is made to die at trial 2 and to stall at trial 4: both count as crashed, and
    # every other trial still runs
    proc, report = fuzz(tmp_path, "--kinds", "fb qtensor", "--sabotage", "crash:2", "--sabotage", "hang:4",
                        "--trial-timeout", "2")
    assert proc.returncode == 1
    flips = next(g for g in report["groups"] if g["corruption"] == "flip")
    assert flips["crashed"] == 2 and flips["raised"] == flips["trials"] - 2
    assert sorted(f["detail"].split(" ")[0] for f in report["failures"]) == ["exit", "hung"]
