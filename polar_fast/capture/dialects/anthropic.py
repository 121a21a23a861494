"""Anthropic Messages (`/v1/messages`, what Claude Code speaks) ⇄ canonical conversation.

`system` (string or text blocks) becomes the first system message; a `system`-role message inside
`messages` (Claude Code sends one) stays a system message in place. Blocks: `text`, `tool_use`,
`tool_result` (string or text blocks; each becomes a canonical tool message, placed before the
user text of the same turn), `thinking` (reasoning); `redacted_thinking` is dropped; `image` and
`document` are rejected. Tools with an `input_schema` are offered; server tools are ignored.
`thinking` settings, `metadata`, `tool_choice` are accepted and ignored. Done as the API does:
tools with `defer_loading` stay out of the model's tool list, and a `tool_reference` block in a
tool result becomes the referenced tool's definition as JSON text, where the API expands it
(Claude Code's ToolSearch answers with these; a 400 makes it drop tool search after 3 retries);
a system text block starting `x-anthropic-billing-header:` is attribution metadata that Claude
Code puts first in `system` (its hash changes with the conversation), so it is dropped. The stream is
`message_start`, per block `content_block_start` → delta(s) → `content_block_stop`,
`message_delta` (stop reason, usage), `message_stop`.
"""

from __future__ import annotations

from typing import Any, Iterator, cast

import msgspec

from polar_fast.capture.dialects import DialectError, Fold, ReplyMeta, decode, fold_items, json_text, reject_media, sse
from polar_fast.conversation import Completion, Conversation, Message, Role, Tool, ToolCall

NAME = "anthropic"


class _Block(msgspec.Struct):
    type: str
    text: str | None = None
    tool_name: str | None = None  # tool_reference
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[_Block] | None = None


class _MessageIn(msgspec.Struct):
    role: str
    content: str | list[_Block]


class _ToolIn(msgspec.Struct):
    name: str = ""
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    defer_loading: bool | None = None


class _Request(msgspec.Struct):
    messages: list[_MessageIn]
    model: str = ""
    system: str | list[_Block] | None = None
    tools: list[_ToolIn] | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class _CountRequest(msgspec.Struct):
    messages: list[_MessageIn]
    model: str = ""
    system: str | list[_Block] | None = None
    tools: list[_ToolIn] | None = None


BILLING_HEADER = "x-anthropic-billing-header:"

_Defs = dict[str, str]  # tool name -> its definition as JSON text (for tool_reference blocks)


