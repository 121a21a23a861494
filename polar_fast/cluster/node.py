"""A rollout node: one machine's rollout stack as a Ray actor (one per node offering
`cluster.rollout_resource`; driver.py places them).

The actor runs today's rollout side unchanged (rollouts/stack.py: harness bundle, engine client,
sandbox factory, capture proxy, record log) on its own uvloop thread, so polar_fast's loop never
shares Ray's; the actor's methods hand coroutines to that loop and await them. Its record log
is `<output_dir>/nodes/<node>/records.log` on the node's own disk: crash-safe, as a single
process run's is, and `drain` hands the driver every complete frame written since the last
drain, byte for byte, which the driver appends to its own log (nothing captured lives only on a
node for longer than a stream interval). Rollout records are the driver's to write, as they are
the train loop's on one machine: the node's log holds calls and exchanges.

A lane is one `Pools.run` of the driver's (training, or an evaluation beside it): `open_lane`
starts the node's pools on a stream of group specs, `run_group` feeds one and returns the group's
record when its last rollout ends, `close_lane` cancels what still runs (the pools remove their
sandboxes). Stragglers a partial group left behind come back through `drain`.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
from pathlib import Path
from typing import Any

import anyio
import msgspec

from polar_fast.config import Config
from polar_fast.pools import Pools
from polar_fast.records import iter_frames
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord, GroupSpec
from polar_fast.rollouts.stack import Rollouts, open_rollouts

STOP_TIMEOUT_S = 120  # closing the lanes and the stack (sandbox removal) on stop
_frame_bounds = msgspec.msgpack.Decoder(msgspec.Raw)  # frames are checked and cut, never decoded, here


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    hostname: str
    capacity: int  # groups it runs at once
    leftovers_removed: int  # sandboxes of a killed earlier run on this node


class Drained(msgspec.Struct, frozen=True, kw_only=True):
    frames: bytes  # complete record frames, in log order, since the last drain
    late: dict[str, list[FinishedRollout]] = {}  # lane -> stragglers of its partial groups, finished since
    statistics: dict[str, dict] = {}  # lane -> its PoolsStatistics, as builtins
    calls_in_flight: int = 0


def node_capacity(cfg: Config) -> int:
    if cfg.cluster.node_groups_in_flight > 0:
        return cfg.cluster.node_groups_in_flight
    return max(1, (cfg.pools.agent_workers + cfg.pools.prewarm) // max(cfg.pools.group_size, 1))


class LogTail:
    """The complete frames a record log gained since the last read (a torn tail, a frame the
    writer is still appending, waits for the next read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return b""
        end = 0
        for end, _ in iter_frames(data, _frame_bounds):
            pass
        self.offset += end
        return data[:end]


class _LoopThread:
    """A uvloop event loop on its own thread; `run` awaits a coroutine on it from another loop."""

    def __init__(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="polar-rollout-node", daemon=True)
        self._thread.start()

    async def run(self, coro) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class _Lane:
    def __init__(self, rollouts: Rollouts, options: dict[str, Any]) -> None:
        self.pools = Pools.for_rollouts(rollouts, **options, on_late=self._on_late)
        self.specs, self._specs_rx = anyio.create_memory_object_stream[GroupSpec](math.inf)
        self.waiting: dict[str, asyncio.Future] = {}
        self.late: list[FinishedRollout] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.pools.run(self._specs_rx, self._on_group)
        except BaseException as e:  # every group still waiting fails with what stopped the pools
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(e if isinstance(e, Exception) else RuntimeError("lane closed"))
            raise

    async def _on_group(self, group: GroupRecord) -> None:
        future = self.waiting.pop(group.group_id, None)
        if future is not None and not future.done():
            future.set_result(group)

    async def _on_late(self, rollout: FinishedRollout) -> None:
        self.late.append(rollout)

    async def run_group(self, spec: GroupSpec) -> GroupRecord:
        future = asyncio.get_running_loop().create_future()
        self.waiting[spec.group_id] = future
        self.specs.send_nowait(spec)
        return await future

    async def close(self) -> None:
        self.specs.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class RolloutNode:
    """The actor (driver.py makes it a Ray actor pinned to its node). Methods take and return
    msgspec-encoded bytes, so Ray never pickles our records."""

    def __init__(self) -> None:
        self._thread: _LoopThread | None = None
        self._rollouts: Rollouts | None = None
        self._lanes: dict[str, _Lane] = {}
        self._stop: asyncio.Event | None = None
        self._serving: asyncio.Task | None = None
        self._tail: LogTail | None = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def start(self, cfg_json: bytes, node_dir: str, engine: Any = None) -> bytes:
        """Open the rollout stack under `node_dir`; the node's NodeInfo. `engine` (tests: a
        scripted policy) replaces the configured one; this node gets its own copy."""
        cfg = msgspec.json.decode(cfg_json, type=Config)
        self._thread = _LoopThread()
        rollouts = await self._thread.run(self._open(cfg, Path(node_dir), engine))
        info = NodeInfo(node_id=self.node_id(), hostname=socket.gethostname(), capacity=node_capacity(cfg),
                        leftovers_removed=rollouts.leftovers_removed)
        return msgspec.msgpack.encode(info)

    async def _open(self, cfg: Config, node_dir: Path, engine: Any) -> Rollouts:
        ready: asyncio.Future[Rollouts] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._serving = asyncio.create_task(self._serve(cfg, node_dir, engine, ready))
        rollouts = await ready
        self._tail = LogTail(rollouts.log.path)
        return rollouts

    async def _serve(self, cfg: Config, node_dir: Path, engine: Any, ready: asyncio.Future) -> None:
        try:
            async with open_rollouts(cfg, node_dir, engine=engine) as rollouts:
                self._rollouts = rollouts
                ready.set_result(rollouts)
                await self._stop.wait()
                for lane in list(self._lanes.values()):
                    await lane.close()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            raise

    async def open_lane(self, lane_id: str, options: bytes) -> None:
        """Start the node's pools for one of the driver's runs (group_size, max_groups_in_flight,
        partial_group_after_s, as Pools.for_rollouts takes them)."""
        async def open_() -> None:  # on the node's loop: the lane's pools run there
            self._lanes[lane_id] = _Lane(self._rollouts, msgspec.msgpack.decode(options))

        await self._thread.run(open_())

    async def run_group(self, lane_id: str, spec: bytes) -> bytes:
        group_spec = msgspec.msgpack.decode(spec, type=GroupSpec)

        async def run() -> bytes:
            return msgspec.msgpack.encode(await self._lanes[lane_id].run_group(group_spec))

        return await self._thread.run(run())

    async def close_lane(self, lane_id: str) -> None:
        async def close() -> None:
            if (lane := self._lanes.pop(lane_id, None)) is not None:
                await lane.close()

        await self._thread.run(close())

    async def drain(self) -> bytes:
        """What the driver has not had yet (Drained): the log's new frames, late rollouts, and
        the lanes' statistics."""
        async def drain() -> bytes:
            frames = await asyncio.to_thread(self._tail.read)
            late = {lane_id: lane.late for lane_id, lane in self._lanes.items() if lane.late}
            for lane in self._lanes.values():
                lane.late = []
            stats = {lane_id: msgspec.to_builtins(lane.pools.statistics()) for lane_id, lane in self._lanes.items()}
            return msgspec.msgpack.encode(Drained(frames=frames, late=late, statistics=stats,
                                                  calls_in_flight=self._rollouts.proxy.state.calls_in_flight))

        return await self._thread.run(drain())

    async def update_weights(self, version: int, named_tensors: list | None = None) -> None:
        """This node's engine serves `version` (the weights, where the engine is in-process)."""
        await self._thread.run(self._rollouts.engine.update_weights(named_tensors, version=version))

    async def _close(self) -> None:
        self._stop.set()
        with anyio.move_on_after(STOP_TIMEOUT_S):
            await asyncio.gather(self._serving, return_exceptions=True)

    async def stop(self) -> None:
        """Close every lane and the rollout stack (sandboxes removed, the log closed)."""
        if self._thread is None:
            return
        if self._serving is not None:
            await self._thread.run(self._close())
        self._thread.close()
        self._thread = None
