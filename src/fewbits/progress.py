"""Progress reports while fewbits works: one way for every layer (a leaf: imports nothing of fewbits).

counter(): the count of a known number of steps (layers quantized, layers x schemes measured): a
    bar on stderr, a user callback(done, total, name), or nothing.
Lines: '[label] message' lines on a stream (stderr by default), optionally with the time since
    the start ('[fewbits study 1:23] message'), or nothing when disabled.
Every: lets through one report per interval, so that a long loop reports now and then.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

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
