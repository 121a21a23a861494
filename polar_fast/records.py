"""Records shared by every stage: captured model calls, finished rollouts, and their log on disk.

A `CallRecord` is one model API call as the policy saw it: the exact prompt token ids, the sampled
token ids and their behaviour logprobs. Merge and learner work from these alone, so they carry ids
and never text. Right after each CallRecord the proxy appends an `ExchangeRecord`: the same call
as the canonical conversation (messages, tool schemas, the assistant reply), which the SFT export
turns into chat data. It is kept apart so the training path never decodes text it does not need.

`RecordLog` appends records to one file as length-prefixed, checksummed msgpack frames:

    frame = u32 little-endian payload length | u32 little-endian crc32(payload) | payload

A process killed mid-write leaves at most one torn frame at the end; `read_log` returns every
complete record before it and reports the torn tail instead of raising, so nothing captured
before a crash is lost. Appends reopen nothing and never rewrite earlier bytes.

A run closes its part of the log: each rollout it leaves in flight gets a RolloutRecord with
outcome `abandoned`, then a `RunEndRecord` says why the run ended. The writer holds an flock on
the file, so `log_in_use` tells a live run from one that was killed (no marker, no lock).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import struct
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import msgspec

from polar_fast.conversation import Message, Tool
from polar_fast.errors import PolarError
from polar_fast.wire import crc32, msgpack_int32s

_HEADER = struct.Struct("<II")
MAX_FRAME_BYTES = 1 << 30  # a length above this is corruption, not a record


class LogInUse(PolarError):
    """Another live process appends to this record log (RecordLog allows one writer)."""


class Outcome(enum.StrEnum):
    """How a rollout ended. `infra_error` and `abandoned` are kept out of reward statistics."""

    OK = "ok"
    AGENT_ERROR = "agent_error"  # the harness exited non-zero or produced nothing: reward 0
    TIMEOUT = "timeout"  # the agent hit its hard timeout: reward 0
    INFRA_ERROR = "infra_error"  # sandbox did not boot, engine down: retried, never scored
    DIFF_TOO_LARGE = "diff_too_large"  # the repo's diff passed the sandbox's output cap: reward 0, not evaluated
    ABANDONED = "abandoned"  # still in flight when the run stopped (or crashed): never scored, never trained


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """Wall-clock stamps of one call, in seconds."""

    started_at: float = 0.0  # unix time the request arrived at the proxy
    render_s: float = 0.0  # chat template + tokenisation
    engine_s: float = 0.0  # waiting for the engine (queue + generation)
    total_s: float = 0.0  # request arrival to last byte handed to the harness


class HarnessSampling(msgspec.Struct, frozen=True, kw_only=True):
    """What the harness asked for (None: it did not say); the run's [sampling] decides what is used."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None


class CallRecord(msgspec.Struct, frozen=True, kw_only=True, tag="call"):
    """One captured model call. `prompt_ids + completion_ids` is exactly what the engine saw.

    On disk an exact-history call stores only its new prompt ids: its first `n_prefix` prompt
    ids are the prompt + completion ids of this session's call `prefix_call` (the call it
    extends) and `prompt_ids` holds the rest. Whole prompts would grow the log, and the proxy's
    memory, quadratically with session length. `LogContents.calls` and the proxy's session
    records give every call whole; one whose prefix record is missing (a torn log) is left out
    and counted there, never completed wrongly. `prefix_call == -1`: `prompt_ids` is whole, as
    the merge and the learner require."""

    session_id: str
    rollout_id: str
    group_id: str
    call_index: int  # 0-based position of this call within its session
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]  # behaviour logprob of each completion id, same length
    policy_version: int  # weights version that sampled the completion (its first token)
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    dialect: str  # "chat" | "responses" | "anthropic"
    timings: Timings = Timings()
    history: str = "exact"  # how the prompt was formed: "exact" reuse, or "render" + cause
    prefix_call: int = -1
    n_prefix: int = 0
    # [index, version]: completion token `index` and those after it were sampled by `version`, a
    # weight sync having happened mid-call (vllm pause_mode "keep"); empty = all `policy_version`.
    version_changes: list[tuple[int, int]] = []
    temperature: float = 1.0  # the completion was sampled, and its logprobs taken, at this temperature
    harness_sampling: HarnessSampling = HarnessSampling()
    # answered by the rollout's guide (a teacher's reply, teachers/guide.py), not sampled by the
    # policy: kept in the log (later calls store their prompts as deltas against it), never trained,
    # gated, counted or exported; its logprobs are 0s. Its tokens reach the merge only as the next
    # call's prompt, with loss mask 0.
    guided: bool = False

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.completion_logprobs):
            raise ValueError(
                f"call {self.session_id}#{self.call_index}: {len(self.completion_ids)} completion ids"
                f" but {len(self.completion_logprobs)} logprobs"
            )


