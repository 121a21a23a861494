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


HARNESSES = ("claude-code", "qwen-code", "codex", "pi", "mini-swe-agent")


def test_merge_bench_quick_counts_drops_and_drift_per_baseline():
    """Token counts only (the synthetic traces are seeded): the trie drops nothing, Polar's chain
    drops the rest of a chain after a retry, and drifts exactly where the template strips reasoning."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "merge_bench.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.removeprefix("RESULT ").split())
    assert set(fields) == {"rust_speedup", "tree_packed_vs_polar_chain", "polar_chain_dropped",
                           "polar_chain_drifted", "trie_dropped", "pack_overhead"}
    assert fields["trie_dropped"] == "0"
    assert int(fields["polar_chain_dropped"]) > 0  # the traces include retries
    assert float(fields["pack_overhead"]) >= 1.0  # packing never forwards less than the bound
    assert re.search(r"^synthetic traces sha256 [0-9a-f]{64}$", out.stdout, re.M)
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^(%s)\s+(.*)$" % "|".join(HARNESSES), out.stdout, re.M)}
    assert set(rows) == set(HARNESSES)
    # columns: calls sampled budget per-call polar paths tree nodes bound traces p.drop p.drift t.drop ...
    drift = {name: int(r[11]) for name, r in rows.items()}
    assert drift["qwen-code"] > 0 and all(drift[n] == 0 for n in HARNESSES if n != "qwen-code")
    assert sum(drift.values()) == int(fields["polar_chain_drifted"])
    for name, r in rows.items():
        per_call, polar, tree, nodes, bound = int(r[3]), int(r[4]), int(r[6]), int(r[7]), int(r[8])
        assert int(r[12]) == 0 and tree >= bound >= nodes and per_call > max(polar, tree), name
