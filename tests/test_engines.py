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
from polar_fast.engines.vllm import VllmEngine, _VersionSpan, version_changes
from polar_fast.engines.vllm_wire import PromptJsonCache
from polar_fast.errors import WeightSyncError

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

    async def generate(request):
        body = await request.json()
        seen.append((body, dict(request.headers)))
        if failures["left"]:
            failures["left"] -= 1
            return web.Response(status=503, text="busy")
        ids = [len(body["token_ids"]), 2]
        return web.json_response({"request_id": "r", "choices": [{  # as vLLM 0.32's /inference/v1/generate
            "index": 0, "token_ids": ids, "finish_reason": "stop",
            "logprobs": {"content": [{"token_id": i, "logprob": lp} for i, lp in zip(ids, [-0.25, -0.5])]},
            "weight_versions": [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 2}]}]})

    async def chat(request):
        body = await request.json()
        seen.append((body, dict(request.headers)))
        message = {"role": "assistant", "content": None, "reasoning_content": "r",
                   "tool_calls": [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}
        return web.json_response({"prompt_token_ids": [1, 2, 3], "choices": [
            {"token_ids": [9, 2], "message": message, "finish_reason": "tool_calls",
             "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}}]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
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
        assert (gen.policy_version, gen.version_changes) == (4, [(1, 5)])  # from the reply's spans
        body, headers = seen[-1]
        params = body["sampling_params"]
        assert body["token_ids"] == [7, 8, 9] and params["logprobs"] == 0 and params["seed"] == 3
        gen = await engine.generate(array("i", [70000, -1, 0]), Sampling(max_tokens=5), session_id="abc")  # what the proxy renders
        assert seen[-1][0]["token_ids"] == [70000, -1, 0] and gen.token_ids == [3, 2]
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
        return web.json_response({"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"logprob": -1.0}]}}]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", bad)
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


def test_version_changes_from_vllm_spans():
    span = _VersionSpan
    assert version_changes([], 3) == (3, [])  # no labels: the version at the call's start
    assert version_changes([span("3", 0, 5)], 2) == (3, [])
    assert version_changes([span("3", 0, 2), span("4", 2, 9)], 3) == (3, [(2, 4)])
    assert version_changes([span("4", 6, 9)], 3) == (3, [(6, 4)])  # tokens before any label
    assert version_changes([span("x", 0, 2), span("5", 2, 4)], 4) == (4, [(2, 5)])  # not our label


async def _fake_control(fail: str = ""):
    """Dev-mode routes that log (path with query, body) and fail `fail` with a 500. A fake because
    a real vLLM cannot be made to fail one step on purpose; the real sequence is tested in
    test_vllm_real.py."""
    log: list[tuple[str, object]] = []

    async def route(request):
        body = await request.read()
        log.append((request.path_qs, msgspec.json.decode(body) if body else None))
        if request.path == fail:
            return web.Response(status=500, text="boom")
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", route)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, log


async def test_vllm_sync_pauses_in_keep_mode_and_labels_the_version():
    server, log = await _fake_control()
    engine = VllmEngine(str(server.make_url("")), model="m")
    try:
        await engine.update_weights(None, version=7)
    finally:
        await engine.aclose()
        await server.close()
    assert [p for p, _ in log] == ["/pause?mode=keep&clear_cache=false", "/collective_rpc",
                                   "/reset_prefix_cache?reset_running_requests=true", "/update_weight_version", "/resume"]
    assert log[1][1] == {"method": "reload_weights"} and log[3][1] == {"new_version": "7"}
    assert engine.policy_version == 7


async def test_vllm_sync_failure_resumes_and_names_the_step():
    server, log = await _fake_control(fail="/collective_rpc")
    engine = VllmEngine(str(server.make_url("")), model="m", pause_mode="wait")
    try:
        with pytest.raises(WeightSyncError, match=r"reload weights \(/collective_rpc\) failed: .*boom"):
            await engine.update_weights(None, version=1)
    finally:
        await engine.aclose()
        await server.close()
    assert log[0][0] == "/pause?mode=wait&clear_cache=false" and log[-1][0] == "/resume"
    assert engine.policy_version == 0  # the version did not move
    with pytest.raises(ValueError, match="abort would fail the calls in flight"):
        VllmEngine("http://127.0.0.1:9", model="m", pause_mode="abort")
