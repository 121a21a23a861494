"""The driver of a Ray run: rollout nodes found and started, groups handed out, records streamed in.

    async with open_cluster(cfg, run_dir, emit=emit, engine=engine) as rollouts:
        pools = Pools.for_rollouts(rollouts)  # ClusterPools: the same run / abandon / statistics
        ...                                   # train.py runs its loop on it unchanged

Start-up: the run joins the cluster at `cluster.address` (it never starts one on other machines),
waits up to `cluster.start_timeout_s` for `cluster.min_rollout_nodes` alive nodes offering
`cluster.rollout_resource`, and starts one RolloutNode actor on each (node.py), every placement
under the same deadline; one not placed in time ends the run with what was asked for and what
the cluster offers (placement.py).

Records: every `stream_interval_s` each node's new log frames are appended, byte for byte, to the
driver's `<output_dir>/records.log`, so `view` of the driver's run shows rollouts in flight; a
finished group is drained once more, and any of its calls still missing (a node that died in
between) written from the group record, before it is handed on: the learner never trains on a
group its log does not hold. Rollout records are written by the driver (the train loop's
`on_group`, as on one machine).

Scheduling: a group runs whole on one node (its sandboxes, its sessions' prefix cache); each new
group goes to the alive node with the most free slots (NodeInfo.capacity), and a group run again
after a node died goes before new ones.

A node that dies: its groups in flight are lost with it. Each rollout of theirs whose calls
reached the driver gets an `abandoned` record naming the node (the calls stay in the log, never
trained); the group runs again on another node as its next attempt (GroupSpec.first_attempt:
`<id>.a<n>` rollout ids, which count against `pools.infra_retries`); past that it is handed on as
infra errors, as a local run's would be. The run goes on with the nodes it has, and ends with a
ClusterError when none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable

import anyio
import msgspec

from polar_fast.cluster import ClusterError
from polar_fast.cluster.node import Drained, NodeInfo, RolloutNode
from polar_fast.cluster.placement import placed, unplaced
from polar_fast.config import Config
from polar_fast.pools import HISTOGRAM_BOUNDS_S, PoolsStatistics, StageStatistics
from polar_fast.records import Outcome, Record, RecordLog, RolloutRecord, attempt_of, iter_frames
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord, GroupSpec
from polar_fast.rollouts.tasks import Task

Emit = Callable[[str, dict], None]
NODE_STOP_TIMEOUT_S = 150  # a node's lanes and stack closing (its sandboxes removed)


class _CallHead(msgspec.Struct, tag="call"):
    session_id: str
    rollout_id: str
    group_id: str
    call_index: int


class _ExchangeHead(msgspec.Struct, tag="exchange"):
    pass


class _RolloutHead(msgspec.Struct, tag="rollout"):
    rollout_id: str


class _RunEndHead(msgspec.Struct, tag="run_end"):
    pass


_heads = msgspec.msgpack.Decoder(_CallHead | _ExchangeHead | _RolloutHead | _RunEndHead)


def _node_died_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return RayActorError, ActorUnavailableError


class _LogState:
    calls_in_flight = 0  # over the nodes, as of their last drain (the run's status line)


class DriverLog:
    """The driver's record log: node frames as they stream in, and the driver's own records. It
    stands where the proxy stands on one machine (`record`, `state.calls_in_flight`) and knows,
    from the frames' heads, which calls and rollouts it holds."""

    def __init__(self, log: RecordLog) -> None:
        self.log = log
        self.state = _LogState()
        self._lock = asyncio.Lock()  # one appender (RecordLog's cut-back on failure assumes it)
        self.calls: set[tuple[str, int]] = set()  # (session, call index) of every call it holds
        self.rollout_calls: dict[str, dict[str, int]] = {}  # group id -> rollout id -> calls held
        self.ended: set[str] = set()  # rollouts with an end record

    async def record(self, *records: Record) -> None:
        async with self._lock:
            await asyncio.to_thread(self.log.append_all, list(records))
        for r in records:
            if isinstance(r, RolloutRecord):
                self.ended.add(r.rollout_id)

    async def append_frames(self, frames: bytes) -> None:
        if not frames:
            return
        async with self._lock:
            await asyncio.to_thread(self.log.append_all, [frames])
        for _, head in iter_frames(frames, _heads):
            if isinstance(head, _CallHead):
                self._saw_call(head.session_id, head.call_index, head.group_id, head.rollout_id)
            elif isinstance(head, _RolloutHead):
                self.ended.add(head.rollout_id)

    def _saw_call(self, session_id: str, call_index: int, group_id: str, rollout_id: str) -> None:
        self.calls.add((session_id, call_index))
        per_rollout = self.rollout_calls.setdefault(group_id, {})
        per_rollout[rollout_id] = per_rollout.get(rollout_id, 0) + 1

    async def ensure_group(self, group: GroupRecord) -> None:
        """Write the group's calls the streams have not brought (whole prompts, as the group
        record holds them)."""
        missing = [c for c in group.calls if (c.session_id, c.call_index) not in self.calls]
        if missing:
            await self.record(*missing)
            for c in missing:
                self._saw_call(c.session_id, c.call_index, c.group_id, c.rollout_id)

    def unended(self, group_id: str) -> dict[str, int]:
        """The group's rollouts that made calls and have no end record: rollout id -> calls."""
        return {r: n for r, n in self.rollout_calls.get(group_id, {}).items() if r not in self.ended}


@dataclass(eq=False)
class _Node:
    actor: Any
    info: NodeInfo
    alive: bool = True
    running: int = 0  # groups it runs now, all lanes
    statistics: dict[str, dict] = field(default_factory=dict)  # lane -> its PoolsStatistics (builtins)
    calls_in_flight: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one drain at a time, in log order

    @property
    def label(self) -> str:
        return f"{self.info.node_id[:12]} ({self.info.hostname})"

    @property
    def free(self) -> int:
        return self.info.capacity - self.running


class Cluster:
    """The driver's view of its rollout nodes: placement of groups, streaming, node loss."""

    def __init__(self, cfg: Config, log: DriverLog, nodes: list[_Node], emit: Emit) -> None:
        self.cfg, self.log, self.nodes, self.emit = cfg, log, nodes, emit
        self.lanes: dict[str, ClusterPools] = {}
        self._changed = asyncio.Condition()
        self._retries_waiting = 0

    @property
    def alive(self) -> list[_Node]:
        return [n for n in self.nodes if n.alive]

    async def acquire(self, *, retry: bool = False) -> _Node:
        """The alive node with the most free slots, once one has a slot; ClusterError when no
        node is left. A group run again after its node died (`retry`) goes before new groups: its
        data is the oldest, and the run should not leave it behind."""
        async with self._changed:
            self._retries_waiting += retry
            try:
                while True:
                    if not self.alive:
                        raise ClusterError("every rollout node of the cluster died: the run cannot go on "
                                           f"({len(self.nodes)} started; see each node's Ray logs)")
                    node = max(self.alive, key=lambda n: n.free)
                    if node.free > 0 and (retry or not self._retries_waiting):
                        node.running += 1
                        return node
                    await self._changed.wait()
            finally:
                self._retries_waiting -= retry

    async def release(self, node: _Node) -> None:
        async with self._changed:
            node.running -= 1
            self._changed.notify_all()

    async def lost(self, node: _Node, error: BaseException) -> None:
        if not node.alive:
            return
        async with self._changed:
            node.alive = False
            self._changed.notify_all()
        self.emit("info", {"message": f"rollout node {node.label} died ({type(error).__name__}): its groups in "
                                      f"flight run again on the {len(self.alive)} nodes left"})

    async def drain(self, node: _Node) -> bool:
        """Copy the node's new records into the driver's log; False when the node is gone."""
        if not node.alive:
            return False
        async with node.lock:
            try:
                drained = msgspec.msgpack.decode(await node.actor.drain.remote(), type=Drained)
            except _node_died_errors() as e:
                await self.lost(node, e)
                return False
            await self.log.append_frames(drained.frames)
        node.statistics, node.calls_in_flight = drained.statistics, drained.calls_in_flight
        self.log.state.calls_in_flight = sum(n.calls_in_flight for n in self.alive)
        for lane_id, late in drained.late.items():
            if (lane := self.lanes.get(lane_id)) is not None:
                for rollout in late:
                    await lane.late(rollout)
        return True

    async def stream(self) -> None:
        """Every stream interval, each alive node's new records into the driver's log."""
        while True:
            await asyncio.gather(*(self.drain(n) for n in self.alive))
            await asyncio.sleep(self.cfg.cluster.stream_interval_s)

    async def update_weights(self, version: int, named_tensors: list | None) -> None:
        """Each alive node's engine serves `version` (the weights travel through Ray's object
        store once, when the nodes' engines compute with them)."""
        import ray

        weights = None if named_tensors is None else await asyncio.to_thread(ray.put, named_tensors)
        nodes = self.alive

        async def one(node: _Node) -> None:
            try:
                await node.actor.update_weights.remote(version, weights)
            except _node_died_errors() as e:
                await self.lost(node, e)

        await asyncio.gather(*(one(n) for n in nodes))


