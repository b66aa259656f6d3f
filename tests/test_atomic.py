"""fewbits.atomic: the one way fewbits replaces a file (fb.save, training checkpoints, the report)."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fewbits as fb
from fewbits import atomic
from fewbits.study.report import _atomic_write
from fewbits.train import Engine, Policy, save_checkpoint


def _stale(directory, target: str) -> str:
    """What a write killed outright leaves: our directory, unlocked, with a half-written file."""
    stale = directory / (atomic.temp_prefix(target) + "dead0000")
    stale.mkdir()
    (stale / target).write_bytes(b"half")
    return stale


def _leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if atomic.TEMP_MARK in n)


def test_replacing_writes_whole_files_only(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic.replacing(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"new, but")
            raise RuntimeError("midway")
    assert target.read_bytes() == b"old" and _leftovers(tmp_path) == []
    with atomic.replacing(target) as tmp:
        assert os.path.dirname(tmp) != str(tmp_path) and atomic.TEMP_MARK in tmp
        with open(tmp, "wb") as f:
            f.write(b"new")
    assert target.read_bytes() == b"new" and _leftovers(tmp_path) == []
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~atomic._umask()


@pytest.mark.parametrize("writer", ["fb.save", "checkpoint", "report"])
def test_every_writer_removes_what_a_killed_write_left(writer, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    names = {"fb.save": "m.safetensors", "checkpoint": "ck.pt", "report": "report.html"}
    target = names[writer]
    _stale(tmp_path, target)
    other = _stale(tmp_path, "other.pt")  # another target's leftovers are not this write's business
    if writer == "fb.save":
        fb.save(model, tmp_path / target)
    elif writer == "checkpoint":
        opt = torch.optim.AdamW(model.parameters())
        save_checkpoint(Engine(model, opt, Policy.preset("bf16-mixed")), tmp_path / target)
    else:
        _atomic_write(tmp_path / target, "<html></html>")
    assert _leftovers(tmp_path) == [other.name]
    assert (tmp_path / target).stat().st_size > 4
