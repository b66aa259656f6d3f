"""The table of format names: every registered format under its name and aliases, and the one
spelling rule names are looked up by. A leaf of formats (the descriptors ask it whether a default
name is taken; the registry fills it), so neither imports the other."""
from __future__ import annotations

import re

from .base import Format

_REGISTRY: dict[str, Format] = {}
_ALIASES: dict[str, str] = {}  # normalized alias -> canonical name
_DESCRIPTIONS: dict[str, str] = {}


def normalize_name(name: str) -> str:
    """The key a name is looked up by: lower case, without spaces, '_', '-' or '.'. Formats use
    it, and so do quantization schemes (fewbits.quant.get_scheme): one spelling rule."""
    return re.sub(r"[\s_\-.]", "", name.lower())


def register(fmt: Format, aliases=(), description: str = "") -> Format:
    """Add a format under its name and aliases (names are case- and separator-insensitive)."""
    key = normalize_name(fmt.name)
    if key in _ALIASES and _ALIASES[key] != fmt.name:
        raise ValueError(f"name {fmt.name!r} is already taken by {_ALIASES[key]!r}")
    _REGISTRY[fmt.name] = fmt
    _DESCRIPTIONS[fmt.name] = description
    for alias in (fmt.name, *aliases):
        _ALIASES[normalize_name(alias)] = fmt.name
    return fmt


def is_taken(name: str, fmt: Format) -> bool:
    """Whether `name` already names a different registered format."""
    key = normalize_name(name)
    return key in _ALIASES and _REGISTRY[_ALIASES[key]] != fmt