_lane_ids = itertools.count()


class ClusterPools:
    """Pools.run / abandon / statistics over the cluster's nodes (train.py and evaluate.py use
    it as they use Pools); see the module docstring."""

    def __init__(self, cluster: Cluster, *, group_size: int | None = None, max_groups_in_flight: int = 0,
                 partial_group_after_s: float = 0.0,
                 on_late: Callable[[FinishedRollout], Awaitable[None]] | None = None) -> None:
        self.cluster = cluster
        self.group_size = group_size or cluster.cfg.pools.group_size
        self.options = {"group_size": self.group_size, "partial_group_after_s": partial_group_after_s}
        self.max_groups_in_flight = max_groups_in_flight
        self.on_late = on_late
        self.lane = f"lane{next(_lane_ids)}"
        self._running: dict[str, tuple[GroupSpec, _Node]] = {}  # group id -> where it runs now
        self._groups_done = self._rollouts_done = self._retries = 0
        self._started_at = time.monotonic()

    async def late(self, rollout: FinishedRollout) -> None:
        if self.on_late is not None:
            await self.on_late(rollout)

    async def run(self, tasks: Iterable[Task | GroupSpec] | AsyncIterable[Task | GroupSpec],
                  on_group: Callable[[GroupRecord], Awaitable[None]]) -> None:
        cluster = self.cluster
        options = msgspec.msgpack.encode(self.options)
        await asyncio.gather(*(n.actor.open_lane.remote(self.lane, options) for n in cluster.alive),
                             return_exceptions=True)  # a node that died is found by its next call
        cluster.lanes[self.lane] = self
        slots = anyio.Semaphore(self.max_groups_in_flight) if self.max_groups_in_flight > 0 else None
        try:
            async with anyio.create_task_group() as tg:
                async for n, item in _enumerate(tasks):
                    if not isinstance(item, GroupSpec):
                        item = GroupSpec(task=item, group_id=f"{item.instance_id}-g{n}", group_size=self.group_size)
                    if slots is not None:
                        await slots.acquire()
                    await _wait_for_a_free_node(cluster)
                    tg.start_soon(self._group, item, on_group, slots)
        finally:
            with anyio.CancelScope(shield=True):
                cluster.lanes.pop(self.lane, None)
                await asyncio.gather(*(cluster.drain(n) for n in cluster.alive))  # every call made is in the log
                with anyio.move_on_after(NODE_STOP_TIMEOUT_S):
                    await asyncio.gather(*(n.actor.close_lane.remote(self.lane) for n in cluster.alive),
                                         return_exceptions=True)

    async def _group(self, spec: GroupSpec, on_group, slots: anyio.Semaphore | None) -> None:
        try:
            while True:
                node = await self.cluster.acquire(retry=spec.first_attempt > 0)
                self._running[spec.group_id] = (spec, node)
                encoded, died = None, None
                try:
                    encoded = await node.actor.run_group.remote(self.lane, msgspec.msgpack.encode(spec))
                except _node_died_errors() as e:
                    died = e
                finally:
                    await self.cluster.release(node)
                if died is not None:
                    await self.cluster.lost(node, died)
                    retry = await self._after_node_loss(spec, node, died, on_group)
                    self._running.pop(spec.group_id, None)
                    if retry is None:
                        return
                    spec = retry
                    continue
                group = msgspec.msgpack.decode(encoded, type=GroupRecord)
                await self.cluster.drain(node)
                await self.cluster.log.ensure_group(group)  # in the driver's log before anyone may train on it
                self._rollouts_done += len(group.rollouts)
                self._groups_done += 1
                await on_group(group)
                self._running.pop(spec.group_id, None)  # only now: a stop during on_group leaves it to abandon()
                return
        finally:
            if slots is not None:
                slots.release()

    async def _after_node_loss(self, spec: GroupSpec, node: _Node, error: BaseException, on_group) -> GroupSpec | None:
        """An abandoned record for each of the group's rollouts whose calls reached the driver;
        the group's next attempt, or None once out of attempts (then handed on as infra errors)."""
        log, harness = self.cluster.log, self.cluster.cfg.harness.name
        left = log.unended(spec.group_id)
        why = f"rollout node {node.label} died ({type(error).__name__}) while it ran"
        await log.record(*(RolloutRecord(rollout_id=r, group_id=spec.group_id, task_id=spec.task.instance_id,
                                         harness=harness, outcome=Outcome.ABANDONED, n_calls=n,
                                         attempt=attempt_of(r)[1], error=f"{why}; its group runs again elsewhere")
                           for r, n in sorted(left.items())))
        attempt = max([spec.first_attempt] + [attempt_of(r)[1] for r in left]) + 1
        if attempt <= self.cluster.cfg.pools.infra_retries:
            self._retries += spec.group_size
            return msgspec.structs.replace(spec, first_attempt=attempt)
        records = [RolloutRecord(rollout_id=f"{spec.group_id}-r{i}.a{attempt}", group_id=spec.group_id,
                                 task_id=spec.task.instance_id, harness=harness, outcome=Outcome.INFRA_ERROR,
                                 attempt=attempt, error=f"{why}; out of retries (pools.infra_retries)")
                   for i in range(spec.group_size)]
        self._groups_done += 1
        await on_group(GroupRecord(group_id=spec.group_id, task=spec.task,
                                   rollouts=[FinishedRollout(record=r) for r in records]))
        return None

    def abandon(self, reason: str) -> list[FinishedRollout]:
        """After `run` ended early: an `abandoned` record for each rollout of a group still
        running whose calls reached the driver (they are all in its log: run's last drain)."""
        out = []
        for spec, node in self._running.values():
            for rollout_id, n in sorted(self.cluster.log.unended(spec.group_id).items()):
                out.append(FinishedRollout(record=RolloutRecord(
                    rollout_id=rollout_id, group_id=spec.group_id, task_id=spec.task.instance_id,
                    harness=self.cluster.cfg.harness.name, outcome=Outcome.ABANDONED, n_calls=n,
                    attempt=attempt_of(rollout_id)[1], error=f"{reason}, while running on node {node.label} "
                                                             f"({n} model calls)")))
        self._running.clear()
        return out

    def statistics(self) -> PoolsStatistics:
        per_node = [n.statistics[self.lane] for n in self.cluster.alive if self.lane in n.statistics]
        stages = {name: _sum_stages(name, [s[name] for s in per_node]) for name in ("boot", "agent", "eval")}
        return PoolsStatistics(
            **stages, groups_done=self._groups_done, rollouts_done=self._rollouts_done, retries=self._retries,
            elapsed_s=time.monotonic() - self._started_at, groups_in_flight=len(self._running),
            stragglers=sum(s["stragglers"] for s in per_node),
            oldest_straggler_s=max((s["oldest_straggler_s"] for s in per_node), default=0.0),
            partial_groups=sum(s["partial_groups"] for s in per_node),
            waiting_for_disk="; ".join(s["waiting_for_disk"] for s in per_node if s["waiting_for_disk"]))


