"""Groups onto rollout nodes (a Ray run's driver, driver.py): `Cluster` is the driver's view of its
nodes (slots, streaming, node loss), `ClusterPools` the `Pools` face train, eval and serve use
(`run` / `abandon` / `statistics` / `on_late`). A group runs whole on one node; each goes to the
alive node with the most free slots, a group run again after its node died before new ones."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, Awaitable, Callable, Iterable

import anyio
import msgspec

from polar_fast.cluster import ClusterError
from polar_fast.cluster.driver_log import DriverLog
from polar_fast.cluster.node import Drained, NodeInfo
from polar_fast.config import Config
from polar_fast.pools import HISTOGRAM_BOUNDS_S, PoolsStatistics, StageStatistics
from polar_fast.records import Outcome, RolloutRecord, attempt_id, attempt_of
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord, GroupSpec, group_specs
from polar_fast.rollouts.tasks import Task

Emit = Callable[[str, dict], None]
NODE_STOP_TIMEOUT_S = 150  # a node's lanes and stack closing (its sandboxes removed)


def node_died_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return RayActorError, ActorUnavailableError


@dataclass(eq=False)
class Node:
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

    def __init__(self, cfg: Config, log: DriverLog, nodes: list[Node], emit: Emit) -> None:
        self.cfg, self.log, self.nodes, self.emit = cfg, log, nodes, emit
        self.lanes: dict[str, ClusterPools] = {}
        self._changed = asyncio.Condition()
        self._retries_waiting = 0

    @property
    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    async def acquire(self, *, retry: bool = False) -> Node:
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

    async def release(self, node: Node) -> None:
        async with self._changed:
            node.running -= 1
            self._changed.notify_all()

    async def lost(self, node: Node, error: BaseException) -> None:
        if not node.alive:
            return
        async with self._changed:
            node.alive = False
            self._changed.notify_all()
        self.emit("info", {"message": f"rollout node {node.label} died ({type(error).__name__}): its groups in "
                                      f"flight run again on the {len(self.alive)} nodes left"})

    async def drain(self, node: Node) -> bool:
        """Copy the node's new records into the driver's log; False when the node is gone."""
        if not node.alive:
            return False
        async with node.lock:
            try:
                drained = msgspec.msgpack.decode(await node.actor.drain.remote(), type=Drained)
            except node_died_errors() as e:
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

        async def one(node: Node) -> None:
            try:
                await node.actor.update_weights.remote(version, weights)
            except node_died_errors() as e:
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
        self._running: dict[str, tuple[GroupSpec, Node]] = {}  # group id -> where it runs now
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
                async for item in group_specs(tasks, self.group_size):
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
                except node_died_errors() as e:
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

    async def _after_node_loss(self, spec: GroupSpec, node: Node, error: BaseException, on_group) -> GroupSpec | None:
        """An abandoned record for each of the group's rollouts whose calls reached the driver;
        the group's next attempt, or None once out of attempts (then handed on as infra errors)."""
        log, harness = self.cluster.log, self.cluster.cfg.harness.name
        left = log.unended(spec.group_id)
        why = f"rollout node {node.label} died ({type(error).__name__}) while it ran"
        await log.record(*(self._abandoned(spec, r, n, f"{why}; its group runs again elsewhere")
                           for r, n in sorted(left.items())))
        attempt = max([spec.first_attempt] + [attempt_of(r)[1] for r in left]) + 1
        if attempt <= self.cluster.cfg.pools.infra_retries:
            self._retries += spec.group_size
            return msgspec.structs.replace(spec, first_attempt=attempt)
        records = [RolloutRecord(rollout_id=attempt_id(f"{spec.group_id}-r{i}", attempt), group_id=spec.group_id,
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
        out = [FinishedRollout(record=self._abandoned(spec, rollout_id, n, f"{reason}, while running on node "
                                                                           f"{node.label} ({n} model calls)"))
               for spec, node in self._running.values()
               for rollout_id, n in sorted(self.cluster.log.unended(spec.group_id).items())]
        self._running.clear()
        return out

    def _abandoned(self, spec: GroupSpec, rollout_id: str, n_calls: int, error: str) -> RolloutRecord:
        """The end record of a rollout of `spec` that made `n_calls` calls and never finished."""
        return RolloutRecord(rollout_id=rollout_id, group_id=spec.group_id, task_id=spec.task.instance_id,
                             harness=self.cluster.cfg.harness.name, outcome=Outcome.ABANDONED, n_calls=n_calls,
                             attempt=attempt_of(rollout_id)[1], error=error)

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


async def _wait_for_a_free_node(cluster: Cluster) -> None:
    """Do not take the next task before a node can run it (backpressure to the task stream, as
    the local pools' bounded queues give)."""
    await cluster.release(await cluster.acquire())