# What the proxy counts per session, the causes of a zero reward a metric can name:
#   tool_parse_failure  a reply that tried a tool call the parser could not read
#   no_tool_call        a reply with no tool call although the harness offered tools
#   format_error        the harness rejected a reply's format (it says so in its next request)
#   context_length      a prompt that did not fit the model's context
#   truncated           a reply cut at max_tokens (finish_reason "length")
CALL_CAUSES = ("tool_parse_failure", "no_tool_call", "format_error", "context_length", "truncated",
               # infra faults the harness saw as an error reply (and may have retried past)
               "engine_failure", "record_failure")


class RolloutRecord(msgspec.Struct, frozen=True, kw_only=True, tag="rollout"):
    """One finished rollout (one harness run on one task) and its reward."""

    rollout_id: str
    group_id: str
    task_id: str
    harness: str
    outcome: Outcome
    reward: float | None = None  # None when outcome is infra_error
    n_calls: int = 0
    duration_s: float = 0.0
    attempt: int = 0  # retries after infra errors
    error: str = ""  # short reason for anything but `ok`
    causes: dict[str, int] = {}  # CALL_CAUSES counted over its calls (why a reward may be 0)
    purpose: str = "train"  # "eval": an evaluation sample (evaluate.py), never trained on


def attempt_id(rollout_id: str, attempt: int) -> str:
    """The id of a rollout's retry after an infra error: `<id>.a<attempt>` (attempt 0 is `<id>`)."""
    return rollout_id if attempt == 0 else f"{rollout_id}.a{attempt}"


def attempt_of(rollout_id: str) -> tuple[str, int]:
    """(the rollout's first id, its attempt), the inverse of `attempt_id`."""
    base, sep, n = rollout_id.rpartition(".a")
    return (base, int(n)) if sep and n.isdigit() else (rollout_id, 0)


class RunEndRecord(msgspec.Struct, frozen=True, kw_only=True, tag="run_end"):
    """The run stopped here, and why; written after the `abandoned` records of the rollouts it
    left in flight. A log whose last run has no such record, and that no process holds open
    (`log_in_use`), was killed or crashed: its rollouts without an end record are abandoned."""

    reason: str  # "finished: ...", "stopped: SIGTERM", "error: ...", "crashed: ..." (closed by --resume)
    step: int = 0  # learner steps done
    abandoned: int = 0  # rollouts in flight that got an `abandoned` record
    ended_at: float = 0.0  # unix time