def _sum_stages(name: str, stages: list[dict]) -> StageStatistics:
    workers = sum(s["workers"] for s in stages)
    completed = sum(s["completed"] for s in stages)
    histogram = [sum(col) for col in zip(*(s["histogram"] for s in stages))] or [0] * (len(HISTOGRAM_BOUNDS_S) + 1)
    return StageStatistics(
        name=name, workers=workers, running=sum(s["running"] for s in stages), queued=sum(s["queued"] for s in stages),
        completed=completed, failed=sum(s["failed"] for s in stages),
        busy_fraction=sum(s["busy_fraction"] * s["workers"] for s in stages) / workers if workers else 0.0,
        oldest_running_s=max((s["oldest_running_s"] for s in stages), default=0.0), histogram=histogram,
        mean_s=sum(s["mean_s"] * s["completed"] for s in stages) / completed if completed else 0.0)


async def _enumerate(items) -> AsyncIterator[tuple[int, Any]]:
    if isinstance(items, AsyncIterable):
        n = 0
        async for item in items:
            yield n, item
            n += 1
    else:
        for n, item in enumerate(items):
            yield n, item


async def _wait_for_a_free_node(cluster: Cluster) -> None:
    """Do not take the next task before a node can run it (backpressure to the task stream, as
    the local pools' bounded queues give)."""
    await cluster.release(await cluster.acquire())


