"""OpenAI Chat Completions (`/v1/chat/completions`) ⇄ canonical conversation.

Accepts `system`/`developer` (both become system), `user`, `assistant` (with `tool_calls` and
`reasoning_content`/`reasoning`) and `tool` messages; content as a string, null or text parts.
Streams the chunk sequence of the OpenAI API: a role chunk, reasoning and content deltas, one
tool-call header chunk + one arguments chunk per call, a chunk carrying `finish_reason`, an
optional usage chunk (`stream_options.include_usage`), then `data: [DONE]`.
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec

from polar_fast.capture.dialects import (
    DialectError,
    Fold,
    ReplyMeta,
    decode,
    fold_items,
    json_text,
    openai_error,
    reject_media,
    sse,
)
from polar_fast.conversation import Completion, Conversation, Message, Tool, ToolCall

NAME = "chat"


class _Part(msgspec.Struct):
    type: str = "text"
    text: str = ""


class _Function(msgspec.Struct):
    name: str = ""
    arguments: str | dict[str, Any] | None = None


class _ToolCallIn(msgspec.Struct):
    function: _Function
    id: str = ""
    type: str = "function"


class _MessageIn(msgspec.Struct):
    role: str
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _ToolFunction(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _ToolIn(msgspec.Struct):
    type: str = "function"
    function: _ToolFunction | None = None


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Request(msgspec.Struct):
    messages: list[_MessageIn]
    model: str = ""
    tools: list[_ToolIn] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None


def text_of(content: str | list[_Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type in ("text", "input_text", "output_text"):
            texts.append(part.text)
        elif part.type in ("image_url", "input_image", "image", "input_audio", "file"):
            raise reject_media(f"{part.type} ({where})")
        else:
            raise DialectError(f"unsupported content part type {part.type!r} in {where}")
    return "\n".join(texts)


def _arguments(fn: _Function) -> str:
    if isinstance(fn.arguments, dict):
        return json_text(fn.arguments)
    return fn.arguments or "{}"


def _message(i: int, m: _MessageIn) -> Message:
    where = f"messages[{i}]"
    match m.role:
        case "system" | "developer":
            return Message(role="system", content=text_of(m.content, where))
        case "user":
            return Message(role="user", content=text_of(m.content, where))
        case "assistant":
            calls = tuple(
                ToolCall(id=c.id, name=c.function.name, arguments=_arguments(c.function)) for c in m.tool_calls or ()
            )
            reasoning = m.reasoning_content or m.reasoning or ""
            return Message(role="assistant", content=text_of(m.content, where), reasoning=reasoning, tool_calls=calls)
        case "tool" | "function":
            return Message(role="tool", content=text_of(m.content, where), tool_call_id=m.tool_call_id or "")
    raise DialectError(f"{where}.role {m.role!r} is not one of system, developer, user, assistant, tool")


ITEMS, ITEM, REQUEST = "messages", _MessageIn, _Request


class _Fold(Fold):
    def add(self, i: int, item: _MessageIn) -> None:
        self.messages.append(_message(i, item))


def parse(body: bytes) -> Conversation:
    return parse_fold(body)[0]


def parse_fold(body: bytes) -> tuple[Conversation, Fold]:
    req: _Request = decode(body, _Request, "chat completions")
    fold = fold_items(start(req), req.messages)
    return finish(req, fold), fold


def start(req: _Request) -> Fold:
    """The fold of `req`'s messages before its first one (checks what needs no message)."""
    if req.n not in (None, 1):
        raise DialectError("only n=1 is supported")
    return _Fold([])


def finish(req: _Request, fold: Fold) -> Conversation:
    """The conversation of `req` whose messages `fold` holds."""
    tools = [
        Tool(name=t.function.name, description=t.function.description or "", parameters=t.function.parameters or {})
        for t in req.tools or ()
        if t.type == "function" and t.function is not None
    ]
    return extend(
        Conversation(
            model=req.model,
            messages=fold.messages,
            tools=tools,
            stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
        ),
        fold,
    )


def extend(conv: Conversation, fold: Fold) -> Conversation:
    """`conv` with the messages of `fold` (from a request that differs from conv's only in them)."""
    if not fold.messages:
        raise DialectError("messages must not be empty")
    return msgspec.structs.replace(conv, messages=fold.messages)


def _usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


def _tool_calls(c: Completion) -> list[dict[str, Any]]:
    return [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}} for t in c.tool_calls]


def reply(c: Completion, meta: ReplyMeta) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
    if c.reasoning:
        message["reasoning_content"] = c.reasoning
    if c.tool_calls:
        message["tool_calls"] = _tool_calls(c)
    body = {
        "id": "chatcmpl-" + meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": c.finish_reason}],
        "usage": _usage(c),
    }
    return msgspec.json.encode(body)


def stream(c: Completion, meta: ReplyMeta, *, include_usage: bool = False) -> Iterator[bytes]:
    head = {"id": "chatcmpl-" + meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse(msgspec.json.encode(head | {"choices": [choice]}))

    yield chunk({"role": "assistant", "content": ""})
    if c.reasoning:
        yield chunk({"reasoning_content": c.reasoning})
    if c.content:
        yield chunk({"content": c.content})
    for i, t in enumerate(c.tool_calls):
        yield chunk({"tool_calls": [{"index": i, "id": t.id, "type": "function", "function": {"name": t.name, "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": t.arguments}}]})
    yield chunk({}, c.finish_reason)
    if include_usage:
        yield sse(msgspec.json.encode(head | {"choices": [], "usage": _usage(c)}))
    yield sse(b"[DONE]")


def error(status: int, kind: str, message: str) -> bytes:
    return openai_error(kind, message, server_type="api_error")
