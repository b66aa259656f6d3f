"""The layering of design.md, checked on the source: imports only go downward, and no module
imports itself back through others (no cycles)."""
from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "fewbits"
LEAVES = {"atomic", "_version", "progress", "model_building"}  # import nothing of fewbits; anyone may use them
BELOW = {  # room -> the rooms it may import (besides itself and the leaves)
    "formats": set(),
    "kernels": {"formats"},
    "quant": {"formats", "kernels"},
    "train": {"formats", "kernels"},
    "models": {"formats", "kernels", "quant"},
    "files": {"formats", "kernels", "quant"},
    "hardware": {"formats", "kernels"},
    "memory": {"formats", "kernels", "quant", "train", "files", "hardware", "models"},
    "study": {"formats", "kernels", "quant", "train", "files", "hardware", "memory", "models"},
    "cli": {"formats", "kernels", "quant", "train", "files", "hardware", "memory", "models", "study"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, set[str]]:
    """{module: the fewbits modules it imports}, read from the source (an `from X import y` names
    X.y where that is a module, else X)."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in paths else module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_only_go_downward():
    wrong = []
    for module, targets in _modules().items():
        room = _room(module)
        if room == "":  # the package root presents every room
            continue
        assert room in BELOW or room in LEAVES, f"{module}: a room design.md does not name"
        allowed = set() if room in LEAVES else BELOW[room] | LEAVES
        wrong += [f"{module} -> {t}" for t in sorted(targets) if _room(t) not in allowed | {room}]
    assert not wrong, "imports that run upward or sideways:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = _modules()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("room", sorted(BELOW))
def test_every_room_exists(room):
    assert (SRC / room).is_dir() or (SRC / f"{room}.py").is_file(), room
