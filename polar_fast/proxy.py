"""The capture proxy: three model API dialects in front of one engine, recording every call.

Routes (each `/v1/...` route also lives under `/s/<token>/v1/...`):
    POST /v1/chat/completions         OpenAI Chat Completions
    POST /v1/responses                OpenAI Responses
    POST /v1/messages[?beta=true]     Anthropic Messages;  POST /v1/messages/count_tokens
    GET  /v1/models                   served model (OpenAI and Anthropic list shapes in one)
    HEAD /, GET /                     liveness
    POST /sessions, GET /sessions/<token>/records, DELETE /sessions/<token>   (admin)

Admin routes are served on the TCP port only, never on `proxy.unix_socket`: that socket is what
network-none Docker boxes reach, so a box sees its own session's model routes and nothing else
(an admin path there is a 404). Boxes that reach the TCP port (host networking, the local
sandbox) get admin routes behind a key generated for the run (rollouts/stack.py); a session
token is never an admin key, so a box's token cannot read or end another session.

A request's session comes from the path token, else from its API key (`Authorization: Bearer`
or `x-api-key`); unknown → 401 in the caller's dialect. One model call reads top to bottom in
`_complete`: route → session (capture/session.py) → dialect parse (the session's incremental
parse, capture/dialects/incremental.py: only what the request adds is decoded) → prompt ids
(History.plan + finish: exact-history ids, only a new suffix rendered and tokenised, long
tokenisations in worker threads) → engine (`_engine_call`: timeout and failure accounting) →
Renderer.parse → record (awaited on disk) → the dialect's reply or SSE in one send. Every failure is answered in the caller's dialect: bad input 400,
unknown session 401, unknown route 404, body over `proxy.max_body_bytes` 413, engine down 503,
engine timeout 504, other engine failure 502, a call whose record cannot be written 503 (it is
then not part of the session's history either); a 500 means a bug here. Handler cancellation
stays off (aiohttp default), so a client hanging up never tears a record in half.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import random
import secrets
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Sequence, TypeVar

import anyio
import msgspec
from aiohttp import web

from polar_fast.capture.dialects import DIALECTS, Dialect, DialectError, ReplyMeta, anthropic
from polar_fast.capture.history import History, Prompt
from polar_fast.capture.recorder import Recorder
from polar_fast.capture.render import Renderer, template_message, template_tool
from polar_fast.capture.sampling import sampling_for
from polar_fast.capture.session import Session
from polar_fast.conversation import Completion, Conversation, ToolCall
from polar_fast.engines import Engine, EngineError, EngineFailed, EngineTimeout, Generation, Sampling
from polar_fast.errors import ConfigError, PolarError
from polar_fast.records import (
    CallRecord,
    HarnessSampling,
    Record,
    RecordLog,
    Timings,
    encode_frame,
    packed_ids,
)

if TYPE_CHECKING:
    from polar_fast.config import Config

log = logging.getLogger(__name__)
TEARDOWN_TIMEOUT_S = 60  # closing the listeners and writing what the recorder holds


class _NewSession(msgspec.Struct):
    rollout_id: str = ""
    group_id: str = ""


@dataclass(eq=False)
class ProxyState:
    cfg: Config
    engine: Engine
    renderer: Renderer
    recorder: Recorder
    sessions: dict[str, Session] = field(default_factory=dict)
    base_url: str = ""
    errors: dict[int, int] = field(default_factory=dict)  # replies by error status
    calls_in_flight: int = 0  # model calls received and not yet answered (run status, chaos tests)
    # Whole renders (first calls, no match: tens of ms for a long prompt) queue here, apart from the
    # short suffix tokenisations of exact calls, so a burst of new sessions never holds up the
    # sessions already running. None: the loop's default executor.
    render_pool: ThreadPoolExecutor | None = None

    def new_session(self, rollout_id: str = "", group_id: str = "", *,
                    format_error_markers: tuple[str, ...] = (), guide: Sequence[str] = ()) -> Session:
        """`guide`: texts that answer the session's first calls instead of the engine, each as a
        model that stopped by itself would end it (the end-of-turn token)."""
        token = "pf-" + secrets.token_hex(16)
        session_id = secrets.token_hex(8)
        history = History(self.renderer, self.cfg.proxy.history, max_calls=self.cfg.proxy.history_max_calls)
        guided = tuple(self.renderer.encode(text) + [self.renderer.eot_id] for text in guide)
        session = Session(token, session_id, rollout_id or session_id, group_id, history,
                          format_error_markers=format_error_markers, guide=guided)
        self.sessions[token] = session
        return session


STATE = web.AppKey("state", ProxyState)


# ----------------------------------------------------------------------------- errors


def _dialect_of(request: web.Request) -> Dialect:
    """The dialect an error is answered in: the route's, else Anthropic's when the client says so."""
    path = request.path
    if "/messages" in path:
        return DIALECTS["anthropic"]
    if "/responses" in path:
        return DIALECTS["responses"]
    return DIALECTS["anthropic" if "anthropic-version" in request.headers else "chat"]


class RecordFailed(PolarError):
    """A call's record could not be written (disk full, log gone): the call fails with 503."""


