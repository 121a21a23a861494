"""What the view reads from a run directory, while the run may still be writing it.

`RunData.refresh()` reads records.log from where the last refresh stopped, so a page reload
shows new rollouts without re-reading the log. The index keeps one small row per rollout and the
file span of each of its frames; prompts, token ids and conversations stay on disk until one
rollout is asked for (`rollout_records`), which re-reads just that rollout's frames. A torn tail
(a frame being written, or a crash) stops the walk before it and is reported; the next refresh
starts again at the last complete frame, so a frame that was only half written is read once it
is whole. metrics.jsonl and groups.jsonl are small (a line per step) and are read whole; a line
that does not parse is counted and skipped, never fatal.

A rollout with no end record yet is, as of each refresh: `retried` when a later attempt of it is
in the log (an infra error ended it), `running` while a live process holds the log open
(records.log_in_use), and otherwise `abandoned`: the run ended without recording its end, after
a run-end marker or, when the last run has none, because it was killed or crashed (a resumed run
writes those `abandoned` records itself, see train.py).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from polar_fast.records import (
    CallRecord,
    ExchangeRecord,
    RolloutRecord,
    RunEndRecord,
    attempt_id,
    attempt_of,
    decode_frame,
    iter_frames,
    log_in_use,
    whole_calls,
    whole_exchanges,
)


class _CallView(msgspec.Struct, tag="call"):
    """The fields of a CallRecord the index needs; prompt ids are skipped undecoded."""

    session_id: str
    rollout_id: str
    group_id: str
    call_index: int
    completion_ids: msgspec.Raw
    policy_version: int
    history: str = "exact"


class _ExchangeView(msgspec.Struct, tag="exchange"):
    rollout_id: str


_index_decoder = msgspec.msgpack.Decoder(_CallView | _ExchangeView | RolloutRecord | RunEndRecord)
READ_CHUNK_BYTES = 64 << 20


def _msgpack_array_len(raw: msgspec.Raw) -> int:
    """Length of a MessagePack array from its header (fixarray, array 16, array 32)."""
    raw = memoryview(raw)
    head = raw[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(raw[1:3], "big")
    if head == 0xDD:
        return int.from_bytes(raw[1:5], "big")
    raise ValueError(f"not a msgpack array (header byte {head:#x})")


@dataclass
class RolloutRow:
    """One rollout in the table: what its records say so far (no rollout record yet: running,
    retried or abandoned, see the module docstring)."""

    rollout_id: str
    group_id: str = ""
    task_id: str = ""
    harness: str = ""
    outcome: str = "running"
    reward: float | None = None
    n_calls: int = 0
    sampled_tokens: int = 0
    duration_s: float | None = None
    version_min: int | None = None
    version_max: int | None = None
    rendered_calls: int = 0  # calls whose prompt was rendered afresh instead of extending one
    error: str = ""
    ended: bool = False  # its end record (a RolloutRecord) is in the log
    order: int = 0  # position of its first record in the log
    spans: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (start, end) of its frames

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "spans"}


@dataclass
class RolloutRecords:
    row: RolloutRow
    rollout: RolloutRecord | None  # None while it runs
    calls: list[CallRecord]  # whole prompts, log order
    exchanges: list[ExchangeRecord]  # whole requests, log order


class RunData:
    """The index of one run directory; `refresh()` is cheap when nothing was appended."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir / "records.log"
        self.rollouts: dict[str, RolloutRow] = {}
        self.torn_bytes = 0
        self.torn_reason = ""
        self.config: dict[str, Any] | None = None  # config.json as the run wrote it
        self.has_log = False
        self.live = False  # a live process holds the log open (a run, eval or serve writing it)
        self.ended: RunEndRecord | None = None  # the last run's end marker, when nothing came after it
        self._unended: set[str] = set()  # rollouts without an end record
        self._attempts: dict[str, int] = {}  # a rollout's first id -> its latest attempt in the log
        self._offset = 0  # just past the last complete frame read
        self._lock = threading.Lock()  # refreshes run in worker threads

    def refresh(self) -> None:
        with self._lock:
            self.config = self._read_config()
            try:
                size = self.log_path.stat().st_size
                self.has_log = True
            except FileNotFoundError:
                size, self.has_log = 0, False
            self.live = self.has_log and log_in_use(self.log_path)
            if size < self._offset:  # a resumed run cut a torn tail off, or the log was replaced
                self.rollouts.clear()
                self._unended.clear()
                self._attempts.clear()
                self.ended = None
                self._offset = 0
            if size == self._offset:
                self.torn_bytes = 0
                self._settle()
                return
            pending = b""  # bytes read that do not yet form a whole frame
            with self.log_path.open("rb") as f:
                f.seek(self._offset)
                left = size - self._offset
                while left > 0:  # in chunks: a first look at a long log never holds all of it
                    chunk = f.read(min(READ_CHUNK_BYTES, left))
                    if not chunk:
                        break
                    left -= len(chunk)
                    data = pending + chunk
                    consumed = 0
                    for end, record in iter_frames(data, _index_decoder):
                        self._add(record, self._offset + consumed, self._offset + end)
                        consumed = end
                    self._offset += consumed
                    pending = data[consumed:]
            self.torn_bytes = len(pending)
            self.torn_reason = _torn_reason(pending, self._offset) if pending else ""
            self._settle()

    def _add(self, record, start: int, end: int) -> None:
        if isinstance(record, RunEndRecord):
            self.ended = record
            return
        self.ended = None  # records after a marker: a resumed run
        row = self.rollouts.get(record.rollout_id)
        if row is None:
            row = self.rollouts[record.rollout_id] = RolloutRow(record.rollout_id, order=len(self.rollouts))
            self._unended.add(row.rollout_id)
            base, attempt = attempt_of(row.rollout_id)
            self._attempts[base] = max(self._attempts.get(base, 0), attempt)
        row.spans.append((start, end))
        if isinstance(record, _CallView):
            row.group_id = row.group_id or record.group_id
            row.n_calls += 1
            row.sampled_tokens += _msgpack_array_len(record.completion_ids)
            v = record.policy_version
            row.version_min = v if row.version_min is None else min(row.version_min, v)
            row.version_max = v if row.version_max is None else max(row.version_max, v)
            row.rendered_calls += record.history != "exact" and record.call_index > 0
        elif isinstance(record, RolloutRecord):
            row.group_id, row.task_id, row.harness = record.group_id, record.task_id, record.harness
            row.outcome, row.reward, row.duration_s = record.outcome.value, record.reward, record.duration_s
            row.error, row.ended = record.error, True
            self._unended.discard(row.rollout_id)

    def _settle(self) -> None:
        """What each rollout without an end record is now (see the module docstring)."""
        for rollout_id in self._unended:
            row = self.rollouts[rollout_id]
            base, attempt = attempt_of(rollout_id)
            if self._attempts[base] > attempt:
                row.outcome = "retried"
                row.error = f"an infra error ended this attempt; retried as {attempt_id(base, attempt + 1)}"
            elif self.live:
                row.outcome, row.error = "running", ""
            elif self.ended is not None:
                row.outcome, row.error = "abandoned", f"the run ended ({self.ended.reason}) before it finished"
            else:
                row.outcome = "abandoned"
                row.error = "the run ended without a run-end marker (killed or crashed) before it finished"

    def unended(self) -> list[RolloutRow]:
        """Rollouts with no end record that no later attempt replaced, in log order."""
        rows = [self.rollouts[r] for r in self._unended]
        rows = [r for r in rows if self._attempts[attempt_of(r.rollout_id)[0]] == attempt_of(r.rollout_id)[1]]
        return sorted(rows, key=lambda r: r.order)

    def rollout_records(self, rollout_id: str) -> RolloutRecords:
        """One rollout's records, calls and exchanges made whole, read from its frames only.
        KeyError when the run has no such rollout."""
        row = self.rollouts[rollout_id]
        with self.log_path.open("rb") as f:
            records = []
            for start, end in row.spans:
                f.seek(start)
                records.append(decode_frame(f.read(end - start)))
        calls, _ = whole_calls(r for r in records if isinstance(r, CallRecord))
        exchanges, _ = whole_exchanges(r for r in records if isinstance(r, ExchangeRecord))
        finished = [r for r in records if isinstance(r, RolloutRecord)]
        return RolloutRecords(row, finished[-1] if finished else None, calls, exchanges)

    def group(self, group_id: str) -> list[RolloutRow]:
        return [r for r in self.rollouts.values() if r.group_id == group_id]

    def outcome_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.rollouts.values():
            counts[row.outcome] = counts.get(row.outcome, 0) + 1
        return counts

    # ------------------------------------------------------------------ small files, read whole

    @staticmethod
    def learner_steps(metrics: list[dict[str, float]]) -> int:
        """The learner's step count: its own `learner/step`, not the number of metrics lines
        (an evaluation writes lines of its own)."""
        return max((int(m["learner/step"]) for m in metrics if "learner/step" in m), default=0)

    def metrics(self) -> tuple[list[dict[str, float]], str]:
        """(one dict per step line of metrics.jsonl, a note on anything missing or skipped)."""
        rows, bad = _json_lines(self.run_dir / "metrics.jsonl")
        if rows is None:
            return [], "no metrics.jsonl yet: the run has not finished a step"
        rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), (int, float))]
        return rows, f"{bad} line(s) of metrics.jsonl could not be read and were skipped" if bad else ""

    def group_steps(self) -> dict[str, dict[str, Any]]:
        """group_id -> the learner's decision about it from groups.jsonl ({"step", "status"})."""
        rows, _ = _json_lines(self.run_dir / "groups.jsonl")
        return {r["group_id"]: r for r in rows or [] if isinstance(r, dict) and "group_id" in r}

    def _read_config(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir / "config.json").read_text())
        except (OSError, ValueError):
            return None


def _json_lines(path: Path) -> tuple[list[Any] | None, int]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, 0
    rows, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written, or damage: skip it, say so
            bad += 1
    return rows, bad


def _torn_reason(tail: bytes, offset: int) -> str:
    if len(tail) < 8:
        return f"{len(tail)} bytes of a frame header at offset {offset}"
    length = int.from_bytes(tail[:4], "little")
    if len(tail) - 8 < length:
        return f"frame at offset {offset} cut short: {len(tail) - 8} of {length} payload bytes"
    return f"damaged frame at offset {offset} (checksum mismatch)"
