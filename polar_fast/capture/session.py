"""One proxy session: a rollout's conversation with the model, call by call.

A session holds what the proxy keeps between a rollout's calls: its exact history (history.py),
its per-dialect incremental parsers, the log frames of its recorded calls (so `records()` gives
the rollout's calls back whole), and the counts of what went wrong (records.CALL_CAUSES: engine
and record failures are infra, the rest feed the zero-reward metrics). The proxy (proxy.py)
creates sessions, finds them by token, and updates them as each call goes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from polar_fast.capture.dialects import Dialect
from polar_fast.capture.dialects.incremental import IncrementalParser
from polar_fast.capture.history import History
from polar_fast.conversation import Conversation, Message, ToolCall
from polar_fast.records import CallRecord, ExchangeRecord, decode_frame, whole_calls


@dataclass(eq=False)
class Session:
    token: str
    session_id: str
    rollout_id: str
    group_id: str
    history: History
    # Its call records as the log frames written for them (prompt deltas, see CallRecord): each is
    # encoded once, and a first call's whole prompt (~1e4 ids) sits in bytes the garbage
    # collector never walks rather than in an int list it would.
    call_frames: list[bytes] = field(default_factory=list)
    # (call index, request messages) of its last exchange on disk: the next one stores a delta
    last_exchange: tuple[int, list[Message]] = (-1, [])
    n_calls: int = 0
    failing_calls: int = 0  # engine or record failures since the last recorded call: the harness gave up on them
    # why calls went wrong, for the zero-reward metrics (records.CALL_CAUSES); counted as they happen
    causes: dict[str, int] = field(default_factory=dict)
    # texts the harness puts in its next request when it rejects a reply's format (Harness.format_error_markers)
    format_error_markers: tuple[str, ...] = ()
    # "<dialect> stream" / "<dialect> json" -> model requests seen (`harnesses check` reports them)
    requests: dict[str, int] = field(default_factory=dict)
    # per dialect: decodes only what a request adds to the conversation it resends
    parsers: dict[str, IncrementalParser] = field(default_factory=dict)
    # token ids (end-of-turn included) of the replies that answer this session's first calls
    # instead of the engine: a guided rollout's teacher turns (teachers/guide.py)
    guide: tuple[list[int], ...] = ()

    def guided_reply(self) -> list[int] | None:
        """The guide's reply for the call being answered now, or None once the policy answers."""
        return self.guide[self.n_calls] if self.n_calls < len(self.guide) else None

    def parse(self, dialect: Dialect, body: bytes) -> Conversation:
        parser = self.parsers.get(dialect.NAME)
        if parser is None:
            parser = self.parsers[dialect.NAME] = IncrementalParser(dialect)
        return parser.parse(body)

    @property
    def engine_failures(self) -> int:  # calls the engine could not answer: an infra failure, not the agent's
        return self.causes.get("engine_failure", 0)

    @property
    def record_failures(self) -> int:  # calls answered but not recorded (disk full): also infra
        return self.causes.get("record_failure", 0)

    def count(self, cause: str) -> None:
        self.causes[cause] = self.causes.get(cause, 0) + 1

    def failed(self, cause: str) -> None:
        """A call the harness got no answer to ("engine_failure", "record_failure")."""
        self.failing_calls += 1
        self.count(cause)

    def count_format_errors(self, conv: Conversation) -> None:
        """A harness that rejects a reply says so in the messages it adds after that reply."""
        if not self.format_error_markers or not self.n_calls:
            return
        # what this request adds after the previous one (some harnesses drop the rejected reply)
        new = conv.messages[len(self.last_exchange[1]):]
        markers = self.format_error_markers
        if any(marker in (m.content or "") for m in new if m.role != "assistant" for marker in markers):
            self.count("format_error")

    def count_reply_causes(self, conv: Conversation, content: str, calls: Sequence[ToolCall],
                           finish_reason: str) -> None:
        if finish_reason == "length":
            self.count("truncated")
        if conv.tools and not calls:
            # the parsers hand malformed calls back whole as content
            self.count("tool_parse_failure" if "<tool_call>" in content else "no_tool_call")

    def exchange(self, call_index: int, conv: Conversation, reply: Message, *, model: str,
                 dialect: str) -> ExchangeRecord:
        """A call's exchange record, holding only the messages its request added to the session's
        last recorded one (see ExchangeRecord)."""
        prefix_call, previous = self.last_exchange
        messages = conv.messages
        n = 0
        while n < len(messages) and n < len(previous) and (messages[n] is previous[n] or messages[n] == previous[n]):
            n += 1
        return ExchangeRecord(
            session_id=self.session_id, rollout_id=self.rollout_id, group_id=self.group_id,
            call_index=call_index, model=model, dialect=dialect,
            messages=messages[n:] if n else messages, tools=conv.tools, reply=reply,
            prefix_call=prefix_call if n else -1, n_prefix=n,
        )

    def records(self) -> list[CallRecord]:
        """Its call records, each with its whole prompt."""
        return whole_calls(decode_frame(f) for f in self.call_frames)[0]  # type: ignore[misc]
