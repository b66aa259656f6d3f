"""Every example in README.md and docs/*.md still runs, and still prints what the page shows.

The pages' code blocks are the ones fenced as ```bash / ```sh / ```console (shell) or ```python,
and any fenced block with lines starting with `$ ` (a shell transcript: commands and their output).
Other fenced blocks (```text, or no language) are listings and outputs; one that directly follows a
code block (nothing but blank lines between) is that block's output.

Each code block is run here, in a temporary directory with a time limit, unless HTML comments
directly above its fence say otherwise (these are visible in the page's source, and this file
checks that every one gives a reason):

    <!-- not run: REASON -->               never run here (installs, minutes of work, your files)
    <!-- slow: REASON -->                  run only with `pytest -m slow`
    <!-- output: numbers vary -->          compare the output with every number (and a table's
                                           rule of dashes, as wide as they) a wildcard
    <!-- output not compared: REASON -->   run, check that it succeeds, ignore what it prints

Output shown on the page is compared line by line: each of its non-blank lines (a line `...`
stands for lines left out) must appear in what the block prints, in the same order; trailing
spaces are ignored.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
TIME_LIMIT_S = 120  # one command of a cheap block (they take seconds)
SLOW_TIME_LIMIT_S = 900  # one command of a slow block (quantizing SmolLM2: minutes on 2 busy cores)
DIRECTIVE = re.compile(r"^<!--\s*(not run|slow|output not compared|output)\s*:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(`{3,})(\S*)\s*$")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str  # "python", "shell" or "text"
    text: str
    directives: dict = field(default_factory=dict)
    output: str | None = None  # the output shown on the page, if any
    bad: list = field(default_factory=list)  # malformed directives

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def transcript(self) -> bool:
        return self.lang == "shell" and any(ln.startswith("$ ") for ln in self.text.splitlines())


ORPHANS: list[str] = []  # directives not directly above a fence


def parse(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    pending: dict = {}
    bad: list = []
    last_code: Block | None = None  # the code block an output block would belong to
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        stripped = lines[i].strip()
        if m:
            ticks, info = m.group(1), m.group(2).lower()
            j = i + 1
            while j < len(lines) and lines[j].strip() != ticks:
                j += 1
            body = "\n".join(lines[i + 1:j])
            if info in PYTHON:
                lang = "python"
            elif info in SHELL or any(ln.startswith("$ ") for ln in body.splitlines()):
                lang = "shell"
            else:
                lang = "text"
            if lang == "text" and last_code is not None and not pending and not bad:
                last_code.output = body
                last_code = None
            else:
                block = Block(page, i + 1, lang, body, pending, bad=bad)
                blocks.append(block)
                last_code = block if lang != "text" else None
            pending, bad = {}, []
            i = j + 1
            continue
        if re.match(r"^<!--\s*(not run|slow|output)", stripped):
            d = DIRECTIVE.match(stripped)
            if d and d.group(2):
                pending[d.group(1)] = d.group(2)
            else:
                bad.append(f"malformed: {stripped}")
        elif stripped:
            if pending or bad:
                ORPHANS.append(f"{page}:{i + 1}: directive not directly above a fence: {pending or bad}")
            pending, bad, last_code = {}, [], None
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page)]
CODE = [b for b in BLOCKS if b.lang != "text"]


def _params(slow: bool):
    out = []
    for b in CODE:
        if "not run" in b.directives:
            continue
        if ("slow" in b.directives) != slow:
            continue
        marks = [pytest.mark.slow] if slow else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


def test_pages_have_blocks_and_every_directive_is_well_formed():
    assert any(b.page == "README.md" for b in CODE)
    problems = [f"{b.id}: {x}" for b in BLOCKS for x in b.bad] + ORPHANS
    problems += [f"{b.id}: a directive on a listing, not a code block" for b in BLOCKS
                 if b.lang == "text" and b.directives]
    problems += [f"{b.id}: <!-- output: {b.directives['output']} --> (only 'numbers vary' is known)"
                 for b in BLOCKS if b.directives.get("output", "numbers vary") != "numbers vary"]
    assert not problems, problems


def test_every_code_block_is_run_or_says_why():
    """Each block is run (by default or under -m slow) or names why not; the reasons are here."""
    skipped = {b.id: b.directives["not run"] for b in CODE if "not run" in b.directives}
    assert all(len(r) > 10 for r in skipped.values()), skipped
    assert len(skipped) < len(CODE)


def test_readme_states_the_commands_ci_runs():
    """CI (.ci/run) installs and tests with the commands the README gives (-q aside)."""
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip().startswith(("pip install", "python -m pytest"))]
    assert any(c.startswith("python -m pytest") for c in ci), ci
    readme = (ROOT / "README.md").read_text()
    for command in ci:
        shown = command.replace("pip install -q ", "pip install ")
        assert shown in readme, f"README does not state CI's command {shown!r}"


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr reach the pipe in the order printed
    env.setdefault("OMP_NUM_THREADS", "1")  # the machines running tests are small and shared
    return env


def _commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) for each command of a shell block."""
    if not block.transcript:
        return [(block.text, (block.output or "").splitlines())]
    result: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            cmd = lines[i][2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            result.append((cmd, []))
        elif result:
            result[-1][1].append(lines[i])
        i += 1
    return result


def _pattern(line: str, numbers_vary: bool) -> re.Pattern:
    parts = re.split(r"(\s+)", line.strip())
    out = []
    for p in parts:
        if not p:
            continue
        if p.isspace():
            out.append(r"\s+")
        elif numbers_vary and re.fullmatch(r"-{3,}", p):
            out.append("-+")  # a table's rule: as wide as the numbers under it
        elif numbers_vary:
            pieces = re.split(r"(\d+(?:[.,]\d+)*)", p)
            out.append("".join(r"[\d.,]+" if k % 2 else re.escape(s) for k, s in enumerate(pieces)))
        else:
            out.append(re.escape(p))
    return re.compile(r"^\s*" + "".join(out) + r"\s*$")


def _check_output(shown: list[str], printed: str, numbers_vary: bool, where: str):
    got = [ln.rstrip() for ln in printed.splitlines()]
    k = 0
    for want in shown:
        if not want.strip() or want.strip() in ("...", "…"):
            continue
        pat = _pattern(want, numbers_vary)
        while k < len(got) and not pat.match(got[k]):
            k += 1
        assert k < len(got), f"{where}: the page shows\n  {want.strip()}\nwhich the run did not print " \
                             f"(in order). It printed:\n" + printed[-4000:]
        k += 1


def _run(block: Block, tmp_path: Path, limit: int):
    env = _env()
    compare = "output not compared" not in block.directives
    numbers_vary = block.directives.get("output") == "numbers vary"
    if block.lang == "python":
        script = tmp_path / "example.py"
        script.write_text(block.text)
        runs = [([sys.executable, str(script)], (block.output or "").splitlines(), block.text)]
    else:
        runs = [(["bash", "-euo", "pipefail", "-c", cmd], shown, cmd) for cmd, shown in _commands(block)]
    for argv, shown, what in runs:
        proc = subprocess.run(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=limit)
        printed = proc.stdout  # stdout and stderr interleaved, as on a terminal
        assert proc.returncode == 0, f"{block.id}: exit {proc.returncode} from\n{what}\n{printed[-4000:]}"
        if compare and shown:
            _check_output(shown, printed, numbers_vary, block.id)


@pytest.mark.parametrize("block", _params(slow=False))
def test_example_runs(block: Block, tmp_path: Path):
    _run(block, tmp_path, TIME_LIMIT_S)


@pytest.mark.parametrize("block", _params(slow=True))
def test_slow_example_runs(block: Block, tmp_path: Path):
    _run(block, tmp_path, SLOW_TIME_LIMIT_S)


def test_relative_links_and_images_resolve():
    """Every relative link or image on the pages points at a file that exists (anchors aside)."""
    missing = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing
