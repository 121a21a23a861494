"""A group of rollouts of one task: what the pools run (`GroupSpec`) and what a finished group is
(`GroupRecord`).

A GroupRecord is built once, where the group's last rollout ends (pools.py hands it to
`on_group`): the task, and per rollout, in rollout order, its record, the calls it made (capture
order, each with its whole prompt), and for a scored rollout its diff and test results. It then
travels unchanged: the train loop logs its rollouts and queues it (train.py), the learner merges
each group's calls and spreads each rollout's advantage over them (grpo.build_step_batch), and the
rollout service encodes it as a batch (service.py).

Only the final attempt of a rollout is in the record: calls captured during an attempt that hit an
infra error and was retried stay in the record log, never in the group. A guided rollout's first
calls were answered by its guide, not the policy (CallRecord.guided): they travel with it, but
`GroupRecord.calls` leaves them out, so nothing downstream trains on or counts them.
"""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Iterable

import msgspec

from polar_fast.records import CallRecord, RolloutRecord
from polar_fast.rollouts.reward import EvalResult
from polar_fast.rollouts.tasks import Task


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One group to run, with its id and size chosen by the caller (a plain Task gets
    `<instance_id>-g<n>` and `pools.group_size`)."""

    task: Task
    group_id: str
    group_size: int
    # the attempt its rollouts start at: a group a dead rollout node left is run again elsewhere as
    # its next attempt (cluster/driver.py), so retried rollout ids never repeat the lost ones
    first_attempt: int = 0
    # the replies that answer each rollout's first calls instead of the policy (teachers/guide.py:
    # a teacher's, up to the step where the policy takes over); [] = the policy answers every call
    guide: list[str] = []


async def group_specs(items: Iterable[Task | GroupSpec] | AsyncIterable[Task | GroupSpec],
                      group_size: int) -> AsyncIterator[GroupSpec]:
    """A task stream (sync or async, Tasks or GroupSpecs) as the groups to run: a GroupSpec as it
    is, a plain Task, the n-th item, as `<instance_id>-g<n>` of `group_size` rollouts. The local
    pools and a cluster's (cluster/scheduling.py) both name groups here."""
    def spec(n: int, item: Task | GroupSpec) -> GroupSpec:
        if isinstance(item, GroupSpec):
            return item
        return GroupSpec(task=item, group_id=f"{item.instance_id}-g{n}", group_size=group_size)

    if isinstance(items, AsyncIterable):
        n = 0
        async for item in items:
            yield spec(n, item)
            n += 1
    else:
        for n, item in enumerate(items):
            yield spec(n, item)


class FinishedRollout(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout as it ended."""

    record: RolloutRecord  # outcome and reward (None for an infra error), as written to the log
    calls: list[CallRecord] = []  # the model calls it made, in capture order, whole prompts
    diff: str = ""  # the agent's diff (rollouts that were scored)
    eval: EvalResult | None = None  # per-test results (rollouts that were scored)

    @property
    def sampled_calls(self) -> list[CallRecord]:
        """The calls the policy sampled: every call but the guided ones (CallRecord.guided)."""
        return [c for c in self.calls if not c.guided]


class GroupRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A finished group: see the module docstring."""

    group_id: str
    task: Task
    # in rollout order; a group handed on without its stragglers (pools.partial_group_after_s)
    # holds only its finished members
    rollouts: list[FinishedRollout]

    @property
    def records(self) -> list[RolloutRecord]:
        return [r.record for r in self.rollouts]

    @property
    def calls(self) -> list[CallRecord]:
        """Every call the policy sampled, rollout by rollout, each rollout's in capture order:
        what the learner, staleness and the run's counts see. Guided calls (answered by a
        teacher) are left out here, the one place they are filtered."""
        return [c for r in self.rollouts for c in r.sampled_calls]

    @property
    def recorded_calls(self) -> list[CallRecord]:
        """Every call of the group, guided ones too: what the record log must hold."""
        return [c for r in self.rollouts for c in r.calls]

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version any of its sampled calls was sampled under (None: none)."""
        return min((c.policy_version for c in self.calls), default=None)
