"""Guided prefixes (teachers/guide.py) and the training stream (rollouts/stream.py).

The end-to-end test runs a real training step with mini-swe-agent in a local sandbox and the
real proxy, guided up to the teacher's edit: the teacher's replies answer the first calls, a
scripted policy the rest. The guided calls must be in records.log (later prompts are stored as
deltas against them), and never in the trained batch, the mismatch figures or the SFT export."""

from __future__ import annotations

import json

import anyio
import pytest

from polar_fast.config import GuideConfig, parse_config
from polar_fast.errors import ConfigError
from polar_fast.export import export_run
from polar_fast.records import Outcome, read_log
from polar_fast.rollouts.families import family_task
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord
from polar_fast.teachers.guide import Guide, check_guide
from polar_fast.records import RolloutRecord
from polar_fast.rollouts.stream import MIN_ACTIVE, TrainingStream
from polar_fast.teachers import teacher_for
from polar_fast.teachers.mini_swe_agent import SUBMIT, bash_call
from polar_fast.train import train

from test_distributed_train import tiny_model_dir

TEACHER = teacher_for("mini-swe-agent")


def test_the_guide_answers_every_call_before_the_edit_and_shrinks_over_steps():
    constant, returns = family_task("constant", 0), family_task("returns", 0)
    guide = Guide(GuideConfig(until="edit"), TEACHER)
    # constant reproduces the bug first (search, read, reproduce); returns quotes no call to run
    assert [s for s, _ in TEACHER.steps(constant)][:4] == ["search", "read", "reproduce", "edit"]
    assert guide.replies(constant) == TEACHER.replies(constant)[:3]
    assert guide.replies(returns) == TEACHER.replies(returns)[:2]
    shrinking = Guide(GuideConfig(until="edit", shrink_every_steps=2), TEACHER)
    assert [len(shrinking.replies(constant, step)) for step in range(8)] == [3, 3, 2, 2, 1, 1, 0, 0]
    with pytest.raises(ConfigError, match="'edits' is not a teacher step"):
        check_guide(GuideConfig(until="edits"), "mini-swe-agent")
    assert Guide.for_run(GuideConfig(), "mini-swe-agent") is None


def test_the_returns_teacher_never_runs_a_signature_as_a_call():
    """`total(a, b)` in a statement is a signature: printing it raises NameError before and after
    the fix, and the teacher would then say 'the fix works' over a failing check."""
    task = next(t for t in (family_task("returns", s) for s in range(64)) if "(a, b)`" in t.problem_statement)
    steps = TEACHER.steps(task)
    assert "reproduce" not in [s for s, _ in steps]
    check = dict(steps)["check"]
    assert "unittest" in check and "(a, b)" not in check


def _group(task, group_id: str, rewards: list[float]) -> GroupRecord:
    return GroupRecord(group_id=group_id, task=task, rollouts=[FinishedRollout(record=RolloutRecord(
        rollout_id=f"{group_id}-r{i}", group_id=group_id, task_id=task.instance_id, harness="h", outcome=Outcome.OK,
        reward=r)) for i, r in enumerate(rewards)])


def test_tasks_whose_groups_keep_scoring_alike_retire_but_never_below_the_minimum():
    tasks = [family_task("constant", s) for s in range(4)]
    stream = TrainingStream(tasks, seed=0, group_size=2, retire_after=2)
    specs = iter(stream)
    first = [next(specs) for _ in range(4)]  # one epoch: every task once, named as plain tasks are
    assert sorted(s.task.instance_id for s in first) == sorted(t.instance_id for t in tasks)
    assert [s.group_id.rsplit("-g", 1)[1] for s in first] == ["0", "1", "2", "3"] and not first[0].guide
    solved, mixed = first[0].task, first[1].task
    stream.observe(_group(solved, first[0].group_id, [1.0, 1.0]))
    stream.observe(_group(mixed, first[1].group_id, [1.0, 0.0]))
    assert not stream.retired  # one alike group is not a pattern
    stream.observe(_group(solved, "x", [1.0, 1.0]))
    stream.observe(_group(mixed, "y", [0.0, 0.0]))  # the mixed group in between reset its count
    assert stream.retired == {solved.instance_id}
    later = [next(specs).task.instance_id for _ in range(6)]
    assert solved.instance_id not in later
    for task in tasks:  # everything scores alike from now on: retiring stops at the minimum
        for _ in range(2):
            stream.observe(_group(task, "z", [0.0, 0.0]))
    assert len(tasks) - len(stream.retired) == MIN_ACTIVE


