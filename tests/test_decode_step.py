"""The embedded engine's fused step (engines/decode_step.py) on SmolLM2's real weights.

Compiled (engine.compile) in float32, a call samples the same ids alone as batched with others
(joining at different steps, one prompt in two prefill chunks), with a teacher-forced forward's
logprobs. In bfloat16 it decodes with the logprobs the learner's bf16 autocast computes for the
same tokens (the same rounding recipe), much closer to them than to float32's, also after a
weight update, which must reach the packed weights and the LM head's bf16 copy."""

from __future__ import annotations

import asyncio

import pytest
import torch

from polar_fast.config import LearnerConfig, parse_config
from polar_fast.engines import Sampling
from polar_fast.records import CallRecord

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def _prompt(i: int, n: int) -> list[int]:
    return [(1000 + 37 * i + 11 * j) % 40_000 + 100 for j in range(n)]


async def _engine(**engine):
    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = parse_config({"engine": {"max_batch": 4, "prefill_chunk_tokens": 256, **engine}})
    return await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)


def _teacher_forced(prompt: list[int], ids: list[int]) -> list[float]:
    from polar_fast.model import load_model

    model = load_model("").eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)]


async def test_compiled_step_samples_alike_alone_and_batched():
    engine = await _engine(compile=True)
    prompts = [_prompt(i, n) for i, n in enumerate([40, 310, 95])]
    sampling = [Sampling(temperature=1.0, max_tokens=10 + 3 * i, seed=200 + i) for i in range(3)]
    try:
        assert engine.forward.compile_s > 0  # compiled, not fallen back to eager
        alone = []
        for p, s in zip(prompts, sampling):
            engine.prefix_cache.clear()
            alone.append(await engine.generate(p, s))
        engine.prefix_cache.clear()
        start = engine.statistics().steps
        tasks = []
        for i, (p, s) in enumerate(zip(prompts, sampling)):
            while engine.statistics().steps < start + 2 * i:  # call i joins once the batch ran 2*i steps
                await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(engine.generate(p, s)))
        together = await asyncio.gather(*tasks)
        stats = engine.statistics()
    finally:
        await engine.aclose()
    assert stats.batch_tokens_max >= 2, "the calls never shared a step"
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    reference = await asyncio.to_thread(_teacher_forced, prompts[1], together[1].token_ids)
    assert together[1].logprobs == pytest.approx(reference, abs=1e-4)


def _learner_logprobs(dtype: str, calls: list[CallRecord], state: dict) -> torch.Tensor:
    from polar_fast.grpo import Learner
    from polar_fast.model import load_model

    model = load_model("")
    model.load_state_dict(state)
    learner = Learner(LearnerConfig(dtype=dtype, check_packed=False), model, layout="tree", max_tokens=4096)
    return torch.cat([torch.as_tensor(x) for x in learner.logprobs(calls)])


async def test_bf16_step_computes_as_the_bf16_learner_also_after_an_update():
    engine = await _engine(dtype="bfloat16")
    try:
        # every kind of weight moved: packed projections, norms, and the tied embedding / LM head
        new = {name: t.float() * (1.02 if "norm" in name else 0.98) for name, t in engine.model.state_dict().items()}
        await engine.update_weights(list(new.items()), version=1)
        prompts = [_prompt(i, n) for i, n in enumerate([60, 300, 120])]
        gens = await asyncio.gather(*[engine.generate(p, Sampling(temperature=1.0, max_tokens=24, seed=300 + i))
                                      for i, p in enumerate(prompts)])
    finally:
        await engine.aclose()
    assert all(g.policy_version == 1 and len(g.token_ids) == 24 for g in gens)
    calls = [CallRecord(session_id=f"s{i}", rollout_id=f"r{i}", group_id="g", call_index=0, prompt_ids=p,
                        completion_ids=g.token_ids, completion_logprobs=g.logprobs, policy_version=1,
                        finish_reason=g.finish_reason, dialect="chat") for i, (p, g) in enumerate(zip(prompts, gens))]
    engine_logp = torch.tensor([lp for g in gens for lp in g.logprobs])
    as_bf16 = await asyncio.to_thread(_learner_logprobs, "bfloat16", calls, new)
    as_fp32 = await asyncio.to_thread(_learner_logprobs, "float32", calls, new)
    gap_bf16, gap_fp32 = (engine_logp - as_bf16).abs().mean(), (engine_logp - as_fp32).abs().mean()
    assert gap_bf16 < BF16_GAP, f"bf16 engine vs bf16 learner: mean |delta logprob| {gap_bf16:.4f}"
    assert gap_fp32 < FP32_GAP, f"bf16 engine vs fp32 learner: mean |delta logprob| {gap_fp32:.4f}"
    assert gap_bf16 < gap_fp32 / 2, "the bf16 engine should round as the bf16 learner does"
