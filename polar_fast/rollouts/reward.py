"""Reward: run a task's tests against an agent's diff, in a fresh sandbox.

SWE-bench's procedure: check the repo out at base_commit (history scrubbed), apply the agent's
diff, restore the files the test patch touches to base_commit (so an agent cannot weaken the
tests), apply the test patch, run the test command, parse one status per test. The reward is 1
only if every FAIL_TO_PASS and every PASS_TO_PASS test passed; a test missing from the output
counts as failed. A diff that does not apply, or a test patch that no longer applies on top of it,
gives reward 0 with the reason in `error`. Sandbox failures propagate as SandboxError so the
caller can retry them as infra errors instead of scoring them.

The log is read by the task's `log_parser` (log_parsers.py: SWE-bench's per-repo readings for
published tasks, and the default reading, `parse_test_output`, for the rest).
"""

from __future__ import annotations

import msgspec

from polar_fast.rollouts.log_parsers import PASSED, parse_log
from polar_fast.rollouts.tasks import Task, prepare_repo


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    tests: dict[str, str]  # test id -> passed | failed | error | skipped
    failed: list[str]  # FAIL_TO_PASS / PASS_TO_PASS tests that did not pass (or were missing)
    error: str = ""  # why the tests could not run as asked (diff or test patch did not apply)
    timed_out: bool = False
    output_tail: str = ""  # the end of the test command's output, for logs
    duration_s: float = 0.0


def score(task: Task, statuses: dict[str, str], mode: str = "binary") -> tuple[float, list[str]]:
    """The reward and the listed tests that did not pass. "binary": 1 iff every listed test
    passed. "partial": the fraction of FAIL_TO_PASS tests passing, but 0 unless every
    PASS_TO_PASS test passes, so breaking the repo or doing nothing scores 0."""
    failed = [t for t in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS] if statuses.get(t) != PASSED]
    if mode == "binary":
        return (0.0 if failed else 1.0), failed
    if mode != "partial":
        raise ValueError(f"unknown reward mode {mode!r} (binary or partial)")
    if any(t in failed for t in task.PASS_TO_PASS):
        return 0.0, failed
    return sum(1 for t in task.FAIL_TO_PASS if t not in failed) / len(task.FAIL_TO_PASS), failed


async def evaluate(box, task: Task, diff: str, *, timeout_s: float = 1800.0, mode: str = "binary") -> EvalResult:
    """Apply `diff` and the test patch in `box` (fresh, from the task's image) and score it."""
    await prepare_repo(box, task)
    diff_path, test_patch_path = f"{box.home}/agent.diff", f"{box.home}/test.patch"  # private per box
    if diff.strip():
        await box.write_files({diff_path: diff})
        applied = await box.exec(["git", "apply", "--binary", "--whitespace=nowarn", diff_path], timeout_s=120)
        if applied.exit_code != 0:
            return _unscored(task, f"agent diff did not apply: {applied.stderr.strip()[-500:]}")
    restore = (
        'base="$1"; shift; for f in "$@"; do '
        'if git cat-file -e "$base:$f" 2>/dev/null; then git checkout -q "$base" -- "$f"; else rm -f -- "$f"; fi; '
        'done'
    )
    done = await box.exec(["sh", "-c", restore, "restore", task.base_commit, *task.test_files()], timeout_s=120)
    if done.exit_code != 0:
        return _unscored(task, f"restoring test files failed: {done.stderr.strip()[-500:]}")
    await box.write_files({test_patch_path: task.test_patch})
    applied = await box.exec(["git", "apply", "--binary", "--whitespace=nowarn", test_patch_path], timeout_s=120)
    if applied.exit_code != 0:
        return _unscored(task, f"test patch did not apply on top of the agent's diff: {applied.stderr.strip()[-500:]}")
    run = await box.exec(["sh", "-c", task.shell_test_command()], timeout_s=timeout_s)
    statuses = parse_log(task.log_parser, run.stdout + "\n" + run.stderr)
    reward, failed = score(task, statuses, mode)
    return EvalResult(
        reward=reward,
        tests=statuses,
        failed=failed,
        timed_out=run.timed_out,
        error="test command timed out" if run.timed_out else "",
        output_tail=(run.stdout[-2000:] + "\n" + run.stderr[-2000:]).strip(),
        duration_s=run.duration_s,
    )


def _unscored(task: Task, error: str) -> EvalResult:
    return EvalResult(reward=0.0, tests={}, failed=[*task.FAIL_TO_PASS, *task.PASS_TO_PASS], error=error)