class NodeEngines:
    """The engines of the rollout nodes, as the learner's weight sync and the run's mismatch gate
    see one engine (train.py): `update_weights` reaches every alive node."""

    def __init__(self, cluster: Cluster, made_up_logprobs: bool) -> None:
        self.cluster = cluster
        self.made_up_logprobs = made_up_logprobs  # a scripted policy: no gate, and no weights to ship
        self.policy_version = 0

    async def update_weights(self, named_tensors, *, version: int) -> None:
        tensors = None if self.made_up_logprobs or named_tensors is None else [
            (name, t.detach().to("cpu").contiguous()) for name, t in named_tensors]
        await self.cluster.update_weights(version, tensors)
        self.policy_version = version


@dataclass(eq=False)
class ClusterRollouts:
    """What train.py needs of the rollout side, on a cluster: `cfg`, `engine` (NodeEngines),
    `proxy` (the DriverLog), `leftovers_removed`, `weight_sync`, and the pools
    (`Pools.for_rollouts` calls `cluster_pools`)."""

    cfg: Config
    engine: NodeEngines
    proxy: DriverLog
    cluster: Cluster
    leftovers_removed: int
    weight_sync: Any = None  # the learner's WeightSync: replicas' (replicas.py), a disk reload, or NodeEngines'

    def cluster_pools(self, **options: Any) -> ClusterPools:
        return ClusterPools(self.cluster, **options)


async def _connect(cfg: Config) -> bool:
    """Join the cluster (True when this call did, so the caller disconnects)."""
    import ray

    if ray.is_initialized():
        return False
    try:
        await asyncio.to_thread(ray.init, address=cfg.cluster.address, include_dashboard=False, log_to_driver=False,
                                configure_logging=False)
    except ConnectionError as e:
        raise ClusterError(f"no Ray cluster at cluster.address = {cfg.cluster.address!r} ({e}): start one first "
                           "(`ray start --head`, docs/scaling.md); a run never starts a cluster itself") from None
    return True


async def _rollout_node_ids(cfg: Config) -> list[str]:
    """The alive nodes offering the rollout resource, once there are `min_rollout_nodes` of them
    (ClusterError at the deadline)."""
    import ray

    c = cfg.cluster
    deadline = time.monotonic() + c.start_timeout_s
    while True:
        nodes = await asyncio.to_thread(ray.nodes)
        ids = [n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get(c.rollout_resource, 0) >= 1]
        if len(ids) >= c.min_rollout_nodes:
            return ids
        if time.monotonic() >= deadline:
            raise unplaced(f"cluster.min_rollout_nodes = {c.min_rollout_nodes} rollout node(s)",
                           {c.rollout_resource: 1}, c.start_timeout_s)
        await asyncio.sleep(min(1.0, c.start_timeout_s / 10))


async def _start_node(cfg: Config, node_id: str, run_dir: Path, engine: Any) -> _Node:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    c = cfg.cluster
    actor = await asyncio.to_thread(lambda: _actor_class().options(  # Ray's calls block: off the loop
        resources={c.rollout_resource: 1}, num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)).remote())
    await placed(actor.node_id.remote(), f"the rollout actor on node {node_id[:12]}", {c.rollout_resource: 1},
                 c.start_timeout_s)
    # the node runs the local stack: its own pools, proxy and sandboxes
    node_cfg = msgspec.structs.replace(cfg, cluster=msgspec.structs.replace(cfg.cluster, kind="local"))
    try:
        # the engine (a scripted one in tests) is pickled with the call: off the loop too
        info = await (await asyncio.to_thread(actor.start.remote, msgspec.json.encode(node_cfg),
                                              str(run_dir / "nodes" / node_id[:12]), engine))
    except Exception as e:
        await asyncio.to_thread(ray.kill, actor)
        raise ClusterError(f"the rollout node {node_id[:12]} could not open its rollout stack: {e}") from None
    return _Node(actor=actor, info=msgspec.msgpack.decode(info, type=NodeInfo))


