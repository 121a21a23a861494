"""vLLM engine replicas on a Ray cluster (`cluster.kind = "ray"`, `engine.replicas`).

    async with placed_replicas(cfg, run_dir, emit=emit) as replicas:
        replicas.cfg   # engine.urls = the replicas' URLs: what the rollout nodes build their engine from
        replicas.sync  # the learner's WeightSync (ReplicaSync)

- Placement: one placement group of `engine.replicas` bundles, `{"CPU": 1, "GPU":
  engine.gpus_per_replica}` each (no GPU at 0: a server of vLLM's CPU build), strategy SPREAD:
  replicas go to different nodes where they can and share one where they must. A bundle is one
  node, so a data-parallel replica (`engine.data_parallel_size` up to its GPUs) or a
  tensor-parallel one (`engine.launch_args`) stays on its node.
- Each replica is an `EngineReplica` actor in its bundle, running the stock `vllm serve` through
  the run's own launcher (engines/vllm_launch.py): on the GPUs Ray gave the actor, listening on
  its node's address (dev-mode routes included: the cluster's network must be trusted, as Ray's
  own ports require), serving `<run_dir>/replicas/<i>/weights` on its node (the same path on
  every node, with the model at `model.path`), with its log beside it. It reports its URL.
- Deadlines: the placement group and each actor are awaited for at most
  `cluster.start_timeout_s` (placement.placed says what was asked for and what the cluster
  offers), each server's readiness for `engine.launch_timeout_s` (the launcher's own). On any
  failure the replicas started so far are stopped and the placement group removed before the
  error propagates: the run exits, it never hangs.
- Weight sync (`ReplicaSync`, disk through a writer on each replica's node): the driver writes
  the weights once in the serving dtype (save_safetensors, as DiskSync does on one machine) and
  puts the file into Ray's object store; each actor writes it into its own served directory
  (atomic rename) and reloads its own server (pause, reload, prefix-cache reset, version label,
  resume: VllmEngine.update_weights), all replicas at once. Each replica's calls then carry the
  new version (vLLM's `weight_versions`, read by every rollout node's engine). A replica whose
  actor died is dropped (its URL stops answering, so the rollout nodes take it out of routing);
  any other failure is a WeightSyncError, as for one engine. The object store holds one copy of
  the weights during a sync. NCCL transfer to several replicas is refused (config.py).
- Teardown: each actor stops its server (SIGTERM to vLLM's process group, SIGKILL after the
  launcher's grace period; a start still running is cancelled, which stops it the same way), then
  is killed, and the placement group is removed.

Ray is imported inside the functions: importing this module does not import it.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, Iterable, TypeVar

import msgspec

from polar_fast.cluster import ClusterError
from polar_fast.cluster.placement import placed
from polar_fast.engines import Engine, build_engine
from polar_fast.engines.vllm_launch import STOP_GRACE_S, WEIGHTS_DIR, launched_vllm
from polar_fast.errors import WeightSyncError
from polar_fast.learner.weight_sync import NamedTensors, save_safetensors

if TYPE_CHECKING:
    import numpy as np

    from polar_fast.config import Config

REPLICAS_DIR = "replicas"  # under the run dir, on each replica's node: <i>/weights, <i>/vllm.log
SYNC_DIR = "replica-sync"  # under the driver's run dir: the file each sync puts into the object store
STRATEGY = "SPREAD"
STOP_MARGIN_S = 10.0  # beyond the launcher's SIGTERM grace, for the actor's reply
LOAD_STEPS = 6  # a replica's share of a sync: the file written, then five dev-mode calls of engine.sync_timeout_s each
T = TypeVar("T")


def bundle(cfg: Config) -> dict[str, float]:
    """What one replica asks of its node."""
    gpus = cfg.engine.gpus_per_replica
    return {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}


def replica_config(cfg: Config, gpus: list[int]) -> Config:
    """The config one replica's launcher sees: the GPUs Ray gave its actor (absolute ids on its
    node; a CPU replica gets nominal ids, one per data-parallel rank, that no device backs), and
    no learner: the launcher keeps vLLM off a CUDA learner's GPUs by reading this process's
    CUDA_VISIBLE_DEVICES, which in the actor are the replica's own."""
    e = cfg.engine
    engine = msgspec.structs.replace(e, launch_gpus=gpus or list(range(e.data_parallel_size)))
    return msgspec.structs.replace(cfg, engine=engine, learner=msgspec.structs.replace(cfg.learner, device="cpu"))


