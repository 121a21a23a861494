"""Merge bench: Rust vs the Python reference, and what each trajectory layout costs the learner.

Two tables from one run:
  1. merge time of polar_fast.merge (Rust) vs merge_reference on the same group (identical output
     asserted): Rust from msgpack bytes (the form records travel and rest in; this is the
     headline ratio) and from CallRecord objects (msgspec encode included);
  2. for each harness shape, a group of 8 rollouts (the 8-GPU example's group_size), the tokens the
     learner forwards after packing into micro-batches of the example's 65,536 tokens (raised to
     the next power of two where one sequence is longer), under
       per-call     every call its own sequence;
       polar chain  Polar's prefix_merging as its code runs it (support/polar_chain.py): open
                    chains joined by longest tip prefix, interstitials after the first end-of-turn
                    token, a STOP on a break that drops the rest of the chain;
       trie paths   one sequence per leaf;
       trie tree    each prefix once (tree attention), split at the budget by merge.pack;
     with the sampled tokens never trained (dropped), the trained tokens whose training context
     differs from their sampling context (drifted), the cost per TRAINED sampled token, and the
     tree's pack_overhead over the least any packing can forward (support/pack_bound.py), also at
     2x and 4x the budget.

    python bench/merge_bench.py [--quick]
Last line: RESULT rust_speedup=R tree_packed_vs_polar_chain=T polar_chain_dropped=N
           polar_chain_drifted=D trie_dropped=M pack_overhead=O
  tree_packed_vs_polar_chain = (polar chain tokens per trained token) / (packed tree tokens per
  trained token), summed over the harness shapes; > 1 means the tree forwards less.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # shared trace generators, not benches

from pack_bound import pack_lower_bound  # noqa: E402
from polar_chain import polar_chain_merge  # noqa: E402
from synthetic_traces import IM_END, PROFILES, group_calls  # noqa: E402

from polar_fast import merge as rust  # noqa: E402
from polar_fast.merge import reference as reference  # noqa: E402


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def speed_table(quick: bool) -> float:
    profile = PROFILES["mini-swe-agent"] if quick else PROFILES["codex"]
    rollouts, per = (4, (60, 60)) if quick else (8, (125, 125))
    calls = group_calls(profile, rollouts=rollouts, calls_per_rollout=per, seed=1)
    n_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    payload = msgspec.msgpack.encode(calls)  # how records travel and rest on disk
    t_ref, m_ref = best_of(lambda: reference.merge(calls), 1)
    t_rust, m_rust = best_of(lambda: rust.merge(payload), 5)
    t_objects, m_objects = best_of(lambda: rust.merge(calls), 3)
    for m in (m_rust, m_objects):
        assert m.stats == m_ref.stats and np.array_equal(m.tokens, m_ref.tokens)
        assert np.array_equal(m.logprobs, m_ref.logprobs) and np.array_equal(m.size, m_ref.size)
    t_pack, batches = best_of(lambda: rust.pack(m_rust, max_tokens=131_072), 5)
    print(f"\nmerge speed: {profile.name}-shaped group, {len(calls)} calls, {n_tokens / 1e6:.1f}M call tokens, "
          f"{m_rust.stats.n_nodes / 1e6:.2f}M trie nodes")
    print(f"{'impl':<34}{'merge s':>10}{'Mtok/s':>10}{'vs ref':>8}")
    for name, t in [("python reference (CallRecords)", t_ref), ("rust (msgpack bytes)", t_rust),
                    ("rust (CallRecords, encode incl.)", t_objects)]:
        print(f"{name:<34}{t:>10.3f}{n_tokens / t / 1e6:>10.1f}{t_ref / t:>7.0f}x")
    print(f"rust pack into {len(batches)} micro-batches of <=128k tokens: {t_pack * 1e3:.1f} ms")
    return t_ref / t_rust


EXAMPLE_BUDGET = 65_536  # examples/8gpu.toml [merge] max_tokens
GROUP_SIZE = 8  # examples/8gpu.toml [rollout] group_size
TRACES = Path(__file__).resolve().parent / "support" / "synthetic_traces.py"


def packed_tokens(merged, budget: int) -> int:
    return sum(len(plan.index) for plan in rust.pack_plans(merged, max_tokens=budget))


def layout_row(calls) -> dict:
    """Forwarded, trained, dropped and drifted tokens of each layout for one group."""
    tree = rust.merge(calls, layout="tree")
    paths = rust.merge(calls, layout="paths")
    s = tree.stats
    longest = max(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    budget = EXAMPLE_BUDGET if longest <= EXAMPLE_BUDGET else 1 << (longest - 1).bit_length()
    chains = polar_chain_merge(calls, eot=IM_END)
    trie_lost = sum(s.n_samples - (int(m.loss_mask.sum()) + len(m.extra_index)) for m in (tree, paths))
    bounds = {k: pack_lower_bound(tree.parent, tree.size, tree.positions, k * budget) for k in (1, 2, 4)}
    tree_packed = {k: packed_tokens(tree, k * budget) for k in (1, 2, 4)}
    return dict(
        calls=s.n_calls, sampled=s.n_samples, budget=budget, per_call=s.n_call_tokens,
        polar=sum(len(c.tokens) for c in chains), polar_trained=sum(c.trained for c in chains),
        polar_dropped=sum(c.dropped for c in chains), polar_drifted=sum(c.drifted for c in chains),
        polar_traces=len(chains), paths=packed_tokens(paths, budget), tree_nodes=s.n_nodes,
        tree=tree_packed[1], trie_dropped=trie_lost, bound=bounds, tree_at=tree_packed,
    )


def layout_table(quick: bool) -> dict:
    per = (20, 40) if quick else (50, 300)
    print(f"\nsynthetic traces sha256 {hashlib.sha256(TRACES.read_bytes()).hexdigest()}")
    print(f"tokens the learner forwards after packing, per harness shape (group of {GROUP_SIZE} rollouts, "
          f"{per[0]}-{per[1]} calls each); 'per trained' = forwarded / sampled tokens that are trained")
    print(f"{'harness':<15}{'calls':>6}{'sampled':>9}{'budget':>8}{'per-call':>10}{'polar':>10}{'paths':>10}"
          f"{'tree':>10}{'nodes':>10}{'bound':>10}{'traces':>7}{'p.drop':>8}{'p.drift':>9}{'t.drop':>7}"
          f"{'per-call/tr':>12}{'polar/tr':>9}{'paths/tr':>9}{'tree/tr':>8}{'overhead':>9}")
    rows = []
    for seed, profile in enumerate(PROFILES.values()):
        calls = group_calls(profile, rollouts=GROUP_SIZE, calls_per_rollout=per, seed=100 + seed)
        r = layout_row(calls)
        rows.append(r)
        trained = r["sampled"]  # the trie and per-call train every sample
        print(f"{profile.name:<15}{r['calls']:>6}{r['sampled']:>9}{r['budget']:>8}{r['per_call']:>10}{r['polar']:>10}"
              f"{r['paths']:>10}{r['tree']:>10}{r['tree_nodes']:>10}{r['bound'][1]:>10}{r['polar_traces']:>7}{r['polar_dropped']:>8}"
              f"{r['polar_drifted']:>9}{r['trie_dropped']:>7}{r['per_call'] / trained:>12.1f}"
              f"{r['polar'] / max(r['polar_trained'], 1):>9.1f}{r['paths'] / trained:>9.1f}"
              f"{r['tree'] / trained:>8.1f}{r['tree'] / r['bound'][1]:>9.3f}")
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731
    print("tree pack_overhead over the lower bound at budget x1, x2, x4: " + ", ".join(
        f"x{k} {sum(r['tree_at'][k] for r in rows) / sum(r['bound'][k] for r in rows):.3f}" for k in (1, 2, 4)))
    polar_cost = total("polar") / total("polar_trained")
    tree_cost = total("tree") / total("sampled")
    print(f"polar chain: {total('polar_dropped')} of {total('sampled')} sampled tokens dropped "
          f"({total('polar_dropped') / total('sampled'):.1%}), {total('polar_drifted')} trained on a drifted context "
          f"({total('polar_drifted') / total('sampled'):.1%})")
    return dict(
        tree_packed_vs_polar_chain=polar_cost / tree_cost, polar_chain_dropped=total("polar_dropped"),
        polar_chain_drifted=total("polar_drifted"), trie_dropped=total("trie_dropped"),
        pack_overhead=total("tree") / sum(r["bound"][1] for r in rows),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small groups; finishes in under 30 s")
    args = parser.parse_args()
    speedup = speed_table(args.quick)
    layout = layout_table(args.quick)
    print(f"\nRESULT rust_speedup={speedup:.0f} tree_packed_vs_polar_chain={layout['tree_packed_vs_polar_chain']:.3f} "
          f"polar_chain_dropped={layout['polar_chain_dropped']} polar_chain_drifted={layout['polar_chain_drifted']} "
          f"trie_dropped={layout['trie_dropped']} pack_overhead={layout['pack_overhead']:.3f}")


if __name__ == "__main__":
    main()
