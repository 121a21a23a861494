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
    assert all(int(r[2]) == int(r[0]) * QUICK_TURNS for r in rows)  # every session ran every turn
    result = dict(kv.split("=") for kv in lines[-1].removeprefix("RESULT ").split())
    assert lines[-1].startswith("RESULT ") and set(result) == KEYS  # timings are printed, never asserted


QUICK_TURNS = 4
KEYS = {"added_p50_ms", "added_p99_ms", "rps_ratio", "floor_added_p50_ms", "cpu_of_engine"}
LITELLM = Path(__file__).parents[1] / ".venv-litellm" / "bin" / "litellm"


@pytest.mark.skipif(not LITELLM.exists(), reason="LiteLLM is an optional bench dependency (.venv-litellm, see bench/proxy_bench.py)")
def test_proxy_bench_puts_litellm_beside_polar_fast():
    """The real LiteLLM proxy in front of the same fake engine, the same sessions through both."""
    bench = Path(__file__).parents[1] / "bench" / "proxy_bench.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--concurrency", "2", "--litellm", str(LITELLM)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    at = lines.index(next(line for line in lines if line.startswith("LiteLLM proxy")))
    rows = [line.split() for line in lines[at + 2:] if re.match(r"\s*2\s+(json|sse)\s", line)]
    assert [(r[0], r[1], r[2]) for r in rows] == [("2", "sse", "8")], done.stdout  # --quick: streaming only above concurrency 1
    result = dict(kv.split("=") for kv in lines[-1].removeprefix("RESULT ").split())
    assert set(result) == KEYS | {"rps_per_core_vs_litellm"}