class ExchangeRecord(msgspec.Struct, frozen=True, kw_only=True, tag="exchange"):
    """The canonical conversation of one call (the CallRecord with the same session and index).

    `messages` is the request as every dialect translates it (system, user, assistant turns with
    reasoning and tool calls, tool results); `reply` is the assistant message the proxy answered
    with, parsed from the sampled ids.

    On disk a call stores only what its request added: its first `n_prefix` messages are those
    of this session's exchange `prefix_call` (the call before it) and `messages` holds the rest.
    Harnesses resend the whole conversation every call, so whole records would grow the log
    quadratically with session length. `LogContents.exchanges` gives every record whole again;
    one whose prefix record is missing (a torn log) is left out and counted there, never
    completed wrongly. `prefix_call == -1`: `messages` is the whole request."""

    session_id: str
    rollout_id: str
    group_id: str
    call_index: int
    model: str  # the served policy model (model.name), not what the client asked for
    dialect: str
    messages: list[Message]
    tools: list[Tool] = []
    reply: Message
    prefix_call: int = -1
    n_prefix: int = 0


Record = CallRecord | RolloutRecord | ExchangeRecord | RunEndRecord

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode_frame(record: Record) -> bytes:
    payload = _encoder.encode(record)
    return _HEADER.pack(len(payload), crc32(payload)) + payload


def packed_ids(ids: Sequence[int]) -> msgspec.Raw:
    """A record's id list pre-encoded as the MessagePack `encode_frame` writes for `list(ids)`,
    made in Rust from an `array("i")` without a Python int per id (a first prompt has 1e4-1e5).
    Only for a record headed straight to `encode_frame`: its field then holds bytes, not ints."""
    if isinstance(ids, array) and ids.typecode == "i" and ids:
        return msgspec.Raw(msgpack_int32s(ids))
    return msgspec.Raw(_encoder.encode(list(ids)))


def decode_frame(frame: bytes) -> Record:
    """The record of one frame made by `encode_frame` (checksum not checked: in-memory use)."""
    return _decoder.decode(memoryview(frame)[_HEADER.size :])


class RecordLog:
    """Append-only record file with one appender at a time (the proxy's Recorder). Each append is
    one `os.write` that lands whole or is cut back off (see `append_all`); `fsync=True` makes
    each append durable before it returns.

    Opening an existing log first cuts off a torn tail left by a crash (`repaired_bytes` says how
    much), so records appended by a resumed run stay readable after the old ones.

    The appender holds an exclusive `flock` on the file while it is open, which the kernel drops
    when the process dies however it dies: `log_in_use` tells a reader (`view`, a resume) whether
    a live process still writes the log, and a second appender is refused (`LogInUse`)."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self.repaired_bytes = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise LogInUse(f"{self.path} is open in another process (a run still alive?): one writer at a time") from None
        contents = read_log(self.path)  # only after the lock: never cut what a live writer is appending
        if contents.torn_bytes:
            os.ftruncate(self._fd, contents.valid_bytes)
            self.repaired_bytes = contents.torn_bytes

    def append(self, record: Record | bytes) -> None:
        """Append a record, or a frame already made by `encode_frame`."""
        self.append_all([record])

    def append_all(self, records: Sequence[Record | bytes]) -> None:
        """Append records (or frames) all together or not at all: one write, and when it fails
        (disk full, file size limit, I/O error) the file is cut back to where it ended, so a
        half-written frame never sits in front of the records appended after it (a reader
        would stop there and lose them) and a call record never lands without its exchange."""
        data = b"".join(r if isinstance(r, bytes) else encode_frame(r) for r in records)
        end = os.fstat(self._fd).st_size  # this writer is the log's only appender (see Recorder)
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a regular file only short-writes when it cannot grow
                raise OSError(errno.ENOSPC, f"short write to {self.path}: {written} of {len(data)} bytes")
            if self._fsync:
                os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, end)
            except OSError:  # the next open cuts the torn tail off (see __init__)
                pass
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_in_use(path: str | os.PathLike[str]) -> bool:
    """Whether a live process holds `path` open as its RecordLog (see RecordLog)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock too