@functools.cache
def _actor_class():
    import ray

    return ray.remote(RolloutNode)


async def _stop_node(node: _Node) -> None:
    import ray

    if node.alive:
        with contextlib.suppress(Exception), anyio.move_on_after(NODE_STOP_TIMEOUT_S):
            await node.actor.stop.remote()
    with contextlib.suppress(Exception):
        await asyncio.to_thread(ray.kill, node.actor)


@asynccontextmanager
async def open_cluster(cfg: Config, run_dir: Path, *, emit: Emit | None = None,
                       engine: Any = None) -> AsyncIterator[ClusterRollouts]:
    """The cluster's rollout side for the life of the block; see the module docstring. `engine`
    (tests: a scripted policy) is copied to every node in place of the configured one. A vLLM
    engine with neither url nor urls gets `engine.replicas` servers placed first (replicas.py),
    which the nodes' engines route to."""
    import ray

    emit = emit or (lambda kind, data: None)
    run_dir = await asyncio.to_thread(run_dir.resolve)  # nodes on other machines get it absolute
    joined = await _connect(cfg)
    try:
        async with contextlib.AsyncExitStack() as stack:
            e = cfg.engine
            replica_sync = None
            if engine is None and e.kind == "vllm" and not (e.url or e.urls):
                from polar_fast.cluster.replicas import placed_replicas

                replicas = await stack.enter_async_context(placed_replicas(cfg, run_dir, emit=emit))
                cfg, replica_sync = replicas.cfg, replicas.sync
            async with _rollout_nodes(cfg, run_dir, emit, engine) as rollouts:
                rollouts.weight_sync = replica_sync or await _weight_sync(cfg, rollouts, run_dir, stack)
                yield rollouts
    finally:
        if joined:
            with anyio.CancelScope(shield=True):
                await asyncio.to_thread(ray.shutdown)


async def _weight_sync(cfg: Config, rollouts: ClusterRollouts, run_dir: Path, stack: contextlib.AsyncExitStack):
    """How the learner's weights reach the engines when no replicas were placed: servers the
    user started (engine.url / urls) reload `<output_dir>/weights`, which they must serve, as on
    one machine; in-process engines on the nodes get them through Ray (NodeEngines)."""
    from polar_fast.learner.weight_sync import DiskSync, EngineSync

    if rollouts.engine.made_up_logprobs or cfg.engine.kind != "vllm":
        return EngineSync(rollouts.engine)
    from polar_fast.engines import build_engine

    client = await asyncio.to_thread(build_engine, cfg.model, cfg.engine)
    stack.push_async_callback(client.aclose)
    return DiskSync(client, run_dir / "weights", dtype=cfg.engine.dtype)


@asynccontextmanager
async def _rollout_nodes(cfg: Config, run_dir: Path, emit: Emit, engine: Any) -> AsyncIterator[ClusterRollouts]:
    nodes: list[_Node] = []
    try:
        ids = await _rollout_node_ids(cfg)
        emit("info", {"message": f"starting rollout actors on {len(ids)} nodes"})
        started = await asyncio.gather(*(_start_node(cfg, i, run_dir, engine) for i in ids), return_exceptions=True)
        nodes = [n for n in started if isinstance(n, _Node)]
        if errors := [e for e in started if isinstance(e, BaseException)]:
            raise errors[0]
        log = DriverLog(await asyncio.to_thread(RecordLog, run_dir / "records.log", fsync=cfg.proxy.record_fsync))
        try:
            cluster = Cluster(cfg, log, nodes, emit)
            made_up = getattr(engine, "made_up_logprobs", False) or (engine is None and cfg.engine.kind == "scripted")
            rollouts = ClusterRollouts(cfg, NodeEngines(cluster, made_up), log, cluster,
                                       sum(n.info.leftovers_removed for n in nodes))
            async with anyio.create_task_group() as tg:
                tg.start_soon(cluster.stream)
                try:
                    yield rollouts
                finally:
                    tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*(cluster.drain(n) for n in cluster.alive))
        finally:
            with anyio.CancelScope(shield=True):
                await asyncio.to_thread(log.log.close)
    finally:
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*(_stop_node(n) for n in nodes))
