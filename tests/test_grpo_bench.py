"""bench/learner_bench.py --quick runs as a test: the layouts agree on the loss and the RESULT
line is last (timings are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_learner_bench_quick():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learner_bench.py"), "--quick"],
                          capture_output=True, text=True, timeout=230, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT tree_vs_percall=") and " paths_vs_percall=" in lines[-1]
    assert any(line.startswith("max loss difference") for line in lines)
