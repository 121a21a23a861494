"""The hand-written _native.pyi matches the extension, the merge bench runs and holds its
correctness claims (timings are printed, never asserted), and the real captured sessions it
reads (bench/data/captured) hold the shapes they are shipped for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from polar_fast.config import LAYOUTS
from polar_fast.merge import MergeStats, PackPlan, merge, pack_plans
from polar_fast.merge.arrays import ARRAY_FIELDS
from polar_fast.model import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "support"))
import captured  # noqa: E402


def test_stub_matches_the_extension():
    out = subprocess.run([sys.executable, "-m", "mypy.stubtest", "polar_fast._native"],
                         capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def _rust_fn(source: str, name: str) -> str:
    return source.split(f"fn {name}", 1)[1].split("\n}\n", 1)[0]


def test_the_rust_side_uses_the_names_python_defines():
    """Layout names (config.LAYOUTS) and array names (merge.arrays.ARRAY_FIELDS, MergeStats,
    PackPlan) are defined once in Python; lib.rs and _native.pyi spell them again, so hold them
    to the Python definitions."""
    lib = (ROOT / "rust" / "merge" / "src" / "lib.rs").read_text()
    assert tuple(re.findall(r'd\.set_item\("(\w+)"', _rust_fn(lib, "layout_dict"))) == ARRAY_FIELDS
    assert tuple(re.findall(r'\("(\w+)", s\.\w+\)', _rust_fn(lib, "stats_dict"))) == MergeStats.__struct_fields__
    pack = _rust_fn(lib, "pack_plan")
    assert tuple(re.findall(r'd\.set_item\("(\w+)"', pack)) == tuple(PackPlan.__dataclass_fields__)
    for name in ("merge_calls", "pack_plan"):
        assert tuple(re.findall(r'"(\w+)" =>', _rust_fn(lib, name))) == LAYOUTS, name
    inputs = re.findall(r"(\w+): PyReadonlyArray1", pack)
    assert inputs and set(inputs) <= set(ARRAY_FIELDS)
    stub = (ROOT / "polar_fast" / "_native.pyi").read_text()
    assert "from polar_fast.config import Layout" in stub and not re.search(r'"(tree|paths)"\]', stub)
    stub_pack = stub.split("def pack_plan(", 1)[1].split("*,", 1)[0]
    assert re.findall(r"(\w+): npt", stub_pack) == inputs


HARNESSES = ("claude-code", "qwen-code", "codex", "pi", "mini-swe-agent")


def table_rows(text: str) -> dict[str, list[str]]:
    return {m.group(1): m.group(2).split() for m in re.finditer(r"^(%s)\s+(.*)$" % "|".join(HARNESSES), text, re.M)}


def test_merge_bench_quick_counts_drops_and_drift_per_baseline():
    """Token counts only (the synthetic traces are seeded): the trie drops nothing, Polar's chain
    drops the rest of a chain after a retry, and drifts exactly where the template strips reasoning."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "merge_bench.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.removeprefix("RESULT ").split())
    assert set(fields) == {"rust_speedup", "tree_packed_vs_polar_chain", "polar_chain_dropped",
                           "polar_chain_drifted", "trie_dropped", "pack_overhead", "captured_tree_vs_polar",
                           "captured_polar_dropped", "captured_trie_dropped", "captured_pack_overhead"}
    assert fields["trie_dropped"] == "0" and fields["captured_trie_dropped"] == "0"
    assert float(fields["captured_pack_overhead"]) >= 1.0
    synthetic, real = out.stdout.split("\nreal captured sessions")
    assert int(fields["polar_chain_dropped"]) > 0  # the traces include retries
    assert float(fields["pack_overhead"]) >= 1.0  # packing never forwards less than the bound
    assert re.search(r"^synthetic traces sha256 [0-9a-f]{64}$", out.stdout, re.M)
    rows = table_rows(synthetic)
    assert set(rows) == set(HARNESSES)
    # columns: calls sampled budget per-call polar paths tree nodes bound traces p.drop p.drift t.drop ...
    drift = {name: int(r[11]) for name, r in rows.items()}
    assert drift["qwen-code"] > 0 and all(drift[n] == 0 for n in HARNESSES if n != "qwen-code")
    assert sum(drift.values()) == int(fields["polar_chain_drifted"])
    for name, r in rows.items():
        per_call, polar, tree, nodes, bound = int(r[3]), int(r[4]), int(r[6]), int(r[7]), int(r[8])
        assert int(r[12]) == 0 and tree >= bound >= nodes and per_call > max(polar, tree), name
    for name, r in table_rows(real).items():  # same columns on the captured sessions
        per_call, tree, nodes, bound = int(r[3]), int(r[6]), int(r[7]), int(r[8])
        assert int(r[12]) == 0 and tree >= bound >= nodes and per_call > tree, name
    assert set(table_rows(real)) == set(HARNESSES)


COMPACTS = ("claude-code", "codex", "qwen-code", "pi")
SUBAGENTS = ("claude-code", "qwen-code")  # the harnesses whose sub-agent tool the capture drives


def test_captured_sessions_are_multi_turn_groups_with_compactions_and_sub_agents():
    """Facts of the shipped sessions that the merge sees in the token ids: each harness is a
    group of several multi-turn rollouts with tool results; a rollout breaks inside a prompt
    exactly when it compacted or ran a sub-agent (the summary, and the sub-agent's own system
    prompt, start a new branch); the trie drops nothing and forwards fewer tokens than per-call."""
    meta = captured.read_meta()
    assert set(meta["harnesses"]) == set(HARNESSES)
    tool_response = load_tokenizer("").encode("<tool_response>", add_special_tokens=False)
    for name, info in meta["harnesses"].items():
        calls = captured.group_calls(name)
        assert len({c.group_id for c in calls}) == 1 and len(calls) == info["calls"], name
        rollouts = info["rollouts"]
        assert len(rollouts) > 1 and merge(calls).stats.n_rollouts == len(rollouts), name
        for i, r in enumerate(rollouts):
            mine = [c for c in calls if c.rollout_id == f"{name}-r{i}"]
            assert len(mine) == r["calls"] >= 3, (name, i)
            last = mine[-1].prompt_ids
            assert any(last[k : k + len(tool_response)] == tool_response for k in range(len(last))), (name, i)
            breaks = merge(mine).stats.in_prompt
            assert (breaks >= 1) == (r["compacted"] or r["subagent_calls"] > 0), (name, i, breaks)
        assert any(r["compacted"] for r in rollouts) == (name in COMPACTS), name
        assert any(r["subagent_calls"] for r in rollouts) == (name in SUBAGENTS), name
        tree = merge(calls, layout="tree")
        assert tree.stats.n_samples == int(tree.loss_mask.sum()) + len(tree.extra_index), name  # no drops
        packed = sum(len(p.index) for p in pack_plans(tree, max_tokens=65_536))  # the 8-GPU example's budget
        assert tree.stats.n_nodes <= packed <= tree.stats.n_call_tokens, name
