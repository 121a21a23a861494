"""The engine/learner mismatch against an engine whose recorded logprobs are shifted on purpose:
the step's figures equal the shift, `none` loses to the clip the gradient `tis` keeps (for a
positive and for a negative advantage), `mask` drops what leaves its band, and the first step's
gate stops before the update.

The engine is the real embedded one over a tiny random Llama (its logprobs are the learner's own
to ~1e-6 in fp32); ShiftedEngine adds a chosen shift to what it records, per session."""

from __future__ import annotations

import math

import anyio
import msgspec
import pytest
import torch

from polar_fast.config import EngineConfig, LearnerConfig, ModelConfig
from polar_fast.engines import Sampling
from polar_fast.engines.embedded import EmbeddedEngine
from polar_fast.grpo import Gate, Learner, MismatchError
from polar_fast.model import load_model, load_tokenizer
from polar_fast.records import CallRecord, Outcome, RolloutRecord
from polar_fast.testing import groups_of

VOCAB = 64
PROMPT = [1, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=2, bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("mismatch") / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    load_tokenizer().save_pretrained(path)  # only its eos id (2) is used
    return str(path)


class ShiftedEngine:
    """The embedded engine, its recorded logprobs shifted by `shift[session_id]` (0 for others; a
    tuple shifts the tokens in turn)."""

    def __init__(self, engine: EmbeddedEngine, shift: dict[str, float | tuple[float, ...]]) -> None:
        self.engine, self.shift = engine, shift

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, sampling: Sampling, *, session_id: str = ""):
        gen = await self.engine.generate(prompt_ids, sampling, session_id=session_id)
        s = self.shift.get(session_id, 0.0)
        cycle = s if isinstance(s, tuple) else (s,)
        return msgspec.structs.replace(gen, logprobs=[lp + cycle[i % len(cycle)] for i, lp in enumerate(gen.logprobs)])


def sample_group(model_dir: str, shift: dict, seeds: dict[str, int]) -> list[CallRecord]:
    """One call per rollout (session = rollout id), sampled by the shifted engine; equal seeds give
    equal tokens (the embedded engine's per-call generators)."""
    async def run() -> list[CallRecord]:
        base = await anyio.to_thread.run_sync(lambda: EmbeddedEngine(ModelConfig(path=model_dir), EngineConfig()))
        engine = ShiftedEngine(base, shift)
        calls = []
        try:
            for rid, seed in seeds.items():
                gen = await engine.generate(PROMPT, Sampling(max_tokens=12, seed=seed), session_id=rid)
                calls.append(CallRecord(session_id=rid, rollout_id=rid, group_id="g", call_index=0,
                                        prompt_ids=PROMPT, completion_ids=gen.token_ids,
                                        completion_logprobs=gen.logprobs, policy_version=0,
                                        finish_reason=gen.finish_reason, dialect="chat"))
        finally:
            await base.aclose()
        return calls

    return anyio.run(run)


def rollouts(rewards: dict[str, float]) -> list[RolloutRecord]:
    return [RolloutRecord(rollout_id=r, group_id="g", task_id="t", harness="h", outcome=Outcome.OK, reward=v)
            for r, v in rewards.items()]


def learner(model_dir: str, **cfg) -> Learner:
    cfg.setdefault("lr", 1e-3)
    return Learner(LearnerConfig(**cfg), load_model(model_dir), layout="tree", max_tokens=64, merge_impl="reference")


def test_the_step_measures_the_shift(model_dir):
    shift = 0.3  # the engine says every token was e^0.3 likelier than the learner finds it
    calls = sample_group(model_dir, {"a": shift, "b": shift}, {"a": 1, "b": 2})
    m = learner(model_dir).step(groups_of(calls, rollouts({"a": 1.0, "b": 0.0})))
    assert m.n_terms == sum(len(c.completion_ids) for c in calls) > 10
    assert m.mismatch_abs_mean == pytest.approx(shift, abs=1e-5)
    assert m.mismatch_abs_max == pytest.approx(shift, abs=1e-5)
    assert m.mismatch_kl == pytest.approx(math.exp(-shift) - 1 + shift, abs=1e-5)  # k3 at r = e^-0.3
    assert m.mismatch_out_of_clip == 1.0  # e^-0.3 = 0.74 < 1 - clip_low

    plain = sample_group(model_dir, {}, {"a": 1, "b": 2})
    m = learner(model_dir).step(groups_of(plain, rollouts({"a": 1.0, "b": 0.0})))
    assert m.mismatch_abs_max < 1e-4 and m.mismatch_kl < 1e-8 and m.mismatch_out_of_clip == 0.0


