"""Rollouts on a Ray cluster (cluster/): a head and two worker nodes on this machine
(`ray.cluster_utils.Cluster`), each worker offering `polar_rollout`, CPUs and object store capped.
train() runs for real on it: the real mini-swe-agent CLI in local sandboxes on each node, the
real proxy per node, the learner in the driver; only the model's choices are scripted (each node
gets its own copy of the scripted engine)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import anyio
import pytest

from polar_fast.config import parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.model import load_tokenizer
from polar_fast.records import Outcome, RunEndRecord, attempt_of, read_log

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.test_train import GROUP_REPLIES, raw_config  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "resources": {"polar_rollout": 1}}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
    for _ in range(2):
        c.add_node(**NODE)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def cluster_config(tmp_path, cluster, *, steps: int = 2, **sections):
    raw = raw_config(tmp_path, steps=steps, **sections)
    raw["run"].update(groups_per_step=2)  # one group per node at a time: both nodes work every step
    raw["cluster"] = {"kind": "ray", "address": cluster.address, "min_rollout_nodes": 2, "start_timeout_s": 60,
                      "stream_interval_s": 0.2, **raw.get("cluster", {})}
    return parse_config(raw)


@pytest.fixture
def scripted_engine() -> ScriptedEngine:
    # per node, in order: each group's first rollout fixes the task, its second gives up
    return ScriptedEngine(GROUP_REPLIES, load_tokenizer(""), cycle=True)


def node_logs(run: Path) -> dict[str, Path]:
    return {p.parent.name: p for p in sorted((run / "nodes").glob("*/records.log"))}


def groups_whole_in(log_path: Path, groups) -> None:
    """Each group's rollout records, and every call of each of its rollouts, are in the log."""
    contents = read_log(log_path)
    ended = {r.rollout_id for r in contents.rollouts}
    held = {(c.session_id, c.call_index) for c in contents.calls}
    for group in groups:
        for rollout in group.rollouts:
            assert rollout.record.rollout_id in ended, f"{rollout.record.rollout_id} not in the driver's log"
            assert all((c.session_id, c.call_index) in held for c in rollout.calls)


def checked_steps(monkeypatch, run: Path) -> list:
    """Learner.step, checking first that the groups it gets are whole in the driver's log."""
    from polar_fast.grpo import Learner

    original, trained = Learner.step, []

    def step(self, groups, **kw):
        groups_whole_in(run / "records.log", groups)
        trained.extend(groups)
        return original(self, groups, **kw)

    monkeypatch.setattr(Learner, "step", step)
    return trained


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_two_steps_on_two_rollout_nodes_stream_every_call_to_the_driver(tmp_path, cluster, monkeypatch,
                                                                              scripted_engine):
    from polar_fast.train import train

    run = tmp_path / "run"
    trained = checked_steps(monkeypatch, run)
    summary = await train(cluster_config(tmp_path, cluster), engine=scripted_engine)

    assert [s["learner/step"] for s in summary.steps] == [1, 2] and len(trained) == 4
    await anyio.to_thread.run_sync(check_streamed, run, trained)


def check_streamed(run: Path, trained) -> None:
    """Every call of each node's log is in the driver's log, both nodes ran rollouts, and the
    run ended with its marker."""
    driver = read_log(run / "records.log")
    assert isinstance(driver.records[-1], RunEndRecord) and driver.records[-1].reason.startswith("finished")
    held = {(c.session_id, c.call_index) for c in driver.calls}
    logs = node_logs(run)
    assert len(logs) == 2
    for name, path in logs.items():
        calls = read_log(path).calls
        assert calls, f"no rollout ran on node {name}"
        assert {(c.session_id, c.call_index) for c in calls} <= held  # every call streamed to the driver
    # each trained group ran on one node, and both nodes ran trained groups
    on = {name: {c.group_id for c in read_log(p).calls} for name, p in logs.items()}
    trained_ids = {g.group_id for g in trained}
    assert all(sum(g in groups for groups in on.values()) == 1 for g in trained_ids)
    assert all(groups & trained_ids for groups in on.values())
