"""The training run's stream of groups: endless seeded epochs over the training tasks, each group
guided as the run's guide (teachers/guide.py) says at the current learner step, and tasks retired
once their groups keep scoring alike.

    stream = TrainingStream(tasks, seed=0, group_size=8, guide=guide, retire_after=2, step=lambda: learner.step_count)
    pools.run(stream, on_group)      # GroupSpecs, named `<instance_id>-g<n>` as plain tasks would be
    stream.observe(group)            # every finished group the loop takes, trained or not

Difficulty filtering: a group whose rewards are all equal (every rollout passed, or every one
failed) has no advantage and trains nothing. The loop already passes over such groups for a next
one (run.zero_variance_skips); a task whose last `retire_after` groups were all like that is
taken out of the stream for good: always solved, it has nothing left to teach; never solved, it
wastes a group per epoch. At least `MIN_ACTIVE` tasks always stay, so the stream never runs dry.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Iterator, Protocol, Sequence

from polar_fast.errors import PolarError
from polar_fast.rollouts.groups import GroupRecord, GroupSpec
from polar_fast.rollouts.tasks import Task

MIN_ACTIVE = 2  # tasks never retired below this many


class Guide(Protocol):
    """What answers a training rollout's first calls (teachers/guide.py)."""

    def replies(self, task: Task, step: int = 0) -> list[str]: ...


class StreamError(PolarError):
    """The training stream has no tasks."""


class TrainingStream:
    def __init__(self, tasks: Sequence[Task], *, seed: int, group_size: int, guide: Guide | None = None,
                 retire_after: int = 0, step: Callable[[], int] = lambda: 0) -> None:
        if not tasks:
            raise StreamError("the task source yielded no tasks")
        self.tasks, self.seed, self.group_size = list(tasks), seed, group_size
        self.guide, self.retire_after, self.step = guide, retire_after, step
        self.retired: set[str] = set()  # instance ids out of the stream
        self._alike: dict[str, int] = {}  # instance id -> its last groups in a row that scored alike
        self._task_of: dict[str, str] = {}  # group id -> instance id

    def __iter__(self) -> Iterator[GroupSpec]:
        rng = random.Random(self.seed)
        n = itertools.count()
        while True:
            epoch = [t for t in self.tasks if t.instance_id not in self.retired]
            rng.shuffle(epoch)
            for task in epoch:
                if task.instance_id in self.retired:  # retired while this epoch ran
                    continue
                group_id = f"{task.instance_id}-g{next(n)}"
                self._task_of[group_id] = task.instance_id
                guide = self.guide.replies(task, self.step()) if self.guide else []
                yield GroupSpec(task=task, group_id=group_id, group_size=self.group_size, guide=guide)

    def observe(self, group: GroupRecord) -> None:
        """A finished group's rewards count towards retiring its task."""
        task_id = self._task_of.pop(group.group_id, group.task.instance_id)
        scored = [r.reward for r in group.records if r.reward is not None]
        if len(scored) < 2:
            return  # too few scored (infra failures): says nothing of the task's difficulty
        self._alike[task_id] = self._alike.get(task_id, 0) + 1 if len(set(scored)) == 1 else 0
        active = len(self.tasks) - len(self.retired)
        if self.retire_after and self._alike[task_id] >= self.retire_after and active > MIN_ACTIVE:
            self.retired.add(task_id)
