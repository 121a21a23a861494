"""Generated task families: seeded, split by seed, frozen held-out split, and every task holds
(its reference fix passes, doing nothing fails) in a real sandbox."""

from __future__ import annotations

import uuid

import pytest

from polar_fast.config import SandboxConfig
from polar_fast.rollouts.families import FAMILIES, HELDOUT_SEEDS, family_task, family_tasks, heldout_digest
from polar_fast.rollouts.reward import evaluate, score
from polar_fast.rollouts.sandboxes import SandboxSpec, make_sandbox_factory
from polar_fast.rollouts.tasks import TaskError, load_tasks

# Frozen when the held-out split was made, before any tuning: a change to the generators that moves
# a held-out task must fail here. Never update this to fit a result.
HELDOUT_DIGEST = "f1b3e5ba20cef3b58c84f74b3cd3629300968a00980f12d3923d83b068f2a8b7"


def test_the_heldout_split_is_frozen():
    assert heldout_digest() == HELDOUT_DIGEST


def test_a_seed_always_gives_the_same_task_and_seeds_differ(tmp_path):
    a, b = family_task("returns", 3, cache_root=tmp_path), family_task("returns", 3, cache_root=tmp_path / "x")
    assert a.problem_statement == b.problem_statement and a.patch == b.patch and a.base_commit == b.base_commit
    statements = {family_task("constant", s, cache_root=tmp_path).problem_statement for s in range(8)}
    assert len(statements) == 8


def test_splits_are_disjoint_and_interleave_families():
    train = family_tasks("train", per_family=5)
    heldout = family_tasks("heldout")
    demos = family_tasks("demos", per_family=5)
    assert len(train) == 5 * len(FAMILIES) and len(heldout) == len(HELDOUT_SEEDS) * len(FAMILIES)
    assert len(demos) == len(train)
    ids = [{t.instance_id for t in split} for split in (train, heldout, demos)]
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert [t.repo for t in train[: len(FAMILIES)]] == [f"polar-families/{f}" for f in FAMILIES]
    assert [t.instance_id for t in load_tasks("families", split="train", per_family=5, families=["rename"])] == [
        f"family__rename-{s}" for s in range(5)]


def test_bad_family_and_split_are_named():
    with pytest.raises(TaskError, match="unknown task family 'nope'"):
        family_task("nope", 0)
    with pytest.raises(TaskError, match="splits 'train', 'heldout' and 'demos', not 'test'"):
        family_tasks("test")


def test_partial_credit_is_the_fraction_of_fail_to_pass_and_zero_when_pass_to_pass_breaks():
    task = family_task("constant", 0)  # two FAIL_TO_PASS tests, one PASS_TO_PASS
    [f1, f2], [p1] = task.FAIL_TO_PASS, task.PASS_TO_PASS
    assert score(task, {f1: "passed", f2: "failed", p1: "passed"}, "partial")[0] == 0.5
    assert score(task, {f1: "passed", f2: "passed", p1: "failed"}, "partial")[0] == 0.0
    assert score(task, {p1: "passed"}, "partial")[0] == 0.0  # doing nothing scores 0
    assert score(task, {f1: "passed", f2: "failed", p1: "passed"}, "binary")[0] == 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("task", [family_task(f, s) for f in FAMILIES for s in (0, 1, HELDOUT_SEEDS[0])],
                         ids=lambda t: t.instance_id)
async def test_every_family_task_holds_in_a_sandbox(task):
    factory = make_sandbox_factory(SandboxConfig(kind="local"), run_id=f"fam-{uuid.uuid4().hex[:6]}")
    async with factory.open(SandboxSpec()) as box:
        good = await evaluate(box, task, task.patch)
    async with factory.open(SandboxSpec()) as box:
        empty = await evaluate(box, task, "")
    async with factory.open(SandboxSpec()) as box:
        partial = await evaluate(box, task, "", mode="partial")
    assert good.reward == 1.0, good.output_tail
    assert empty.reward == 0.0 and set(empty.failed) == set(task.FAIL_TO_PASS)
    assert all(empty.tests[t] == "passed" for t in task.PASS_TO_PASS)  # they really pass before the fix
    assert partial.reward == 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("task", [family_task(f, s) for f in FAMILIES for s in (0, HELDOUT_SEEDS[1])],
                         ids=lambda t: t.instance_id)
async def test_the_teacher_command_fixes_the_task(task):
    """What a teacher demonstration types (the warm start's traces) really solves the task."""
    from polar_fast.rollouts.tasks import prepare_repo, repo_diff

    factory = make_sandbox_factory(SandboxConfig(kind="local"), run_id=f"fam-{uuid.uuid4().hex[:6]}")
    async with factory.open(SandboxSpec()) as box:
        await prepare_repo(box, task)
        done = await box.exec(["sh", "-c", task.solution_command], cwd=box.workdir)
        assert done.exit_code == 0, done.stderr
        diff = await repo_diff(box, task.base_commit)
    async with factory.open(SandboxSpec()) as box:
        result = await evaluate(box, task, diff)
    assert result.reward == 1.0, result.output_tail
