"""bench/pools_bench.py runs as a test on a short window: it must finish and print its RESULT line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_pools_bench_runs_and_prints_result():
    bench = Path(__file__).parents[1] / "bench" / "pools_bench.py"
    done = subprocess.run([sys.executable, str(bench), "--minutes", "20", "--slots", "4"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT pools_busy=") and "sequential_busy=" in last and "speedup=" in last