class EngineReplica:
    """One `vllm serve` on the node Ray placed this actor on (`ray.remote` at placement)."""

    def __init__(self, cfg: Config, run_dir: str, index: int) -> None:
        self._cfg = cfg
        self._dir = Path(run_dir) / REPLICAS_DIR / str(index)
        self._stack = contextlib.AsyncExitStack()
        self._starting: asyncio.Task | None = None
        self._engine: Engine | None = None  # a VllmEngine on the server: the syncs' client

    async def node(self) -> str:
        """The node's id: answered once the actor runs (the start-up deadline's first step)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def start(self) -> str:
        """Starts the server; its URL once it answers."""
        import ray

        self._starting = asyncio.current_task()  # stop() cancels it
        host = ray.util.get_node_ip_address()
        cfg = replica_config(self._cfg, [int(g) for g in ray.get_gpu_ids()])
        await asyncio.to_thread(self._dir.mkdir, parents=True, exist_ok=True)
        served = await self._stack.enter_async_context(launched_vllm(cfg, self._dir, host=host))
        self._engine = build_engine(served.model, served.engine)
        return served.engine.url

    async def load(self, weights: np.ndarray, version: int) -> int:
        """Writes the weights (the bytes of a safetensors file) where the server reads them, then
        makes it reload them under the label `version`."""
        if self._engine is None:
            raise WeightSyncError("engine replica: a sync arrived before its server started")
        await asyncio.to_thread(_write_atomically, self._dir / WEIGHTS_DIR / "model.safetensors", weights)
        await self._engine.update_weights(None, version=version)
        return version

    async def stop(self) -> None:
        """Stops the server and its process group (cancelling a start still under way)."""
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.wait([self._starting])  # its launcher stops what it started
        if self._engine is not None:
            await self._engine.aclose()
        await self._stack.aclose()


def _write_atomically(path: Path, data: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.data)
    tmp.replace(path)  # replaces the symlink to the model's file, never writes into it


@dataclass
class ReplicaSync:
    """The learner's WeightSync for placed replicas (module docstring)."""

    replicas: dict[str, Any]  # url -> actor handle, the live ones
    staging: Path  # on the driver
    dtype: str  # the serving dtype
    timeout_s: float  # per replica and sync
    lost: dict[str, str] = field(default_factory=dict)  # url -> why it was dropped

    async def push(self, named_tensors: NamedTensors, *, version: int) -> None:
        path = self.staging / "model.safetensors"
        await asyncio.to_thread(save_safetensors, named_tensors, path, dtype=self.dtype)
        try:
            ref = await asyncio.to_thread(_put_file, path)
            live = list(self.replicas.items())
            results = await asyncio.gather(*(self._load(actor, ref, version) for _, actor in live),
                                           return_exceptions=True)
            del ref  # the object store frees it once no replica holds it
        finally:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        self._settle(live, results, version)

    async def _load(self, actor: Any, ref: Any, version: int) -> int:
        return await asyncio.wait_for(asyncio.wrap_future(actor.load.remote(ref, version).future()), self.timeout_s)

    def _settle(self, live: list[tuple[str, Any]], results: list[Any], version: int) -> None:
        from ray.exceptions import RayActorError

        failed = []
        for (url, _), result in zip(live, results):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled: not a replica's fault
            if isinstance(result, RayActorError):  # the actor, and the server with it, is gone
                del self.replicas[url]
                self.lost[url] = f"its actor died: {result}"
            elif isinstance(result, TimeoutError):
                failed.append(f"replica {url}: no answer within {self.timeout_s:g} s ({LOAD_STEPS} x engine.sync_timeout_s)")
            elif isinstance(result, Exception):
                failed.append(f"replica {url}: {getattr(result, 'cause', None) or result}")
        if failed:
            raise WeightSyncError(f"weight sync to version {version}: " + "; ".join(failed))
        if not self.replicas:
            raise WeightSyncError(f"weight sync to version {version}: no engine replica is left "
                                  f"({'; '.join(f'{u}: {w}' for u, w in self.lost.items())})")


