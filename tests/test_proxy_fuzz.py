"""Fuzz: 10,000+ random and malformed bodies, headers and paths across every route, in process
(aiohttp test server + client on loopback). Never a 500, the proxy keeps answering, and the
records of an untouched session stay as they were.

Bodies are cheap to draw: a valid seed body per route (so plenty of requests get through to the
engine), mutated by hypothesis-chosen byte overwrites, truncations, splices with another seed and
type confusions (a value somewhere in the seed's JSON replaced by a nasty one), plus raw random
bytes and bodies over the size limit. Hypothesis draws only small integers, choices and short byte strings, and each
example is a batch of requests sent concurrently through one client.
"""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_fast.capture.recorder import Recorder
from polar_fast.capture.render import Renderer
from polar_fast.config import parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.model import load_tokenizer
from polar_fast.proxy import ProxyState, make_app
from polar_fast.records import RecordLog

pytestmark = pytest.mark.anyio

N_EXAMPLES = 250
PER_EXAMPLE = 42  # requests per hypothesis example, sent concurrently: 10,500 in all

_TOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "s": {"type": "string"}}}
_CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": _TOOL_SCHEMA}}],
    "stream": True,
    "max_tokens": 8,
    "temperature": 0.5,
}
_RESPONSES = {
    "model": "m",
    "instructions": "be brief",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
    ],
    "tools": [{"type": "function", "name": "f", "parameters": _TOOL_SCHEMA}],
    "stream": False,
    "max_output_tokens": 8,
}
_MESSAGES = {
    "model": "m",
    "max_tokens": 8,
    "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out"}]},
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": _TOOL_SCHEMA}],
    "stream": True,
}
_COUNT = {k: v for k, v in _MESSAGES.items() if k not in ("max_tokens", "stream")}
_SESSION = {"rollout_id": "r", "group_id": "g"}

ROUTES = [  # (method, path, seed body)
    ("POST", "/v1/chat/completions", _CHAT),
    ("POST", "/v1/responses", _RESPONSES),
    ("POST", "/v1/messages", _MESSAGES),
    ("POST", "/v1/messages?beta=true", _MESSAGES),
    ("POST", "/v1/messages/count_tokens", _COUNT),
    ("GET", "/v1/models", None),
    ("HEAD", "/", None),
    ("POST", "/sessions", _SESSION),
    ("GET", "/sessions/{token}/records", None),
    ("DELETE", "/sessions/{token}", None),
]
SEEDS = [_CHAT, _RESPONSES, _MESSAGES, _COUNT, _SESSION]
SEED_BYTES = [json.dumps(s).encode() for s in SEEDS]


