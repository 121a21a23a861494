"""Engines: scripted replies, and the vLLM client against a fake `vllm serve` (a real aiohttp app
on 127.0.0.1:0): token-id prompts, logprobs, the data-parallel rank header, retries, 503; the
prompt's JSON and the cut of vLLM's prompt echo agree with plain msgspec (property tests)."""

from __future__ import annotations

import asyncio
from array import array

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_fast.engines import ENGINES, EngineFailed, EngineUnavailable, Sampling
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.engines.vllm import VllmEngine, _completion_decoder
from polar_fast.engines.vllm_wire import PromptJsonCache, without_prompt_echo

pytestmark = pytest.mark.anyio


def test_engine_map():
    assert set(ENGINES) == {"embedded", "scripted", "vllm"}


async def test_scripted_in_order_and_truncated():
    engine = ScriptedEngine([[5, 6, 7], [8]])
    g1 = await engine.generate([1], Sampling(max_tokens=2))
    assert (g1.token_ids, g1.finish_reason, len(g1.logprobs)) == ([5, 6], "length", 2)
    assert (await engine.generate([1], Sampling())).token_ids == [8]
    with pytest.raises(EngineUnavailable):
        await engine.generate([1], Sampling())


async def _fake_vllm(fail_first: int = 0):
    seen: list[tuple[dict, dict]] = []
    failures = {"left": fail_first}

    async def completions(request):
        body = await request.json()
        seen.append((body, dict(request.headers)))
        if failures["left"]:
            failures["left"] -= 1
            return web.Response(status=503, text="busy")
        ids = [len(body["prompt"]), 2]
        return web.json_response({"choices": [{  # as vLLM >= 0.10.2 answers return_token_ids
            "prompt_token_ids": body["prompt"], "token_ids": ids, "logprobs": {"token_logprobs": [-0.25, -0.5]},
            "finish_reason": "stop"}]})

    async def chat(request):
        body = await request.json()
        seen.append((body, dict(request.headers)))
        message = {"role": "assistant", "content": None, "reasoning_content": "r",
                   "tool_calls": [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}
        return web.json_response({"prompt_token_ids": [1, 2, 3], "choices": [
            {"token_ids": [9, 2], "message": message, "finish_reason": "tool_calls",
             "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, seen


async def test_vllm_generate_with_rank_header_and_retries():
    server, seen = await _fake_vllm(fail_first=1)
    engine = VllmEngine(str(server.make_url("")), model="m", data_parallel_size=4, retry_delay_s=0.01)
    try:
        gen = await engine.generate([7, 8, 9], Sampling(max_tokens=5, seed=3), session_id="abc")
        assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([3, 2], [-0.25, -0.5], "stop")
        body, headers = seen[-1]
        assert body["prompt"] == [7, 8, 9] and body["return_token_ids"] and body["logprobs"] == 0 and body["seed"] == 3
        gen = await engine.generate(array("i", [70000, -1, 0]), Sampling(max_tokens=5), session_id="abc")  # what the proxy renders
        assert seen[-1][0]["prompt"] == [70000, -1, 0] and gen.token_ids == [3, 2]
        assert headers["X-data-parallel-rank"] == str(engine.rank_of("abc"))
        assert len(seen) == 3  # one 503, retried
        reply = await engine.chat([{"role": "user", "content": "hi"}], [], Sampling(), session_id="abc")
        assert reply.prompt_ids == [1, 2, 3] and reply.generation.logprobs == [-0.1, -0.2]
    finally:
        await engine.aclose()
        await server.close()


async def test_vllm_down_is_unavailable():
    engine = VllmEngine("http://127.0.0.1:9", model="m", max_retries=1, retry_delay_s=0.01)
    with pytest.raises(EngineUnavailable, match="unavailable after 2 tries"):
        await engine.generate([1], Sampling())
    await engine.aclose()


async def test_vllm_bad_reply_is_engine_failure():
    async def bad(request):
        return web.json_response({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]})

    app = web.Application()
    app.router.add_post("/v1/completions", bad)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    engine = VllmEngine(str(server.make_url("")), model="m")
    with pytest.raises(EngineFailed, match="2 token ids but 1 logprobs"):
        await engine.generate([1], Sampling())
    await engine.aclose()
    await server.close()


INT32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def _prompt_steps(draw):
    """(session, ids) calls as a proxy makes them: mostly a session's last prompt extended, some
    repeated (a retry), some unrelated (a side call), some plain lists or empty."""
    last: dict[str, list[int]] = {}
    steps = []
    for _ in range(draw(st.integers(1, 25))):
        session = draw(st.sampled_from(["a", "b", "c", ""]))
        kind = draw(st.sampled_from(["extend", "extend", "extend", "repeat", "new", "list", "empty"]))
        ids = last.get(session, [])
        if kind == "extend":
            ids = ids + draw(st.lists(INT32, min_size=1, max_size=30))
        elif kind == "new":
            ids = draw(st.lists(INT32, min_size=1, max_size=60))
        elif kind == "empty":
            ids = []
        last[session] = ids
        steps.append((session, array("i", ids) if kind != "list" else list(ids)))
    return steps


@settings(max_examples=300)
@given(_prompt_steps(), st.sampled_from([64, 400, 256 << 20]))
def test_prompt_json_is_what_msgspec_writes(steps, max_bytes):
    cache = PromptJsonCache(max_bytes=max_bytes)
    for session, ids in steps:
        assert cache.json(session, ids) == msgspec.json.encode(list(ids))
        assert cache._bytes <= max_bytes


def test_prompt_json_formats_only_what_a_prompt_adds():
    cache = PromptJsonCache()
    prompt = array("i", range(1000))
    for turn in range(5):
        assert cache.json("s", prompt) == msgspec.json.encode(list(prompt))
        prompt = prompt + array("i", [turn] * 50)
    assert cache.hits == 4


_ECHO = st.one_of(st.lists(INT32, max_size=40), st.none(), st.text(max_size=20), st.lists(st.lists(INT32, max_size=3), max_size=3))
_TEXT = st.one_of(st.text(max_size=30), st.sampled_from(['"prompt_token_ids":[1,2]', 'x"prompt_token_ids":[', ']"prompt_token_ids"']))


@st.composite
def _replies(draw):
    choice = {"text": draw(_TEXT), "token_ids": draw(st.lists(INT32, max_size=5)), "finish_reason": draw(st.sampled_from(["stop", "length", None]))}
    choice["logprobs"] = {"token_logprobs": [-0.5] * len(choice["token_ids"])}
    keys = draw(st.permutations(["prompt_token_ids", "text", "token_ids", "finish_reason", "logprobs"]))
    choice["prompt_token_ids"] = draw(_ECHO)
    reply = {"choices": [{k: choice[k] for k in keys}]}
    if draw(st.booleans()):
        reply["prompt_token_ids"] = draw(_ECHO)  # some servers echo at the top level too
    return reply


def _same_but_echo(a, b) -> bool:
    """b equals a, except that a `prompt_token_ids` list may have become None."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(
            (k == "prompt_token_ids" and b[k] is None and isinstance(a[k], list)) or _same_but_echo(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same_but_echo(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=500)
@given(_replies(), st.booleans())
def test_cutting_the_prompt_echo_changes_nothing_the_engine_reads(reply, spaced):
    raw = (msgspec.json.encode(reply) if not spaced else msgspec.json.format(msgspec.json.encode(reply), indent=1))
    cut = without_prompt_echo(raw)
    assert _same_but_echo(reply, msgspec.json.decode(cut))
    assert _completion_decoder.decode(cut) == _completion_decoder.decode(raw)
    echo = reply["choices"][0]["prompt_token_ids"]
    if not spaced and isinstance(echo, list) and all(isinstance(i, int) for i in echo):
        assert msgspec.json.decode(cut)["choices"][0]["prompt_token_ids"] is None  # the usual shape is cut


async def test_http1_pool_keeps_connections_and_resends_on_one_the_server_closed_idle():
    """One connection for back-to-back calls; after the server drops it for idleness (uvicorn
    does after 5 s) the next call goes out again on a new connection, invisibly."""
    from polar_fast.engines.http1 import Http1Pool

    peers, transports = [], []

    async def echo(request):
        peers.append(request.transport.get_extra_info("peername"))
        transports.append(request.transport)
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/base/echo", echo)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    pool = Http1Pool(str(server.make_url("/base")))
    try:
        for i in range(3):
            assert await pool.post("/echo", b"x%d" % i, {"Content-Type": "application/json"}) == (200, b"x%d" % i)
        assert len(set(peers)) == 1
        for close_seen in (True, False):
            transports[-1].close()  # the server drops the idle connection
            if close_seen:
                await asyncio.sleep(0.1)  # its FIN has arrived: the pool skips the connection
            assert await pool.post("/echo", b"again", {}) == (200, b"again")
        assert len(set(peers)) == 3 and len(peers) == 5
    finally:
        pool.close()
        await server.close()


async def test_http1_pool_reads_chunked_and_connection_close_replies():
    from polar_fast.engines.http1 import Http1Pool

    peers = []

    async def chunked(request):
        peers.append(request.transport.get_extra_info("peername"))
        reply = web.StreamResponse()
        reply.enable_chunked_encoding()
        await reply.prepare(request)
        for part in (b'{"a":', b"1", b"}"):
            await reply.write(part)
        await reply.write_eof()
        return reply

    async def closing(request):
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(body=b"bye", headers={"Connection": "close"})

    app = web.Application()
    app.router.add_post("/chunked", chunked)
    app.router.add_post("/closing", closing)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    pool = Http1Pool(str(server.make_url("")))
    try:
        assert await pool.post("/chunked", b"{}", {}) == (200, b'{"a":1}')
        assert await pool.post("/closing", b"{}", {}) == (200, b"bye")
        assert await pool.post("/chunked", b"{}", {}) == (200, b'{"a":1}')
        assert len(peers) == 3 and peers[0] == peers[1] != peers[2]  # not reused after "close"
    finally:
        pool.close()
        await server.close()


async def test_vllm_server_that_answers_garbage_is_unavailable():
    async def garbage(reader, writer):
        await reader.read(100)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = VllmEngine(f"http://127.0.0.1:{port}", model="m", max_retries=1, retry_delay_s=0.01)
    try:
        with pytest.raises(EngineUnavailable, match="not an HTTP/1.x status line"):
            await engine.generate([1], Sampling())
    finally:
        await engine.aclose()
        server.close()
