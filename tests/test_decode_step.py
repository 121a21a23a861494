"""The embedded engine's fused step (engines/decode_step.py).

On tiny random models (a Llama, a Qwen2 with biased projections) it computes in float32 the
logits transformers' own forward computes with the same attention, step after step; a model it
does not know goes through transformers' forward. On SmolLM2's real weights: compiled (engine.compile) in float32, a call samples the same ids alone as batched with others
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


def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    if kind == "qwen2":  # biased q, k and v
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)).eval()


def _scenario(step) -> list[torch.Tensor]:
    """A prompt prefilled in two chunks, then two calls that share it as their base, each
    prefilling its own turn in one step, then decoding together: the logits of every step."""
    from polar_fast.engines.batched_attention import CallKV, Segment, StepPlan

    config = step.model.config
    rep = config.num_attention_heads // config.num_key_value_heads
    out = []

    def run(parts: list[tuple[CallKV, list[int]]]) -> None:
        segments, tokens, positions, rows = [], [], [], []
        for kv, ids in parts:
            segments.append(Segment(kv, len(tokens), len(tokens) + len(ids)))
            positions += range(kv.length, kv.length + len(ids))
            tokens += ids
            rows.append(len(tokens) - 1)
        plan = StepPlan.of(segments, "cpu", step.dtype, rep=rep)
        out.append(step.logits(tokens, positions, plan, rows))
        plan.commit()

    with torch.inference_mode():
        root = CallKV.for_model(config, dtype=step.dtype, device="cpu", capacity=8)
        solo = CallKV.for_model(config, dtype=step.dtype, device="cpu", capacity=8)
        run([(root, list(range(3, 20)))])
        run([(root, list(range(20, 31))), (solo, [7, 8, 9, 10, 11, 12])])  # two chunks in one step
        calls = [root.share_prefix(25), root.share_prefix(25)]  # root keeps 3 positions past the base
        run([(calls[0], [40, 41, 42]), (calls[1], [50, 51, 52, 53, 54])])  # prefill over a base
        for t in range(3):  # the base's group is rows 0, 2 and 3; solo has no base
            run([(calls[0], [60 + t]), (solo, [70 + t]), (calls[1], [80 + t]), (root, [90 + t])])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_step_computes_what_transformers_does(kind):
    """Tiny random models through the fused step and through transformers' forward with the same
    attention, in float32: the same logits at every step (chunked prefill, shared bases, a call
    with none beside them)."""
    import copy

    from polar_fast.engines.decode_step import FusedStep, TransformersStep

    model = _tiny(kind)
    fused = _scenario(FusedStep(copy.deepcopy(model), torch.float32))
    reference = _scenario(TransformersStep(copy.deepcopy(model)))
    for a, b in zip(fused, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_models_the_fused_step_does_not_know_take_transformers_forward():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from polar_fast.engines.decode_step import TransformersStep, for_model, why_not_fused

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert why_not_fused(model) == "Qwen3Attention has parts besides q/k/v/o projections"  # q_norm, k_norm
    assert isinstance(for_model(model, dtype="float32"), TransformersStep)




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


@pytest.mark.anyio
@pytest.mark.slow
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


def _autocast_logprobs(state: dict, ids: list[int]) -> torch.Tensor:
    """(T, V) logprobs of transformers' forward under the learner's bf16 autocast."""
    from polar_fast.model import load_model

    model = load_model("").eval()
    model.load_state_dict(state)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _one_step_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """(T, V) logprobs of the engine's step forwarding `ids` as one prefill of a fresh call."""
    from polar_fast.engines.batched_attention import CallKV, Segment, StepPlan

    config, step = engine.model.config, engine.forward
    kv = CallKV.for_model(config, dtype=step.dtype, device="cpu", capacity=len(ids))
    plan = StepPlan.of([Segment(kv, 0, len(ids))], "cpu", step.dtype,
                       rep=config.num_attention_heads // config.num_key_value_heads)
    with torch.inference_mode():
        return torch.log_softmax(step.logits(ids, list(range(len(ids))), plan, list(range(len(ids)))), dim=-1)


@pytest.mark.anyio
@pytest.mark.slow
async def test_bf16_step_computes_as_the_bf16_learner_also_after_an_update():
    """bf16 rounding is chaotic: two computations that differ in one rounding anywhere (a matmul
    of 1 row rounds a few outputs apart from one of 200) end as far apart as bf16 is from
    float32. So the recipe is checked where shapes match, one prefill against one autocast
    forward of the same tokens, bit for bit; sampled calls (decode steps of a few rows) are
    checked against the learners at bf16's own distance."""
    engine = await _engine(dtype="bfloat16")
    try:
        # every kind of weight moved: packed projections, norms, and the tied embedding / LM head
        new = {name: t.float() * (1.02 if "norm" in name else 0.98) for name, t in engine.model.state_dict().items()}
        await engine.update_weights(list(new.items()), version=1)
        prompts = [_prompt(i, n) for i, n in enumerate([60, 300, 120])]
        gens = await asyncio.gather(*[engine.generate(p, Sampling(temperature=1.0, max_tokens=24, seed=300 + i))
                                      for i, p in enumerate(prompts)])
        ids = prompts[1] + gens[1].token_ids
        stepped = await asyncio.to_thread(_one_step_logprobs, engine, ids)  # the scheduler thread is idle now
    finally:
        await engine.aclose()
    assert all(g.policy_version == 1 and len(g.token_ids) == 24 for g in gens)
    torch.testing.assert_close(stepped, await asyncio.to_thread(_autocast_logprobs, new, ids), atol=1e-3, rtol=0)

    calls = [CallRecord(session_id=f"s{i}", rollout_id=f"r{i}", group_id="g", call_index=0, prompt_ids=p,
                        completion_ids=g.token_ids, completion_logprobs=g.logprobs, policy_version=1,
                        finish_reason=g.finish_reason, dialect="chat") for i, (p, g) in enumerate(zip(prompts, gens))]
    engine_logp = torch.tensor([lp for g in gens for lp in g.logprobs])
    for dtype in ("bfloat16", "float32"):
        gap = (engine_logp - await asyncio.to_thread(_learner_logprobs, dtype, calls, new)).abs()
        assert gap.mean() < 0.1 and gap.max() < 0.5, f"bf16 engine vs {dtype} learner: mean |delta| {gap.mean():.4f}"
