"""The learner memory estimate (learner/memory.py) against the peak a real step allocates.

For each model shape (random weights built from a config on the device: nothing downloaded) and
each gradient-checkpointing setting, one learner (the run's own Learner, bf16 autocast on one
GPU) takes two GRPO steps on a group of two rollouts whose calls fill `--tokens` (one packed
micro-batch). The second step's peak (`torch.cuda.max_memory_allocated`; the first step creates
the optimizer state) is compared with `estimate.total_bytes`, and the static parts are measured
exactly: weights, and optimizer state after the step.

    python bench/memory_bench.py                       # cuda, the shapes below, 16k tokens
    python bench/memory_bench.py --device cpu --quick  # smoke run: a tiny shape, sizes only

Ends with `RESULT key=value ...` (the worst estimate / measured ratio over the rows).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast.config import LearnerConfig, parse_config  # noqa: E402
from polar_fast.grpo import Learner  # noqa: E402
from polar_fast.learner.memory import estimate_memory  # noqa: E402
from polar_fast.records import CallRecord, Outcome, RolloutRecord  # noqa: E402
from polar_fast.testing import groups_of  # noqa: E402

GIB = 2**30
SHAPES = {  # public configs' shapes (Qwen3-0.6B / 1.7B / 4B, Llama-3.2-1B); random weights
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True)),
    "llama-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                     tie_word_embeddings=True)),
    "qwen3-1.7b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True)),
    "qwen3-4b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                     head_dim=128, tie_word_embeddings=True)),
    "tiny": ("LlamaConfig", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),
}


def groups(tokens: int, vocab: int):
    """One group of two rollouts (rewards 1 and 0), one call each, together `tokens` long."""
    rng = np.random.default_rng(0)
    half = tokens // 2
    calls = []
    for rid in ("a", "b"):
        prompt, completion = rng.integers(3, vocab, half // 2).tolist(), rng.integers(3, vocab, half - half // 2).tolist()
        calls.append(CallRecord(session_id=rid, rollout_id=rid, group_id="g", call_index=0, prompt_ids=prompt,
                                completion_ids=completion, completion_logprobs=[-1.0] * len(completion),
                                policy_version=0, finish_reason="stop", dialect="chat"))
    rollouts = [RolloutRecord(rollout_id=r, group_id="g", task_id="t", harness="h", outcome=Outcome.OK, reward=v)
                for r, v in (("a", 1.0), ("b", 0.0))]
    return groups_of(calls, rollouts)


def row(shape: str, tokens: int, checkpointing: bool, device: str, tmp: Path) -> dict:
    import transformers

    kind, fields = SHAPES[shape]
    config = getattr(transformers, kind)(**fields)
    config.save_pretrained(tmp)
    raw = {"model": {"path": str(tmp)}, "merge": {"max_tokens": tokens},
           "learner": {"dtype": "bfloat16", "device": device, "gradient_checkpointing": checkpointing,
                       "logprob_chunk_tokens": 1024}}
    estimate = estimate_memory(parse_config(raw))
    torch.manual_seed(0)
    with torch.device(device):  # random weights made where they train
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    cuda = device.startswith("cuda")
    learner = Learner(LearnerConfig(**raw["learner"], check_packed=False, attention="sdpa"), model,
                      layout="tree", max_tokens=tokens, merge_impl="reference")
    batch = groups(tokens, config.vocab_size)
    weights = sum(p.numel() * p.element_size() for p in learner.policy.parameters())
    started = time.perf_counter()
    try:
        learner.step(batch)  # creates the optimizer state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        learner.step(batch)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
    except torch.OutOfMemoryError:  # the estimate said so too, or it is wrong: the row shows which
        peak = -1
    optimizer = sum(t.numel() * t.element_size() for s in learner.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))
    out = {"shape": shape, "tokens": tokens, "gc": checkpointing, "params_M": estimate.params / 1e6,
           "weights_ok": estimate.weights == weights, "optimizer_ok": estimate.optimizer == optimizer,
           "estimate_GiB": estimate.total_bytes(checkpointing=checkpointing) / GIB,
           "measured_GiB": peak / GIB, "step_s": time.perf_counter() - started}
    out["ratio"] = out["estimate_GiB"] / out["measured_GiB"] if peak > 0 else float("nan")
    del learner, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="qwen3-0.6b,llama-1b")
    p.add_argument("--tokens", default="16384")
    p.add_argument("--quick", action="store_true", help="the tiny shape at 256 tokens (smoke run)")
    args = p.parse_args()
    shapes, token_counts = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
    if args.quick:
        shapes, token_counts = ["tiny"], [256]
    import tempfile

    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / GIB:.1f} GiB; "
              f"torch {torch.__version__}")
    rows = []
    print(f"{'shape':<12}{'tokens':>7}{'gc':>6}{'params_M':>10}{'estimate':>10}{'measured':>10}{'ratio':>7}"
          f"{'step_s':>8}  exact(weights, optimizer)")
    for shape in shapes:
        for tokens in token_counts:
            for checkpointing in (False, True):
                with tempfile.TemporaryDirectory() as tmp:
                    r = row(shape, tokens, checkpointing, args.device, Path(tmp))
                rows.append(r)
                measured = "OOM" if r["measured_GiB"] < 0 else f"{r['measured_GiB']:.2f}"
                print(f"{r['shape']:<12}{r['tokens']:>7}{str(r['gc']):>6}{r['params_M']:>10.1f}"
                      f"{r['estimate_GiB']:>10.2f}{measured:>10}{r['ratio']:>7.2f}{r['step_s']:>8.2f}"
                      f"  {r['weights_ok']}, {r['optimizer_ok']}", flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"] == r["ratio"]]
    exact = all(r["weights_ok"] and r["optimizer_ok"] for r in rows)
    worst = f"{min(ratios):.3f}/{max(ratios):.3f}" if ratios else "nan"
    print(f"RESULT rows={len(rows)} exact={exact} ratio_min_max={worst}")


if __name__ == "__main__":
    main()
