"""The command line read: the parser of every command (each command module adds its own), negative
numbers kept as values, and a mistyped command or option answered with the close names."""
from __future__ import annotations

import argparse

from .._version import __version__
from . import bench, explain, formats, generate, memory, quantize, study, train
from .common import parse_number

COMMANDS = (formats, explain, quantize, generate, train, memory, bench, study)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fewbits",
        description="Reduced numeric precision made practical: number formats, exactly.",
        epilog="Every command takes --json for machine-readable output (non-finite numbers are written "
               "as the strings \"inf\", \"-inf\", \"nan\").",
    )
    parser.add_argument("--version", action="version", version=f"fewbits {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def protect_negative_numbers(argv: list[str]) -> list[str]:
    """argparse takes '-1e-3' or '-inf' for an option; a leading space keeps it a value
    (parse_number strips it)."""
    protected = []
    for a in argv:
        if a.startswith("-") and not a.startswith("--") and len(a) > 1:
            try:
                parse_number(a)
            except argparse.ArgumentTypeError as exc:
                if "not a number" not in str(exc):  # a number, out of range: let parse_number say so
                    a = " " + a
            else:
                a = " " + a
        protected.append(a)
    return protected


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def _did_you_mean(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with a mistyped command or option answered by that command's usage and the
    close names: argparse reports an unknown option of a command with the top-level usage only,
    and suggests nothing."""
    commands = _subparsers(parser)
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is not None and first not in commands and argv.index(first) == 0:
        parser.error(f"unknown command {first!r}{_did_you_mean(first, commands)}; commands: {', '.join(commands)}")
    args, extras = parser.parse_known_args(argv)
    if extras:
        target = commands.get(getattr(args, "command", None) or "", parser)
        options = [o for a in target._actions for o in a.option_strings]  # noqa: SLF001
        hints = [_did_you_mean(e.split("=", 1)[0], options) for e in extras if e.startswith("-")]
        target.error(f"unrecognized arguments: {' '.join(extras)}{''.join(h for h in hints if h)}")
    return args
