"""Rollouts on a Ray cluster (cluster/): a head and two worker nodes on this machine
(`ray.cluster_utils.Cluster`, tests/conftest.py), each worker offering `polar_rollout`, CPUs and
object store capped. train() runs for real on it: the real mini-swe-agent CLI in local sandboxes
on each node, the real proxy per node, the learner in the driver (a two-layer model with
SmolLM2's vocabulary, tokenizer and template: the steps are real and quick); only the model's
choices are scripted (each node gets its own copy of the scripted engine), or come from HTTP
doubles of vLLM placed as engine replicas."""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path

import anyio
import pytest

from polar_fast.config import parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.model import load_tokenizer
from polar_fast.records import Outcome, RunEndRecord, attempt_of, read_log

ray = pytest.importorskip("ray")
from conftest import RAY_NODE  # noqa: E402
from test_distributed_train import tiny_model_dir  # noqa: E402
from test_rollout_service import TASK, read_frames  # noqa: E402
from test_train import GROUP_REPLIES, raw_config  # noqa: E402
from vllm_double import fake_vllm_python  # noqa: E402


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


def cluster_config(tmp_path, ray_cluster, *, steps: int = 2, cluster: dict | None = None, model: Path | None = None,
                   engine: dict | None = None, **sections):
    raw = raw_config(tmp_path, steps=steps, **sections)
    raw["run"].update(groups_per_step=2)  # one group per node at a time: both nodes work every step
    if model is not None:
        raw["model"] = {"path": str(model)}
    if engine is not None:
        raw["engine"] = engine
    raw["cluster"] = {"kind": "ray", "address": ray_cluster.address, "min_rollout_nodes": 2, "start_timeout_s": 60,
                      "stream_interval_s": 0.2, **(cluster or {})}
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
                                                                              scripted_engine, tiny_model):
    from polar_fast.train import train

    run = tmp_path / "run"
    trained = checked_steps(monkeypatch, run)
    summary = await train(cluster_config(tmp_path, cluster, model=tiny_model), engine=scripted_engine)

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


@pytest.fixture
def victim(cluster):
    """A third rollout node (Ray starts a node's processes from the main thread only)."""
    node = cluster.add_node(**RAY_NODE)
    cluster.wait_for_nodes()
    yield node
    if node in cluster.worker_nodes:
        cluster.remove_node(node)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_node_that_dies_mid_step_has_its_rollouts_abandoned_and_run_again_elsewhere(
        tmp_path, cluster, victim, monkeypatch, scripted_engine, tiny_model):
    """A third rollout node joins, and is removed once one of its rollouts has calls in the
    driver's log and no end: those rollouts get `abandoned` records naming the node, their
    group runs again on the nodes left (attempt ids; before new groups, so the second step trains
    it), and the run finishes both steps on them."""
    from polar_fast.train import train

    run = tmp_path / "run"
    trained = checked_steps(monkeypatch, run)
    cfg = cluster_config(tmp_path, cluster, cluster={"min_rollout_nodes": 3}, model=tiny_model)
    killed: dict[str, set[str]] = {}

    async def kill_mid_rollout() -> None:
        while not killed:
            await anyio.sleep(0.1)
            running = await anyio.to_thread.run_sync(rollouts_in_flight_from, run, victim.node_id[:12])
            if running:
                killed["rollouts"] = running
                await anyio.to_thread.run_sync(cluster.remove_node, victim)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_mid_rollout)
        summary = await train(cfg, engine=scripted_engine)
        tg.cancel_scope.cancel()

    assert killed, "the victim node never ran a rollout"
    assert [s["learner/step"] for s in summary.steps] == [1, 2]
    await anyio.to_thread.run_sync(check_node_loss, run, killed["rollouts"], trained)


def rollouts_in_flight_from(run: Path, node: str) -> set[str]:
    """Rollouts of `node` whose calls are in the driver's log and that have no end record yet."""
    node_log, driver_log = run / "nodes" / node / "records.log", run / "records.log"
    if not node_log.exists() or not driver_log.exists():
        return set()
    mine = {c.rollout_id for c in read_log(node_log).calls}
    driver = read_log(driver_log)
    return {c.rollout_id for c in driver.calls if c.rollout_id in mine} - {r.rollout_id for r in driver.rollouts}