def _put_file(path: Path) -> Any:
    """The file's bytes in the object store, read through a memory map (no copy on the heap)."""
    import numpy as np
    import ray

    return ray.put(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")))


@dataclass(frozen=True)
class PlacedReplicas:
    cfg: Config  # engine.urls set to `urls`
    urls: list[str]
    nodes: list[str]  # the node id of each replica
    sync: ReplicaSync


@asynccontextmanager
async def placed_replicas(cfg: Config, run_dir: Path, *,
                          emit: Callable[[str, dict], None] | None = None) -> AsyncIterator[PlacedReplicas]:
    """`engine.replicas` vLLM servers placed on the cluster `ray.init` joined, for the block."""
    from ray.util.placement_group import placement_group, remove_placement_group

    e, deadline_s = cfg.engine, cfg.cluster.start_timeout_s
    if e.kind != "vllm" or e.url or e.urls:
        raise ClusterError("engine replicas are vLLM servers the run starts: engine.kind = \"vllm\" with neither "
                           "engine.url nor engine.urls set")
    if e.gpus_per_replica and e.data_parallel_size > e.gpus_per_replica:
        raise ClusterError(f"engine.data_parallel_size = {e.data_parallel_size} needs as many GPUs per replica, "
                           f"engine.gpus_per_replica = {e.gpus_per_replica}")
    emit = emit or (lambda kind, data: None)
    each = bundle(cfg)
    emit("info", {"message": f"placing {e.replicas} engine replica(s), each {each}"})
    group = await asyncio.to_thread(placement_group, [dict(each) for _ in range(e.replicas)], strategy=STRATEGY)
    actors: list[Any] = []
    running: list[Any] = []  # the actors that answered: the ones with a server to stop

    async def node_of(i: int, actor: Any) -> str:
        node = await placed(actor.node.remote(), f"engine replica {i}'s actor", each, deadline_s)
        running.append(actor)
        return node

    try:
        await placed(group.ready(), f"engine.replicas = {e.replicas} (a placement group of one bundle per replica, "
                     f"strategy {STRATEGY}, each bundle on one node)", each, deadline_s)
        actors = await asyncio.to_thread(_create_actors, cfg, run_dir, group)
        nodes = await _all(node_of(i, a) for i, a in enumerate(actors))
        urls = await _all(_started(cfg, i, a, node) for i, (a, node) in enumerate(zip(actors, nodes)))
        for i, (url, node) in enumerate(zip(urls, nodes)):
            emit("info", {"message": f"engine replica {i} ready at {url} (node {node[:12]})"})
        await asyncio.to_thread((run_dir / SYNC_DIR).mkdir, parents=True, exist_ok=True)
        sync = ReplicaSync(dict(zip(urls, actors)), run_dir / SYNC_DIR, e.dtype, LOAD_STEPS * e.sync_timeout_s)
        served = msgspec.structs.replace(cfg, engine=msgspec.structs.replace(e, urls=list(urls)))
        yield PlacedReplicas(cfg=served, urls=list(urls), nodes=list(nodes), sync=sync)
    finally:
        await _stop(actors, running, emit)
        await asyncio.to_thread(remove_placement_group, group)


def _create_actors(cfg: Config, run_dir: Path, group: Any) -> list[Any]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(EngineReplica)
    return [actor.options(num_cpus=1, num_gpus=cfg.engine.gpus_per_replica, max_restarts=0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
            .remote(cfg, str(run_dir), i) for i in range(cfg.engine.replicas)]


async def _started(cfg: Config, index: int, actor: Any, node: str) -> str:
    """The replica's URL once its server answers; a ClusterError saying why it did not."""
    from ray.exceptions import RayError

    limit_s = cfg.engine.launch_timeout_s + cfg.cluster.start_timeout_s  # the launcher's own deadline comes first
    try:
        return await asyncio.wait_for(asyncio.wrap_future(actor.start.remote().future()), limit_s)
    except TimeoutError:
        raise ClusterError(f"engine replica {index} (node {node[:12]}) did not report its server ready within "
                           f"{limit_s:g} s (engine.launch_timeout_s + cluster.start_timeout_s)") from None
    except RayError as err:
        raise ClusterError(f"engine replica {index} (node {node[:12]}) could not start vllm serve: "
                           f"{getattr(err, 'cause', None) or err}") from None


async def _all(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of `calls`, run together; the first failure cancels the others and is raised
    as itself (not as an exception group)."""
    try:
        async with asyncio.TaskGroup() as tasks:
            started: list[asyncio.Task[T]] = [tasks.create_task(call) for call in calls]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [task.result() for task in started]


async def _stop(actors: list[Any], running: list[Any], emit: Callable[[str, dict], None]) -> None:
    """Each running actor stops its server, then every actor is killed (module docstring). Ray
    also ends the child processes of an actor that dies, on Linux: its server's leader."""
    import ray

    stops = [asyncio.wrap_future(a.stop.remote().future()) for a in running]
    _, pending = await asyncio.wait(stops, timeout=STOP_GRACE_S + STOP_MARGIN_S) if stops else (set(), set())
    for actor, stop in zip(running, stops):
        failure = "no answer" if stop in pending else stop.exception()
        if failure is not None:
            emit("info", {"message": f"engine replica {actors.index(actor)} did not stop its server cleanly "
                                     f"({failure}); killing its actor"})
        stop.cancel()  # a pending one: its answer no longer matters
    for actor in actors:
        await asyncio.to_thread(ray.kill, actor, no_restart=True)