class LogContents(msgspec.Struct, frozen=True):
    records: list[Record]
    valid_bytes: int  # offset just past the last complete frame
    torn_bytes: int  # bytes after it that do not form a complete, intact frame
    torn_reason: str = ""

    @property
    def calls(self) -> list[CallRecord]:
        """Every call with its whole prompt (see CallRecord), in log order."""
        return whole_calls(r for r in self.records if isinstance(r, CallRecord))[0]

    @property
    def rollouts(self) -> list[RolloutRecord]:
        return [r for r in self.records if isinstance(r, RolloutRecord)]

    @property
    def exchanges(self) -> list[ExchangeRecord]:
        """Every exchange with its whole request (see ExchangeRecord), in log order."""
        return whole_exchanges(r for r in self.records if isinstance(r, ExchangeRecord))[0]


def whole_calls(records: Iterable[CallRecord]) -> tuple[list[CallRecord], int]:
    """(calls with their whole `prompt_ids`, how many could not be completed because the record
    they extend is missing), from call records in log order."""

    def complete(r: CallRecord, base: CallRecord) -> CallRecord:
        n_prompt = len(base.prompt_ids)
        prefix = base.prompt_ids[: r.n_prefix] if r.n_prefix <= n_prompt else (
            base.prompt_ids + base.completion_ids[: r.n_prefix - n_prompt])
        return msgspec.structs.replace(r, prompt_ids=prefix + r.prompt_ids, prefix_call=-1, n_prefix=0)

    return _whole(records, lambda r: len(r.prompt_ids) + len(r.completion_ids), complete)


def whole_exchanges(records: Iterable[ExchangeRecord]) -> tuple[list[ExchangeRecord], int]:
    """(exchanges with their whole `messages`, how many could not be completed because the
    record holding their prefix is missing), from exchange records in log order."""

    def complete(r: ExchangeRecord, base: ExchangeRecord) -> ExchangeRecord:
        return msgspec.structs.replace(r, messages=base.messages[: r.n_prefix] + r.messages, prefix_call=-1, n_prefix=0)

    return _whole(records, lambda r: len(r.messages), complete)


def _whole(records, length, complete):
    """Complete delta records (see CallRecord / ExchangeRecord) from the whole ones before them."""
    whole: dict[tuple[str, int], Any] = {}
    out, missing = [], 0
    for r in records:
        if r.prefix_call >= 0:
            base = whole.get((r.session_id, r.prefix_call))
            if base is None or length(base) < r.n_prefix:
                missing += 1
                continue
            r = complete(r, base)
        whole[(r.session_id, r.call_index)] = r
        out.append(r)
    return out, missing


def iter_frames(data: bytes, decoder: msgspec.msgpack.Decoder = _decoder) -> Iterator[tuple[int, Any]]:
    """Yield (end offset, record) for each complete frame; stop at the first torn one. A
    `decoder` of lighter view Structs (same tags) reads only the fields a reader needs."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        if length > MAX_FRAME_BYTES or start + length > len(data):
            return
        payload = data[start : start + length]
        if crc32(payload) != crc:
            return
        yield start + length, decoder.decode(payload)
        offset = start + length


def read_log(path: str | os.PathLike[str]) -> LogContents:
    """Every complete record in the log, plus how many trailing bytes were torn and why."""
    data = Path(path).read_bytes()
    records: list[Record] = []
    valid = 0
    for end, record in iter_frames(data):
        records.append(record)
        valid = end
    torn = len(data) - valid
    reason = ""
    if torn:
        reason = _describe_torn_tail(data, valid)
    return LogContents(records, valid, torn, reason)


def _describe_torn_tail(data: bytes, offset: int) -> str:
    if len(data) - offset < _HEADER.size:
        return f"{len(data) - offset} bytes of a frame header at offset {offset}"
    length, _ = _HEADER.unpack_from(data, offset)
    if length > MAX_FRAME_BYTES:
        return f"implausible frame length {length} at offset {offset}"
    have = len(data) - offset - _HEADER.size
    if have < length:
        return f"frame at offset {offset} cut short: {have} of {length} payload bytes"
    return f"checksum mismatch in frame at offset {offset}"