def check_node_loss(run: Path, lost: set[str], trained) -> None:
    driver = read_log(run / "records.log")
    ends = {r.rollout_id: r for r in driver.rollouts}
    for rollout_id in lost:
        end = ends[rollout_id]
        assert end.outcome is Outcome.ABANDONED and "died" in end.error and end.reward is None
        assert end.n_calls == sum(c.rollout_id == rollout_id for c in driver.calls) > 0  # its calls stay, marked
    assert isinstance(driver.records[-1], RunEndRecord) and driver.records[-1].reason.startswith("finished: 2 of 2")
    # the lost group ran again, on another node, as its next attempt, and was trained (whole: checked_steps)
    retried = {attempt_of(r)[0].rsplit("-r", 1)[0] for r in lost}
    [again] = [g for g in trained if g.group_id in retried]
    assert all(attempt_of(r.record.rollout_id)[1] >= 1 for r in again.rollouts)
    assert {r.record.rollout_id for r in again.rollouts}.isdisjoint(lost)


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_a_resource_no_node_offers_ends_the_run_within_the_deadline(tmp_path, cluster, scripted_engine):
    from polar_fast.cluster import ClusterError
    from polar_fast.train import train

    cfg = cluster_config(tmp_path, cluster, cluster={"rollout_resource": "polar_gpu_rollout", "start_timeout_s": 5})
    started = time.monotonic()
    with pytest.raises(ClusterError) as error:
        await train(cfg, engine=scripted_engine)
    message = str(error.value)
    assert "polar_gpu_rollout=1" in message and "start_timeout_s = 5" in message
    assert message.count("polar_rollout=1") == 2  # what the cluster offers: the two worker nodes
    assert time.monotonic() - started < 5 + 60  # the learner loads first (~10 s); never a hang


def test_check_reports_the_rollout_nodes_and_what_they_run(tmp_path, cluster):
    from polar_fast.preflight.cluster import check_cluster

    items = check_cluster(cluster_config(tmp_path, cluster))
    assert [i.status for i in items] == ["pass"] * 4, items
    assert "2 nodes offer polar_rollout" in items[1].evidence
    version = importlib.metadata.version("polar_fast")
    assert all(f"polar_fast {version}" in i.evidence for i in items[2:])  # each node imports the driver's
    short = check_cluster(cluster_config(tmp_path, cluster, cluster={"min_rollout_nodes": 3}))
    assert short[1].status == "fail" and "--resources '{\"polar_rollout\": 1}'" in short[1].fix


def test_nccl_weight_transfer_is_refused_on_a_cluster_before_anything_starts():
    from polar_fast.train import RunError, check_run

    raw = {"cluster": {"kind": "ray"}, "engine": {"kind": "vllm", "weight_sync": "transfer"},
           "learner": {"device": "cuda"}}
    with pytest.raises(RunError, match="not supported on a Ray cluster"):
        check_run(parse_config(raw))
    check_run(parse_config({**raw, "cluster": {"kind": "local"}}))  # one machine: as before


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_two_engine_replicas_serve_the_nodes_and_every_sync_reaches_both(tmp_path, cluster, monkeypatch,
                                                                              tiny_model):
    """engine.replicas = 2 with no url: the run places two vLLM servers (HTTP doubles of vLLM's
    routes, started by the real launcher through engine.launch_python), the rollout nodes route
    their sessions to them, and each of the learner's syncs reaches both replicas, whose calls
    then carry the new version."""
    from polar_fast.cluster.replicas import ReplicaSync
    from polar_fast.train import train

    after_sync: list[tuple[int, list[dict]]] = []
    push = ReplicaSync.push

    async def push_and_look(self, named_tensors, *, version):
        await push(self, named_tensors, version=version)
        after_sync.append((version, [await double_state(url) for url in self.replicas]))

    monkeypatch.setattr(ReplicaSync, "push", push_and_look)
    fake = await anyio.to_thread.run_sync(fake_vllm_python, tmp_path / "fake")
    engine = {"kind": "vllm", "replicas": 2, "gpus_per_replica": 0, "launch_python": str(fake),
              "launch_timeout_s": 120, "max_retries": 1}
    # the doubles' logprobs are made up: no mismatch gate
    cfg = cluster_config(tmp_path, cluster, model=tiny_model, engine=engine, learner={"max_mismatch_kl": 0.0})
    summary = await train(cfg)

    assert [s["learner/step"] for s in summary.steps] == [1, 2]
    assert [v for v, _ in after_sync] == [1, 2]
    for version, states in after_sync:
        assert [s["version"] for s in states] == [str(version)] * 2  # the sync reached both replicas
    assert all(s["calls"] > 0 for s in after_sync[-1][1])  # both served the nodes' sessions
    versions = await anyio.to_thread.run_sync(lambda: {c.policy_version for c in read_log(tmp_path / "run" / "records.log").calls})
    assert {0, 1} <= versions <= {0, 1, 2}  # calls sampled after the first sync carry its version


async def double_state(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url + "/double/state") as r:
        return await r.json()


CLUSTER_CANCEL_MARK = "polar-cluster-cancelled-while-this-runs"


