"""The `fewbits` command: parses arguments, calls the library, prints tables or JSON. One module
per command (its arguments, its run, its text); `common` holds what they share, `parsing` the
parser; here: `main`, which runs one command and turns its errors into exit codes.

Exit codes: 0 success; 2 bad input (unknown format, scheme, mode or device, not a number,
impossible option, a broken model directory) or a missing optional package (the message carries
the pip command); 1 a file that cannot be written (output paths are checked before the work
starts), a `study` part that failed (its report is still written), or an unexpected error;
130 interrupted (Ctrl-C). Every error is one line on stderr, never a traceback
(FEWBITS_TRACEBACK=1 shows the traceback of an unexpected error).
"""
from __future__ import annotations

import contextlib
import os
import sys

from .parsing import build_parser, parse, protect_negative_numbers

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "fewbits"
    try:
        parser = build_parser()
        if not argv:
            parser.print_help(sys.stdout)
            return 0
        try:
            args = parse(parser, protect_negative_numbers(argv))
        except SystemExit as exc:  # --help, --version, usage errors (already printed by argparse)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if args.command is None:
            parser.print_help(sys.stdout)
            return 0
        command = f"fewbits {args.command}"
        _quiet_library_loggers()
        with _third_party_quiet(getattr(args, "quiet", False)):
            return _run(command, args)
    except KeyboardInterrupt:  # Ctrl-C: no traceback; 130 = 128 + SIGINT, as a shell reports it
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _third_party_quiet(enabled: bool):
    """--quiet: no progress bars or warnings from the libraries fewbits calls (tqdm's bars, which
    transformers' and huggingface_hub's are; transformers' logging; Python warnings other than
    fewbits' own; the root logger below ERROR) while the command runs; errors still show.
    Everything is restored afterwards, since the command may run inside a longer process."""
    if not enabled:
        yield
        return
    import functools
    import logging
    import warnings

    undo = []
    try:
        import tqdm.std
    except ImportError:
        pass
    else:
        init = tqdm.std.tqdm.__init__  # subclasses (tqdm.auto, transformers' bars) inherit the default
        tqdm.std.tqdm.__init__ = functools.partialmethod(init, disable=True)
        undo.append(lambda: setattr(tqdm.std.tqdm, "__init__", init))
    had_transformers = "transformers" in sys.modules
    saved_verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers is first imported
    if had_transformers:
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        undo.append(lambda: hf_logging.set_verbosity(level))
    root = logging.getLogger()
    root_level = root.level
    root.setLevel(max(root_level, logging.ERROR))
    undo.append(lambda: root.setLevel(root_level))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"fewbits(\.|$)")  # fewbits' own: news for the user
            yield
    finally:
        for u in reversed(undo):
            u()
        if saved_verbosity is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = saved_verbosity
        if not had_transformers and "transformers.utils.logging" in sys.modules:  # imported during the command
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity(hf_logging._get_default_logging_level())  # noqa: SLF001 - as at import


def _quiet_library_loggers() -> None:
    """transformers imports torchao where it is installed, which logs a warning per CUDA-only
    extension it cannot load on a CPU machine, and torch warns about enum registrations: noise
    on the command line, not news for its user."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _run(command: str, args) -> int:
    def error(message) -> None:
        print(f"{command}: error: {' '.join(str(message).split())}", file=sys.stderr)

    try:
        return args.func(args, sys.stdout)
    except ValueError as exc:
        error(exc)
        return 2
    except ImportError as exc:  # an optional package is missing: the message carries the pip hint
        error(exc)
        return 2
    except BrokenPipeError:  # `fewbits formats | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        error(exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug or a case we did not foresee: one line, not a traceback
        if os.environ.get("FEWBITS_TRACEBACK"):
            raise
        error(f"{type(exc).__name__}: {exc} (unexpected; FEWBITS_TRACEBACK=1 shows where)")
        return 1
