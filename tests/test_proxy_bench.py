"""bench/proxy_bench.py on a small load: it checks exact history on every session it drives (the
proxy's recorded prompts must extend each other token for token) and must print its RESULT."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("engine", ["scripted", "vllm"])
def test_proxy_bench_small_run_checks_history_and_prints_result(engine):
    """`vllm`: the proxy's real vLLM client against the bench's fake `vllm serve`."""
    bench = Path(__file__).parents[1] / "bench" / "proxy_bench.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--concurrency", "1", "8", "--engine", engine],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    rows = [line.split() for line in lines if re.match(r"\s*(1|8)\s+(json|sse)\s", line)]
    assert {(r[0], r[1]) for r in rows} == {("1", "json"), ("1", "sse"), ("8", "sse")}, done.stdout
    assert all(float(r[12]) > 0 for r in rows)  # proxy requests/s
    result = dict(kv.split("=") for kv in lines[-1].removeprefix("RESULT ").split())
    assert lines[-1].startswith("RESULT ") and set(result) == {"added_p50_ms", "added_p99_ms", "rps_ratio", "floor_added_p50_ms"}
    assert 0 < float(result["rps_ratio"]) <= 1.5
