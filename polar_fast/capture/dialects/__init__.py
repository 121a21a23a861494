"""The dialects: their contract (`Dialect`), what they share (the error they raise, the step-wise
parse `Fold`, reply metadata, wire helpers) and the three of them by name (`DIALECTS`). The
canonical conversation they translate to lives in polar_fast/conversation.py.

A dialect module (chat_completions.py, responses.py, anthropic.py) is pure: bytes in, canonical
structs out, and a canonical `Completion` back to reply bytes or SSE frames. No aiohttp, I/O or
clock: ids and timestamps arrive in `ReplyMeta`. Each module satisfies the `Dialect` Protocol
below, checked by mypy over this package (tests/test_dialects_golden.py):

    NAME: str
    parse(body: bytes) -> Conversation            # raises DialectError (400) on bad input
    ITEMS, ITEM, REQUEST, parse_fold, start, finish, extend   # the same parse in steps (see Fold)
    reply(completion, meta) -> bytes              # non-streamed JSON body
    stream(completion, meta) -> Iterator[bytes]   # SSE frames, in the order real servers send
    error(status, kind, message) -> bytes         # the dialect's error object

Canonical choices: tool-call arguments are JSON object text; tool results are strings (text
content parts are joined with newlines); images and documents are rejected with a clear 400.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Literal, Protocol, cast

import msgspec

from polar_fast.conversation import Completion, Conversation, Message
from polar_fast.errors import PolarError

ErrorKind = Literal[
    "invalid_request", "authentication", "not_found", "too_large", "context_length", "engine", "timeout", "internal"
]


class ReplyMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a reply needs that a pure function cannot make up: ids and the clock."""

    id: str  # random hex; each dialect adds its own prefix
    created: int  # unix seconds
    model: str


class Fold:
    """A request's conversation items (the array at top-level key `ITEMS` of the dialect: chat
    and anthropic `messages`, responses `input`) turned into canonical messages one at a time.

    After each item it keeps a mark: the message count, the last message and the dialect's own
    pending state. A later request of the session that resends the first k items unchanged
    resumes after item k - 1 (`resumed(k)`) instead of converting them again (see
    dialects/incremental.py), and its first messages are the very same objects."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = messages
        self.initial = tuple(messages)  # what the request gave before its first item (a system prompt)
        self.marks: list[tuple[int, Message | None, Any]] = [self._mark()]

    def add(self, i: int, item: Any) -> None:
        """Convert item `i` (append to or amend `messages`); raises DialectError."""
        raise NotImplementedError

    def push(self, i: int, item: Any) -> None:
        self.add(i, item)
        self.marks.append(self._mark())

    @property
    def n_items(self) -> int:
        return len(self.marks) - 1

    def resumed(self, k: int) -> Fold:
        """A copy as it stood after its first k items; this one is left unchanged."""
        n, last, state = self.marks[k]
        fold = copy.copy(self)
        # only the last message can be amended by a later item (a merged assistant turn); a mark
        # taken after n > 0 messages holds the last of them
        fold.messages = [*self.messages[: n - 1], cast(Message, last)] if n else []
        fold.marks = self.marks[: k + 1]
        fold._restore(state)
        return fold

    def context(self) -> tuple:
        """What item conversion depends on besides the items: equal contexts, equal folds."""
        return self.initial

    def _mark(self) -> tuple[int, Message | None, Any]:
        return len(self.messages), self.messages[-1] if self.messages else None, self._state()

    def _state(self) -> Any:
        return None

    def _restore(self, state: Any) -> None:
        pass


def fold_items(fold: Fold, items: Any, first: int = 0) -> Fold:
    """`fold` after pushing `items`, numbered from `first` (their index in the request)."""
    for i, item in enumerate(items, first):
        fold.push(i, item)
    return fold


class DialectError(PolarError):
    """Bad input from the caller, answered in its dialect with `status`."""

    def __init__(self, message: str, *, status: int = 400, kind: ErrorKind = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


def reject_media(kind: str) -> DialectError:
    return DialectError(f"{kind} content is not supported by this proxy (text-only policy model)")


def decode(body: bytes, schema: type, dialect: str):
    """Typed decode with a clear message: `msgspec` already names the offending path."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        raise DialectError(f"invalid {dialect} request: {e}") from None
    except msgspec.DecodeError as e:
        raise DialectError(f"request body is not valid JSON: {e}") from None


def sse(data: bytes, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


def json_text(value: Any) -> str:
    return msgspec.json.encode(value).decode()


# OpenAI-style error bodies (chat completions and responses), by our error kind.
_OPENAI_ERRORS = {
    "invalid_request": ("invalid_request_error", None),
    "context_length": ("invalid_request_error", "context_length_exceeded"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "authentication": ("authentication_error", "invalid_api_key"),
    "not_found": ("not_found_error", None),
    "engine": (None, "engine_unavailable"),
    "timeout": (None, "engine_timeout"),
    "internal": (None, None),
}


def openai_error(kind: str, message: str, *, server_type: str) -> bytes:
    """The error object the OpenAI clients parse; `server_type` names server-side failures
    ("api_error" for chat completions, "server_error" for responses)."""
    type_, code = _OPENAI_ERRORS.get(kind, (None, None))
    return msgspec.json.encode(
        {"error": {"message": message, "type": type_ or server_type, "param": None, "code": code}}
    )


# --------------------------------------------------------------------------------- the contract


class Dialect(Protocol):
    """One wire format, as the proxy and the incremental parser use it. The members are module
    attributes and functions of each dialect module (mypy checks a module against a Protocol)."""

    @property
    def NAME(self) -> str: ...  # the record's `dialect`, and the key in DIALECTS

    @property
    def ITEMS(self) -> str: ...  # top-level key of the request's conversation items

    @property
    def ITEM(self) -> type: ...  # msgspec type of one item

    @property
    def REQUEST(self) -> type: ...  # msgspec type of a request (its items decoded too)

    def parse(self, body: bytes) -> Conversation:
        """The request's canonical conversation; DialectError on bad input."""

    def parse_fold(self, body: bytes) -> tuple[Conversation, Fold]:
        """`parse`, and the fold that produced its messages (kept to resume later requests)."""

    def start(self, req: Any) -> Fold:
        """An empty fold for a decoded REQUEST: its messages before the first item."""

    def finish(self, req: Any, fold: Fold) -> Conversation:
        """The conversation of a decoded REQUEST whose items `fold` has taken."""

    def extend(self, conv: Conversation, fold: Fold) -> Conversation:
        """`conv` with the messages of `fold`: a request that changed only its items."""

    def reply(self, c: Completion, meta: ReplyMeta) -> bytes:
        """The non-streamed JSON reply."""

    def stream(self, c: Completion, meta: ReplyMeta, *, include_usage: bool = False) -> Iterator[bytes]:
        """The reply as SSE frames, in the order the real server sends them."""

    def error(self, status: int, kind: str, message: str) -> bytes:
        """The dialect's error object."""


# The family's name -> dialect map, imported after the definitions above, which the modules use.
from polar_fast.capture.dialects import anthropic, chat_completions, responses  # noqa: E402

DIALECTS: dict[str, Dialect] = {
    chat_completions.NAME: chat_completions,
    responses.NAME: responses,
    anthropic.NAME: anthropic,
}
