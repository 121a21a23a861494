"""Tiny model servers that speak just enough of each harness's wire dialect (test doubles for the
model only): every request is recorded, every reply is the fixed `answer` text, or for
mini-swe-agent a bash tool call that submits it. Real aiohttp apps on 127.0.0.1 port 0 or on a
Unix socket; routes answer under `/s/<token>/v1/...` and plain `/v1/...`."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from aiohttp import web


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: dict


@dataclass
class FakeModel:
    answer: str
    requests: list[Seen] = field(default_factory=list)

    def model_requests(self) -> list[Seen]:
        return [r for r in self.requests if r.method == "POST" and not r.path.endswith("count_tokens")]


async def _record(request: web.Request) -> Seen:
    raw = await request.read()
    body = json.loads(raw) if raw else {}
    seen = Seen(request.method, request.path, dict(request.headers), body)
    request.app[_MODEL].requests.append(seen)
    return seen


_MODEL = web.AppKey("model", FakeModel)


async def _sse(request: web.Request, events: list[tuple[str | None, dict | str]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for event, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        head = f"event: {event}\n" if event else ""
        await resp.write(f"{head}data: {text}\n\n".encode())
    await resp.write_eof()
    return resp


# --- OpenAI Chat Completions -------------------------------------------------------------------

async def chat_completions(request: web.Request) -> web.StreamResponse:
    seen = await _record(request)
    model, answer = seen.body.get("model", ""), request.app[_MODEL].answer
    base = {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": model}
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    if not seen.body.get("stream"):
        if seen.body.get("tools"):  # mini-swe-agent: submit the answer through its bash tool
            command = f"printf 'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\\n{answer}\\n'"
            message = {"role": "assistant", "content": "Submitting.", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": answer}, "stop"
        return web.json_response(base | {"choices": [{"index": 0, "message": message,
                                                       "finish_reason": finish}], "usage": usage})
    chunk = base | {"object": "chat.completion.chunk"}
    events = [
        (None, chunk | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
        (None, chunk | {"choices": [{"index": 0, "delta": {"content": answer}, "finish_reason": None}]}),
        (None, chunk | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        (None, chunk | {"choices": [], "usage": usage}),
        (None, "[DONE]"),
    ]
    return await _sse(request, events)


# --- OpenAI Responses --------------------------------------------------------------------------

async def responses(request: web.Request) -> web.StreamResponse:
    seen = await _record(request)
    answer = request.app[_MODEL].answer
    text_part = {"type": "output_text", "text": answer, "annotations": []}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": [text_part]}
    response = {"id": "resp_1", "object": "response", "created_at": int(time.time()),
                "model": seen.body.get("model", ""), "status": "in_progress", "output": []}
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    events = [
        ("response.created", {"type": "response.created", "sequence_number": 0, "response": response}),
        ("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 1,
                                        "output_index": 0, "item": item | {"status": "in_progress", "content": []}}),
        ("response.content_part.added", {"type": "response.content_part.added", "sequence_number": 2,
                                         "item_id": "msg_1", "output_index": 0, "content_index": 0,
                                         "part": text_part | {"text": ""}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 3,
                                        "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": answer}),
        ("response.output_text.done", {"type": "response.output_text.done", "sequence_number": 4,
                                       "item_id": "msg_1", "output_index": 0, "content_index": 0, "text": answer}),
        ("response.content_part.done", {"type": "response.content_part.done", "sequence_number": 5,
                                        "item_id": "msg_1", "output_index": 0, "content_index": 0, "part": text_part}),
        ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 6,
                                       "output_index": 0, "item": item}),
        ("response.completed", {"type": "response.completed", "sequence_number": 7,
                                "response": response | {"status": "completed", "output": [item], "usage": usage}}),
    ]
    return await _sse(request, events)


# --- Anthropic Messages ------------------------------------------------------------------------

async def messages(request: web.Request) -> web.StreamResponse:
    seen = await _record(request)
    answer = request.app[_MODEL].answer
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": seen.body.get("model", ""),
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 10, "output_tokens": 1}}
    if not seen.body.get("stream"):
        return web.json_response(message | {"content": [{"type": "text", "text": answer}], "stop_reason": "end_turn"})
    events = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": answer}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return await _sse(request, events)


async def count_tokens(request: web.Request) -> web.Response:
    await _record(request)
    return web.json_response({"input_tokens": 10})


async def models(request: web.Request) -> web.Response:
    await _record(request)
    return web.json_response({"object": "list", "data": []})


def make_app(model: FakeModel) -> web.Application:
    app = web.Application()
    app[_MODEL] = model
    for prefix in ("/s/{token}/v1", "/v1"):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/responses", responses)
        app.router.add_post(f"{prefix}/messages", messages)
        app.router.add_post(f"{prefix}/messages/count_tokens", count_tokens)
        app.router.add_get(f"{prefix}/models", models)
    return app


def _bind_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o666)  # the container's user may differ from ours
    return sock


@asynccontextmanager
async def serve(model: FakeModel, *, unix_path: str | None = None) -> AsyncIterator[str]:
    """Run the fake on 127.0.0.1:0 (yields `http://127.0.0.1:PORT`) or on a Unix socket (yields
    the socket path)."""
    runner = web.AppRunner(make_app(model), access_log=None)
    await runner.setup()
    try:
        if unix_path is not None:
            # Bound in a thread: binding a path is file I/O, which blockbuster forbids on the loop.
            sock = await anyio.to_thread.run_sync(_bind_unix, unix_path)
            site: web.BaseSite = web.SockSite(runner, sock)
            await site.start()
            yield unix_path
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
