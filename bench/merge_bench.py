"""Merge bench: Rust vs the Python reference, and what each trajectory layout costs the learner.

Two tables from one run:
  1. merge time of polar_fast.merge (Rust) vs merge_reference on the same group (identical output
     asserted): Rust from msgpack bytes (the form records travel and rest in; this is the
     headline ratio) and from CallRecord objects (msgspec encode included);
  2. for each harness profile, tokens the learner computes per sampled token under
       per-call  every call its own sequence;
       chain     Polar-style: a call joins the rollout's current chain when its prompt starts with
                 the previous call's prompt, and the chain becomes that call's prompt+completion;
                 a prompt that does not extend the previous prompt starts a new chain. A sampled
                 token survives only if the chain's final sequence holds it at the same position,
                 so a rewritten or retried answer is dropped;
       paths     trie, one sequence per leaf;
       tree      trie, each prefix once (tree attention);
     the sampled tokens that never reach training (trie: must be 0), and the chain's computed
     tokens per sampled token that does reach training.

    python bench/merge_bench.py [--quick]
Last line: RESULT rust_speedup=R tree_vs_chain=T trie_dropped=N chain_dropped=M
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # shared trace generators, not benches

from synthetic_traces import PROFILES, group_calls  # noqa: E402

from polar_fast import merge as rust  # noqa: E402
from polar_fast.merge import reference as reference  # noqa: E402
from polar_fast.records import CallRecord  # noqa: E402


def chain_merge(calls: list[CallRecord]) -> tuple[int, int]:
    """(tokens computed, sampled tokens dropped) of Polar-style chains; see the module docstring."""
    computed = dropped = 0
    by_rollout: dict[str, list[CallRecord]] = {}
    for c in calls:
        by_rollout.setdefault(c.rollout_id, []).append(c)
    for rollout_calls in by_rollout.values():
        chain: list[CallRecord] = []
        for c in rollout_calls:
            if chain and c.prompt_ids[: len(chain[-1].prompt_ids)] != chain[-1].prompt_ids:
                computed, dropped = _close(chain, computed, dropped)
                chain = []
            chain.append(c)
        computed, dropped = _close(chain, computed, dropped)
    return computed, dropped


def _close(chain: list[CallRecord], computed: int, dropped: int) -> tuple[int, int]:
    final = chain[-1].prompt_ids + chain[-1].completion_ids
    computed += len(final)
    for c in chain[:-1]:
        start = len(c.prompt_ids)
        if final[start : start + len(c.completion_ids)] != c.completion_ids:
            dropped += len(c.completion_ids)
    return computed, dropped


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


def layout_table(quick: bool) -> tuple[float, int, int]:
    rollouts, per = (4, (20, 40)) if quick else (8, (50, 300))
    header = f"{'harness':<16}{'calls':>7}{'sampled':>10}{'per-call':>10}{'chain':>8}{'paths':>8}{'tree':>8}" \
             f"{'breaks':>8}{'chain drop':>12}{'trie drop':>11}{'chain/trained':>15}"
    print(f"\ntokens computed per sampled token ({rollouts} rollouts per group)")
    print(header)
    chain_total = tree_total = chain_dropped = trie_dropped = 0
    for seed, profile in enumerate(PROFILES.values()):
        calls = group_calls(profile, rollouts=rollouts, calls_per_rollout=per, seed=100 + seed)
        tree = rust.merge(calls, layout="tree")
        paths = rust.merge(calls, layout="paths")
        s = tree.stats
        chain_tokens, dropped = chain_merge(calls)
        lost = s.n_samples - (int(tree.loss_mask.sum()) + len(tree.extra_index))
        lost += s.n_samples - (int(paths.loss_mask.sum()) + len(paths.extra_index))
        chain_total += chain_tokens
        tree_total += s.n_nodes
        chain_dropped += dropped
        trie_dropped += lost
        per_sample = lambda n: n / s.n_samples  # noqa: E731
        print(f"{profile.name:<16}{s.n_calls:>7}{s.n_samples:>10}{per_sample(s.n_call_tokens):>10.1f}"
              f"{per_sample(chain_tokens):>8.1f}{per_sample(paths.stats.n_output_tokens):>8.1f}"
              f"{per_sample(s.n_nodes):>8.1f}{s.n_breaks:>8}{dropped:>12}{lost:>11}"
              f"{chain_tokens / max(s.n_samples - dropped, 1):>15.1f}")
    return chain_total / tree_total, trie_dropped, chain_dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small groups; finishes in under 30 s")
    args = parser.parse_args()
    speedup = speed_table(args.quick)
    tree_vs_chain, trie_dropped, chain_dropped = layout_table(args.quick)
    print(f"\nRESULT rust_speedup={speedup:.0f} tree_vs_chain={tree_vs_chain:.2f} "
          f"trie_dropped={trie_dropped} chain_dropped={chain_dropped}")


if __name__ == "__main__":
    main()
