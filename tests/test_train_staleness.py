"""The training loop withholds groups whose oldest call is older than `max_staleness` versions,
counts them, and trains on the fresh ones; it passes over zero-variance groups (up to
run.zero_variance_skips per step) for the next one (learner, pools and metrics are stand-ins
here; the end-to-end runs live in test_train.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from polar_fast.config import parse_config
from polar_fast.grpo import StepMetrics
from polar_fast.pools import PoolsStatistics, StageStatistics
from polar_fast.records import CallRecord, Outcome, RolloutRecord
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord
from polar_fast.testing import stand_in_task
from polar_fast.train import RunSummary, _Loop


def call(rollout: str, version: int) -> CallRecord:
    return CallRecord(session_id=rollout, rollout_id=rollout, group_id=rollout, call_index=0, prompt_ids=[1],
                      completion_ids=[2], completion_logprobs=[-0.5], policy_version=version,
                      finish_reason="stop", dialect="chat")


def group(name: str, version: int, rewards: tuple[float, ...] = (1.0, 0.0)) -> GroupRecord:
    """Its first rollout made one call, at policy `version`."""
    records = [RolloutRecord(rollout_id=f"{name}" if i == 0 else f"{name}-r{i}", group_id=name, task_id="t",
                             harness="h", outcome=Outcome.OK, reward=r) for i, r in enumerate(rewards)]
    rollouts = [FinishedRollout(record=r, calls=[call(name, version)] if i == 0 else []) for i, r in enumerate(records)]
    return GroupRecord(group_id=name, task=stand_in_task(), rollouts=rollouts)


def loop(cfg, learner, pools, metrics, summary, stop=None) -> _Loop:
    return _Loop(cfg, learner=learner, sync=None, pools=pools, proxy=None, metrics=metrics, summary=summary,
                 stop=stop or asyncio.Event(), emit=lambda *a: None)


def fake_pools():
    return SimpleNamespace(statistics=lambda: PoolsStatistics(boot=stage("boot"), agent=stage("agent"),
                                                              eval=stage("eval"), groups_done=0, rollouts_done=0,
                                                              retries=0, elapsed_s=0.0))


class Learner:
    def __init__(self, version: int) -> None:
        self.version, self.step_count, self.trained = version, 0, []

    def step(self, groups: list[GroupRecord], *, gate=None, control=None) -> StepMetrics:
        self.trained.append([c.rollout_id for g in groups for c in g.calls])
        self.step_count += 1
        self.version += 1
        return StepMetrics(step=self.step_count, version=self.version, loss=0.0, pg_loss=0.0, kl=0.0, clip_frac=0.0,
                           ratio_mean=1.0, grad_norm=0.0, reward_mean=1.0, n_rollouts=1, n_terms=1, n_tokens=2,
                           n_micro_batches=1, time_s=0.0)

    async def sync_weights(self, sync) -> None:
        pass

    def save(self, directory: str) -> str:
        return directory


def stage(name: str) -> StageStatistics:
    return StageStatistics(name=name, workers=1, running=0, queued=0, completed=0, failed=0, busy_fraction=0.0,
                           oldest_running_s=0.0, histogram=[], mean_s=0.0)


class Metrics:
    def __init__(self) -> None:
        self.groups: list[tuple[int, str, str]] = []  # what groups.jsonl would get

    async def write_groups(self, step, statuses):
        self.groups += [(step, g, s) for g, s in statuses]

    async def write(self, step, values):
        return {"step": step, **{k: v for k, v in values.items() if not isinstance(v, dict)}}


@pytest.mark.anyio
async def test_stale_groups_are_withheld_and_counted(tmp_path):
    cfg = parse_config({"run": {"steps": 1, "groups_per_step": 1, "max_staleness": 2, "output_dir": str(tmp_path),
                                "checkpoint_every": 100}})
    learner = Learner(version=5)
    summary = RunSummary()
    metrics = Metrics()
    runner = loop(cfg, learner, fake_pools(), metrics, summary)
    learn = asyncio.ensure_future(runner._learn())
    await runner.ready.put(group("too-old", 2))  # learner at version 5: 5 - 2 > 2, stale
    await runner.ready.put(group("fresh-enough", 3))  # 5 - 3 <= 2
    await asyncio.wait_for(learn, 30)
    assert learner.trained == [["fresh-enough"]]
    assert summary.groups_withheld == 1 and summary.groups_trained == 1
    assert metrics.groups == [(1, "fresh-enough", "trained"), (1, "too-old", "withheld")]


@pytest.mark.anyio
@pytest.mark.parametrize("skips", [0, 2])
async def test_zero_variance_groups_are_passed_over_up_to_the_limit(tmp_path, skips):
    cfg = parse_config({"run": {"steps": 1, "groups_per_step": 1, "zero_variance_skips": skips,
                                "output_dir": str(tmp_path), "checkpoint_every": 100}})
    learner, metrics, summary = Learner(version=0), Metrics(), RunSummary()
    runner = loop(cfg, learner, fake_pools(), metrics, summary)

    async def feed():
        for g in (group("all-fail", 0, (0.0, 0.0)), group("all-pass", 0, (1.0, 1.0)),
                  group("all-fail-2", 0, (0.0, 0.0)), group("mixed", 0)):
            await runner.ready.put(g)

    feeder = asyncio.ensure_future(feed())
    await asyncio.wait_for(runner._learn(), 30)
    feeder.cancel()
    if skips == 0:  # trained as it came: a step with nothing to learn
        assert learner.trained == [["all-fail"]] and metrics.groups == [(1, "all-fail", "trained")]
    else:  # two passed over, the third zero-variance group trains: the limit bounds a step's wait
        assert learner.trained == [["all-fail-2"]]
        assert metrics.groups == [(1, "all-fail-2", "trained"), (1, "all-fail", "skipped"), (1, "all-pass", "skipped")]
    assert summary.groups_trained == 1


@pytest.mark.anyio
async def test_a_stop_request_ends_the_loop_between_groups(tmp_path):
    cfg = parse_config({"run": {"steps": 3, "groups_per_step": 1, "output_dir": str(tmp_path)}})
    stop = asyncio.Event()
    summary = RunSummary()
    runner = loop(cfg, Learner(version=0), None, Metrics(), summary, stop)
    learn = asyncio.ensure_future(runner._learn())
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(learn, 5)
    assert summary.stopped_early and summary.groups_trained == 0
