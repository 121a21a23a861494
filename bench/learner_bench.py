"""Learner step time: per-call vs trie `paths` vs trie `tree`, on the same harness-shaped traces.

Two tiny random models run side by side: a Llama (attention only) and a hybrid Qwen3.5 (three
Gated DeltaNet layers per full-attention layer, the torch reference kernels on CPU), whose
`paths` and `tree` run the recurrent layers segment by segment (learner/packed_recurrence.py);
its rows also show the recurrent scan calls per layer (segment levels x length buckets).

Traces look like a coding harness: every rollout of a group starts from one long system prompt
(with tool definitions), then makes many calls, each prompt extending the previous one by the
last completion and a tool result; one rollout in four compacts its history midway (a branch).
Per-call trains each call as its own sequence (what a plain trainer does); `paths` and `tree`
train the merge of each group. Each layout gets a fresh copy of the same weights and the same
rollouts; the table shows tokens forwarded, step time (forward + backward + AdamW: the best of
--repeats steps after one warm-up step, the layouts taking turns so that a busy moment on a
shared machine hits all of them) and speed-up over per-call, plus the step loss of the warm-up
step, which must agree across layouts. All layouts run the same learner code: on CPU, per-call
sequences get plain causal SDPA, as a one-sequence trainer would.

Then precision (skipped by --quick; --dtypes ""): SmolLM2-135M, its real weights, one learner
per dtype (float32, and bfloat16 autocast: grpo.Learner.autocast) on the same `tree` batch of
the same traces, each from a fresh copy of the same weights. Per dtype: learner tokens per second
(forward and backward), and the step split into forward, backward and optimizer (clip + AdamW),
the best of --repeats steps after a warm-up; `--profile` adds each dtype's heaviest ops
(torch.profiler, one more step).

    .venv/bin/python bench/learner_bench.py --quick              # < 60 s on 2 CPU cores
    .venv/bin/python bench/learner_bench.py                      # + the SmolLM2 dtype rows (~5 min)
    .venv/bin/python bench/learner_bench.py --models "" --profile   # only the dtype rows, profiled
    .venv/bin/python bench/learner_bench.py --device cuda --models smollm2

Last line: `RESULT tree_vs_percall=X paths_vs_percall=Y qwen35_tree_vs_percall=.. qwen35_paths_vs_percall=..
qwen35_tree_vs_paths=.. smollm2_fp32_tok_s=.. smollm2_bf16_tok_s=.. bf16_over_fp32=..` (the first two
for the Llama-type model, tiny or smollm2; the last three from the dtype rows).
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast import grpo, merge  # noqa: E402
from polar_fast.config import LearnerConfig  # noqa: E402
from polar_fast.grpo import Learner  # noqa: E402
from polar_fast.learner import packed_recurrence  # noqa: E402
from polar_fast.records import CallRecord, Outcome, RolloutRecord  # noqa: E402
from polar_fast.testing import groups_of  # noqa: E402

LAYOUTS = ("percall", "paths", "tree")


def harness_traces(*, groups: int, rollouts: int, calls: int, prompt: int, completion: int,
                   tool: int, vocab: int, seed: int = 0) -> tuple[list[CallRecord], list[RolloutRecord]]:
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    out_calls, out_rollouts = [], []
    for g in range(groups):
        system = ids(prompt)
        for r in range(rollouts):
            rid, context = f"g{g}r{r}", list(system)
            for i in range(calls):
                if r % 4 == 3 and i == calls // 2:  # compaction: history replaced by a summary
                    context = system + ids(tool)
                sampled = ids(completion)
                out_calls.append(CallRecord(
                    session_id=rid, rollout_id=rid, group_id=f"g{g}", call_index=i, prompt_ids=context,
                    completion_ids=sampled, completion_logprobs=(-rng.random(completion) * 2).tolist(),
                    policy_version=0, finish_reason="tool_calls", dialect="chat"))
                context = context + sampled + ids(tool)
            out_rollouts.append(RolloutRecord(rollout_id=rid, group_id=f"g{g}", task_id=str(g),
                                              harness="bench", outcome=Outcome.OK, reward=float(r % 2)))
    return out_calls, out_rollouts


def build_model(kind: str, vocab: int, hidden: int = 128, layers: int = 4):
    if kind == "smollm2":
        from polar_fast.model import load_model

        return load_model()
    torch.manual_seed(0)
    if kind == "tiny-qwen35":  # layer_types: 3 linear_attention then 1 full_attention, repeated
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                num_hidden_layers=max(4, layers // 4 * 4), num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, linear_key_head_dim=32,
                                linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                max_position_embeddings=16384)
        return Qwen3_5ForCausalLM(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
    return LlamaForCausalLM(cfg)


def merge_impl() -> str:
    """The merge the learner goes through polar_fast.merge with: "rust", or its Python twin
    where the extension does not run here (a device machine it was not built for)."""
    try:
        merge.merge([], layout="tree")  # raises if the Rust extension is missing
        return "rust"
    except Exception:
        return "reference"


def run(args: argparse.Namespace, kind: str) -> dict[str, dict]:
    model = build_model(kind, args.vocab, args.hidden, args.layers)
    vocab = model.config.vocab_size
    calls, rollouts = harness_traces(groups=args.groups, rollouts=args.rollouts, calls=args.calls,
                                     prompt=args.prompt, completion=args.completion, tool=args.tool, vocab=vocab)
    impl = merge_impl()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    cfg = LearnerConfig(lr=1e-6, device=args.device, dtype=dtype, attention=args.attention,
                        logprob_chunk_tokens=1024)
    print(f"model={kind} device={args.device} merge={impl} calls={len(calls)} "
          f"rollouts={len(rollouts)} call_tokens={sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)}")
    learners, batches, rows = {}, {}, {}
    for layout in LAYOUTS:
        learners[layout] = Learner(cfg, copy.deepcopy(model), layout=layout, max_tokens=args.max_tokens,
                                   merge_impl=impl)
        t0 = time.perf_counter()
        batches[layout] = batch = learners[layout].prepare(groups_of(calls, rollouts))
        rows[layout] = {"tokens": batch.n_tokens, "micro_batches": len(batch.micro_batches),
                        "terms": batch.n_terms, "prepare_s": time.perf_counter() - t0,
                        "scan_calls": _scan_calls(batch) if learners[layout].policy.recurrent else 0}
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for layout in LAYOUTS:  # warm-up (kernels, allocator) on the same weights: its loss is compared
        rows[layout]["loss"] = _timed_step(learners[layout], batches[layout], args.device, times[layout]).loss
        if args.repeats:
            times[layout].clear()
    for _ in range(args.repeats):  # round-robin, so a busy moment on a shared machine hits every layout
        for layout in LAYOUTS:
            _timed_step(learners[layout], batches[layout], args.device, times[layout])
    for layout in LAYOUTS:
        rows[layout]["step_s"] = min(times[layout])
    return rows


def dtype_rows(args: argparse.Namespace) -> list[dict]:
    """SmolLM2-135M on one `tree` batch, one learner per dtype, each on the weights as loaded
    (one learner at a time: a SmolLM2 learner holds ~2 GB before its activations)."""
    vocab = build_model("smollm2", args.vocab).config.vocab_size
    calls, rollouts = harness_traces(groups=1, rollouts=args.rollouts, calls=args.dtype_calls, prompt=args.prompt,
                                     completion=args.completion, tool=args.tool, vocab=vocab)
    rows = []
    for dtype in args.dtypes.split(","):
        cfg = LearnerConfig(lr=1e-6, device=args.device, dtype=dtype, attention=args.attention,
                            logprob_chunk_tokens=1024, gradient_checkpointing=args.checkpointing)
        learner = Learner(cfg, build_model("smollm2", vocab), layout="tree", max_tokens=args.max_tokens,
                          merge_impl=merge_impl())
        batch = learner.prepare(groups_of(calls, rollouts))
        steps = [_step_parts(learner, batch, args.device) for _ in range(1 + args.repeats)]
        best = min(steps[1:] or steps, key=lambda part: part["step_s"])
        row = {"dtype": dtype, "tokens": batch.n_tokens, "micro_batches": len(batch.micro_batches), **best,
               "tok_s": batch.n_tokens / (best["forward_s"] + best["backward_s"])}
        if args.profile:
            row["top_ops"] = _top_ops(learner, batch)
        rows.append(row)
        del learner, batch
        gc.collect()
    return rows


def _step_parts(learner: Learner, batch, device: str) -> dict:
    """One step's wall time split: forward (the policy's forwards), optimizer (grad clip and
    AdamW: grpo._clip_and_step, wrapped for the measure) and backward (the rest: autograd, and the
    LM-head chunks it recomputes)."""
    clock = {"forward_s": 0.0, "optimizer_s": 0.0}
    began: list[float] = []

    def forward_began(module, args):
        _sync(device)
        began.append(time.perf_counter())

    def forward_ended(module, args, out):
        _sync(device)
        clock["forward_s"] += time.perf_counter() - began.pop()

    clip_and_step = grpo._clip_and_step

    def timed_clip_and_step(*a, **k):
        _sync(device)
        t0 = time.perf_counter()
        out = clip_and_step(*a, **k)
        _sync(device)
        clock["optimizer_s"] += time.perf_counter() - t0
        return out

    hooks = [learner.policy.register_forward_pre_hook(forward_began),
             learner.policy.register_forward_hook(forward_ended)]
    grpo._clip_and_step = timed_clip_and_step
    try:
        times: list[float] = []
        _timed_step(learner, batch, device, times)
    finally:
        grpo._clip_and_step = clip_and_step
        for hook in hooks:
            hook.remove()
    return {"step_s": times[0], **clock, "backward_s": times[0] - clock["forward_s"] - clock["optimizer_s"]}


def _top_ops(learner: Learner, batch, n: int = 8) -> list[tuple[str, float]]:
    """The `n` ops with the most self time over one step, in seconds."""
    with torch.profiler.profile() as prof:
        learner.train_step(batch)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.self_cpu_time_total / 1e6) for e in events[:n]]


def print_dtype_rows(rows: list[dict]) -> list[str]:
    """The dtype table; returns its RESULT items."""
    print("SmolLM2-135M learner, one `tree` batch, by dtype (seconds per step; tok/s = tokens / (forward + backward))")
    print("| dtype | tokens | micro-batches | tok/s | step | forward | backward | optimizer |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['dtype']} | {r['tokens']} | {r['micro_batches']} | {r['tok_s']:.1f} | {r['step_s']:.2f} "
              f"| {r['forward_s']:.2f} | {r['backward_s']:.2f} | {r['optimizer_s']:.2f} |")
    for r in rows:
        if "top_ops" in r:
            print(f"{r['dtype']}: heaviest ops, self seconds over one step: "
                  + ", ".join(f"{name} {sec:.2f}" for name, sec in r["top_ops"]))
    by = {r["dtype"]: r["tok_s"] for r in rows}
    items = [f"smollm2_{SHORT.get(d, d)}_tok_s={v:.1f}" for d, v in by.items()]
    if "float32" in by and "bfloat16" in by:
        items.append(f"bf16_over_fp32={by['bfloat16'] / by['float32']:.2f}")
    print()
    return items


SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def _scan_calls(batch) -> int:
    """Sequential kernel calls per recurrent layer over the step (segment levels x length buckets)."""
    return sum(packed_recurrence.plan(torch.as_tensor(np.asarray(mb.size, np.int64))).n_calls
               for mb in batch.micro_batches)


def _timed_step(learner: Learner, batch, device: str, times: list[float]):
    _sync(device)
    t0 = time.perf_counter()
    metrics = learner.train_step(batch)
    _sync(device)
    times.append(time.perf_counter() - t0)
    return metrics


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small traces, tiny model, best of 3 steps per layout")
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="tiny,tiny-qwen35",
                   help="comma-separated: tiny (Llama), tiny-qwen35 (hybrid Gated DeltaNet), smollm2")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flex_attention", "eager"])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=4, help="per group")
    p.add_argument("--calls", type=int, default=12, help="per rollout")
    p.add_argument("--prompt", type=int, default=2000, help="system prompt tokens")
    p.add_argument("--completion", type=int, default=60, help="tokens per completion")
    p.add_argument("--tool", type=int, default=120, help="tool-result tokens per turn")
    p.add_argument("--max-tokens", type=int, default=8192, help="per micro-batch")
    p.add_argument("--vocab", type=int, default=32000, help="tiny model vocabulary")
    p.add_argument("--hidden", type=int, default=128, help="tiny model width")
    p.add_argument("--layers", type=int, default=4, help="tiny model depth")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch default; --quick uses 1: on a shared 2-core box OpenMP spin-waits dominate)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps after a warm-up (0: time the first)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help='the SmolLM2 precision rows, comma-separated ("": none; --quick: none)')
    p.add_argument("--dtype-calls", type=int, default=6, help="precision rows: calls per rollout (one group)")
    p.add_argument("--checkpointing", action="store_true", help="precision rows: gradient checkpointing on")
    p.add_argument("--profile", action="store_true", help="precision rows: each dtype's heaviest ops")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.rollouts, args.calls = 1, 4, 5
        args.prompt, args.completion, args.tool, args.max_tokens, args.repeats = 400, 16, 32, 4096, 3
        args.vocab, args.hidden, args.layers = 8000, 128, 2
        args.threads = args.threads or 1
        args.dtypes = ""
    if args.threads:
        torch.set_num_threads(args.threads)
    result = []
    for kind in filter(None, args.models.split(",")):
        torch.manual_seed(0)
        rows = run(args, kind)
        base = rows["percall"]
        print(f"{'layout':8} {'tokens':>8} {'batches':>8} {'terms':>7} {'scans':>6} {'prepare_s':>10} "
              f"{'step_s':>8} {'speedup':>8} {'loss':>12}")
        for layout, r in rows.items():
            print(f"{layout:8} {r['tokens']:8d} {r['micro_batches']:8d} {r['terms']:7d} {r['scan_calls']:6d} "
                  f"{r['prepare_s']:10.3f} {r['step_s']:8.3f} {base['step_s'] / r['step_s']:7.2f}x {r['loss']:12.6f}")
        loss_gap = max(abs(r["loss"] - base["loss"]) for r in rows.values())
        print(f"max loss difference vs per-call: {loss_gap:.2e} (same weights, same rollouts)\n")
        if loss_gap > 1e-3:
            print(f"ERROR: layouts disagree on the loss ({kind})", file=sys.stderr)
            return 1
        prefix = "qwen35_" if kind == "tiny-qwen35" else ""
        result += [f"{prefix}tree_vs_percall={base['step_s'] / rows['tree']['step_s']:.2f}",
                   f"{prefix}paths_vs_percall={base['step_s'] / rows['paths']['step_s']:.2f}"]
        if prefix:
            result.append(f"{prefix}tree_vs_paths={rows['paths']['step_s'] / rows['tree']['step_s']:.2f}")
    if args.dtypes:
        torch.manual_seed(0)
        result += print_dtype_rows(dtype_rows(args))
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
