"""`python -m polar_fast tasks validate SOURCE`: does each task hold before anyone trains on it?

A task holds when its reference patch passes (reward 1) and the empty patch fails (reward 0),
each scored by the same code the eval pool uses (reward.evaluate) in its own fresh sandbox from
the task's image. A task that does not hold would teach the policy noise: a broken reference
means no rollout can ever score, a passing empty patch means doing nothing scores.

Reasons are reported per task: the reference patch did not apply or left tests failing (named),
the empty patch passed (the FAIL_TO_PASS tests that already pass are named), there is no
reference patch, the repo could not be prepared at base_commit, or the sandbox itself failed
(an infra error, reported apart: the task was not judged). Docker images are checked first, so a
missing one is one clear error instead of a failure per task.
"""

from __future__ import annotations

import uuid
from typing import Callable

import anyio
import msgspec

from polar_fast.rollouts.reward import EvalResult, evaluate
from polar_fast.rollouts.sandboxes import SandboxError, SandboxSpec
from polar_fast.rollouts.task_images import check_images
from polar_fast.rollouts.tasks import Task, TaskError

HOLDS, BROKEN, INFRA = "holds", "broken", "infra"
_SHOWN_TESTS = 5


class TaskCheck(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    verdict: str  # holds | broken | infra (the sandbox failed: not judged)
    problems: list[str] = []
    reference_reward: float | None = None
    empty_reward: float | None = None


async def validate_tasks(tasks: list[Task], factory, *, workers: int = 2, timeout_s: float = 1800.0,
                         on_check: Callable[[TaskCheck], None] | None = None) -> list[TaskCheck]:
    """Check every task (at most `workers` sandboxes at once); results in task order."""
    if factory.kind == "docker":
        await anyio.to_thread.run_sync(check_images, tasks)
    elif needs_image := [t.instance_id for t in tasks if t.image and not t.repo_snapshot]:
        raise TaskError(f"tasks {', '.join(needs_image[:3])}{' ...' if len(needs_image) > 3 else ''} run in their "
                        f"Docker images, which {factory.kind!r} sandboxes cannot use: add --set sandbox.kind=docker")
    limiter = anyio.CapacityLimiter(max(1, workers))
    results: list[TaskCheck | None] = [None] * len(tasks)

    async def one(index: int, task: Task) -> None:
        results[index] = check = await check_task(task, factory, limiter=limiter, timeout_s=timeout_s)
        if on_check is not None:
            on_check(check)

    async with anyio.create_task_group() as tg:
        for index, task in enumerate(tasks):
            tg.start_soon(one, index, task)
    return [r for r in results if r is not None]


async def check_task(task: Task, factory, *, limiter: anyio.CapacityLimiter | None = None,
                     timeout_s: float = 1800.0) -> TaskCheck:
    limiter = limiter or anyio.CapacityLimiter(1)
    problems: list[str] = []
    try:
        reference = None
        if task.patch.strip():
            reference = await _score(task, task.patch, "reference", factory, limiter, timeout_s)
            problems += _reference_problems(task, reference)
        else:
            problems.append("no reference patch (field 'patch' is empty)")
        empty = await _score(task, "", "empty", factory, limiter, timeout_s)
        problems += _empty_problems(task, empty)
    except SandboxError as e:
        return TaskCheck(instance_id=task.instance_id, verdict=INFRA, problems=[f"sandbox failed: {e}"])
    except TaskError as e:
        problems.append(f"repo could not be prepared: {e}")
        return TaskCheck(instance_id=task.instance_id, verdict=BROKEN, problems=problems)
    return TaskCheck(
        instance_id=task.instance_id, verdict=BROKEN if problems else HOLDS, problems=problems,
        reference_reward=reference.reward if reference else None, empty_reward=empty.reward,
    )


async def _score(task: Task, diff: str, label: str, factory, limiter, timeout_s: float) -> EvalResult:
    async with limiter, factory.open(SandboxSpec(name=f"validate-{task.instance_id}-{label}",
                                                 image=task.image)) as box:
        return await evaluate(box, task, diff, timeout_s=timeout_s)


def _tests(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN_TESTS} more" if len(names) > _SHOWN_TESTS else ""
    return ", ".join(names[:_SHOWN_TESTS]) + more


def _reference_problems(task: Task, result: EvalResult) -> list[str]:
    if result.reward == 1.0:
        return []
    if result.error:
        return [f"reference patch: {result.error}"]
    return [f"reference patch leaves tests not passing: {_tests(result.failed)}"]


def _empty_problems(task: Task, result: EvalResult) -> list[str]:
    if result.reward == 0.0:
        return []
    return [f"empty patch passes: every FAIL_TO_PASS test already passes without a fix ({_tests(task.FAIL_TO_PASS)})"]


async def run_validation(cfg, source: str, *, split: str = "train", limit: int = 0, workers: int = 2,
                         on_check: Callable[[TaskCheck], None] | None = None) -> list[TaskCheck]:
    """Load `source` as the run would (tasks.image applies) and check it in cfg.sandbox's boxes."""
    from polar_fast.rollouts.sandboxes import sandbox_class
    from polar_fast.rollouts.tasks import load_tasks

    tasks = await anyio.to_thread.run_sync(
        lambda: load_tasks(source, split=split, limit=limit, image=cfg.tasks.image))
    factory_class = await anyio.to_thread.run_sync(sandbox_class, cfg.sandbox.kind)
    factory = factory_class(cfg.sandbox, run_id=f"validate-{uuid.uuid4().hex[:8]}")
    try:
        return await validate_tasks(tasks, factory, workers=workers, timeout_s=cfg.pools.eval_timeout_s,
                                    on_check=on_check)
    finally:
        await factory.remove_leftovers()
        if hasattr(factory, "aclose"):
            await factory.aclose()


def format_report(checks: list[TaskCheck]) -> str:
    lines = []
    for check in checks:
        if check.verdict != HOLDS:
            lines += [f"{check.verdict.upper():7} {check.instance_id}: {p}" for p in check.problems]
    counts = {v: sum(c.verdict == v for c in checks) for v in (HOLDS, BROKEN, INFRA)}
    lines.append(f"{len(checks)} tasks: {counts[HOLDS]} hold, {counts[BROKEN]} do not hold, "
                 f"{counts[INFRA]} not judged (sandbox failures)")
    return "\n".join(lines)