def _text(blocks: str | list[_Block] | None, where: str, defs: _Defs | None = None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for b in blocks:
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "tool_reference" and defs is not None:
            if not b.tool_name:
                raise DialectError(f"{where}: tool_reference needs tool_name")
            texts.append(defs.get(b.tool_name) or json_text({"name": b.tool_name}))
        elif b.type in ("image", "document", "search_result"):
            raise reject_media(f"{b.type} ({where})")
        else:
            raise DialectError(f"unsupported block type {b.type!r} in {where}")
    return "\n".join(texts)


def _system(system: str | list[_Block] | None) -> str:
    if isinstance(system, list):
        system = [b for b in system if not (b.type == "text" and (b.text or "").startswith(BILLING_HEADER))]
    elif system is not None and system.startswith(BILLING_HEADER):
        system = system.partition("\n")[2]
    return _text(system, "system")


def _definitions(tools: list[_ToolIn]) -> _Defs:
    """What the API puts in context for a referenced tool: its definition."""
    defs = {}
    for t in tools:
        d: dict[str, Any] = {"name": t.name}
        if t.description:
            d["description"] = t.description
        d["input_schema"] = t.input_schema or {}
        defs[t.name] = json_text(d)
    return defs


def _turn(i: int, m: _MessageIn, defs: _Defs) -> list[Message]:
    where = f"messages[{i}]"
    if m.role not in ("user", "assistant", "system"):
        raise DialectError(f"{where}.role {m.role!r} is not one of user, assistant")
    if isinstance(m.content, str):
        return [Message(role=cast(Role, m.role), content=m.content)]
    if m.role == "assistant":
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(m.content):
            match b.type:
                case "text":
                    texts.append(b.text or "")
                case "thinking":
                    reasoning.append(b.thinking or "")
                case "redacted_thinking":
                    pass
                case "tool_use":
                    if not b.id or not b.name:
                        raise DialectError(f"{where}.content[{j}]: tool_use needs id and name")
                    calls.append(ToolCall(id=b.id, name=b.name, arguments=json_text(b.input if b.input is not None else {})))
                case other:
                    raise DialectError(f"{where}.content[{j}]: unsupported block type {other!r} in an assistant turn")
        return [Message(role="assistant", content="".join(texts), reasoning="".join(reasoning), tool_calls=tuple(calls))]
    results, texts = [], []
    for j, b in enumerate(m.content):
        if b.type == "tool_result":
            if not b.tool_use_id:
                raise DialectError(f"{where}.content[{j}]: tool_result needs tool_use_id")
            content = _text(b.content, f"{where}.content[{j}]", defs)
            results.append(Message(role="tool", content=content, tool_call_id=b.tool_use_id))
        else:
            texts.append(_text([b], f"{where}.content[{j}]"))
    out = results
    if texts or not results:
        out.append(Message(role=cast(Role, m.role), content="\n".join(texts)))
    return out


ITEMS, ITEM, REQUEST = "messages", _MessageIn, _Request


class _Fold(Fold):
    def __init__(self, messages: list[Message], defs: _Defs) -> None:
        super().__init__(messages)
        self.defs = defs

    def add(self, i: int, item: _MessageIn) -> None:
        self.messages.extend(_turn(i, item, self.defs))

    def context(self) -> tuple:
        return (*super().context(), self.defs)


def _offered(req: _Request | _CountRequest) -> list[_ToolIn]:
    return [t for t in req.tools or () if t.input_schema is not None and t.name]


def start(req: _Request | _CountRequest) -> Fold:
    """The fold of `req`'s turns before its first one: the system prompt, the tool definitions."""
    system = _system(req.system)
    return _Fold([Message(role="system", content=system)] if system else [], _definitions(_offered(req)))


def _tools(req: _Request | _CountRequest) -> list[Tool]:
    # a tool without input_schema keeps None as its parameters, as it always has (typed as a dict)
    return [Tool(name=t.name, description=t.description or "", parameters=cast(dict, t.input_schema))
            for t in _offered(req) if not t.defer_loading]


def parse(body: bytes) -> Conversation:
    return parse_fold(body)[0]


def parse_fold(body: bytes) -> tuple[Conversation, Fold]:
    req: _Request = decode(body, _Request, "messages")
    fold = fold_items(start(req), req.messages)
    return finish(req, fold), fold


def finish(req: _Request, fold: Fold) -> Conversation:
    """The conversation of `req` whose turns `fold` holds."""
    conv = Conversation(
        model=req.model,
        messages=fold.messages,
        tools=_tools(req),
        stream=bool(req.stream),
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
    )
    return extend(conv, fold)


def extend(conv: Conversation, fold: Fold) -> Conversation:
    """`conv` with the messages of `fold` (from a request that differs from conv's only in them)."""
    if not fold.n_items:
        raise DialectError("messages must not be empty")
    return msgspec.structs.replace(conv, messages=fold.messages)


def parse_count(body: bytes) -> Conversation:
    req: _CountRequest = decode(body, _CountRequest, "count_tokens")
    fold = fold_items(start(req), req.messages)
    return extend(Conversation(model=req.model, messages=fold.messages, tools=_tools(req)), fold)


def count_reply(n_tokens: int) -> bytes:
    return msgspec.json.encode({"input_tokens": n_tokens})


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _blocks(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.reasoning:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    if c.content or not c.tool_calls:
        blocks.append({"type": "text", "text": c.content})
    for t in c.tool_calls:
        blocks.append({"type": "tool_use", "id": t.id, "name": t.name, "input": msgspec.json.decode(t.arguments)})
    return blocks


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message(c: Completion, meta: ReplyMeta, content: list[dict[str, Any]], stop: str | None, out_tokens: int) -> dict:
    return {
        "id": "msg_" + meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": _usage(c.prompt_tokens, out_tokens),
    }


def reply(c: Completion, meta: ReplyMeta) -> bytes:
    return msgspec.json.encode(_message(c, meta, _blocks(c), _STOP[c.finish_reason], c.completion_tokens))


def stream(c: Completion, meta: ReplyMeta, **_: Any) -> Iterator[bytes]:
    def event(kind: str, **fields: Any) -> bytes:
        return sse(msgspec.json.encode({"type": kind} | fields), kind)

    yield event("message_start", message=_message(c, meta, [], None, 1))
    for index, block in enumerate(_blocks(c)):
        match block["type"]:
            case "thinking":
                yield event("content_block_start", index=index, content_block=block | {"thinking": ""})
                yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": block["thinking"]})
                yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
            case "text":
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                if block["text"]:
                    yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
            case "tool_use":
                yield event("content_block_start", index=index, content_block=block | {"input": {}})
                delta = {"type": "input_json_delta", "partial_json": json_text(block["input"])}
                yield event("content_block_delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
    stop: dict[str, Any] = {"stop_reason": _STOP[c.finish_reason], "stop_sequence": None}
    yield event("message_delta", delta=stop, usage=_usage(c.prompt_tokens, c.completion_tokens))
    yield event("message_stop")


_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "too_large": "request_too_large",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "engine": "api_error",
    "timeout": "api_error",
    "internal": "api_error",
}


def error(status: int, kind: str, message: str) -> bytes:
    return msgspec.json.encode({"type": "error", "error": {"type": _ERROR_TYPES.get(kind, "api_error"), "message": message}})