def sleepers(marker: str) -> int:
    """Processes of this machine with `marker` on their command line (local boxes' commands)."""
    import os

    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                count += marker.encode() in f.read()
        except OSError:
            continue
    return count


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_cluster_run_cancelled_mid_rollout_loses_nothing_and_leaves_no_box(tmp_path, cluster, tiny_model):
    """Cancelled from outside while a rollout runs on each node: the nodes' last records are
    drained into the driver's log, each rollout in flight gets its abandoned record there, the
    run its end marker, and the nodes remove their boxes (the commands inside are gone)."""
    from polar_fast.train import train
    from polar_fast.warm_start import bash_call

    engine = await anyio.to_thread.run_sync(
        lambda: ScriptedEngine([bash_call(f"sleep 300 # {CLUSTER_CANCEL_MARK}")], load_tokenizer(""), cycle=True))
    cfg = cluster_config(tmp_path, cluster, model=tiny_model, run={"tensorboard": False})
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_once_both_nodes_run() -> None:
                while await anyio.to_thread.run_sync(sleepers, CLUSTER_CANCEL_MARK) < 2:
                    await anyio.sleep(0.2)
                scope.cancel()

            tg.start_soon(cancel_once_both_nodes_run)
            await train(cfg, engine=engine)
    assert scope.cancelled_caught
    assert await anyio.to_thread.run_sync(sleepers, CLUSTER_CANCEL_MARK) == 0
    await anyio.to_thread.run_sync(check_cancelled, tmp_path / "run")


def check_cancelled(run: Path) -> None:
    driver = read_log(run / "records.log")
    abandoned = driver.rollouts
    assert len(abandoned) == 2 and all(r.outcome is Outcome.ABANDONED and r.n_calls == 1 for r in abandoned)
    assert all(r.error.startswith("the run ended (cancelled), while running on node") for r in abandoned)
    end = driver.records[-1]
    assert isinstance(end, RunEndRecord) and (end.reason, end.abandoned) == ("cancelled", 2)
    held = {(c.session_id, c.call_index) for c in driver.calls}
    for path in node_logs(run).values():
        assert {(c.session_id, c.call_index) for c in read_log(path).calls} <= held


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_eval_runs_on_the_rollout_nodes_too(tmp_path, cluster, scripted_engine, tiny_model):
    """`eval` opens its rollouts through the same door as train: on the cluster, its groups run
    on the nodes and its records land in the driver's eval log."""
    from polar_fast.evaluate import run_eval

    cfg = cluster_config(tmp_path, cluster, model=tiny_model, tasks={"limit": 2})
    report = await run_eval(cfg, samples=2, split="train", limit=2, engine_for=lambda c: scripted_engine)

    # each node's first rollout applies the first task's fix, which only that task takes
    [score] = report.harnesses
    assert score.tasks == 2 and score.pass_at["1"] == 0.25 and score.samples == 4
    await anyio.to_thread.run_sync(check_eval_logs, tmp_path / "run" / "eval" / "mini-swe-agent")


def check_eval_logs(run: Path) -> None:
    log = read_log(run / "records.log")
    assert sorted(r.reward for r in log.rollouts) == [0.0, 0.0, 0.0, 1.0]
    assert all(r.purpose == "eval" for r in log.rollouts) and len(log.calls) == 8
    nodes = node_logs(run)
    assert len(nodes) == 2 and all(read_log(p).calls for p in nodes.values())  # one task's group on each node


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_rollout_service_hands_its_groups_to_the_rollout_nodes(tmp_path, cluster, tiny_model):
    """`serve` on a cluster: two submitted groups run on the two nodes (each node's scripted
    engine, from the config, plays one group), their batches stream out, and the driver's log
    holds every rollout and call the batches were merged from."""
    import aiohttp
    import numpy as np

    from polar_fast import merge
    from polar_fast.rollouts.service import decode_batch
    from polar_fast.serve import open_rollout_service

    cfg = cluster_config(tmp_path, cluster, model=tiny_model)
    async with open_rollout_service(cfg) as running, aiohttp.ClientSession() as http:
        url = running.url
        async with http.get(f"{url}/rollouts/stream") as stream:
            ids = []
            for _ in range(2):
                async with http.post(f"{url}/rollouts/groups", json={"task": TASK.instance_id}) as r:
                    ids.append((await r.json())["group_id"])
            frames = await read_frames(stream, 2)
        async with http.get(f"{url}/rollouts/statistics") as r:
            stats = await r.json()
    assert stats["pending_groups"] == 0 and stats["pools"]["agent"]["completed"] >= 2  # as of the nodes' last drain
    batches = {(batch := decode_batch(f))["group_id"]: batch for f in frames}
    # each group: one rollout fixed the task, one gave up (rewards follow the merge's rollout order,
    # which is not promised to be the order the node ran them in)
    assert sorted(batches) == sorted(ids) and all(sorted(b["rewards"]) == [0.0, 1.0] for b in batches.values())
    contents = await anyio.to_thread.run_sync(read_log, tmp_path / "run" / "records.log")
    assert len(contents.rollouts) == 4
    for group_id, batch in batches.items():
        expected = merge.merge([c for c in contents.calls if c.group_id == group_id])
        assert np.array_equal(batch["arrays"]["tokens"], expected.tokens)
    assert await anyio.to_thread.run_sync(lambda: len(node_logs(tmp_path / "run"))) == 2
