"""Engine/learner mismatch per dtype pair: what `learner/mismatch_kl` (and the step-0 gate,
`learner.max_mismatch_kl`) reads when the embedded engine samples in one dtype and the learner
computes logprobs in another.

The calls are a real harness's: mini-swe-agent's captured prompts (bench/data/captured), each
sampled by the embedded engine at temperature 1 with its own seed and up to --max-tokens new
tokens (run.toml's sampling.max_tokens), all calls decoded together as in a run. Each engine
dtype (float32; bfloat16, the learner's autocast recipe: engines/decode_step.py) samples its own
calls; the learner (grpo.Learner.logprobs, the first forward of a step, on SmolLM2's real weights)
computes their logprobs in float32 and under bf16 autocast. Per pair: the k3 KL(behaviour ||
learner) token mean, mean and max |delta logprob|, the share of tokens outside the PPO clip band
(learner/mismatch.py's figures). float32 against float32 is the check that the engine is exact:
the bench fails when its KL exceeds 1e-6.

    .venv/bin/python bench/mismatch_bench.py --quick   # 4 calls of up to 48 tokens
    .venv/bin/python bench/mismatch_bench.py           # 16 calls of up to 192 tokens

Last line: `RESULT kl_fp32_fp32=.. kl_bf16_bf16=.. kl_bf16_fp32=.. kl_fp32_bf16=..` (engine dtype
first, learner second) and `gate=` (learner.max_mismatch_kl's default).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # the captured sessions

import torch  # noqa: E402

from polar_fast.config import LearnerConfig, parse_config  # noqa: E402
from polar_fast.engines import Sampling  # noqa: E402
from polar_fast.learner import losses  # noqa: E402
from polar_fast.records import CallRecord  # noqa: E402

SHORT = {"float32": "fp32", "bfloat16": "bf16"}
EXACT_KL = 1e-6  # float32 engine against float32 learner: rounding only


def harness_prompts(n: int, max_prompt: int) -> list[list[int]]:
    """`n` distinct prompts of mini-swe-agent's captured calls (the longest first up to max_prompt)."""
    from captured import group_calls

    seen, prompts = set(), []
    for call in sorted(group_calls("mini-swe-agent"), key=lambda c: -len(c.prompt_ids)):
        key = tuple(call.prompt_ids)
        if len(key) <= max_prompt and key not in seen:
            seen.add(key)
            prompts.append(list(key))
    if len(prompts) < n:
        raise SystemExit(f"mismatch_bench: only {len(prompts)} captured prompts of at most {max_prompt} tokens")
    return prompts[:n]


async def sample(dtype: str, prompts: list[list[int]], max_tokens: int) -> list[CallRecord]:
    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = parse_config({"engine": {"dtype": dtype, "max_batch": len(prompts)}})
    engine = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)
    try:
        gens = await asyncio.gather(*[
            engine.generate(p, Sampling(temperature=1.0, max_tokens=max_tokens, seed=1000 + i))
            for i, p in enumerate(prompts)])
    finally:
        await engine.aclose()
    return [CallRecord(session_id=f"s{i}", rollout_id=f"r{i}", group_id="g", call_index=0, prompt_ids=p,
                       completion_ids=g.token_ids, completion_logprobs=g.logprobs, policy_version=0,
                       finish_reason=g.finish_reason, dialect="chat")
            for i, (p, g) in enumerate(zip(prompts, gens))]


def figures(learner_logp: list, calls: list[CallRecord], cfg: LearnerConfig) -> dict:
    learner = torch.cat([torch.as_tensor(x) for x in learner_logp])
    behaviour = torch.tensor([lp for c in calls for lp in c.completion_logprobs])
    k3, delta, outside = losses.mismatch_terms(learner, behaviour, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    return {"kl": float(k3.mean()), "abs_mean": float(delta.mean()), "abs_max": float(delta.max()),
            "out_of_clip": float(outside.mean()), "tokens": len(k3)}


def main() -> int:
    from polar_fast.grpo import Learner
    from polar_fast.model import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 calls of up to 48 tokens")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--max-prompt", type=int, default=4096)
    args = p.parse_args()
    if args.quick:
        args.calls, args.max_tokens, args.max_prompt = 4, 48, 2048
    prompts = harness_prompts(args.calls, args.max_prompt)
    print(f"{len(prompts)} mini-swe-agent prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"up to {args.max_tokens} sampled tokens each", flush=True)
    sampled = {dtype: asyncio.run(sample(dtype, prompts, args.max_tokens)) for dtype in SHORT}
    rows = []
    for learner_dtype in SHORT:
        cfg = LearnerConfig(dtype=learner_dtype)
        learner = Learner(cfg, load_model(""), layout="tree", max_tokens=8192)
        for engine_dtype, calls in sampled.items():
            rows.append({"engine": engine_dtype, "learner": learner_dtype,
                         **figures(learner.logprobs(calls), calls, cfg)})
        del learner
    print("\n| engine | learner | mismatch KL (k3) | mean abs delta | max abs delta | out of clip | tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['engine']} | {r['learner']} | {r['kl']:.2e} | {r['abs_mean']:.2e} | {r['abs_max']:.3f} "
              f"| {100 * r['out_of_clip']:.2f}% | {r['tokens']} |")
    gate = LearnerConfig().max_mismatch_kl
    exact = next(r["kl"] for r in rows if r["engine"] == r["learner"] == "float32")
    if exact > EXACT_KL:
        print(f"ERROR: the float32 engine and learner disagree (KL {exact:.2e} > {EXACT_KL:g})", file=sys.stderr)
        return 1
    print("RESULT " + " ".join(f"kl_{SHORT[r['engine']]}_{SHORT[r['learner']]}={r['kl']:.3g}" for r in rows)
          + f" gate={gate:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
