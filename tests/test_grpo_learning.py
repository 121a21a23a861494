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


# ------------------------------------------------------------------- through a real harness

BOOSTED = range(40_000, 40_016)  # token ids the tiny model mostly samples (rare pieces: never in the prompt)
BOOST = 20.0


def boosted_model_dir(path) -> tuple[str, torch.Tensor]:
    """A two-layer Llama with SmolLM2's vocabulary and tokenizer (the renderer and the harness
    need a real chat template) whose samples, once one of 16 tokens is sampled, stay on those 16:
    their embedding rows are scaled up, so as inputs they dominate the residual stream and as
    outputs their logits dwarf the rest. A reply's first tokens still come from the whole
    vocabulary (after a long real prompt, the 16 hold ~2% of the mass), so some replies of a
    group reach the 16 and some do not: a reward to learn from. The target: a quarter of the 16.
    A larger boost puts nearly all mass on one of the 16 from the first token, and the group's
    rewards then agree (seen at 40: 91% on the 16, none on the target)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[BOOSTED] *= BOOST
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    target = torch.zeros(len(tokenizer), dtype=torch.bool)
    target[list(BOOSTED)[:4]] = True
    return str(path), target


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.anyio
async def test_mean_reward_rises_through_the_real_proxy_and_harness(tmp_path):
    """mini-swe-agent runs each rollout in a local sandbox against the real proxy, which renders
    its requests with SmolLM2's chat template and records the embedded engine's samples; the
    learner trains the tree merge of each group and pushes the weights back in process. The
    task's tests cannot reward a random model, so the reward is the share of its sampled tokens
    in the target set; everything the reward reads went through the capture path."""
    import msgspec

    from polar_fast.cluster import rollout_side
    from polar_fast.config import parse_config
    from polar_fast.pools import Pools
    from polar_fast.rollouts.groups import GroupSpec
    from polar_fast.rollouts.tasks import load_builtin

    model_dir, target = await anyio.to_thread.run_sync(boosted_model_dir, tmp_path / "model")
    cfg = parse_config({
        "run": {"output_dir": str(tmp_path / "run")}, "model": {"path": model_dir, "max_context_tokens": 4096},
        "engine": {"kind": "embedded"}, "sampling": {"max_tokens": 16, "seed": 0},
        "harness": {"name": "mini-swe-agent", "max_steps": 1, "timeout_s": 60}, "sandbox": {"kind": "local"},
        "pools": {"group_size": 6, "boot_workers": 2, "agent_workers": 6, "eval_workers": 2, "prewarm": 2},
        "merge": {"max_tokens": 4096}, "learner": {"lr": 1e-2, "grad_clip": 1.0},
    })
    [task] = await anyio.to_thread.run_sync(lambda: load_builtin()[:1])
    learner = await anyio.to_thread.run_sync(lambda: Learner(cfg.learner, load_model(model_dir), layout="tree",
                                                             max_tokens=4096))

    def scored(group):
        """The group with each rollout rewarded by its sampled tokens (the harness's own outcome kept in `error`)."""
        out = []
        for r in group.rollouts:
            tokens = [t for c in r.sampled_calls for t in c.completion_ids]
            reward = float(target[tokens].float().mean()) if tokens else 0.0
            out.append(msgspec.structs.replace(r, record=msgspec.structs.replace(
                r.record, outcome=Outcome.OK, reward=reward)))
        return msgspec.structs.replace(group, rollouts=out)

    means = []
    async with rollout_side(cfg, tmp_path / "run") as rollouts:
        sync = EngineSync(rollouts.engine)
        for step in range(3):
            groups = []

            async def done(group):
                groups.append(scored(group))

            await Pools.for_rollouts(rollouts).run([GroupSpec(task=task, group_id=f"s{step}", group_size=6)], done)
            [group] = groups
            assert all(c.policy_version == step for c in group.calls) and len(group.calls) >= 6
            metrics = await anyio.to_thread.run_sync(learner.step, groups)
            means.append(metrics.reward_mean)
            await learner.sync_weights(sync)
    # seen with sampling seed 0: 0.12 (2 of 6 replies reach the 16), 0.74, then 1.0 at the third step
    assert means[-1] > means[0] + 0.4, means
