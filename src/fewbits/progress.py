"""Progress reports while fewbits works: one way for every layer (a leaf: imports nothing of fewbits).

counter(): the count of a known number of steps (layers quantized, layers x schemes measured): a
    bar on stderr, a user callback(done, total, name), or nothing.
Lines: '[label] message' lines on a stream (stderr by default), optionally with the time since
    the start ('[fewbits study 1:23] message'), or nothing when disabled.
Every: lets through one report per interval, so that a long loop reports now and then.
quiet_native_stderr(): drops the lines a native library prints on file descriptor 2 that are
    nobody's progress (torch's profiler, kineto, prints 'USDT: ... profiler_start' and
    '... profiler_stop' on every start and stop), so that progress output stays clean.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

BAR_WIDTH = 30
NAME_WIDTH = 40


def counter(progress, total: int, what: str) -> Callable[[int, str], None]:
    """A reporter(done, name) for `total` steps of `what`: progress=True draws a bar on stderr
    ('what [####......] 3/10 name', redrawn in place, a newline at the end), a callable is called
    as progress(done, total, name), anything false reports nothing."""
    if callable(progress) and progress is not True:
        return lambda done, name: progress(done, total, name)
    if not progress:
        return lambda done, name: None

    def bar(done, name):
        filled = BAR_WIDTH * done // max(total, 1)
        sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} "
                         f"{name[:NAME_WIDTH]:<{NAME_WIDTH}}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return bar


class Lines:
    """Prints '[label] message' lines to a stream (stderr by default), each flushed; clock=True
    puts the minutes:seconds since this object was made after the label. enabled=False: silent."""

    def __init__(self, label: str, stream=None, enabled: bool = True, clock: bool = False):
        self.label, self.enabled, self.clock = label, enabled, clock
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        tag = self.label
        if self.clock:
            s = int(time.perf_counter() - self.start)
            tag = f"{tag} {s // 60}:{s % 60:02d}"
        print(f"[{tag}] {message}", file=self.stream, flush=True)


class Every:
    """due(step, total) is true at most once per `seconds` (measured from the last true answer,
    the first from the start). last=True: the final step (step == total) is due whenever the whole
    run took `seconds` or more, so a run that shows progress also shows its end. `elapsed` is the
    time from the start to the last question."""

    def __init__(self, seconds: float, last: bool = False):
        self.seconds, self.last = seconds, last
        self.start = self.previous = self.now = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return self.now - self.start

    def due(self, step: int, total: int) -> bool:
        self.now = time.perf_counter()
        if self.last and step == total:
            ok = self.now - self.start >= self.seconds
        else:
            ok = self.now - self.previous >= self.seconds
        if ok:
            self.previous = self.now
        return ok


# lines that native code prints on stderr and that nobody asked for: kineto (torch's profiler)
# logs every profiler start and stop at its "USDT" level, whatever Python's logging says
NATIVE_NOISE = ("USDT:",)


@contextlib.contextmanager
def quiet_native_stderr(drop: tuple[str, ...] = NATIVE_NOISE) -> Iterator[None]:
    """Within the block, file descriptor 2 (where C and C++ code write, as well as sys.stderr) goes
    to a temporary file; at its end, the lines that start with one of `drop` are dropped and the
    others are written to stderr, in their order. Anything written to stderr within the block,
    from any thread, appears at its end: keep the block to the call that prints the noise. Where
    fd 2 cannot be redirected, the block runs as it is."""
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (AttributeError, OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not line.lstrip().startswith(tuple(d.encode() for d in drop))]
            data = b"".join(kept)
            while data:
                data = data[os.write(2, data):]
