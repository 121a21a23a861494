"""GRPO learns: the real embedded engine samples two-call rollouts, the learner trains on the
tree merge of each group, weights go back in process, and mean reward rises (fixed seeds).

The policy is a tiny random Llama with a 16-token vocabulary (saved next to SmolLM2's tokenizer,
which the engine reads for its stop token), so sampling and training both take seconds on CPU.
Reward: the share of sampled tokens that fall in TARGET (about a quarter by chance)."""

from __future__ import annotations

import anyio
import pytest
import torch

from polar_fast.config import EngineConfig, LearnerConfig, ModelConfig
from polar_fast.engines import Sampling
from polar_fast.engines.embedded import EmbeddedEngine
from polar_fast.grpo import Learner
from polar_fast.learner.weight_sync import EngineSync
from polar_fast.model import load_model, load_tokenizer
from polar_fast.records import CallRecord, Outcome, RolloutRecord
from polar_fast.testing import groups_of

TARGET = {3, 4, 5, 6}
VOCAB = 16
GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 6, 5


@pytest.fixture
def tiny_model_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=2, bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    load_tokenizer().save_pretrained(tmp_path / "tiny")  # only its eos id (2) is used
    return str(tmp_path / "tiny")


def reward(calls: list[CallRecord]) -> float:
    tokens = [t for c in calls for t in c.completion_ids]
    return sum(t in TARGET for t in tokens) / (2 * MAX_TOKENS)


async def rollout(engine, rid: str, gid: str, prompt: list[int], seed: int) -> list[CallRecord]:
    calls = []
    for i in range(2):  # the second call extends the first: the merge shares the prefix
        gen = await engine.generate(prompt, Sampling(max_tokens=MAX_TOKENS, seed=seed + i))
        calls.append(CallRecord(session_id=rid, rollout_id=rid, group_id=gid, call_index=i,
                                prompt_ids=prompt, completion_ids=gen.token_ids,
                                completion_logprobs=gen.logprobs, policy_version=gen.policy_version,
                                finish_reason=gen.finish_reason, dialect="chat"))
        prompt = prompt + gen.token_ids + [7, 8]
    return calls


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.anyio
async def test_mean_reward_rises(tiny_model_dir):
    def setup() -> tuple[EmbeddedEngine, Learner]:  # loading reads files: off the event loop
        engine = EmbeddedEngine(ModelConfig(path=tiny_model_dir), EngineConfig())
        learner = Learner(LearnerConfig(lr=2e-2, grad_clip=1.0), load_model(tiny_model_dir),
                          layout="tree", max_tokens=512, merge_impl="reference")
        return engine, learner

    engine, learner = await anyio.to_thread.run_sync(setup)
    sync = EngineSync(engine)
    means = []
    for step in range(8):
        calls, rollouts = [], []
        for g in range(GROUPS):
            prompt = [1, 9 + g, 10 + g]
            for i in range(GROUP_SIZE):
                rid = f"s{step}g{g}r{i}"
                rc = await rollout(engine, rid, f"s{step}g{g}", prompt, seed=1000 * step + 10 * (g * GROUP_SIZE + i))
                calls += rc
                rollouts.append(RolloutRecord(rollout_id=rid, group_id=f"s{step}g{g}", task_id=str(g),
                                              harness="test", outcome=Outcome.OK, reward=reward(rc)))
        metrics = await anyio.to_thread.run_sync(learner.step, groups_of(calls, rollouts))
        means.append(metrics.reward_mean)
        assert all(c.policy_version == step for c in calls)  # sampled by the weights of this step
        await learner.sync_weights(sync)
        assert engine.policy_version == learner.version == step + 1
    await engine.aclose()
    early, late = sum(means[:2]) / 2, sum(means[-2:]) / 2
    assert late > early + 0.3, means  # seen: 0.21 -> 0.93 over 8 steps
