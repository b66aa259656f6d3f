"""Load a page in headless Chromium and report what a reader would see: console errors, failed
loads, images that did not render, and a screenshot. Standard library only.

Chromium is driven through the DevTools protocol over a pipe (--remote-debugging-pipe: it reads
commands on fd 3 and writes replies and events on fd 4, each a JSON message ending in a NUL
byte), so no port is opened and no websocket client is needed.

    with Browser() as b:
        page = b.load("file:///path/report.html", screenshot="shot.png")
    page.errors        # console errors, uncaught exceptions, failed loads (strings)
    page.images        # [{'src', 'complete', 'naturalWidth', 'naturalHeight'}]
    page.cut_tables    # tables wider than their box (they scroll sideways): [{'title', 'width', 'box'}]

Also a script: `python tests/study/study_browser.py REPORT.html SHOT.png` prints the findings and
saves the screenshot (how docs/report.png is made from a full report).
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = os.environ.get("FEWBITS_CHROMIUM", "/usr/bin/chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio")

_LAUNCHER = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
             "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])")
_IMAGES_JS = """JSON.stringify(Array.from(document.images).map(i => ({src: i.getAttribute('src'),
  complete: i.complete, naturalWidth: i.naturalWidth, naturalHeight: i.naturalHeight})))"""

_CUT_TABLES_JS = """JSON.stringify(Array.from(document.querySelectorAll('.table-wrap')).filter(
  w => w.scrollWidth > w.clientWidth + 1).map(w => {
    const h = w.previousElementSibling;
    return {title: h && h.tagName === 'H3' ? h.textContent : '', width: w.scrollWidth, box: w.clientWidth};
  }))"""


def chromium_path() -> str | None:
    if os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageResult:
    url: str
    errors: list[str] = field(default_factory=list)
    images: list[dict] = field(default_factory=list)
    title: str = ""
    screenshot: str | None = None
    cut_tables: list[dict] = field(default_factory=list)

    @property
    def broken_images(self) -> list[dict]:
        return [i for i in self.images if not i["complete"] or i["naturalWidth"] <= 0]


class BrowserError(RuntimeError):
    pass


class Browser:
    """A headless Chromium with a fresh profile directory, driven over the DevTools pipe."""

    def __init__(self, executable: str | None = None, timeout: float = 60.0, width: int = 1280, height: int = 1600):
        self.executable = executable or chromium_path()
        if not self.executable:
            raise BrowserError(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
        self.timeout, self.width, self.height = timeout, width, height
        self._next_id = 0
        self._buffer = b""
        self._events: list[dict] = []
        self.proc = None

    # -- process and pipe ---------------------------------------------------------------------
    def __enter__(self) -> Browser:
        self.profile = tempfile.mkdtemp(prefix="fewbits-chromium-")
        self._log = tempfile.TemporaryFile()  # chromium's chatter; a pipe nobody reads would fill and block it
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        # the child's ends, moved above 10 so that placing them on fds 3 and 4 cannot clobber them;
        # a small launcher does the placing after exec (Popen's own error pipe may sit on 3 or 4)
        child_r = fcntl.fcntl(cmd_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(res_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(cmd_r)
        os.close(res_w)
        args = [self.executable, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
                f"--window-size={self.width},{self.height}", "about:blank"]
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(child_r), str(child_w), *args],
                                     pass_fds=(child_r, child_w), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(child_r)
        os.close(child_w)
        self._write, self._read = cmd_w, res_r
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.proc and self.proc.poll() is None:
                try:
                    self._send("Browser.close", timeout=5)
                except (BrowserError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            for fd in (self._write, self._read):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def _messages(self, deadline: float):
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                yield json.loads(raw)
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("timed out waiting for chromium")
            ready, _, _ = select.select([self._read], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._read, 1 << 20)
                if not chunk:
                    self._log.seek(0)
                    err = self._log.read().decode(errors="replace")[-2000:]
                    raise BrowserError(f"chromium closed the pipe (exit {self.proc.poll()}): {err}")
                self._buffer += chunk

    def _send(self, method: str, params: dict | None = None, session: str | None = None,
              timeout: float | None = None) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        for reply in self._messages(time.monotonic() + (timeout or self.timeout)):
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def _wait_event(self, method: str, session: str, timeout: float) -> dict:
        for i, ev in enumerate(self._events):
            if ev.get("method") == method and ev.get("sessionId") == session:
                return self._events.pop(i)
        for ev in self._messages(time.monotonic() + timeout):
            if ev.get("method") == method and ev.get("sessionId") == session:
                return ev
            self._events.append(ev)

    # -- a page -------------------------------------------------------------------------------
    def load(self, url: str, screenshot: str | os.PathLike | None = None, settle: float = 0.3) -> PageResult:
        """Open url in a new tab, wait for its load event, collect errors and image states,
        optionally save a PNG screenshot of the viewport."""
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self._send(method, session=session)
        self._send("Emulation.setDeviceMetricsOverride",
                   {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
                   session=session)
        self._events.clear()
        nav = self._send("Page.navigate", {"url": url}, session=session)
        if nav.get("errorText"):
            raise BrowserError(f"navigating to {url}: {nav['errorText']}")
        self._wait_event("Page.loadEventFired", session, self.timeout)
        time.sleep(settle)
        result = PageResult(url)
        images = self._send("Runtime.evaluate", {"expression": _IMAGES_JS, "returnByValue": True}, session=session)
        result.images = json.loads(images["result"]["value"])
        result.title = self._send("Runtime.evaluate", {"expression": "document.title", "returnByValue": True},
                                  session=session)["result"].get("value", "")
        cut = self._send("Runtime.evaluate", {"expression": _CUT_TABLES_JS, "returnByValue": True}, session=session)
        result.cut_tables = json.loads(cut["result"]["value"])
        if screenshot is not None:
            shot = self._send("Page.captureScreenshot", {"format": "png"}, session=session)
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
            result.screenshot = str(screenshot)
        for ev in self._events:
            if ev.get("sessionId") != session:
                continue
            method, params = ev.get("method"), ev.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails", {})
                result.errors.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                result.errors.append(f"console.{params['type']}: {args}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                e = params["entry"]
                result.errors.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}".strip())
        self._send("Target.closeTarget", {"targetId": target})
        return result


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python tests/study/study_browser.py REPORT.html [SHOT.png]", file=sys.stderr)
        return 2
    url = Path(argv[0]).resolve().as_uri()
    with Browser() as b:
        page = b.load(url, screenshot=argv[1] if len(argv) == 2 else None)
    print(f"{url}: title {page.title!r}, {len(page.images)} images, {len(page.broken_images)} broken, "
          f"{len(page.errors)} errors")
    for e in page.errors:
        print("  error:", e)
    for i in page.broken_images:
        print("  broken image:", i)
    for t in page.cut_tables:
        print(f"  table wider than the page (scrolls): {t['title']!r}, {t['width']} px in {t['box']} px")
    if page.screenshot:
        print("screenshot:", page.screenshot)
    return 1 if page.errors or page.broken_images else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
