"""Command line: `python -m polar_fast [train|serve|export] ...`; see `--help` of each."""

from __future__ import annotations

import sys

from polar_fast.cli import main

if __name__ == "__main__":
    sys.exit(main())
