"""The rollout service: polar_fast as the rollout generator of an external trainer.

One process runs the pools, the harness agents, the capture proxy and the engine, exactly as a
training run does (rollouts/stack.py; serve.py starts it), and answers a small HTTP API on its own
port (`[rollout_service] host/port`), apart from the proxy: the proxy faces harnesses in sandboxes,
this faces a trainer, behind its own key (`api_key`, Bearer or x-api-key; required off loopback).

    POST /rollouts/groups             {"task": <SWE-bench row> | "<builtin instance_id>",
                                       "group_size": n (default pools.group_size)}
                                      -> {"group_id", "status": "pending"}; 400 bad task, 429 full
    GET  /rollouts/groups/<id>        -> {"group_id", "task_id", "group_size", "status", "seq",
                                          "rollouts": [rollout records, once done]}
    GET  /rollouts/groups/<id>/batch  -> the finished group's batch (application/msgpack);
                                         409 while pending, 404 unknown or dropped
    GET  /rollouts/stream[?after=SEQ] -> chunked; one frame per finished group in finish order,
                                         those kept with seq > after first, then live:
                                         frame = u32 little-endian length | msgpack batch
    GET  /rollouts/statistics         -> pools statistics (queued / running per stage)

A batch is a msgpack map: group_id, task_id, seq, layout, rollout_ids (the merge's; the `rollout`
array indexes it), rewards (aligned with rollout_ids; None for an infra error), rollouts (every
rollout record of the group, in group order, also those without calls), stats (MergeStats),
arrays {name: {"dtype": "<i4", "shape": [n], "data": bytes}} holding the merge/arrays.py arrays:
`np.frombuffer(a["data"], a["dtype"]).reshape(a["shape"])`. Batches are encoded once, when the
group finishes, and kept for `keep_groups` newer groups. Group ids are `<instance_id>-<random>`,
unique across restarts on the same output dir. Every rollout and call also lands in
`<output_dir>/records.log`, as in a training run. Weights stay the engine's business: a trainer
updates vLLM itself; calls carry the engine's policy version.
"""

from __future__ import annotations

import asyncio
import collections
import math
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any, AsyncIterable, Awaitable, Callable, Protocol

import anyio
import msgspec
from aiohttp import web

from polar_fast.config import RolloutServiceConfig
from polar_fast.errors import PolarError
from polar_fast.merge.arrays import ARRAY_FIELDS, Merged
from polar_fast.records import Record, RolloutRecord
from polar_fast.rollouts.groups import GroupRecord, GroupSpec
from polar_fast.rollouts.tasks import Task, TaskError, parse_task

FRAME_HEADER = struct.Struct("<I")
MAX_GROUP_SIZE = 1024


class _Submit(msgspec.Struct, forbid_unknown_fields=True):
    task: dict[str, Any] | str
    group_size: int | None = None


class GroupStatus(msgspec.Struct, kw_only=True):
    group_id: str
    task_id: str
    group_size: int
    status: str = "pending"  # "pending" | "done"
    seq: int = -1  # finish order, from 0; -1 while pending
    submitted_at: float = 0.0  # unix seconds
    finished_at: float = 0.0
    rollouts: list[RolloutRecord] = []


@dataclass(eq=False)
class _Group:
    status: GroupStatus
    batch: bytes = b""


