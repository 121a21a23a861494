"""Command line: `python -m polar_fast [train|serve|export] ...`; see `--help` of each."""

from __future__ import annotations

import logging
import os
import sys

from polar_fast.cli import main

if __name__ == "__main__":
    code = main()
    # Everything we own is closed by now (logs, sandboxes, process groups). Skipping interpreter
    # teardown spares the user triton's nanobind "leaked functions" report: triton comes with the
    # CUDA torch wheel, gets imported by torch._dynamo inside transformers, and its bindings are
    # never freed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
