"""`python -m fewbits.cli`: the `fewbits` command."""
import sys

from . import main

sys.exit(main())
