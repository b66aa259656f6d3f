"""fewbits.atomic: the one way fewbits replaces a file (fb.save, training checkpoints, the report)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

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


# ---------------------------------------------------------------------------------------------
# one writer per target: a second writer of the same file or directory is refused, never both
# told they succeeded
# ---------------------------------------------------------------------------------------------
HOLDER = """
import sys
from fewbits import atomic
kind, target = sys.argv[1], sys.argv[2]
if kind == "file":
    with atomic.replacing(target) as tmp:
        open(tmp, "wb").write(b"first")
        print("writing", flush=True)
        sys.stdin.readline()
else:
    d = atomic.DirectoryReplacement(target, overwrite=True)
    print("writing", flush=True)
    sys.stdin.readline()
    open(d.tmp + "/x", "w").write("first")
    d.commit()
print("done", flush=True)
"""


@contextlib.contextmanager
def _writer_in_another_process(kind: str, target):
    """A process in the middle of writing `target` (replacing() or DirectoryReplacement) until the
    block ends; then it finishes its write."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, kind, str(target)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        yield child
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.skipif(atomic.fcntl is None, reason="no flock on this platform")
def test_a_second_process_writing_the_same_file_is_refused(tmp_path):
    target = tmp_path / "m.safetensors"
    with _writer_in_another_process("file", target):
        with pytest.raises(atomic.ConcurrentWriteError, match=f"another process is writing {target}"):
            fb.save(nn.Linear(2, 2), target)
        with pytest.raises(atomic.ConcurrentWriteError):
            with atomic.DirectoryReplacement(target, overwrite=True):
                pass
        assert not target.exists()
    assert target.read_bytes() == b"first"  # the first writer's file, whole
    fb.save(nn.Linear(2, 2), target)  # once it is done, the next write goes ahead
    fb.load(target, nn.Linear(2, 2))
    assert _leftovers(tmp_path) == [] and os.listdir(tmp_path) == ["m.safetensors"]
    assert not os.path.exists(atomic._lock_file(str(target)))  # removed by its holder


@pytest.mark.skipif(atomic.fcntl is None, reason="no flock on this platform")
@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_second_writer_is_refused_even_without_the_lock_files(tmp_path, monkeypatch, kind):
    """Where this process can have no lock file (another user made the lock directory first,
    another TMPDIR, another container), the other writer's locked temporary directory beside the
    target still shows it: both writers reported success before."""
    target = tmp_path / "m.gguf"
    monkeypatch.setattr(atomic, "_lock_directory", lambda: None)
    with _writer_in_another_process(kind, target):
        with pytest.raises(atomic.ConcurrentWriteError, match=f"another process is writing {target}"):
            with atomic.replacing(target) as tmp:
                open(tmp, "w").write("second")
        with pytest.raises(atomic.ConcurrentWriteError):
            atomic.DirectoryReplacement(target, overwrite=True)
    assert _leftovers(tmp_path) == []
    with atomic.DirectoryReplacement(tmp_path / "out") as work:  # this process's own staging is no other writer
        with atomic.replacing(tmp_path / "out") as tmp:
            open(tmp, "w").write("x")
        work.abort()


@pytest.mark.skipif(atomic.fcntl is None, reason="no flock on this platform")
def test_a_second_process_writing_the_same_directory_is_refused_even_with_overwrite(tmp_path):
    target = tmp_path / "model"
    with _writer_in_another_process("directory", target):
        with pytest.raises(atomic.ConcurrentWriteError, match=f"another process is writing {target}"):
            atomic.DirectoryReplacement(target, overwrite=True)
        with pytest.raises(atomic.ConcurrentWriteError):
            with atomic.replacing(target) as tmp:
                open(tmp, "w").write("second")
    assert (target / "x").read_text() == "first"
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(atomic.fcntl is None, reason="no flock on this platform")
def test_a_killed_writer_does_not_block_the_next(tmp_path):
    target = tmp_path / "f.bin"
    script = ("import os, signal, sys\nfrom fewbits import atomic\n"
              "with atomic.replacing(sys.argv[1]) as tmp:\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", script, str(target)], timeout=120).returncode == -signal.SIGKILL
    assert os.path.exists(atomic._lock_file(str(target)))  # its lock file, no longer locked
    with atomic.replacing(target) as tmp:
        open(tmp, "wb").write(b"next")
    assert target.read_bytes() == b"next" and _leftovers(tmp_path) == []
    assert not os.path.exists(atomic._lock_file(str(target)))


@pytest.mark.skipif(atomic.fcntl is None, reason="no flock on this platform")
def test_another_thread_writing_the_same_file_is_refused_and_one_thread_may_nest(tmp_path):
    target = tmp_path / "f.bin"
    inside, finish = threading.Event(), threading.Event()

    def first():
        with atomic.replacing(target) as tmp:
            open(tmp, "wb").write(b"first")
            inside.set()
            finish.wait(60)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(60)
        with pytest.raises(atomic.ConcurrentWriteError, match=f"another thread of this process is writing {target}"):
            with atomic.replacing(target):
                pass
        # other targets are not held up
        with atomic.replacing(tmp_path / "g.bin") as tmp:
            open(tmp, "wb").write(b"g")
    finally:
        finish.set()
        t.join()
    assert target.read_bytes() == b"first"
    # one writer nesting another of the same target (a conversion staging beside its output,
    # then writing it): allowed in its own thread
    outer = atomic.DirectoryReplacement(target, overwrite=True)
    with atomic.replacing(target) as tmp:
        open(tmp, "wb").write(b"nested")
    outer.abort()
    assert target.read_bytes() == b"nested" and _leftovers(tmp_path) == []
    with atomic.replacing(target) as tmp:  # and released after
        open(tmp, "wb").write(b"again")
    assert target.read_bytes() == b"again"
