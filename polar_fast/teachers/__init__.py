"""Teachers: scripted demonstrations of a careful agent, one per harness, typed through the real
harness for a warm start (warm_start.py).

A teacher turns a task's `FixPlan` (plan.py: what to search, read, change and check) into the
replies a model would write in that harness's own tool format, each with a short line of
reasoning: look around, read the file, reproduce the bug where the statement gives a call, edit,
check, finish. The forms vary per demonstration (search and read commands, three ways to edit,
phrasings), drawn from a generator seeded by the task, so the student learns a way of working
rather than one command line, and copies its edit from the file it read.

    replies = teacher_for("pi").replies(task)   # list[str], one per model call
    steps = teacher_for("pi").steps(task)       # [(step, reply)]: "search", "read", ..., "edit", ...

Two forms (`warm_start.plan`): "careful" (the steps above) and "short" (moves.short_plan: one grep
that shows the lines to change with their path, the edit, the end), for a small student and
short rollouts; a task the short form cannot show in one grep keeps the careful steps.

A teacher's steps are named, so a rollout can be guided up to one of them (guide.py: the teacher
answers the calls before it, and the policy takes over there).
"""

from __future__ import annotations

import random
from typing import Protocol, get_args

from polar_fast.config import TeacherForm

from polar_fast.errors import PolarError
from polar_fast.rollouts.tasks import Task


class TeacherError(PolarError):
    """No teacher for this harness, or a task a teacher cannot demonstrate."""


STEPS = ("search", "read", "reproduce", "edit", "check", "submit", "finish")  # a plan's steps, in order


class Teacher(Protocol):
    harness: str

    def steps(self, task: Task) -> list[tuple[str, str]]:
        """(step, reply) per model call, in order, that solve `task` in this harness; steps are
        STEPS names (a step may span several replies, e.g. one edit per file)."""
        ...

    def replies(self, task: Task) -> list[str]:
        """The model's replies, in order, that solve `task` in this harness."""
        ...


def rng_for(task: Task, harness: str) -> random.Random:
    return random.Random(f"teacher:{harness}:{task.instance_id}")


from polar_fast.teachers.mini_swe_agent import MiniSweAgentTeacher  # noqa: E402
from polar_fast.teachers.pi import PiTeacher  # noqa: E402

TEACHERS: dict[str, type] = {"mini-swe-agent": MiniSweAgentTeacher, "pi": PiTeacher}


FORMS = get_args(TeacherForm)  # warm_start.plan: the careful agent's six steps, or moves.short_plan's three


def teacher_for(harness: str, form: str = "careful") -> Teacher:
    if form not in FORMS:
        raise TeacherError(f"warm_start.plan = {form!r} is not a teacher's form; forms: {', '.join(FORMS)}")
    try:
        return TEACHERS[harness](form)
    except KeyError:
        raise TeacherError(f"warm_start: no teacher for harness {harness!r} (teachers: {', '.join(TEACHERS)}); "
                           "set warm_start.demos = 0 and start from a model that already speaks its format") from None
