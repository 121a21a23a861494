"""The embedded engine's continuous batching, on the real SmolLM2 weights: a call samples the same
ids with the same logprobs alone or sharing its steps with others (joining at different steps,
different prompt lengths, one stopping early), its logprobs are those of a teacher-forced forward,
a weight update waits for the batch to drain so each call names the weights that sampled it, a
cancelled call leaves the batch without disturbing the rest, and hybrid models are refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from polar_fast.config import parse_config
from polar_fast.engines import EngineError, Sampling

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPT_LENGTHS = [40, 310, 95, 530, 12, 200]  # 310 and 530 take two and three prefill chunks
PREFILL_CHUNK = 256


def _prompt(i: int, n: int) -> list[int]:
    return [(1000 + 37 * i + 11 * j) % 40_000 + 100 for j in range(n)]


async def _engine(max_batch: int = 8):
    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = parse_config({"engine": {"max_batch": max_batch, "prefill_chunk_tokens": PREFILL_CHUNK}})
    return await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)


async def _after_steps(engine, steps: int) -> None:
    """Waits until the engine has run `steps` forwards (its statistics, not a clock)."""
    while engine.statistics().steps < steps:
        await asyncio.sleep(0.005)


def _reference_model(state: dict | None = None):
    """A plain copy of the weights (transformers' own attention), for teacher-forced forwards."""
    from polar_fast.model import load_model

    model = load_model("").eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _teacher_forced(model, prompt: list[int], ids: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)]


async def test_calls_sample_alike_alone_and_batched():
    engine = await _engine()
    try:
        prompts = [_prompt(i, n) for i, n in enumerate(PROMPT_LENGTHS)]
        sampling = [Sampling(temperature=1.0, max_tokens=18 + 2 * i, seed=100 + i) for i in range(len(prompts))]
        # call 2 stops early on a token it samples: its 4th, found by a first run without the stop id
        probe = await engine.generate(prompts[2], sampling[2])
        stop_id = probe.token_ids[3]
        sampling[2] = Sampling(temperature=1.0, max_tokens=sampling[2].max_tokens, seed=102, stop_token_ids=[stop_id])

        alone = []
        for p, s in zip(prompts, sampling):
            engine.prefix_cache.clear()  # nothing carried over from one call to the next
            alone.append(await engine.generate(p, s))
        engine.prefix_cache.clear()

        start = engine.statistics().steps
        tasks = []
        for i, (p, s) in enumerate(zip(prompts, sampling)):
            await _after_steps(engine, start + 3 * i)  # call i joins once the batch has run 3*i steps
            tasks.append(asyncio.create_task(engine.generate(p, s)))
        together = await asyncio.gather(*tasks)
        stats = engine.statistics()
    finally:
        await engine.aclose()

    assert stats.batch_tokens_max >= 3, "the calls never shared a step"
    assert alone[2].finish_reason == together[2].finish_reason == "stop"
    assert alone[2].token_ids[-1] == stop_id and len(alone[2].token_ids) <= 4
    assert [g.finish_reason for i, g in enumerate(together) if i != 2] == ["length"] * 5
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.policy_version == b.policy_version == 0
    reference = await asyncio.to_thread(_reference_model)
    for p, g in zip(prompts, together):
        assert g.logprobs == pytest.approx(_teacher_forced(reference, p, g.token_ids), abs=1e-4)


async def test_weight_update_waits_for_the_batch_to_drain():
    engine = await _engine()
    try:
        first = [asyncio.create_task(engine.generate(_prompt(i, 60), Sampling(max_tokens=24, seed=i)))
                 for i in range(3)]
        await _after_steps(engine, 4)  # the three are decoding together
        # norms and a projection (the fused step's packed weights must follow the update)
        new_weights = {name: t * 1.01 if name.endswith(("norm.weight", "up_proj.weight")) else t
                       for name, t in engine.model.state_dict().items()}
        update = asyncio.create_task(engine.update_weights(list(new_weights.items()), version=1))
        await asyncio.sleep(0)  # the update is queued before the late call
        late = asyncio.create_task(engine.generate(_prompt(9, 60), Sampling(max_tokens=8, seed=9)))
        done_first = await asyncio.gather(*first)
        assert not late.done()  # nothing joins once an update waits
        await update
        late_gen = await late
    finally:
        await engine.aclose()

    assert [g.policy_version for g in done_first] == [0, 0, 0]
    assert all(g.version_changes == [] for g in done_first)
    assert late_gen.policy_version == 1 and engine.policy_version == 1
    # the late call was sampled by the new weights: a forward of them gives its logprobs
    reference = await asyncio.to_thread(_reference_model, new_weights)
    assert late_gen.logprobs == pytest.approx(_teacher_forced(reference, _prompt(9, 60), late_gen.token_ids),
                                              abs=1e-4)


async def test_a_cancelled_call_leaves_the_batch():
    engine = await _engine()
    try:
        keep_alone = await engine.generate(_prompt(1, 50), Sampling(max_tokens=12, seed=1))
        engine.prefix_cache.clear()
        doomed = asyncio.create_task(engine.generate(_prompt(2, 50), Sampling(max_tokens=500, seed=2)))
        keep = asyncio.create_task(engine.generate(_prompt(1, 50), Sampling(max_tokens=12, seed=1)))
        await _after_steps(engine, 3)
        doomed.cancel()
        kept = await keep
        with pytest.raises(asyncio.CancelledError):
            await doomed
        async with asyncio.timeout(10):  # the scheduler drops it at its next step
            while engine.statistics().running:
                await asyncio.sleep(0.005)
    finally:
        await engine.aclose()
    assert kept.token_ids == keep_alone.token_ids


async def test_closed_engine_fails_waiting_calls_cleanly():
    engine = await _engine(max_batch=1)
    running = asyncio.create_task(engine.generate(_prompt(1, 30), Sampling(max_tokens=400, seed=1)))
    queued = asyncio.create_task(engine.generate(_prompt(2, 30), Sampling(max_tokens=4, seed=2)))
    await _after_steps(engine, 2)
    await engine.aclose()
    for task in (running, queued):
        with pytest.raises(EngineError, match="closed"):
            await task


def test_hybrid_models_are_refused(tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from polar_fast.engines.embedded import EmbeddedEngine
    from polar_fast.model import load_tokenizer

    cfg = Qwen3_5TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    Qwen3_5ForCausalLM(cfg).save_pretrained(tmp_path / "hybrid")
    load_tokenizer().save_pretrained(tmp_path / "hybrid")
    run = parse_config({"model": {"path": str(tmp_path / "hybrid")}})
    with pytest.raises(EngineError, match="linear_attention.*vllm"):
        EmbeddedEngine(run.model, run.engine)
