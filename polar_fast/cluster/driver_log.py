"""The driver's record log on a Ray run (driver.py): each rollout node's new log frames appended
byte for byte as they stream in, and the driver's own records. It stands where the proxy stands on
one machine (`record`, `state.calls_in_flight`) and reads only each frame's head (tag and ids) to
know which calls and rollouts it holds: which calls of a finished group are still missing, and
which rollouts of a lost or stopped group made calls but have no end record."""

from __future__ import annotations

import asyncio

import msgspec

from polar_fast.records import Record, RecordLog, RolloutRecord, iter_frames
from polar_fast.rollouts.groups import GroupRecord


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


class _LogState:
    calls_in_flight = 0  # over the nodes, as of their last drain (the run's status line)


class DriverLog:
    """See the module docstring."""

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
        missing = [c for c in group.recorded_calls if (c.session_id, c.call_index) not in self.calls]
        if missing:
            await self.record(*missing)
            for c in missing:
                self._saw_call(c.session_id, c.call_index, c.group_id, c.rollout_id)

    def unended(self, group_id: str) -> dict[str, int]:
        """The group's rollouts that made calls and have no end record: rollout id -> calls."""
        return {r: n for r, n in self.rollout_calls.get(group_id, {}).items() if r not in self.ended}
