"""bench/recurrence_bench.py runs as a test: `tree` and `paths` agree on every logprob for fan
and chain shapes, and the RESULT line is last (timings are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recurrence_bench_small():
    argv = [sys.executable, str(ROOT / "bench" / "recurrence_bench.py"), "--branches", "1", "3", "--trunk", "200",
            "--tail", "16", "--repeats", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=230, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT fan3_tree_vs_paths=") and " chain3_tree_vs_paths=" in lines[-1]
    chain3 = next(line.split() for line in lines if line.startswith("chain ") and line.split()[1] == "3")
    assert int(chain3[5]) == 4  # tree scan calls: one per segment level, k + 1 for a chain of k rewrites
