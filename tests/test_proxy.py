"""The proxy over real HTTP (aiohttp client → aiohttp server on 127.0.0.1), scripted engine with
the real SmolLM2 tokenizer: two-call tool runs in all three dialects, streamed and not, with the
second prompt an exact extension of the first; sessions; every error of the issue's point 7 in
each dialect."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from polar_fast.engines import Generation
from polar_fast.testing import scripted_proxy, write_file_replies

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages?beta=true"}


def first_request(dialect: str, stream: bool) -> dict:
    if dialect == "chat":
        return {
            "model": "m",
            "stream": stream,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "write hello.txt"}],
            "tools": [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": SCHEMA}}],
        }
    if dialect == "responses":
        return {
            "model": "m",
            "stream": stream,
            "instructions": "Be brief.",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "write hello.txt"}]}],
            "tools": [{"type": "function", "name": "bash", "description": "run", "parameters": SCHEMA}],
        }
    return {
        "model": "m",
        "stream": stream,
        "max_tokens": 256,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "write hello.txt"}]}],
        "tools": [{"name": "bash", "description": "run", "input_schema": SCHEMA}],
    }


def parse_sse(text: str) -> list[tuple[str | None, object]]:
    events = []
    for block in text.strip().split("\n\n"):
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        events.append((event, data if data == "[DONE]" else json.loads(data)))
    return events


def tool_call_of(dialect: str, stream: bool, body: str) -> tuple[str, str, dict]:
    """(call id, name, arguments) of the reply's single tool call."""
    if not stream:
        j = json.loads(body)
        if dialect == "chat":
            c = j["choices"][0]["message"]["tool_calls"][0]
            return c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])
        if dialect == "responses":
            c = [o for o in j["output"] if o["type"] == "function_call"][0]
            return c["call_id"], c["name"], json.loads(c["arguments"])
        c = [b for b in j["content"] if b["type"] == "tool_use"][0]
        return c["id"], c["name"], c["input"]
    events = parse_sse(body)
    if dialect == "chat":
        parts = [d["choices"][0]["delta"] for _, d in events if d != "[DONE]" and d["choices"]]
        calls = [tc for p in parts for tc in p.get("tool_calls", [])]
        args = "".join(tc["function"].get("arguments", "") for tc in calls)
        return calls[0]["id"], calls[0]["function"]["name"], json.loads(args)
    if dialect == "responses":
        done = [d["item"] for e, d in events if e == "response.output_item.done" and d["item"]["type"] == "function_call"]
        assert events[-1][0] == "response.completed"
        return done[0]["call_id"], done[0]["name"], json.loads(done[0]["arguments"])
    start = [d["content_block"] for e, d in events if e == "content_block_start" and d["content_block"]["type"] == "tool_use"]
    partial = "".join(d["delta"]["partial_json"] for e, d in events if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert [e for e, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    return start[0]["id"], start[0]["name"], json.loads(partial)


def second_request(dialect: str, req: dict, call_id: str, args: dict) -> dict:
    req = json.loads(json.dumps(req))
    if dialect == "chat":
        call = {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": json.dumps(args)}}
        req["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": [{"type": "text", "text": "ok"}]},
        ]
    elif dialect == "responses":
        req["input"] += [
            {"type": "function_call", "call_id": call_id, "name": "bash", "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": call_id, "output": "ok"},
        ]
    else:
        req["messages"] += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "bash", "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": [{"type": "text", "text": "ok"}]}]},
        ]
    return req


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("dialect", ["chat", "responses", "anthropic"])
async def test_two_calls_extend_exactly(tmp_path, dialect, stream):
    async with scripted_proxy(tmp_path, write_file_replies("hello.txt", "hi")) as px, aiohttp.ClientSession() as http:
        url = px.base_url + PATHS[dialect]
        req = first_request(dialect, stream)
        async with http.post(url, json=req) as r:
            assert r.status == 200, await r.text()
            assert r.content_type == ("text/event-stream" if stream else "application/json")
            call_id, name, args = tool_call_of(dialect, stream, await r.text())
        assert name == "bash" and args == {"command": "printf '%s' \"hi\" > hello.txt"}
        async with http.post(url, json=second_request(dialect, req, call_id, args)) as r:
            assert r.status == 200, await r.text()
            assert "Done: the file is written." in await r.text()
        calls = await px.records()
        parser = px.proxy.state.sessions[px.token].parsers[dialect]
    assert (parser.n_full, parser.n_incremental) == (1, 1)  # the resent conversation was not decoded again
    assert [c.call_index for c in calls] == [0, 1]
    assert [c.history for c in calls] == ["render:first_call", "exact"]
    first, second = calls
    joined = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[: len(joined)] == joined and len(second.prompt_ids) > len(joined)
    assert first.completion_logprobs == pytest.approx([-0.01 * (i + 1) for i in range(len(first.completion_ids))])
    assert {c.dialect for c in calls} == {dialect} and first.finish_reason == "tool_calls"
    assert [c.prompt_ids for c in await px.logged()] == [c.prompt_ids for c in calls]  # on disk too