@pytest.mark.parametrize(("shifted", "shift", "kept"), [
    ("a", -0.5, math.exp(0.5)),  # the positive advantage's tokens: ratio e^0.5 = 1.65 > 1 + clip_high
    ("b", 0.5, math.exp(-0.5)),  # the negative advantage's tokens: ratio e^-0.5 = 0.61 < 1 - clip_low
])
def test_none_loses_to_the_clip_the_gradient_tis_keeps(model_dir, shifted, shift, kept):
    """Rollouts a (reward 1) and b (reward 0) sampled the same tokens, so their terms' gradients are
    +-A g with the same g; one rollout's recorded logprobs are shifted past the clip. `none` clips
    that rollout's terms (gradient 0: what is left is the other rollout's, norm |A| |g|); `tis` keeps
    them with weight `kept`, so the two cancel but for |1 - kept| |A| |g|; `mask` with a band that
    excludes them drops them (the same gradient as none's)."""
    calls = sample_group(model_dir, {shifted: shift}, {"a": 7, "b": 7})
    assert calls[0].completion_ids == calls[1].completion_ids
    group = groups_of(calls, rollouts({"a": 1.0, "b": 0.0}))
    none = learner(model_dir, is_correction="none").step(group)
    tis = learner(model_dir, is_correction="tis").step(group)
    mask = learner(model_dir, is_correction="mask", is_mask_low=0.8, is_mask_high=1.28).step(group)
    assert none.clip_frac == pytest.approx(0.5) and tis.clip_frac == 0.0  # per-rollout weights: half each
    assert tis.grad_norm == pytest.approx(abs(1 - kept) * none.grad_norm, rel=1e-3)
    assert mask.grad_norm == pytest.approx(none.grad_norm, rel=1e-4) and mask.is_corrected == pytest.approx(0.5)
    assert tis.is_weight_mean == pytest.approx((1 + kept) / 2, rel=1e-4)


def test_rollout_level_mask_drops_the_whole_rollout(model_dir):
    """Rollout a's tokens alternate between ratio 1 (inside the band [0.5, 2]) and e^2 (outside):
    the token-level mask keeps half of them, while their geometric mean e^1 (an even count) leaves
    the band, so the rollout level drops all of them, from one extra forward: b's gradient alone,
    as when every token of a is outside."""
    calls = sample_group(model_dir, {"a": (0.0, -2.0)}, {"a": 7, "b": 7})
    assert len(calls[0].completion_ids) == 12  # even: cut at max_tokens
    group = groups_of(calls, rollouts({"a": 1.0, "b": 0.0}))
    token = learner(model_dir, is_correction="mask").step(group)
    whole = learner(model_dir, is_correction="mask", is_mask_level="rollout").step(group)
    assert token.is_corrected == pytest.approx(0.25) and whole.is_corrected == pytest.approx(0.5)
    all_out = groups_of(sample_group(model_dir, {"a": -1.0}, {"a": 7, "b": 7}), rollouts({"a": 1.0, "b": 0.0}))
    b_alone = learner(model_dir, is_correction="mask").step(all_out)
    assert whole.grad_norm == pytest.approx(b_alone.grad_norm, rel=1e-5)
    assert token.grad_norm != pytest.approx(b_alone.grad_norm, rel=1e-2)


def test_the_gate_stops_before_the_update(model_dir):
    calls = sample_group(model_dir, {"a": 0.3, "b": 0.3}, {"a": 1, "b": 2})
    group = groups_of(calls, rollouts({"a": 1.0, "b": 0.0}))
    lrn = learner(model_dir)
    before = [p.detach().clone() for p in lrn.policy.parameters()]
    gate = Gate(max_kl=0.01, settings={"engine.dtype": "bfloat16", "learner.dtype": "float32"})
    with pytest.raises(MismatchError) as caught:
        lrn.step(group, gate=gate)
    text = str(caught.value)
    assert f"mismatch KL {math.exp(-0.3) - 0.7:.4g}" in text and "learner.max_mismatch_kl = 0.01" in text
    assert "100.0% of tokens outside the clip band [0.8, 1.28]" in text
    assert "engine.dtype = bfloat16, learner.dtype = float32" in text
    for cause in ("- dtype:", "- temperature or top-p not owned by the run:", "- the chat template", "- a kernel:"):
        assert cause in text
    assert caught.value.figures.abs_max == pytest.approx(0.3, abs=1e-5)
    assert lrn.step_count == 0 and lrn.version == 0
    assert all(torch.equal(p, q) for p, q in zip(lrn.policy.parameters(), before))
    assert all(p.grad is None for p in lrn.policy.parameters())

    assert lrn.step(group, gate=Gate(max_kl=0.05)).step == 1  # under its limit the step trains
    assert lrn.step(group, gate=Gate(max_kl=0.0)).step == 2  # 0: off