_KIND_OF_STATUS = {401: "authentication", 404: "not_found", 413: "too_large"}


def _error_response(request: web.Request, status: int, kind: str, message: str) -> web.Response:
    request.app[STATE].errors[status] = request.app[STATE].errors.get(status, 0) + 1
    body = _dialect_of(request).error(status, kind, message)
    return web.Response(status=status, body=body, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DialectError as e:
        return _error_response(request, e.status, e.kind, e.message)
    except RecordFailed as e:
        return _error_response(request, 503, "record", str(e))
    except EngineError as e:
        kind = "timeout" if isinstance(e, EngineTimeout) else "engine"
        return _error_response(request, e.status, kind, f"inference engine: {e}")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text or e.reason
        if e.status == 413:
            message = f"request body exceeds {request.app[STATE].cfg.proxy.max_body_bytes} bytes"
        elif e.status == 404:
            message = f"no route {request.method} {request.path}"
        elif e.status == 405:
            message = f"method {request.method} not allowed on {request.path}"
        return _error_response(request, e.status, _KIND_OF_STATUS.get(e.status, "invalid_request"), message)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # a bug here: answer, log, keep serving everyone else
        log.exception("proxy: unhandled error on %s %s", request.method, request.path)
        return _error_response(request, 500, "internal", f"internal proxy error: {type(e).__name__}")


# ----------------------------------------------------------------------------- sessions


def _api_key(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key", "").strip()


def _session(request: web.Request) -> Session:
    token = request.match_info.get("token") or _api_key(request)
    session = request.app[STATE].sessions.get(token)
    if session is None:
        raise DialectError("unknown or closed session token", status=401, kind="authentication")
    return session


async def _body(request: web.Request) -> bytes:
    limit = request.app[STATE].cfg.proxy.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise DialectError(f"request body exceeds {limit} bytes", status=413, kind="too_large")
    return await request.read()  # aiohttp enforces client_max_size on chunked bodies too


def _check_admin(request: web.Request) -> None:
    key = request.app[STATE].cfg.proxy.admin_key
    if not key:
        return
    given = request.headers.get("x-admin-key") or _api_key(request)
    if not secrets.compare_digest(given.encode(), key.encode()):
        raise DialectError("admin key required", status=401, kind="authentication")


async def create_session(request: web.Request) -> web.Response:
    _check_admin(request)
    body = await _body(request)
    try:
        spec = msgspec.json.decode(body, type=_NewSession) if body.strip() else _NewSession()
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DialectError(f"POST /sessions takes optional JSON {{rollout_id, group_id}}: {e}") from None
    state = request.app[STATE]
    session = state.new_session(spec.rollout_id, spec.group_id)
    reply = {"token": session.token, "base_url": f"{state.base_url}/s/{session.token}", "session_id": session.session_id}
    return web.Response(body=msgspec.json.encode(reply), content_type="application/json")


def _admin_session(request: web.Request) -> Session:
    _check_admin(request)
    session = request.app[STATE].sessions.get(request.match_info["token"])
    if session is None:
        raise DialectError("no such session", status=404, kind="not_found")
    return session


async def session_records(request: web.Request) -> web.Response:
    session = _admin_session(request)
    records = await asyncio.to_thread(session.records)  # grows with the session: not on the loop
    return web.Response(body=msgspec.json.encode(records), content_type="application/json")


async def close_session(request: web.Request) -> web.Response:
    session = _admin_session(request)
    del request.app[STATE].sessions[session.token]
    body = {"closed": True, "session_id": session.session_id, "n_calls": session.n_calls}
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


# ----------------------------------------------------------------------------- model calls
#
# One model call, in the order it happens (`_complete`): route -> session -> dialect parse ->
# prompt ids -> engine -> completion -> record (on disk) -> dialect reply. The two ways to get a
# completion (`_answer_from_tokens`, `_answer_from_engine_chat`) share `_engine_call`, the
# timeout and failure accounting every engine call goes through.


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, DIALECTS["chat"])


async def responses_create(request: web.Request) -> web.StreamResponse:
    return await _complete(request, DIALECTS["responses"])


async def messages_create(request: web.Request) -> web.StreamResponse:
    return await _complete(request, DIALECTS["anthropic"])


@dataclass(eq=False)
class _Answer:
    """What the engine made of one request: the prompt it saw, what it sampled, and the reply."""

    prompt_ids: Sequence[int]
    gen: Generation
    version: int  # policy version that sampled it
    completion: Completion
    temperature: float
    history: str  # how the prompt was built: "exact", "render:<cause>" or "render:engine"
    prompt: Prompt | None  # exact history's prompt (None when the engine rendered)
    engine_at: float  # perf_counter when the engine call began (engine render: when it ended)
    engine_s: float  # the engine call's seconds (engine render: counted as rendering)
    guided: bool = False  # answered by the session's guide, not sampled by the policy


async def _complete(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    state = request.app[STATE]
    started_at, t0 = time.time(), time.perf_counter()
    state.calls_in_flight += 1
    try:
        session = _session(request)
        conv = session.parse(dialect, await _body(request))
        kind = f"{dialect.NAME} {'stream' if conv.stream else 'json'}"
        session.requests[kind] = session.requests.get(kind, 0) + 1
        session.count_format_errors(conv)
        if state.cfg.engine.render == "engine":
            answer = await _answer_from_engine_chat(state, session, conv, dialect)
        else:
            answer = await _answer_from_tokens(state, session, conv, dialect)
        timings = Timings(started_at=started_at, render_s=answer.engine_at - t0, engine_s=answer.engine_s,
                          total_s=time.perf_counter() - t0)
        record = _call_record(session, conv, answer, dialect, timings)
        session.n_calls += 1  # before the await: concurrent calls of a session (sub-agents) get distinct indices
        await _record(state, session, conv, answer, record)
        return _reply(state, conv, answer.completion, dialect, started_at)
    finally:
        state.calls_in_flight -= 1


# ------------------------------------------------------------------ prompt ids, engine, completion


async def _answer_from_tokens(state: ProxyState, session: Session, conv: Conversation, dialect: Dialect) -> _Answer:
    """Token-in / token-out: the prompt's ids (exact history), the engine samples, the renderer
    parses the sampled ids back into text, reasoning and tool calls."""
    prompt = await _prompt(state, session.history, conv)
    try:
        sampling = sampling_for(state.cfg, conv, len(prompt.ids), session)
    except DialectError as e:
        if e.kind == "context_length":
            session.count("context_length")
        raise
    t1 = time.perf_counter()
    version = state.engine.policy_version
    guided = session.guided_reply()
    if guided is not None:  # the guide answers: no engine call, and no policy sample to have a logprob (0s)
        ids = guided[: sampling.max_tokens]
        gen = Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop" if ids == guided else "length")
    else:
        gen = await _engine_call(state, session, _generate(state.engine, prompt.ids, sampling, session.session_id))
    t2 = time.perf_counter()
    content, reasoning, calls = state.renderer.parse(gen.token_ids, conv.tools, lambda: _call_id(dialect))
    if guided is None:  # a guided reply is the teacher's: its causes are not the policy's
        session.count_reply_causes(conv, content, calls, gen.finish_reason)
    completion = Completion(
        content=content, reasoning=reasoning, tool_calls=calls,
        finish_reason="tool_calls" if calls else gen.finish_reason,
        prompt_tokens=len(prompt.ids), completion_tokens=len(gen.token_ids),
    )
    return _Answer(prompt.ids, gen, gen.policy_version if gen.policy_version is not None else version, completion,
                   sampling.temperature, prompt.history, prompt, engine_at=t1, engine_s=t2 - t1,
                   guided=guided is not None)


async def _answer_from_engine_chat(state: ProxyState, session: Session, conv: Conversation,
                                   dialect: Dialect) -> _Answer:
    """`render = "engine"`: vLLM renders and parses; we only translate and record."""
    chat_fn = getattr(state.engine, "chat", None)
    if chat_fn is None:
        raise ConfigError('engine.render = "engine" needs the vllm engine')
    sampling = sampling_for(state.cfg, conv, 0, session)
    version = state.engine.policy_version
    messages = [template_message(m, parse_arguments=False) for m in conv.messages]
    tools = [template_tool(t) for t in conv.tools]
    reply = await _engine_call(state, session, chat_fn(messages, tools, sampling, session_id=session.session_id))
    m = reply.message
    calls = tuple(
        ToolCall(id=_call_id(dialect), name=str(c["function"]["name"]), arguments=str(c["function"]["arguments"]))
        for c in m.get("tool_calls") or ()
    )
    completion = Completion(
        content=m.get("content") or "",
        reasoning=m.get("reasoning_content") or m.get("reasoning") or "",
        tool_calls=calls,
        finish_reason="tool_calls" if calls else reply.generation.finish_reason,
        prompt_tokens=len(reply.prompt_ids),
        completion_tokens=len(reply.generation.token_ids),
    )
    # vLLM's own template: no exact history here
    return _Answer(reply.prompt_ids, reply.generation, version, completion, sampling.temperature, "render:engine",
                   None, engine_at=time.perf_counter(), engine_s=0.0)


T = TypeVar("T")


async def _engine_call(state: ProxyState, session: Session, call: Awaitable[T]) -> T:
    """Every engine call goes through here: at most `engine.timeout_s`, and any failure (a
    timeout, the engine's error, or a bug in it) is counted on the session as an engine failure
    (an infra failure, not the agent's) and raised as an EngineError (504 timeout, else 502/503)."""
    try:
        async with asyncio.timeout(state.cfg.engine.timeout_s):
            return await call
    except TimeoutError:
        session.failed("engine_failure")
        raise EngineTimeout(f"no generation within {state.cfg.engine.timeout_s} s") from None
    except EngineError:
        session.failed("engine_failure")
        raise
    except Exception as e:  # an engine bug is still an engine failure, not a proxy one
        session.failed("engine_failure")
        raise EngineFailed(f"{type(e).__name__}: {e}") from e


async def _generate(engine: Engine, prompt_ids: Sequence[int], sampling: Sampling, session_id: str) -> Generation:
    gen = await engine.generate(prompt_ids, sampling, session_id=session_id)
    if gen.finish_reason == "abort":
        raise EngineFailed("generation was aborted")
    if len(gen.token_ids) != len(gen.logprobs):
        raise EngineFailed(f"{len(gen.token_ids)} token ids but {len(gen.logprobs)} logprobs")
    return gen


async def _prompt(state: ProxyState, history: History, conv: Conversation) -> Prompt:
    """Exact history: match and render the new suffix here (cheap), tokenise it in a worker
    thread when long (the tokenizer releases the GIL). A whole render (first call, no match)
    runs in the render pool entirely: a long first prompt takes tens of ms."""
    plan = history.plan(conv.messages, conv.tools)
    if plan.whole:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.render_pool, history.finish, plan, conv.messages, conv.tools)
    if len(plan.text) > state.renderer.inline_encode_chars:
        return await asyncio.to_thread(history.finish, plan, conv.messages, conv.tools)
    return history.finish(plan, conv.messages, conv.tools)


# Reply and tool-call ids only need to be unique, not secret: a seeded PRNG instead of
# os.urandom per id (a syscall each, slow on some VMs). Session tokens stay `secrets`.
# Reply and tool-call ids only need to be unique, not secret: a seeded PRNG instead of
# os.urandom per id (a syscall each, slow on some VMs). Session tokens stay `secrets`.
_ids = random.Random(secrets.randbits(128))
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _reply_id() -> str:
    return f"{_ids.getrandbits(96):024x}"


def _call_id(dialect: Dialect) -> str:
    prefix = {"anthropic": "toolu_", "responses": "call_"}.get(dialect.NAME, "call_")
    return prefix + _reply_id()


# ------------------------------------------------------------------------------- record, reply


def _call_record(session: Session, conv: Conversation, answer: _Answer, dialect: Dialect,
                 timings: Timings) -> CallRecord:
    n_extended = answer.prompt.n_extended if answer.prompt is not None else 0
    return CallRecord(
        session_id=session.session_id,
        rollout_id=session.rollout_id,
        group_id=session.group_id,
        call_index=session.n_calls,
        prompt_ids=packed_ids(answer.prompt_ids[n_extended:]),  # only the new ids (see CallRecord), encoded
        completion_ids=answer.gen.token_ids,
        completion_logprobs=answer.gen.logprobs,
        policy_version=answer.version,
        finish_reason=answer.completion.finish_reason,
        dialect=dialect.NAME,
        timings=timings,
        history=answer.history,
        prefix_call=answer.prompt.extends_call if answer.prompt is not None else -1,
        n_prefix=n_extended,
        version_changes=answer.gen.version_changes,
        temperature=answer.temperature,
        harness_sampling=HarnessSampling(temperature=conv.temperature, top_p=conv.top_p, max_tokens=conv.max_tokens),
        guided=answer.guided,
    )


async def _record(state: ProxyState, session: Session, conv: Conversation, answer: _Answer, record: CallRecord) -> None:
    """The call's record and exchange on disk (one write of the writer; the exchange feeds SFT
    export), then the session remembers the call: only a call on disk becomes a base that later
    records store their prompts as deltas from, and that exact history extends."""
    reply_message = answer.completion.as_message()
    exchange = session.exchange(record.call_index, conv, reply_message, model=state.cfg.model.name,
                                dialect=record.dialect)
    call_frame = encode_frame(record)
    try:
        await state.recorder.put(call_frame, exchange)
    except Exception as e:
        # the harness never sees this reply; its retry is a new call (this index stays unused)
        session.failed("record_failure")
        raise RecordFailed(f"the call could not be recorded ({type(e).__name__}: {e}); no reply goes out without its record, retry") from e
    session.failing_calls = 0  # the harness got past any failure before this call
    session.call_frames.append(call_frame)
    session.last_exchange = (record.call_index, conv.messages)
    if answer.prompt is not None:
        session.history.remember(answer.prompt, answer.gen.token_ids, reply_message, call_index=record.call_index)


def _reply(state: ProxyState, conv: Conversation, completion: Completion, dialect: Dialect,
           started_at: float) -> web.Response:
    meta = ReplyMeta(id=_reply_id(), created=int(started_at), model=conv.model or state.cfg.model.name)
    if not conv.stream:
        return web.Response(body=dialect.reply(completion, meta), content_type="application/json")
    # The whole completion is known: the SSE frames go out with the headers in one send, with a
    # Content-Length, and the client's SSE parser splits them into events.
    body = b"".join(dialect.stream(completion, meta, include_usage=conv.include_usage))
    return web.Response(body=body, headers=_SSE_HEADERS)


# ----------------------------------------------------------------------------- other routes


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _session(request)
    conv = anthropic.parse_count(await _body(request))
    n_tokens = len(await asyncio.to_thread(state.renderer.render, conv.messages, conv.tools))
    return web.Response(body=anthropic.count_reply(n_tokens), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    _session(request)
    name = request.app[STATE].cfg.model.name
    entry = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "polar_fast",
        "type": "model",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
    }
    body = {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name}
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


# ----------------------------------------------------------------------------- app


def make_app(state: ProxyState, *, admin: bool = True) -> web.Application:
    """The proxy's routes; `admin=False` leaves out the session routes (the boxes' socket)."""
    app = web.Application(client_max_size=state.cfg.proxy.max_body_bytes, middlewares=[_errors])
    app[STATE] = state
    for prefix in ("", "/s/{token}"):
        app.router.add_post(prefix + "/v1/chat/completions", chat_completions)
        app.router.add_post(prefix + "/v1/responses", responses_create)
        app.router.add_post(prefix + "/v1/messages", messages_create)
        app.router.add_post(prefix + "/v1/messages/count_tokens", count_tokens)
        app.router.add_get(prefix + "/v1/models", models)
    app.router.add_get("/", health)  # aiohttp answers HEAD on GET routes
    if not admin:
        return app
    app.router.add_post("/sessions", create_session)
    app.router.add_get("/sessions/{token}/records", session_records)
    app.router.add_delete("/sessions/{token}", close_session)
    return app


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind_unix(path: str) -> socket.socket:
    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        os.unlink(path)  # a stale socket from an earlier run
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    # boxes connect as an unprivileged user; the socket serves model routes only (an unknown
    # token gets 401), and its directory decides who on the host can reach it
    os.chmod(path, 0o666)
    return sock


@dataclass(eq=False)
class Proxy:
    """A running proxy: where it listens and its state (sessions, engine, recorder)."""

    state: ProxyState
    base_url: str  # http://HOST:PORT
    unix_socket: str  # "" when not listening on one

    @property
    def admin_key(self) -> str:
        return self.state.cfg.proxy.admin_key

    def new_session(self, rollout_id: str = "", group_id: str = "", *,
                    format_error_markers: tuple[str, ...] = (), guide: Sequence[str] = ()) -> Session:
        return self.state.new_session(rollout_id, group_id, format_error_markers=format_error_markers, guide=guide)

    def close_session(self, token: str) -> Session | None:
        """End a session: its later requests get 401. Returns it, or None if it was not open."""
        return self.state.sessions.pop(token, None)

    async def record(self, *records: Record) -> None:
        """Append records of the run's other stages (finished rollouts) to the record log, in
        order with the calls, and wait until they are written."""
        await self.state.recorder.put(*records)


@asynccontextmanager
async def open_proxy(cfg: Config, engine: Engine, record_log: RecordLog, *, renderer: Renderer | None = None) -> AsyncIterator[Proxy]:
    """Listen on `cfg.proxy.host:port` (and `unix_socket`) until the block exits.

    The recorder's writer runs in this context's TaskGroup; on exit the server stops first, then
    every queued record is written."""
    pc = cfg.proxy
    if not _is_loopback(pc.host) and not pc.admin_key:
        raise ConfigError(f"proxy.host={pc.host!r} listens beyond loopback: set proxy.admin_key")
    if renderer is None:
        from polar_fast.model import load_tokenizer

        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.path)
        renderer = Renderer(tokenizer, tool_parser=cfg.model.tool_parser, reasoning=cfg.model.reasoning)
    if gc.get_freeze_count() == 0:
        # The process holds millions of import-time objects (torch, transformers). A full
        # collection walks them all and stalls the event loop for ~0.5 s; frozen, it skips them.
        gc.collect()
        gc.freeze()
    threshold0, *older = gc.get_threshold()
    if threshold0 < 10_000:
        # Each call leaves young container objects behind (decoded items, Jinja contexts, futures)
        # and a young collection costs the event loop the same however few survive, so they
        # should be rare. Memory: at most ~10k more objects wait for a cycle collection.
        gc.set_threshold(10_000, *older)
    recorder = Recorder(record_log, queue_size=pc.recorder_queue_size)
    render_pool = ThreadPoolExecutor(max_workers=max(1, pc.render_threads), thread_name_prefix="proxy-render")
    state = ProxyState(cfg=cfg, engine=engine, renderer=renderer, recorder=recorder, render_pool=render_pool)
    async with asyncio.TaskGroup() as tg:
        recording = tg.create_task(recorder.run())
        runner = web.AppRunner(make_app(state), handle_signals=False, access_log=None)
        box_runner = None  # the Unix socket's: model routes only, what boxes reach never serves admin
        try:
            await runner.setup()
            site = web.TCPSite(runner, pc.host, pc.port)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # the real port when pc.port == 0
            host = f"[{pc.host}]" if ":" in pc.host else pc.host
            state.base_url = f"http://{host}:{port}"
            if pc.unix_socket:  # bound in a thread: creating the socket file is blocking file I/O
                sock = await asyncio.to_thread(_bind_unix, pc.unix_socket)
                box_runner = web.AppRunner(make_app(state, admin=False), handle_signals=False, access_log=None)
                await box_runner.setup()
                await web.SockSite(box_runner, sock).start()
            yield Proxy(state, state.base_url, pc.unix_socket)
        finally:
            # shielded, with a deadline: a block cancelled from outside (an anyio scope cancels
            # again at every await) still closes its listeners and writes what is queued
            with anyio.CancelScope(shield=True), anyio.move_on_after(TEARDOWN_TIMEOUT_S):
                if box_runner is not None:
                    await box_runner.cleanup()
                await runner.cleanup()
                recorder.close()
                await asyncio.wait([recording])
                await asyncio.to_thread(render_pool.shutdown)