def test_a_guided_stream_carries_the_teachers_replies():
    tasks = [family_task("constant", 0)]
    stream = TrainingStream(tasks, seed=0, group_size=2, guide=Guide(GuideConfig(until="edit"), TEACHER))
    spec = next(iter(stream))
    assert spec.guide == TEACHER.replies(tasks[0])[:3]


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_guided_calls_are_logged_but_never_trained_gated_or_exported(tmp_path):
    task = await anyio.to_thread.run_sync(family_task, "constant", 0)
    replies = await anyio.to_thread.run_sync(TEACHER.replies, task)
    k = 3  # search, read, reproduce: the calls before the edit
    # the policy's own calls: rollout 0 makes the teacher's edit, checks and submits; rollout 1 gives up
    policy = [*replies[k:], bash_call("ls"), bash_call(SUBMIT)]
    model = await anyio.to_thread.run_sync(tiny_model_dir, tmp_path / "model")
    cfg = parse_config({
        "run": {"output_dir": str(tmp_path / "run"), "steps": 1, "groups_per_step": 1, "zero_variance_skips": 0,
                "tensorboard": False, "groups_in_flight": 1},
        "model": {"path": str(model), "max_context_tokens": 4096}, "merge": {"max_tokens": 4096},
        "engine": {"kind": "scripted", "scripted_replies": policy},
        "sampling": {"max_tokens": 512}, "sandbox": {"kind": "local"},
        "harness": {"name": "mini-swe-agent", "max_steps": 8, "timeout_s": 120},
        "tasks": {"source": "families", "families": ["constant"], "per_family": 1},
        "pools": {"group_size": 2, "boot_workers": 1, "agent_workers": 1, "eval_workers": 1, "prewarm": 0},
        "guide": {"until": "edit"}, "learner": {"lr": 1e-3},
    })
    summary = await train(cfg)
    [step] = summary.steps

    run = tmp_path / "run"
    contents = await anyio.to_thread.run_sync(read_log, run / "records.log")
    rewards = {r.rollout_id: r.reward for r in contents.rollouts if r.outcome is Outcome.OK}
    assert sorted(rewards.values()) == [0.0, 1.0]
    calls = [c for c in contents.calls if c.rollout_id in rewards]
    guided = [c for c in calls if c.guided]
    sampled = [c for c in calls if not c.guided]
    # every rollout's first k calls were the teacher's, token for token, with no logprob of the policy's
    assert len(guided) == 2 * k and all(c.call_index < k for c in guided)
    assert all(set(c.completion_logprobs) == {0.0} for c in guided)
    assert len(sampled) == len(policy) and all(c.call_index >= k for c in sampled)
    # a policy call's prompt holds the guided completions (exact history) ...
    first_policy = min((c for c in sampled), key=lambda c: (c.rollout_id, c.call_index))
    last_guided = max((c for c in guided if c.rollout_id == first_policy.rollout_id), key=lambda c: c.call_index)
    whole = last_guided.prompt_ids + last_guided.completion_ids
    assert first_policy.prompt_ids[: len(whole)] == whole
    # ... but the step trained on (and measured the mismatch over) exactly the policy's sampled tokens
    assert step["learner/n_terms"] == sum(len(c.completion_ids) for c in sampled) == step["proxy/sampled_tokens"]
    assert step["proxy/calls"] == len(sampled) and step["guide/calls_per_rollout"] == k
    # export: the passing rollout's token rows train its own tokens only; no chat row shows the teacher's as its own
    report = await anyio.to_thread.run_sync(export_run, run, tmp_path / "sft")
    assert "were guided" in report
    chat = await anyio.to_thread.run_sync((tmp_path / "sft" / "chat.jsonl").read_text)
    assert chat == ""
    tokens = await anyio.to_thread.run_sync((tmp_path / "sft" / "tokens.jsonl").read_text)
    rows = [json.loads(line) for line in tokens.splitlines()]
    passed = next(rid for rid, r in rewards.items() if r == 1.0)
    mine = [c for c in sampled if c.rollout_id == passed]
    assert sum(sum(r["loss_mask"]) for r in rows) == sum(len(c.completion_ids) for c in mine)
