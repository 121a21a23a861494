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

The parts: this module starts and stops the nodes and joins the rest; driver_log.py is the
driver's log and what it knows it holds; scheduling.py places groups on nodes (`Cluster`) and is
the pools' face (`ClusterPools`).

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
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import msgspec

from polar_fast.cluster import ClusterError
from polar_fast.cluster.driver_log import DriverLog
from polar_fast.cluster.node import NodeInfo, RolloutNode
from polar_fast.cluster.placement import placed, unplaced
from polar_fast.cluster.scheduling import NODE_STOP_TIMEOUT_S, Cluster, ClusterPools, Emit, Node
from polar_fast.config import Config
from polar_fast.records import RecordLog


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


async def _start_node(cfg: Config, node_id: str, run_dir: Path, engine: Any) -> Node:
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
    return Node(actor=actor, info=msgspec.msgpack.decode(info, type=NodeInfo))


@functools.cache
def _actor_class():
    import ray

    return ray.remote(RolloutNode)


async def _stop_node(node: Node) -> None:
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
    user started (engine.url / urls) reload `<output_dir>/weights`, which they must serve, through
    a client of the driver's, as on one machine; in-process engines on the nodes get them
    through Ray (NodeEngines)."""
    from polar_fast.learner.weight_sync import EngineSync, weight_sync_for

    if rollouts.engine.made_up_logprobs or cfg.engine.kind != "vllm":
        return EngineSync(rollouts.engine)
    from polar_fast.engines import build_engine

    client = await asyncio.to_thread(build_engine, cfg.model, cfg.engine)
    stack.push_async_callback(client.aclose)
    return weight_sync_for(cfg, client, run_dir)


@asynccontextmanager
async def _rollout_nodes(cfg: Config, run_dir: Path, emit: Emit, engine: Any) -> AsyncIterator[ClusterRollouts]:
    nodes: list[Node] = []
    try:
        ids = await _rollout_node_ids(cfg)
        emit("info", {"message": f"starting rollout actors on {len(ids)} nodes"})
        started = await asyncio.gather(*(_start_node(cfg, i, run_dir, engine) for i in ids), return_exceptions=True)
        nodes = [n for n in started if isinstance(n, Node)]
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