class ServiceError(PolarError):
    """A request the service refuses; answered with `status` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def encode_batch(group: GroupRecord, merged: Merged, seq: int) -> bytes:
    """The msgpack batch of one finished group (format in the module docstring)."""
    rewards = {r.rollout_id: r.reward for r in group.records}
    arrays = {}
    for name in ARRAY_FIELDS:
        a = getattr(merged, name)
        arrays[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    return msgspec.msgpack.encode({
        "group_id": group.group_id, "task_id": group.task.instance_id, "seq": seq, "layout": merged.layout,
        "rollout_ids": merged.rollout_ids, "rewards": [rewards.get(rid) for rid in merged.rollout_ids],
        "rollouts": group.records, "stats": merged.stats, "arrays": arrays,
    })


def decode_batch(data: bytes) -> dict[str, Any]:
    """A batch with its arrays as numpy arrays (for trainers written in Python, and tests)."""
    import numpy as np

    batch = msgspec.msgpack.decode(data)
    batch["arrays"] = {name: np.frombuffer(a["data"], dtype=a["dtype"]).reshape(a["shape"])
                       for name, a in batch["arrays"].items()}
    return batch


class GroupRunner(Protocol):
    """What the service runs the submitted groups on: pools.Pools."""

    async def run(self, tasks: AsyncIterable[GroupSpec], on_group: Callable[[GroupRecord], Awaitable[None]]) -> None: ...

    def statistics(self) -> Any: ...


class RolloutService:
    """Submitted groups -> the pools' task source; finished groups -> merged, encoded batches.

    `record` appends a record to the run's log (the proxy's recorder)."""

    def __init__(self, cfg: RolloutServiceConfig, *, default_group_size: int,
                 record: Callable[[Record], Awaitable[None]], builtin: dict[str, Task] | None = None) -> None:
        self.cfg = cfg
        self.default_group_size = default_group_size
        self.record = record
        self.builtin = builtin or {}
        self.pools: GroupRunner | None = None
        self._send, self._receive = anyio.create_memory_object_stream[GroupSpec](math.inf)  # bounded below
        self._groups: dict[str, _Group] = {}
        self._finished: collections.deque[_Group] = collections.deque()
        self._pending = 0
        self._next_seq = 0
        self._changed = asyncio.Event()  # replaced after each set: a fresh one per change
        self._closed = False

    # ------------------------------------------------------------------------------------ groups

    def submit(self, task: Task, group_size: int | None = None) -> GroupStatus:
        if self._closed:
            raise ServiceError(503, "the service is shutting down")
        size = self.default_group_size if group_size is None else group_size
        if not 1 <= size <= MAX_GROUP_SIZE:
            raise ServiceError(400, f"group_size must be in [1, {MAX_GROUP_SIZE}], got {size}")
        if self._pending >= self.cfg.max_pending_groups:
            raise ServiceError(429, f"{self._pending} groups pending (rollout_service.max_pending_groups); "
                                    "fetch finished ones and retry")
        group_id = f"{task.instance_id}-{secrets.token_hex(4)}"
        status = GroupStatus(group_id=group_id, task_id=task.instance_id, group_size=size, submitted_at=time.time())
        self._groups[group_id] = _Group(status)
        self._pending += 1
        self._send.send_nowait(GroupSpec(task=task, group_id=group_id, group_size=size))
        return status

    def status(self, group_id: str) -> _Group:
        group = self._groups.get(group_id)
        if group is None:
            raise ServiceError(404, f"no group {group_id!r} (unknown, or dropped after "
                                    f"{self.cfg.keep_groups} newer groups finished)")
        return group

    async def on_group(self, done: GroupRecord) -> None:
        """The pools' callback: log the rollouts, merge the calls, keep the encoded batch."""
        from polar_fast.merge import merge

        for rollout in done.records:
            await self.record(rollout)
        group = self._groups.get(done.group_id)
        if group is None:  # not submitted here: cannot happen with this service's task source
            raise RuntimeError(f"finished group {done.group_id!r} was never submitted")
        seq = self._next_seq
        self._next_seq += 1

        def build() -> bytes:  # merge (GIL released) and encode off the event loop
            return encode_batch(done, merge(done.calls, layout=self.cfg.layout), seq)

        group.batch = await asyncio.to_thread(build)
        group.status.status, group.status.seq = "done", seq
        group.status.finished_at, group.status.rollouts = time.time(), done.records
        self._pending -= 1
        self._finished.append(group)
        while len(self._finished) > self.cfg.keep_groups:
            dropped = self._finished.popleft()
            del self._groups[dropped.status.group_id]
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def finished_after(self, seq: int) -> list[_Group]:
        return [g for g in self._finished if g.status.seq > seq]

    async def run(self, pools: GroupRunner) -> None:
        """Run the pools on the submitted groups until `close()` and every pending group is done
        (or until cancelled: in-flight rollouts are abandoned and their sandboxes removed)."""
        self.pools = pools
        await pools.run(self._receive, self.on_group)

    def close(self) -> None:
        """Take no more groups and end open streams."""
        self._closed = True
        self._send.close()
        self._notify()

    # -------------------------------------------------------------------------------------- HTTP

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/rollouts/groups", self._post_group)
        app.router.add_get("/rollouts/groups/{group_id}", self._get_group)
        app.router.add_get("/rollouts/groups/{group_id}/batch", self._get_batch)
        app.router.add_get("/rollouts/stream", self._stream)
        app.router.add_get("/rollouts/statistics", self._statistics)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            self._check_key(request)
            return await handler(request)
        except ServiceError as e:
            return _json({"error": {"message": e.message}}, status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _json({"error": {"message": f"{e.reason}: {request.method} {request.path}"}}, status=e.status)

    def _check_key(self, request: web.Request) -> None:
        if not self.cfg.api_key:
            return
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), self.cfg.api_key.encode()):
            raise ServiceError(401, "api key required (Authorization: Bearer <rollout_service.api_key>)")

    async def _post_group(self, request: web.Request) -> web.Response:
        try:
            spec = msgspec.json.decode(await request.read(), type=_Submit)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            usage = 'POST /rollouts/groups takes JSON {"task": row or builtin id, "group_size": n}'
            raise ServiceError(400, f"{usage}: {e}") from None
        if isinstance(spec.task, str):
            task = self.builtin.get(spec.task)
            if task is None:
                raise ServiceError(400, f"no builtin task {spec.task!r}; known: {sorted(self.builtin)}")
        else:
            try:
                task = parse_task(spec.task, where="task")
            except TaskError as e:
                raise ServiceError(400, str(e)) from None
        status = self.submit(task, spec.group_size)
        return _json({"group_id": status.group_id, "status": status.status})

    async def _get_group(self, request: web.Request) -> web.Response:
        return _json(self.status(request.match_info["group_id"]).status)

    async def _get_batch(self, request: web.Request) -> web.Response:
        group = self.status(request.match_info["group_id"])
        if group.status.status != "done":
            raise ServiceError(409, f"group {group.status.group_id!r} is still running")
        return web.Response(body=group.batch, content_type="application/msgpack")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        try:
            cursor = int(request.query.get("after", "-1"))
        except ValueError:
            raise ServiceError(400, "after must be an integer sequence number") from None
        response = web.StreamResponse(headers={"Content-Type": "application/x-polar-batches"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            while True:
                changed = self._changed  # taken before looking, so no finish slips between
                for group in self.finished_after(cursor):
                    await response.write(FRAME_HEADER.pack(len(group.batch)) + group.batch)
                    cursor = group.status.seq
                if self._closed:
                    break
                await changed.wait()
            await response.write_eof()
        except ConnectionResetError:  # the trainer hung up; it resumes with ?after=<last seq>
            pass
        return response

    async def _statistics(self, request: web.Request) -> web.Response:
        stats = self.pools.statistics() if self.pools is not None else None
        return _json({"pending_groups": self._pending, "finished_kept": len(self._finished),
                      "next_seq": self._next_seq, "pools": stats})


def _json(value: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), status=status, content_type="application/json")
