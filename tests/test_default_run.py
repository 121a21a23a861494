"""The default configuration runs end to end: run.toml as shipped (warm start, seeded sampling,
generated tasks, the real SmolLM2 weights in the embedded engine, mini-swe-agent in a local
sandbox, training rollouts guided up to the edit), cut to one GRPO step without the evals. The
step trains on the sampled tokens of its group exactly when the group's rewards differ: GRPO's
advantage is zero in a group whose rollouts all score the same, and a step that reports gradient
from such a group would be lying.

Whether the shipped warm start gives a group with reward variance is the policy's business, not
the plumbing's: after the careful teacher's demonstrations SmolLM2-135M passes few tasks (see
docs/learning.md), so both branches are live. tests/test_grpo_learning.py shows reward rising.

The warm start is built on first use (~7 min on 2 cores) and cached, so after the README's first
command this test reuses it."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from polar_fast.config import load_config
from polar_fast.records import read_log
from polar_fast.train import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_the_default_run_trains_on_sampled_tokens_of_a_group_with_reward_variance(tmp_path):
    cfg = await anyio.to_thread.run_sync(load_config, ROOT / "run.toml",
                                         [f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "eval.every_steps=0",
                                          "eval.at_start=false"])
    assert cfg.sampling.seed is not None and cfg.warm_start.demos > 0  # seeded, warm-started: the shipped setup
    summary = await train(cfg)

    assert summary.warm_start["demos_kept"] == summary.warm_start["demos"] > 0
    assert summary.warm_start["nll_after"] < summary.warm_start["nll_before"]
    [step] = summary.steps
    assert step["learner/version"] == 1

    run = tmp_path / "run"
    text = await anyio.to_thread.run_sync((run / "groups.jsonl").read_text)
    decisions = [json.loads(line) for line in text.splitlines()]
    [trained] = [d["group_id"] for d in decisions if d["status"] == "trained"]
    skipped = [d["group_id"] for d in decisions if d["status"] == "skipped"]
    assert len(skipped) <= cfg.run.zero_variance_skips
    contents = await anyio.to_thread.run_sync(read_log, run / "records.log")
    rewards = [r.reward for r in contents.rollouts if r.group_id == trained and r.reward is not None]
    assert len(rewards) == cfg.pools.group_size, rewards
    for group_id in skipped:  # a group is passed over only when all its rollouts scored alike
        assert len({r.reward for r in contents.rollouts if r.group_id == group_id and r.reward is not None}) == 1
    if len(set(rewards)) == 2:  # the rewards differ: the step trains on the group's sampled tokens
        assert step["learner/n_terms"] > 0 and step["merge/tokens_forwarded"] > 0 and step["learner/grad_norm"] > 0
    else:  # the skips ran out on groups that all scored alike: no advantage, so no gradient
        assert len(skipped) == cfg.run.zero_variance_skips
        assert step["learner/n_terms"] == 0 and step["learner/grad_norm"] == 0
    # guided up to the edit (run.toml's [guide]): each rollout's first calls are the teacher's, in
    # the log but never trained; the policy's own calls come after them
    calls = [c for c in contents.calls if c.group_id == trained]
    guided = [c for c in calls if c.guided]
    assert cfg.guide.until == "edit" and guided
    scored = {r.rollout_id for r in contents.rollouts if r.group_id == trained and r.reward is not None}
    assert scored <= {c.rollout_id for c in guided}
    sampled = sorted((c for c in calls if not c.guided), key=lambda c: (c.rollout_id, c.call_index))
    assert sampled and all(c.call_index > max((g.call_index for g in guided if g.rollout_id == c.rollout_id), default=-1)
                           for c in sampled)
    # each call sampled under its own seed: the group's first own calls share a prompt, not their samples
    firsts = {}
    for c in sampled:
        firsts.setdefault(c.rollout_id, c.completion_ids)
    assert len({tuple(f) for f in firsts.values()}) > 1