async def test_template_history_renders_from_scratch(tmp_path):
    async with scripted_proxy(tmp_path, config={"proxy": {"history": "template"}}) as px, aiohttp.ClientSession() as http:
        url = px.base_url + PATHS["chat"]
        req = first_request("chat", False)
        async with http.post(url, json=req) as r:
            call_id, _, args = tool_call_of("chat", False, await r.text())
        async with http.post(url, json=second_request("chat", req, call_id, args)) as r:
            assert r.status == 200
        calls = await px.records()
    assert [c.history for c in calls] == ["render:template", "render:template"]


async def test_edited_history_is_rendered_from_scratch(tmp_path):
    async with scripted_proxy(tmp_path) as px, aiohttp.ClientSession() as http:
        url = px.base_url + PATHS["chat"]
        req = first_request("chat", False)
        async with http.post(url, json=req) as r:
            call_id, _, args = tool_call_of("chat", False, await r.text())
        edited = second_request("chat", req, call_id, {"command": "something else"})
        async with http.post(url, json=edited) as r:
            assert r.status == 200
        calls = await px.records()
    assert calls[1].history == "render:no_match"


async def test_api_key_session_and_unix_socket(tmp_path):
    sock = str(tmp_path / "proxy.sock")
    async with scripted_proxy(tmp_path, ["hi"], unix_socket=sock) as px:
        root = px.root_url
        conn = aiohttp.UnixConnector(path=sock)
        async with aiohttp.ClientSession(connector=conn) as http:
            req = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post("http://proxy/v1/messages", json=req, headers={"x-api-key": px.token}) as r:
                assert r.status == 200
                assert (await r.json())["content"] == [{"type": "text", "text": "hi"}]
            # what boxes reach serves no admin route, even to a valid token
            for method, path in (("POST", "/sessions"), ("GET", f"/sessions/{px.token}/records"),
                                 ("DELETE", f"/sessions/{px.token}")):
                async with http.request(method, "http://proxy" + path, headers={"x-api-key": px.token}) as r:
                    assert r.status == 404, (method, path)
        async with aiohttp.ClientSession() as http:
            async with http.get(root + "/v1/models", headers={"Authorization": f"Bearer {px.token}"}) as r:
                assert (await r.json())["data"][0]["id"] == "smollm2-135m-instruct"
            async with http.head(root + "/") as r:
                assert r.status == 200
            async with http.post(px.base_url + "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
                assert (await r.json())["input_tokens"] > 3
            async with http.delete(f"{root}/sessions/{px.token}") as r:
                assert (await r.json())["n_calls"] == 1
            async with http.get(root + "/v1/models", headers={"Authorization": f"Bearer {px.token}"}) as r:
                assert r.status == 401


async def test_admin_key_guards_session_routes(tmp_path):
    async with scripted_proxy(tmp_path, config={"proxy": {"admin_key": "sekrit"}}) as px, aiohttp.ClientSession() as http:
        async with http.post(px.root_url + "/sessions") as r:
            assert r.status == 401
        async with http.get(f"{px.root_url}/sessions/{px.token}/records", headers={"x-admin-key": "nope"}) as r:
            assert r.status == 401
        assert await px.records() == []  # the helper sends the key


async def test_beyond_loopback_needs_admin_key(tmp_path):
    from polar_fast.errors import ConfigError

    with pytest.raises(ConfigError, match="admin_key"):
        async with scripted_proxy(tmp_path, config={"proxy": {"host": "0.0.0.0"}}):
            pass


# ----------------------------------------------------------------------------- errors (point 7)


class SlowEngine:
    policy_version = 0

    async def generate(self, prompt_ids, sampling, *, session_id=""):
        await asyncio.sleep(30)

    async def update_weights(self, named_tensors, *, version):
        pass

    async def aclose(self):
        pass


class DownEngine(SlowEngine):
    async def generate(self, prompt_ids, sampling, *, session_id=""):
        from polar_fast.engines.vllm import VllmEngine

        # A real client to a port nobody listens on: connection refused, retried, then 503.
        engine = VllmEngine("http://127.0.0.1:9", model="m", max_retries=1, retry_delay_s=0.01)
        try:
            return await engine.generate(prompt_ids, sampling, session_id=session_id)
        finally:
            await engine.aclose()


def error_of(dialect: str, body: dict) -> tuple[str, str]:
    if dialect == "anthropic":
        assert body["type"] == "error"
        return body["error"]["type"], body["error"]["message"]
    return body["error"]["type"], body["error"]["message"]


def simple_request(dialect: str) -> dict:
    if dialect == "responses":
        return {"model": "m", "input": "hi"}
    if dialect == "anthropic":
        return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


BAD = {
    "malformed_json": (b'{"model": "m", "messages": [', 400, "not valid JSON"),
    "missing_field": (b'{"model": "m"}', 400, "missing required field"),
    "wrong_type": (b'{"model": "m", "messages": "hi", "input": 5}', 400, "Expected"),
    "image": (None, 400, "not supported"),
}


def image_request(dialect: str) -> dict:
    if dialect == "chat":
        parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        return {"messages": [{"role": "user", "content": parts}]}
    if dialect == "responses":
        return {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}
    return {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}


@pytest.mark.parametrize("dialect", ["chat", "responses", "anthropic"])
async def test_bad_input_answers_in_dialect(tmp_path, dialect):
    async with scripted_proxy(tmp_path, ["fine"], config={"proxy": {"max_body_bytes": 4096}, "model": {"max_context_tokens": 64}}) as px:
        async with aiohttp.ClientSession() as http:
            url = px.base_url + PATHS[dialect]
            for name, (body, status, text) in BAD.items():
                data = body if body is not None else json.dumps(image_request(dialect)).encode()
                async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == status, name
                    assert text in error_of(dialect, await r.json())[1], name
            async with http.post(url, data=b"x" * 5000) as r:  # oversized body
                assert r.status == 413
                error_of(dialect, await r.json())
            long = simple_request(dialect)
            long_text = "word " * 200
            if dialect == "responses":
                long["input"] = long_text
            else:
                long["messages"][0]["content"] = long_text
            async with http.post(url, json=long) as r:  # longer than the model's context
                assert r.status == 400
                # the texts harnesses compact on: Anthropic's (Claude Code), OpenAI's (Pi, Qwen Code)
                message = error_of(dialect, await r.json())[1]
                assert re.search(r"^prompt is too long: \d+ tokens > 64 maximum", message), message
                assert "maximum context length is 64 tokens" in message
            async with http.post(px.root_url + PATHS[dialect], json=simple_request(dialect), headers={"x-api-key": "nope"}) as r:
                assert r.status == 401
                kind, _ = error_of(dialect, await r.json())
                assert kind == "authentication_error"
            async with http.post(url, json=simple_request(dialect)) as r:  # the proxy is still fine
                assert r.status == 200
        assert len(await px.records()) == 1


@pytest.mark.parametrize("dialect", ["chat", "responses", "anthropic"])
async def test_engine_down_and_timeout(tmp_path, dialect):
    for engine, status, config in [(DownEngine(), 503, {}), (SlowEngine(), 504, {"engine": {"timeout_s": 0.2}})]:
        async with scripted_proxy(tmp_path, engine=engine, config=config) as px, aiohttp.ClientSession() as http:
            async with http.post(px.base_url + PATHS[dialect], json=simple_request(dialect)) as r:
                assert r.status == status
                kind, message = error_of(dialect, await r.json())
                assert "engine" in message
            async with http.get(px.root_url + "/") as r:
                assert r.status == 200
            assert await px.records() == []


class ChatEngine(SlowEngine):
    """Stands in for vLLM's chat route under `engine.render = "engine"` (the real one needs vLLM:
    test_vllm_real.py): answers, hangs, or fails with a bug, as asked."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def chat(self, messages, tools, sampling, *, session_id=""):
        from polar_fast.engines.vllm import ChatReply

        if self.mode == "hang":
            await asyncio.sleep(30)
        if self.mode == "bug":
            raise KeyError("choices")
        generation = Generation(token_ids=[5, 6, 2], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop")
        return ChatReply(prompt_ids=[1, 2, 3], generation=generation, message={"content": "hello"})


async def test_engine_rendered_calls_share_the_engine_wrapper(tmp_path):
    """The two ways to a completion go through one timeout-and-failure path: a hung chat call is a
    504, a bug in it a 502, each counted on the session as an engine failure; an answered one is
    recorded with vLLM's prompt ids."""
    for mode, status in [("ok", 200), ("hang", 504), ("bug", 502)]:
        config = {"engine": {"render": "engine", "timeout_s": 0.2}}
        async with scripted_proxy(tmp_path, engine=ChatEngine(mode), config=config) as px, aiohttp.ClientSession() as http:
            async with http.post(px.base_url + PATHS["chat"], json=simple_request("chat")) as r:
                assert r.status == status, mode
            session = px.proxy.state.sessions[px.token]
            assert session.engine_failures == (status != 200) and session.failing_calls == (status != 200), mode
            records = await px.records()
            if status == 200:
                (record,) = records
                assert (record.history, record.prompt_ids, record.completion_ids) == ("render:engine", [1, 2, 3], [5, 6, 2])
            else:
                assert records == []


async def test_scripted_engine_out_of_replies_is_503_and_others_unaffected(tmp_path):
    async with scripted_proxy(tmp_path, ["one"]) as px, aiohttp.ClientSession() as http:
        other = await px.new_session("r1", "g")
        async with http.post(px.base_url + PATHS["chat"], json=simple_request("chat")) as r:
            assert r.status == 200
        async with http.post(f"{px.root_url}/s/{other}/v1/chat/completions", json=simple_request("chat")) as r:
            assert r.status == 503
        assert len(await px.records()) == 1 and await px.records(other) == []


async def test_unknown_route_and_method(tmp_path):
    async with scripted_proxy(tmp_path) as px, aiohttp.ClientSession() as http:
        async with http.post(px.base_url + "/v1/nope", json={}) as r:
            assert r.status == 404 and "error" in await r.json()
        async with http.get(px.base_url + "/v1/messages", headers={"anthropic-version": "2023-06-01"}) as r:
            assert r.status == 405 and (await r.json())["type"] == "error"


async def test_malformed_tool_call_is_plain_text(tmp_path):
    bad = '<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call>'
    async with scripted_proxy(tmp_path, [bad]) as px, aiohttp.ClientSession() as http:
        async with http.post(px.base_url + PATHS["chat"], json=first_request("chat", False)) as r:
            choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == bad


async def test_policy_version_is_stamped(tmp_path):
    async with scripted_proxy(tmp_path, ["a", "b"]) as px, aiohttp.ClientSession() as http:
        url = px.base_url + PATHS["chat"]
        async with http.post(url, json=simple_request("chat")) as r:
            assert r.status == 200
        await px.engine.update_weights(None, version=7)
        async with http.post(url, json=simple_request("chat")) as r:
            assert r.status == 200
        assert [c.policy_version for c in await px.records()] == [0, 7]


async def test_generation_reports_its_own_version(tmp_path):
    class Versioned(SlowEngine):
        async def generate(self, prompt_ids, sampling, *, session_id=""):
            self.policy_version = 9  # weights changed while this generation ran on version 3
            return Generation(token_ids=[2], logprobs=[-0.5], finish_reason="stop", policy_version=3)

    async with scripted_proxy(tmp_path, engine=Versioned()) as px, aiohttp.ClientSession() as http:
        async with http.post(px.base_url + PATHS["chat"], json=simple_request("chat")) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == ""
        assert [c.policy_version for c in await px.records()] == [3]


def test_a_call_that_cannot_be_recorded_fails_alone_and_leaves_the_log_whole(tmp_path):
    """Disk full while a call is recorded: that call gets a 503 in its dialect and leaves no
    bytes in the log; it does not become a base of exact history, so the retry extends the
    call before it and every logged call reads back whole."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("record_failure_run.py")
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["failed"]["status"] == 503
    assert "could not be recorded" in out["failed"]["body"]["error"]["message"]
    assert out["size_after_failure"] == out["size_before"]  # the 16 bytes that fitted were cut off
    assert out["alive"] == 200 and out["retried"] == 200
    first, second = out["served"]
    assert [first[:2], second[:2]] == [[0, "render:first_call"], [2, "exact"]]  # call 1 failed
    assert second[2][: len(first[2]) + len(first[3])] == first[2] + first[3]
    assert out["logged"] == out["served"] and out["torn_bytes"] == 0
    assert out["logged_exchanges"] == [1, 3]
