"""OpenAI Responses (`/v1/responses`, what Codex speaks) ⇄ canonical conversation.

Input: `instructions` (system), `input` as a string or a list of items: messages (with or
without `"type": "message"`; `developer` becomes system), `function_call`,
`function_call_output` (string or text parts), `custom_tool_call(_output)` (treated as function
calls whose arguments are the raw input), and `reasoning` (its summary/content text attaches to
the next assistant turn). Only `function` tools are offered to the model; other tool types are
ignored. The stream follows the API's event order, which Codex's parser relies on:
`response.created`, `response.in_progress`, per output item `output_item.added` → deltas →
`output_item.done`, then `response.completed` (or `response.incomplete` at the token limit).
Every event carries `type` and a `sequence_number`.
"""

from __future__ import annotations

from typing import Any, Iterator, cast

import msgspec

from polar_fast.capture.dialects import (
    DialectError,
    Fold,
    ReplyMeta,
    decode,
    fold_items,
    openai_error,
    reject_media,
    sse,
)
from polar_fast.conversation import Completion, Conversation, Message, Role, Tool, ToolCall

NAME = "responses"


class _Part(msgspec.Struct):
    type: str = "input_text"
    text: str = ""


class _Item(msgspec.Struct):
    type: str = "message"
    role: str | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    input: str | None = None
    output: str | list[_Part] | None = None
    summary: list[_Part] | None = None


class _ToolIn(msgspec.Struct):
    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Request(msgspec.Struct):
    input: str | list[_Item]
    model: str = ""
    instructions: str | None = None
    tools: list[_ToolIn] | None = None
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