def _paths(value, at=()):
    """Every path into a JSON value, the root included."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, at + (i,))


SEED_PATHS = [list(_paths(s)) for s in SEEDS]
NASTY = [None, True, False, 0, -1, 1.5, 2**70, -(2**70), float("nan"), float("inf"), "", "x" * 300, "<|im_end|>",
         "\u0000\ud7ff\U0001f600", [], [None], {}, {"type": "image"}, {"type": "weird", "text": 1}, [{"role": "bogus"}],
         [{"type": "image_url"}], {"role": "user"}, "user", "assistant", "tool", "function_call", "tool_use"]
HEADERS = ["Authorization", "x-api-key", "Content-Type", "anthropic-version", "x-admin-key", "Accept"]
PATH_JUNK = ["/", "/x", "//y", "/%", "/..", "/v1", "/\u00e9", "/a/b/c", "/s/", "?q=1&&", "/v1/models"]
_PATH_CHARS = [chr(c) for c in range(33, 127) if chr(c) not in "?#%"]


def _flip(data: bytes, edits: list[tuple[int, bytes]]) -> bytes:
    out = bytearray(data)
    for at, chunk in edits:
        at %= len(out) + 1
        out[at : at + len(chunk)] = chunk  # overwrite (a short chunk at the end also grows it)
    return bytes(out)


def _confuse(seed: int, pick: int, nasty: int) -> bytes:
    value = json.loads(SEED_BYTES[seed])
    path = SEED_PATHS[seed][pick % len(SEED_PATHS[seed])]
    if not path:
        return json.dumps(NASTY[nasty]).encode()
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = NASTY[nasty]
    return json.dumps(value).encode()


# A body spec is drawn here and made into bytes at send time, when the route's seed is known
# (own = the route's seed, else one of the others).
seed_choice = st.sampled_from(["own"] * 3 + list(range(len(SEEDS))))
body_spec = st.one_of(
    st.tuples(st.just("seed"), seed_choice),
    st.tuples(st.just("flip"), seed_choice, st.lists(st.tuples(st.integers(0, 1200), st.binary(min_size=1, max_size=3)), min_size=1, max_size=3)),
    st.tuples(st.just("cut"), seed_choice, st.integers(0, 1200)),
    st.tuples(st.just("splice"), seed_choice, st.integers(0, len(SEEDS) - 1), st.integers(0, 1200), st.integers(0, 1200)),
    st.tuples(st.just("confuse"), seed_choice, st.integers(0, 10**4), st.integers(0, len(NASTY) - 1)),
    st.tuples(st.just("raw"), st.binary(max_size=64)),
    st.tuples(st.just("big"), seed_choice, st.integers(2, 4)),  # over proxy.max_body_bytes: 413
)
request = st.tuples(
    st.integers(0, len(ROUTES) - 1),
    st.sampled_from([None] * 10 + ["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
    st.sampled_from(["path", "path", "bearer", "x-api-key", "wrong", "none"]),
    st.sampled_from(["", "", "/s/{token}", "/s/{token}", "/s/", "/s/bad"]),
    st.tuples(st.integers(0, 24 + len(PATH_JUNK)), st.binary(max_size=16)),  # "", listed or random junk
    body_spec,
    st.lists(st.tuples(st.sampled_from(HEADERS), st.binary(max_size=24)), max_size=2),
)


def _body(spec: tuple, route_seed: dict | None) -> bytes:
    kind = spec[0]
    if kind == "raw":
        return spec[1]
    seed = SEEDS.index(route_seed) if spec[1] == "own" and route_seed is not None else (spec[1] if spec[1] != "own" else 0)
    data = SEED_BYTES[seed]
    if kind == "flip":
        return _flip(data, spec[2])
    if kind == "cut":
        return data[: spec[2] % (len(data) + 1)]
    if kind == "splice":
        other = SEED_BYTES[spec[2]]
        return data[: spec[3] % (len(data) + 1)] + other[spec[4] % (len(other) + 1) :]
    if kind == "confuse":
        return _confuse(seed, spec[2], spec[3])
    if kind == "big":
        return data + b" " * (1024 * spec[2])
    return data


def _header_value(raw: bytes) -> str:
    return "".join(chr(32 + b % 95) for b in raw)  # printable ASCII: what a client can send


@pytest.fixture
async def fuzz_client(tmp_path):
    cfg = parse_config({"engine": {"kind": "scripted"}, "proxy": {"max_body_bytes": 1024}, "model": {"max_context_tokens": 512}})
    tokenizer = await asyncio.to_thread(load_tokenizer, "")
    log = await asyncio.to_thread(RecordLog, tmp_path / "calls.log")
    engine = ScriptedEngine(["ok", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "<think>x</think>y"], tokenizer, cycle=True)
    engine.prompts = _Discard()
    state = ProxyState(cfg=cfg, engine=engine, renderer=Renderer(tokenizer), recorder=Recorder(log))
    writer = asyncio.get_running_loop().create_task(state.recorder.run())
    client = TestClient(TestServer(make_app(state), host="127.0.0.1"))
    await client.start_server()
    gc.freeze()  # as serve() does: full collections would walk every torch/transformers object
    try:
        yield client, state
    finally:
        gc.unfreeze()
        await client.close()
        state.recorder.close()
        await writer
        await asyncio.to_thread(log.close)


class _Discard(list):
    def append(self, item: object) -> None:  # the scripted engine's prompt log: not needed here
        pass


def test_seeds_fit_the_body_limit():
    assert all(len(b) < 1024 for b in SEED_BYTES)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_fuzz_never_500(fuzz_client):
    client, state = fuzz_client
    bystander = state.new_session("bystander", "g")
    r = await client.post(f"/s/{bystander.token}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200
    before = bystander.records()
    victim = state.new_session("victim", "g")
    statuses: dict[int, int] = {}
    seen = 0

    async def send(route_i, method, token, prefix, junk, spec, header_items):
        nonlocal seen
        seen += 1
        verb, path, seed = ROUTES[route_i]
        junk_i, junk_raw = junk
        if junk_i < 24:
            junk = ""
        elif junk_i < 24 + len(PATH_JUNK):
            junk = PATH_JUNK[junk_i - 24]
        else:
            junk = "".join(_PATH_CHARS[b % len(_PATH_CHARS)] for b in junk_raw)
        verb = method or verb
        if path.startswith("/v1"):
            path = prefix.replace("{token}", victim.token) + path
        path = path.replace("{token}", victim.token if token != "wrong" else "nope") + junk
        if path.startswith("//"):
            path = "/x" + path  # a leading // would make the client read a host out of the path
        headers = {name: _header_value(raw) for name, raw in header_items}
        if token == "bearer":
            headers["Authorization"] = f"Bearer {victim.token}"
        elif token == "x-api-key":
            headers["x-api-key"] = victim.token
        if ROUTES[route_i][1].startswith("/sessions/") and verb == "DELETE":
            verb = "GET"  # keep the victim session alive for the next examples
        data = _body(spec, seed)
        resp = await client.request(verb, path, data=data, headers=headers)
        await resp.read()
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        assert resp.status != 500, (verb, path, data[:200])
        assert resp.status < 500 or resp.status == 503  # 503 only: a scripted engine never fails otherwise

    @settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests=st.lists(request, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    async def batch(requests):
        await asyncio.gather(*(send(*r) for r in requests))

    await _run_async_given(batch)
    assert seen >= 10_000
    r = await client.get("/")
    assert r.status == 200
    assert bystander.records() == before
    assert statuses.get(200, 0) > 300 and statuses.get(400, 0) > 1000, sorted(statuses.items())


async def _run_async_given(test) -> None:
    """hypothesis drives sync functions; run each async example on this loop, one after another."""
    loop = asyncio.get_running_loop()
    inner = test.hypothesis.inner_test

    def sync(**kwargs):
        return asyncio.run_coroutine_threadsafe(inner(**kwargs), loop).result()

    test.hypothesis.inner_test = sync
    await asyncio.to_thread(test)
