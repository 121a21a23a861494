"""The hand-written _native.pyi matches the extension, and the merge bench runs and holds its
correctness claims (timings are printed, never asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stub_matches_the_extension():
    out = subprocess.run([sys.executable, "-m", "mypy.stubtest", "polar_fast._native"],
                         capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_merge_bench_quick_reports_no_trie_drops():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "merge_bench.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.removeprefix("RESULT ").split())
    assert set(fields) == {"rust_speedup", "tree_vs_chain", "trie_dropped", "chain_dropped"}
    assert fields["trie_dropped"] == "0"
    assert int(fields["chain_dropped"]) > 0  # the traces include rewritten history
    assert re.search(r"^qwen-code\s", out.stdout, re.M)