def _text(content: str | list[_Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(part.text)
        elif part.type in ("input_image", "input_file", "input_audio", "image"):
            raise reject_media(f"{part.type} ({where})")
        else:
            raise DialectError(f"unsupported content part type {part.type!r} in {where}")
    return "\n".join(texts)


ITEMS, ITEM, REQUEST = "input", _Item, _Request


class _Fold(Fold):
    """Consecutive assistant output (reasoning, text, calls) is one turn; reasoning waits for it."""

    def __init__(self, messages: list[Message]) -> None:
        self.reasoning = ""
        super().__init__(messages)

    def _state(self) -> str:
        return self.reasoning

    def _restore(self, state: str) -> None:
        self.reasoning = state

    def _assistant(self) -> Message:
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":
            return self.messages.pop()
        m = Message(role="assistant", reasoning=self.reasoning)
        self.reasoning = ""
        return m

    def add(self, i: int, item: _Item) -> None:
        where = f"input[{i}]"
        match item.type:
            case "message":
                role = {"developer": "system"}.get(item.role or "", item.role)
                if role not in ("system", "user", "assistant"):
                    raise DialectError(f"{where}.role {item.role!r} is not one of system, developer, user, assistant")
                text = _text(item.content, where)
                if role == "assistant":
                    prev = self._assistant()
                    self.messages.append(msgspec.structs.replace(prev, content=prev.content + text))
                else:
                    self.messages.append(Message(role=cast(Role, role), content=text))
            case "function_call" | "custom_tool_call":
                if not item.call_id or item.name is None:
                    raise DialectError(f"{where}: a {item.type} needs call_id and name")
                args = item.arguments if item.type == "function_call" else item.input
                call = ToolCall(id=item.call_id, name=item.name, arguments=args or "{}")
                prev = self._assistant()
                self.messages.append(msgspec.structs.replace(prev, tool_calls=prev.tool_calls + (call,)))
            case "function_call_output" | "custom_tool_call_output":
                if not item.call_id:
                    raise DialectError(f"{where}: a {item.type} needs call_id")
                self.messages.append(Message(role="tool", content=_text(item.output, where), tool_call_id=item.call_id))
            case "reasoning":
                self.reasoning += _text(item.summary, where) or _text(item.content, where)
            case other:
                raise DialectError(f"{where}: unsupported input item type {other!r}")


def parse(body: bytes) -> Conversation:
    return parse_fold(body)[0]


def parse_fold(body: bytes) -> tuple[Conversation, Fold]:
    req: _Request = decode(body, _Request, "responses")
    fold = fold_items(start(req), req.input if isinstance(req.input, list) else ())
    return finish(req, fold), fold


def start(req: _Request) -> Fold:
    """The fold of `req`'s input items before the first: its instructions (and a string input)."""
    fold = _Fold([Message(role="system", content=req.instructions)] if req.instructions else [])
    if isinstance(req.input, str):
        fold.messages.append(Message(role="user", content=req.input))
    return fold


def finish(req: _Request, fold: Fold) -> Conversation:
    """The conversation of `req` whose messages `fold` holds."""
    tools = [
        Tool(name=t.name, description=t.description or "", parameters=t.parameters or {})
        for t in req.tools or ()
        if t.type == "function" and t.name
    ]
    conv = Conversation(
        model=req.model,
        messages=fold.messages,
        tools=tools,
        stream=bool(req.stream),
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
    )
    return extend(conv, fold)


def extend(conv: Conversation, fold: Fold) -> Conversation:
    """`conv` with the messages of `fold` (from a request that differs from conv's only in them)."""
    if not fold.messages:
        raise DialectError("input must not be empty")
    return msgspec.structs.replace(conv, messages=fold.messages)


def _items(c: Completion, meta: ReplyMeta) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if c.reasoning:
        items.append(
            {"id": "rs_" + meta.id, "type": "reasoning", "summary": [{"type": "summary_text", "text": c.reasoning}]}
        )
    if c.content or not c.tool_calls:
        part = {"type": "output_text", "text": c.content, "annotations": [], "logprobs": []}
        items.append(
            {"id": "msg_" + meta.id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        )
    for i, t in enumerate(c.tool_calls):
        items.append(
            {
                "id": f"fc_{meta.id}_{i}",
                "type": "function_call",
                "status": "completed",
                "call_id": t.id,
                "name": t.name,
                "arguments": t.arguments,
            }
        )
    return items


def _response(c: Completion | None, meta: ReplyMeta, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    usage = None
    if c is not None:
        usage = {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": c.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        }
    return {
        "id": "resp_" + meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "metadata": {},
    }


def _status(c: Completion) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


def reply(c: Completion, meta: ReplyMeta) -> bytes:
    return msgspec.json.encode(_response(c, meta, _status(c), _items(c, meta)))


def stream(c: Completion, meta: ReplyMeta, **_: Any) -> Iterator[bytes]:
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq} | fields
        seq += 1
        return sse(msgspec.json.encode(data), kind)

    yield event("response.created", response=_response(None, meta, "in_progress", []))
    yield event("response.in_progress", response=_response(None, meta, "in_progress", []))
    items = _items(c, meta)
    for index, item in enumerate(items):
        yield from _item_events(event, index, item)
    status = _status(c)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield event(kind, response=_response(c, meta, status, items))


def _item_events(event, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    at = {"output_index": index, "item_id": item["id"]}
    match item["type"]:
        case "reasoning":
            text = item["summary"][0]["text"]
            yield event("response.output_item.added", output_index=index, item=item | {"summary": []})
            part = {"type": "summary_text", "text": ""}
            yield event("response.reasoning_summary_part.added", **at, summary_index=0, part=part)
            yield event("response.reasoning_summary_text.delta", **at, summary_index=0, delta=text)
            yield event("response.reasoning_summary_text.done", **at, summary_index=0, text=text)
            yield event("response.reasoning_summary_part.done", **at, summary_index=0, part=part | {"text": text})
        case "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index, item=item | {"status": "in_progress", "content": []})
            yield event("response.content_part.added", **at, content_index=0, part=part | {"text": ""})
            if part["text"]:
                yield event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **at, content_index=0, part=part)
        case "function_call":
            yield event("response.output_item.added", output_index=index, item=item | {"status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=index, item=item)


def error(status: int, kind: str, message: str) -> bytes:
    return openai_error(kind, message, server_type="server_error")
