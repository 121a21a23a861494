"""Fuzz: 10,000+ random and malformed bodies, headers and paths across every route, in process
(aiohttp test server + client on loopback). Never a 500, the proxy keeps answering, and the
records of an untouched session stay as they were."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_fast.chat.render import Renderer
from polar_fast.config import parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.model import load_tokenizer
from polar_fast.proxy import ProxyState, make_app
from polar_fast.recorder import Recorder
from polar_fast.records import RecordLog

pytestmark = pytest.mark.anyio

N_EXAMPLES = 2_700
PER_EXAMPLE = 4  # requests per hypothesis example, sent concurrently: 10,800 in all

ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages?beta=true"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("HEAD", "/"),
    ("POST", "/sessions"),
    ("GET", "/sessions/{token}/records"),
    ("DELETE", "/sessions/{token}"),
]

json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=6
)
KEYS = ["model", "messages", "input", "tools", "stream", "max_tokens", "system", "content", "role", "type", "tool_calls",
        "function", "arguments", "call_id", "output", "tool_use_id", "temperature", "top_p", "instructions", "name", "id", "n"]
ROLES = ["system", "developer", "user", "assistant", "tool", "function", "bogus"]
TYPES = ["text", "image", "image_url", "tool_use", "tool_result", "thinking", "message", "function_call",
         "function_call_output", "reasoning", "input_text", "output_text", "input_image", "weird"]
field_value = json_value | st.sampled_from(ROLES + TYPES)
message = st.dictionaries(st.sampled_from(KEYS), field_value | st.lists(st.dictionaries(st.sampled_from(KEYS), field_value, max_size=5), max_size=3), max_size=6)
structured = st.fixed_dictionaries(
    {}, optional={k: (field_value | st.lists(message, max_size=4)) for k in ["model", "messages", "input", "tools", "stream",
                                                                           "max_tokens", "system", "temperature", "top_p", "instructions"]}
)
body = (
    structured.map(lambda d: json.dumps(d).encode())
    | json_value.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
    | structured.map(lambda d: json.dumps(d).encode()[: max(1, len(json.dumps(d)) // 2)])  # truncated JSON
)
header_name = st.sampled_from(["Authorization", "x-api-key", "Content-Type", "anthropic-version", "x-admin-key", "Accept"])
header_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
path_junk = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"), max_size=30)


@pytest.fixture
async def fuzz_client(tmp_path):
    cfg = parse_config({"engine": {"kind": "scripted"}, "proxy": {"max_body_bytes": 1024}, "model": {"max_context_tokens": 512}})
    import asyncio

    tokenizer = await asyncio.to_thread(load_tokenizer, "")
    log = await asyncio.to_thread(RecordLog, tmp_path / "calls.log")
    engine = ScriptedEngine(["ok", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "<think>x</think>y"], tokenizer, cycle=True)
    state = ProxyState(cfg=cfg, engine=engine, renderer=Renderer(tokenizer), recorder=Recorder(log))
    writer = asyncio.get_running_loop().create_task(state.recorder.run())
    client = TestClient(TestServer(make_app(state), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client, state
    finally:
        await client.close()
        state.recorder.close()
        await writer
        await asyncio.to_thread(log.close)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_fuzz_never_500(fuzz_client):
    client, state = fuzz_client
    bystander = state.new_session("bystander", "g")
    r = await client.post(f"/s/{bystander.token}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200
    before = list(bystander.records)
    victim = state.new_session("victim", "g")
    statuses: dict[int, int] = {}
    seen = 0

    import asyncio

    request = st.tuples(
        st.sampled_from(ROUTES),
        st.sampled_from([None] * 6 + ["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
        st.sampled_from(["path", "path", "bearer", "x-api-key", "wrong", "none"]),
        st.sampled_from(["", "", "/s/{token}", "/s/{token}", "/s/", "/s/bad"]),
        st.sampled_from([""] * 12 + ["/", "/x", "//y", "/%", "/..", "/v1", None]).flatmap(
            lambda j: path_junk if j is None else st.just(j)
        ),
        body,
        st.dictionaries(header_name, header_value, max_size=3),
    )

    @settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests=st.lists(request, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    async def one(requests):
        await asyncio.gather(*(send(*r) for r in requests))

    async def send(route, method, token, prefix, junk, data, headers):
        nonlocal seen
        seen += 1
        verb = method or route[0]
        path = route[1]
        if path.startswith("/v1"):
            path = prefix.replace("{token}", victim.token) + path
        path = path.replace("{token}", victim.token if token != "wrong" else "nope") + junk
        if path.startswith("//"):
            path = "/x" + path  # a leading // would make the client read a host out of the path
        headers = dict(headers)
        if token == "bearer":
            headers["Authorization"] = f"Bearer {victim.token}"
        elif token == "x-api-key":
            headers["x-api-key"] = victim.token
        if route[1].startswith("/sessions/") and verb == "DELETE":
            verb = "GET"  # keep the victim session alive for the next examples
        resp = await client.request(verb, path, data=data, headers=headers)
        await resp.read()
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        assert resp.status != 500, (verb, path, data[:200])
        assert resp.status < 500 or resp.status == 503  # 503 only: a scripted engine never fails otherwise

    await _run_async_given(one)
    assert seen >= 10_000
    r = await client.get("/")
    assert r.status == 200
    assert bystander.records == before
    assert statuses.get(200, 0) > 300 and statuses.get(400, 0) > 1000, statuses


async def _run_async_given(test) -> None:
    """hypothesis drives sync functions; run each async example on this loop, one after another."""
    import asyncio

    loop = asyncio.get_running_loop()
    inner = test.hypothesis.inner_test

    def sync(**kwargs):
        return asyncio.run_coroutine_threadsafe(inner(**kwargs), loop).result()

    test.hypothesis.inner_test = sync
    await asyncio.to_thread(test)
