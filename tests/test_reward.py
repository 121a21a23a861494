"""Reward: per-test parsing of pytest and unittest output, and scoring diffs in real sandboxes."""

from __future__ import annotations

import uuid

import pytest

import polar_fast.rollouts.sandboxes.docker  # noqa: F401  (imported before the loop: import reads files)
from polar_fast.config import SandboxConfig
from polar_fast.rollouts.log_parsers import parse_test_output
from polar_fast.rollouts.reward import evaluate
from polar_fast.rollouts.sandboxes import SandboxSpec, make_sandbox_factory
from polar_fast.rollouts.tasks import load_builtin

BUILTIN = {t.repo.split("/")[1]: t for t in load_builtin()}

PYTEST_RA = """\
tests/test_a.py::test_ok PASSED                                         [ 33%]
tests/test_a.py::test_bad FAILED                                        [ 66%]
=========================== short test summary info ============================
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::test_param[1-2]
FAILED tests/test_a.py::test_bad - assert 1 == 2
ERROR tests/test_b.py::test_fixture
SKIPPED tests/test_b.py::test_skip
"""
UNITTEST_V = """\
test_a (tests.test_x.TestX.test_a) ... ok
test_b (tests.test_x.TestX.test_b) ... FAIL
test_c (tests.test_x.TestX.test_c) ... ERROR
test_d (tests.test_x.TestX.test_d) ... skipped 'later'
test_old (tests.test_y.TestY) ... ok
test_doc (tests.test_x.TestX.test_doc)
A docstring line. ... ok
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PYTEST_RA, {"tests/test_a.py::test_ok": "passed", "tests/test_a.py::test_param[1-2]": "passed",
                     "tests/test_a.py::test_bad": "failed", "tests/test_b.py::test_fixture": "error",
                     "tests/test_b.py::test_skip": "skipped"}),
        (UNITTEST_V, {"tests.test_x.TestX.test_a": "passed", "tests.test_x.TestX.test_b": "failed",
                      "tests.test_x.TestX.test_c": "error", "tests.test_x.TestX.test_d": "skipped",
                      "tests.test_y.TestY.test_old": "passed", "tests.test_x.TestX.test_doc": "passed"}),
        ("collected 0 items\n", {}),
    ],
)
def test_parse_test_output(text, expected):
    assert parse_test_output(text) == expected


def test_a_test_reported_twice_keeps_its_worst_status():
    text = "t.py::test_x PASSED\nFAILED t.py::test_x - boom\n"
    assert parse_test_output(text) == {"t.py::test_x": "failed"}


@pytest.fixture
async def local_factory():
    f = make_sandbox_factory(SandboxConfig(kind="local"), run_id=f"reward-{uuid.uuid4().hex[:6]}")
    yield f
    assert await f.remove_leftovers() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(BUILTIN))
async def test_builtin_task_gold_fix_scores_1_and_no_fix_scores_0(local_factory, name):
    task = BUILTIN[name]
    async with local_factory.open(SandboxSpec()) as box:
        good = await evaluate(box, task, task.patch)
    assert good.reward == 1.0, good.output_tail
    assert all(good.tests[t] == "passed" for t in task.FAIL_TO_PASS + task.PASS_TO_PASS)
    async with local_factory.open(SandboxSpec()) as box:
        bad = await evaluate(box, task, "")
    assert bad.reward == 0.0 and set(bad.failed) == set(task.FAIL_TO_PASS)


@pytest.mark.anyio
async def test_deleting_the_failing_tests_does_not_help(local_factory):
    """The agent's edits to test files are reverted before the test patch is applied."""
    task = BUILTIN["semver"]
    test_file = task.test_files()[0]
    async with local_factory.open(SandboxSpec()) as box:
        from polar_fast.rollouts.tasks import prepare_repo, repo_diff

        await prepare_repo(box, task)
        await box.exec(["sh", "-c", f"git rm -q {test_file}"])
        cheat = await repo_diff(box, task.base_commit)
    async with local_factory.open(SandboxSpec()) as box:
        result = await evaluate(box, task, cheat)
    assert result.reward == 0.0 and result.failed == task.FAIL_TO_PASS


@pytest.mark.anyio
async def test_a_diff_that_does_not_apply_scores_0_with_a_reason(local_factory):
    task = BUILTIN["roman"]
    async with local_factory.open(SandboxSpec()) as box:
        result = await evaluate(box, task, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert result.reward == 0.0 and "did not apply" in result.error


@pytest.mark.anyio
@pytest.mark.docker
async def test_docker_gold_fix_1_wrong_fix_0(base_image):
    task = BUILTIN["leapyear"]
    wrong = task.patch.replace("year % 400 == 0", "year % 300 == 0")
    assert wrong != task.patch
    f = make_sandbox_factory(SandboxConfig(kind="docker"), run_id=f"reward-{uuid.uuid4().hex[:6]}")
    try:
        async with f.open(SandboxSpec()) as box:
            good = await evaluate(box, task, task.patch)
        async with f.open(SandboxSpec()) as box:
            bad = await evaluate(box, task, wrong)
    finally:
        assert await f.remove_leftovers() == 0
        await f.aclose()
    assert good.reward == 1.0, good.output_tail
    assert bad.reward == 0.0 and bad.failed == ["tests.test_days.TestDays.test_centuries"]
