"""Guided prefixes: a training rollout's first calls answered by the harness's teacher, so the
policy's own first call is the step where the task sits at its edge.

A small policy warm-started on a careful teacher's demonstrations learns the process (search,
read, reproduce, edit, check, submit) before it learns the content of the edit. Its rollouts then
fail mostly at the edit, every member of a GRPO group alike, and a group with equal rewards
teaches nothing. Guided up to the edit (`guide.until = "edit"`), every rollout of a group reaches
the edit with the file it needs already read, and the group's rewards differ on what the policy
does there: RL trains where it has signal (the hint scaffolds of QuestA and prefix sampling do
the same for reasoning).

The guide is the teacher's own replies (teachers/), typed through the real harness and proxy as
answers to the first calls (Session.guide). They are recorded with `guided = True`: kept in the
record log, since later calls store their prompts as deltas against them, but never trained,
gated, counted or exported; their tokens reach the merge only as the policy's later prompts,
with loss mask 0. How many calls a task's guide answers depends on its plan: the edit is the
fourth reply where the teacher reproduces the bug first, the third where it does not.

`guide.shrink_every_steps = N` answers one call fewer every N learner steps, down to none, so the
policy takes over more of the task as it trains. Evaluation (held-out, transfer, validation as
held-out will see it) never passes a guide.
"""

from __future__ import annotations

from polar_fast.config import GuideConfig
from polar_fast.errors import ConfigError
from polar_fast.rollouts.tasks import Task
from polar_fast.teachers import STEPS, Teacher, teacher_for


def check_guide(cfg: GuideConfig, harness: str, form: str = "careful") -> None:
    """A guide the run can follow: a known step, and a teacher for the harness."""
    if not cfg.until:
        return
    if cfg.until not in STEPS:
        raise ConfigError(f"guide.until = {cfg.until!r} is not a teacher step; steps: {', '.join(STEPS)}")
    if cfg.shrink_every_steps < 0:
        raise ConfigError(f"guide.shrink_every_steps = {cfg.shrink_every_steps} must be >= 0")
    teacher_for(harness, form)  # a TeacherError naming the teachers (or forms) there are


class Guide:
    """The replies that answer a training rollout's first calls, per task and learner step."""

    def __init__(self, cfg: GuideConfig, teacher: Teacher) -> None:
        self.cfg, self.teacher = cfg, teacher
        self._steps: dict[str, list[tuple[str, str]]] = {}  # instance id -> the teacher's steps

    def prepare(self, tasks: list[Task]) -> Guide:
        """Plans every task's demonstration now (it reads the task's repo: call it off the event
        loop), so that `replies` during the run is a lookup."""
        for task in tasks:
            self._plan(task)
        return self

    def _plan(self, task: Task) -> list[tuple[str, str]]:
        steps = self._steps.get(task.instance_id)
        if steps is None:
            steps = self._steps[task.instance_id] = self.teacher.steps(task)
        return steps

    @classmethod
    def for_run(cls, cfg: GuideConfig, harness: str, form: str = "careful") -> Guide | None:
        """The run's guide: its teacher in `form` (warm_start.plan), the form the policy learned."""
        check_guide(cfg, harness, form)
        return cls(cfg, teacher_for(harness, form)) if cfg.until else None

    def replies(self, task: Task, step: int = 0) -> list[str]:
        """The teacher's replies before its `until` step (a task whose plan lacks that step: all
        but the last), fewer by one per `shrink_every_steps` learner steps."""
        steps = self._plan(task)
        names = [name for name, _ in steps]
        k = names.index(self.cfg.until) if self.cfg.until in names else len(steps) - 1
        if self.cfg.shrink_every_steps:
            k = max(0, k - step // self.cfg.shrink_every_steps)
        return [reply for _, reply in steps[:k]]
