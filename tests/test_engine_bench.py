"""bench/engine_bench.py runs as a test (the fused embedded engine at both dtypes, two short
waves each, no vLLM): it must finish, sample tokens at each concurrency and dtype, split a step
and print its RESULT line with float32 and bfloat16 keys."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_engine_bench_quick_prints_result():
    bench = Path(__file__).parents[1] / "bench" / "engine_bench.py"
    done = subprocess.run([sys.executable, str(bench), "--quick", "--concurrency", "1,2"],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    throughput, split = done.stdout.split("| engine | dtype | calls | step |")
    for dtype in ("float32", "bfloat16"):
        assert re.search(rf"^\| embedded \| {dtype} \| 2 \| [\d.]+ \|", throughput, re.M), done.stdout
        assert re.search(rf"^\| embedded \| {dtype} \| 2 \| [\d.]+ \| [\d.]+ \|", split, re.M), done.stdout
    assert lines[-1].startswith("RESULT embedded_c1=") and "embedded_c2=" in lines[-1]
    assert "batch_speedup_c2=" in lines[-1] and "embedded_c2_bf16=" in lines[-1]
