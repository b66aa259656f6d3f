"""The package version, in a leaf: modules that write it into files import it from here, not
from the package root (pyproject.toml reads it from here too)."""
__version__ = "0.1.0"
