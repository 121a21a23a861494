"""Cost of `tree` against `paths` for a hybrid (Gated DeltaNet) model as branch points grow.

In a tree the recurrent layers run segment level by level (learner/packed_recurrence.py): the
sequential scan calls per layer grow with the branch points along the deepest root-to-leaf path,
while the tokens computed stay the tree's. Two shapes, each with k branch points:
- `fan`: k + 1 conversations share one system prompt and then differ (k siblings at one branch
  point: two segment levels whatever k is);
- `chain`: one long conversation whose history is rewritten k times, each rewrite keeping a
  longer prefix than the last (a branch point at each, nested: k + 1 segment levels).
Each row times forward + backward of the sampled tokens' logprobs on a tiny random Qwen3.5
(3 linear + 1 full attention layers, the torch reference kernels on CPU) for `paths` and
`tree` on the same calls (best of --repeats, taking turns), checks the two agree on every
logprob, and shows tokens, scan calls per recurrent layer and tree time / paths time.

    .venv/bin/python bench/recurrence_bench.py --quick

Last line: `RESULT fan{k}_tree_vs_paths=.. chain{k}_tree_vs_paths=..` for the largest k (paths
time / tree time: above 1 the tree is faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast.learner import packed_attention, packed_recurrence  # noqa: E402
from polar_fast.learner.packed_forward import PackedLM, batch_tensors, loss_terms  # noqa: E402
from polar_fast.records import CallRecord  # noqa: E402


def shaped_calls(shape: str, k: int, *, trunk: int, tail: int, vocab: int, seed: int = 0) -> list[CallRecord]:
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    def call(i: int, prompt: list[int]) -> CallRecord:
        completion = ids(tail)
        return CallRecord(session_id=f"r{i}", rollout_id=f"r{i}", group_id="g", call_index=0, prompt_ids=prompt,
                          completion_ids=completion, completion_logprobs=[-1.0] * tail, policy_version=0,
                          finish_reason="stop", dialect="chat")

    base = ids(trunk)
    if shape == "fan":
        return [call(i, base + ids(tail)) for i in range(k + 1)]
    cuts = np.linspace(trunk // (k + 1), trunk, k + 1).astype(int)[:-1]  # k rewrites, each keeping a longer prefix
    return [call(i, base[:cut] + ids(tail)) for i, cut in enumerate(cuts)] + [call(k, base)]


def measure(wrapper: PackedLM, calls: list[CallRecord], layout: str, merge) -> tuple[dict, int, int]:
    merged = merge.merge(calls, layout=layout)
    (mb,) = merge.pack(merged, max_tokens=1 << 20)
    terms = loss_terms(mb)
    inputs = batch_tensors(mb, terms, "cpu")
    wrapper.zero_grad()
    logp = wrapper(**inputs)
    logp.sum().backward()
    keys = []
    for pos in terms.position:  # the sample's token path identifies it across layouts
        chain = [int(pos)]
        while mb.parent[chain[-1]] >= 0:
            chain.append(int(mb.parent[chain[-1]]))
        keys.append(tuple(int(mb.tokens[i]) for i in reversed(chain)))
    scans = packed_recurrence.plan(inputs["size"]).n_calls
    return dict(zip(keys, logp.tolist())), len(mb.tokens), scans


def run(args: argparse.Namespace) -> list[dict]:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from polar_fast import merge

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, max_position_embeddings=16384)
    lm = Qwen3_5ForCausalLM(cfg).float()
    lm.set_attn_implementation(packed_attention.NAME)
    wrapper = PackedLM(lm)
    rows = []
    for shape in ("fan", "chain"):
        for k in args.branches:
            calls = shaped_calls(shape, k, trunk=args.trunk, tail=args.tail, vocab=args.vocab)
            row: dict = {"shape": shape, "k": k}
            times: dict[str, list[float]] = {"paths": [], "tree": []}
            for _ in range(args.repeats):
                for layout in ("paths", "tree"):
                    t0 = time.perf_counter()
                    logp, tokens, scans = measure(wrapper, calls, layout, merge)
                    times[layout].append(time.perf_counter() - t0)
                    row[layout] = logp
                    row[f"{layout}_tokens"], row[f"{layout}_scans"] = tokens, scans
            row["gap"] = max(abs(row["tree"][key] - row["paths"][key]) for key in row["paths"])
            row["paths_s"], row["tree_s"] = min(times["paths"]), min(times["tree"])
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short trunk, k in 1 4 16, best of 2")
    p.add_argument("--branches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--trunk", type=int, default=2048, help="shared prefix tokens")
    p.add_argument("--tail", type=int, default=64, help="tokens after each branch point (prompt tail, and sampled)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny model: 1 is fastest on a busy box)")
    args = p.parse_args(argv)
    if args.quick:
        args.branches, args.trunk, args.repeats = [1, 4, 16], 512, 2
    torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"{'shape':6} {'k':>3} {'paths_tok':>9} {'tree_tok':>8} {'paths_scans':>11} {'tree_scans':>10} "
          f"{'paths_s':>8} {'tree_s':>8} {'tree_vs_paths':>13} {'max_dlogp':>10}")
    for r in rows:
        print(f"{r['shape']:6} {r['k']:3d} {r['paths_tokens']:9d} {r['tree_tokens']:8d} {r['paths_scans']:11d} "
              f"{r['tree_scans']:10d} {r['paths_s']:8.3f} {r['tree_s']:8.3f} {r['paths_s'] / r['tree_s']:12.2f}x "
              f"{r['gap']:10.1e}")
    gap = max(r["gap"] for r in rows)
    if gap > 1e-4:
        print(f"ERROR: tree and paths disagree on a logprob by {gap:.1e}", file=sys.stderr)
        return 1
    top = max(args.branches)
    result = [f"{r['shape']}{top}_tree_vs_paths={r['paths_s'] / r['tree_s']:.2f}" for r in rows if r["k"] == top]
    print("RESULT " + " ".join(result) + f" max_dlogp={gap:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
