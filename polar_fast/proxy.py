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
or `x-api-key`); unknown → 401 in the caller's dialect. Handlers stay thin: the session's
incremental parse (capture/dialects/incremental.py: only what the request adds is decoded) →
History.plan + finish (exact-history ids; only a new suffix is rendered and tokenised, long
tokenisations in worker threads) → engine.generate → Renderer.parse → record (awaited on disk)
→ reply or SSE in one send. Every failure is answered in the caller's dialect: bad input 400,
unknown session 401, unknown route 404, body over `proxy.max_body_bytes` 413, engine down 503,
engine timeout 504, other engine failure 502, a call whose record cannot be written 503 (it is
then not part of the session's history either); a 500 means a bug here. Handler cancellation
stays off (aiohttp default), so a client hanging up never tears a record in half.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import ipaddress
import logging
import math
import os
import random
import secrets
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, AsyncIterator, Sequence

import msgspec
from aiohttp import web

from polar_fast.capture.dialects import DialectError, ReplyMeta, anthropic, responses
from polar_fast.capture.dialects import chat_completions as chat
from polar_fast.capture.dialects.incremental import IncrementalParser
from polar_fast.capture.history import History, Prompt
from polar_fast.capture.recorder import Recorder
from polar_fast.capture.render import Renderer, template_message, template_tool
from polar_fast.conversation import Completion, Conversation, Message, ToolCall
from polar_fast.engines import Engine, EngineError, EngineFailed, EngineTimeout, Sampling
from polar_fast.errors import ConfigError, PolarError
from polar_fast.records import (
    CallRecord,
    ExchangeRecord,
    HarnessSampling,
    Record,
    RecordLog,
    Timings,
    decode_frame,
    encode_frame,
    packed_ids,
    whole_calls,
)

if TYPE_CHECKING:
    from polar_fast.config import Config

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    token: str
    session_id: str
    rollout_id: str
    group_id: str
    history: History
    # Its call records as the log frames written for them (prompt deltas, see CallRecord): each is
    # encoded once, and a first call's whole prompt (~1e4 ids) sits in bytes the garbage
    # collector never walks rather than in an int list it would.
    call_frames: list[bytes] = field(default_factory=list)
    # (call index, request messages) of its last exchange on disk: the next one stores a delta
    last_exchange: tuple[int, list[Message]] = (-1, [])
    n_calls: int = 0
    failing_calls: int = 0  # engine or record failures since the last recorded call: the harness gave up on them
    # why calls went wrong, for the zero-reward metrics (records.CALL_CAUSES); counted as they happen
    causes: dict[str, int] = field(default_factory=dict)
    # texts the harness puts in its next request when it rejects a reply's format (Harness.format_error_markers)
    format_error_markers: tuple[str, ...] = ()
    # per dialect: decodes only what a request adds to the conversation it resends
    parsers: dict[str, IncrementalParser] = field(default_factory=dict)

    def parse(self, dialect: ModuleType, body: bytes) -> Conversation:
        parser = self.parsers.get(dialect.NAME)
        if parser is None:
            parser = self.parsers[dialect.NAME] = IncrementalParser(dialect)
        return parser.parse(body)

    @property
    def engine_failures(self) -> int:  # calls the engine could not answer: an infra failure, not the agent's
        return self.causes.get("engine_failure", 0)

    @property
    def record_failures(self) -> int:  # calls answered but not recorded (disk full): also infra
        return self.causes.get("record_failure", 0)

    def count(self, cause: str) -> None:
        self.causes[cause] = self.causes.get(cause, 0) + 1

    def records(self) -> list[CallRecord]:
        """Its call records, each with its whole prompt."""
        return whole_calls(decode_frame(f) for f in self.call_frames)[0]  # type: ignore[misc]


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
                    format_error_markers: tuple[str, ...] = ()) -> Session:
        token = "pf-" + secrets.token_hex(16)
        session_id = secrets.token_hex(8)
        history = History(self.renderer, self.cfg.proxy.history, max_calls=self.cfg.proxy.history_max_calls)
        session = Session(token, session_id, rollout_id or session_id, group_id, history,
                          format_error_markers=format_error_markers)
        self.sessions[token] = session
        return session


STATE = web.AppKey("state", ProxyState)


# ----------------------------------------------------------------------------- errors


def _dialect_of(request: web.Request) -> ModuleType:
    path = request.path
    if "/messages" in path:
        return anthropic
    if "/responses" in path:
        return responses
    return anthropic if "anthropic-version" in request.headers else chat


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


def call_seed(run_seed: int, rollout_id: str, call_index: int) -> int:
    """The seed of one call of a seeded run: the rollouts of a group (same prompt) must not sample
    alike, and a rerun of the run must sample the same, so it derives from stable ids."""
    digest = hashlib.blake2b(f"{run_seed}:{rollout_id}:{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: every engine takes it


def _sampling(state: ProxyState, conv: Conversation, prompt_len: int, session: Session | None = None) -> Sampling:
    s = state.cfg.sampling
    temperature, top_p = s.temperature, s.top_p  # the run's sampling (config.SamplingConfig)
    if s.from_harness:
        temperature = s.temperature if conv.temperature is None else conv.temperature
        top_p = s.top_p if conv.top_p is None else conv.top_p
    if not (math.isfinite(temperature) and 0 <= temperature <= 100):
        raise DialectError(f"temperature must be a number in [0, 100], got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise DialectError(f"top_p must be in (0, 1], got {top_p}")
    if conv.max_tokens is not None and conv.max_tokens < 1:
        raise DialectError(f"max_tokens must be at least 1, got {conv.max_tokens}")
    context = state.cfg.model.max_context_tokens
    if prompt_len >= context:
        # Anthropic's wording first (Claude Code compacts and retries on it), then OpenAI's (Pi
        # matches "maximum context length is N tokens"; Qwen Code also reads the error code).
        raise DialectError(
            f"prompt is too long: {prompt_len} tokens > {context} maximum (this model's maximum "
            f"context length is {context} tokens)",
            kind="context_length",
        )
    max_tokens = min(conv.max_tokens or s.max_tokens, s.max_tokens, context - prompt_len)
    seed = conv.seed if conv.seed is not None else s.seed
    if conv.seed is None and s.seed is not None and session is not None:
        seed = call_seed(s.seed, session.rollout_id, session.n_calls)
    return Sampling(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)


# Reply and tool-call ids only need to be unique, not secret: a seeded PRNG instead of
# os.urandom per id (a syscall each, slow on some VMs). Session tokens stay `secrets`.
_ids = random.Random(secrets.randbits(128))
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _count_format_errors(session: Session, conv: Conversation) -> None:
    """A harness that rejects a reply says so in the messages it adds after that reply."""
    if not session.format_error_markers or not session.n_calls:
        return
    # what this request adds after the previous one (some harnesses drop the rejected reply)
    new = conv.messages[len(session.last_exchange[1]):]
    if any(marker in (m.content or "") for m in new if m.role != "assistant" for marker in session.format_error_markers):
        session.count("format_error")


def _count_reply_causes(session: Session, conv: Conversation, content: str, calls, finish_reason: str) -> None:
    if finish_reason == "length":
        session.count("truncated")
    if conv.tools and not calls:
        # the parsers hand malformed calls back whole as content
        session.count("tool_parse_failure" if "<tool_call>" in content else "no_tool_call")


def _reply_id() -> str:
    return f"{_ids.getrandbits(96):024x}"


def _call_id(dialect: ModuleType) -> str:
    prefix = {"anthropic": "toolu_", "responses": "call_"}.get(dialect.NAME, "call_")
    return prefix + _reply_id()


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


async def _generate(state: ProxyState, session: Session, prompt_ids: Sequence[int], sampling: Sampling):
    try:
        return await _engine_generate(state, session, prompt_ids, sampling)
    except EngineError:
        _engine_failed(session)
        raise


def _engine_failed(session: Session) -> None:
    session.failing_calls += 1
    session.count("engine_failure")


async def _engine_generate(state: ProxyState, session: Session, prompt_ids: Sequence[int], sampling: Sampling):
    version = state.engine.policy_version
    try:
        async with asyncio.timeout(state.cfg.engine.timeout_s):
            gen = await state.engine.generate(prompt_ids, sampling, session_id=session.session_id)
    except TimeoutError:
        raise EngineTimeout(f"no generation within {state.cfg.engine.timeout_s} s") from None
    except EngineError:
        raise
    except Exception as e:  # an engine bug is still an engine failure, not a proxy one
        raise EngineFailed(f"{type(e).__name__}: {e}") from e
    if gen.finish_reason == "abort":
        raise EngineFailed("generation was aborted")
    if len(gen.token_ids) != len(gen.logprobs):
        raise EngineFailed(f"{len(gen.token_ids)} token ids but {len(gen.logprobs)} logprobs")
    return gen, gen.policy_version if gen.policy_version is not None else version


async def _complete(request: web.Request, dialect: ModuleType) -> web.StreamResponse:
    state = request.app[STATE]
    state.calls_in_flight += 1
    try:
        return await _answer(request, dialect, state)
    finally:
        state.calls_in_flight -= 1


async def _answer(request: web.Request, dialect: ModuleType, state: ProxyState) -> web.StreamResponse:
    started_at, t0 = time.time(), time.perf_counter()
    session = _session(request)
    conv = session.parse(dialect, await _body(request))
    _count_format_errors(session, conv)
    if state.cfg.engine.render == "engine":
        prompt_ids, gen, version, completion, history = await _complete_in_engine(state, session, conv, dialect)
        temperature = _sampling(state, conv, 0).temperature
        prompt, extends_call, n_extended = None, -1, 0  # vLLM's own template: no exact history here
        t1 = t2 = time.perf_counter()
    else:
        prompt = await _prompt(state, session.history, conv)
        try:
            sampling = _sampling(state, conv, len(prompt.ids), session)
        except DialectError as e:
            if e.kind == "context_length":
                session.count("context_length")
            raise
        temperature = sampling.temperature
        t1 = time.perf_counter()
        gen, version = await _generate(state, session, prompt.ids, sampling)
        t2 = time.perf_counter()
        content, reasoning, calls = state.renderer.parse(gen.token_ids, conv.tools, lambda: _call_id(dialect))
        finish = "tool_calls" if calls else gen.finish_reason
        _count_reply_causes(session, conv, content, calls, gen.finish_reason)
        completion = Completion(
            content=content,
            reasoning=reasoning,
            tool_calls=calls,
            finish_reason=finish,
            prompt_tokens=len(prompt.ids),
            completion_tokens=len(gen.token_ids),
        )
        prompt_ids, history = prompt.ids, prompt.history
        extends_call, n_extended = prompt.extends_call, prompt.n_extended
    record = CallRecord(
        session_id=session.session_id,
        rollout_id=session.rollout_id,
        group_id=session.group_id,
        call_index=session.n_calls,
        prompt_ids=packed_ids(prompt_ids[n_extended:]),  # only the new ids (see CallRecord), encoded
        completion_ids=gen.token_ids,
        completion_logprobs=gen.logprobs,
        policy_version=version,
        finish_reason=completion.finish_reason,
        dialect=dialect.NAME,
        timings=Timings(started_at=started_at, render_s=t1 - t0, engine_s=t2 - t1, total_s=time.perf_counter() - t0),
        history=history,
        prefix_call=extends_call,
        n_prefix=n_extended,
        version_changes=gen.version_changes,
        temperature=temperature,
        harness_sampling=HarnessSampling(temperature=conv.temperature, top_p=conv.top_p, max_tokens=conv.max_tokens),
    )
    session.n_calls += 1  # before the await: concurrent calls of a session (sub-agents) get distinct indices
    reply_message = completion.as_message()
    exchange = _exchange(state, session, record.call_index, conv, reply_message, dialect)
    # Both in one write of the writer (the exchange feeds SFT export).
    call_frame = encode_frame(record)
    try:
        await state.recorder.put(call_frame, exchange)
    except Exception as e:
        # the harness never sees this reply; its retry is a new call (this index stays unused)
        session.failing_calls += 1
        session.count("record_failure")
        raise RecordFailed(f"the call could not be recorded ({type(e).__name__}: {e}); no reply goes out without its record, retry") from e
    session.failing_calls = 0  # the harness got past any failure before this call
    # Only a call on disk becomes a base: later records store their prompts as deltas from it.
    session.call_frames.append(call_frame)
    session.last_exchange = (record.call_index, conv.messages)
    if prompt is not None:
        session.history.remember(prompt, gen.token_ids, reply_message, call_index=record.call_index)
    meta = ReplyMeta(id=_reply_id(), created=int(started_at), model=conv.model or state.cfg.model.name)
    if not conv.stream:
        return web.Response(body=dialect.reply(completion, meta), content_type="application/json")
    # The whole completion is known: the SSE frames go out with the headers in one send, with a
    # Content-Length, and the client's SSE parser splits them into events.
    body = b"".join(dialect.stream(completion, meta, include_usage=conv.include_usage))
    return web.Response(body=body, headers=_SSE_HEADERS)


def _exchange(
    state: ProxyState, session: Session, call_index: int, conv: Conversation, reply: Message, dialect: ModuleType
) -> ExchangeRecord:
    """The call's exchange record, holding only the messages its request added to the session's
    last recorded one (see ExchangeRecord)."""
    prefix_call, previous = session.last_exchange
    messages = conv.messages
    n = 0
    while n < len(messages) and n < len(previous) and (messages[n] is previous[n] or messages[n] == previous[n]):
        n += 1
    return ExchangeRecord(
        session_id=session.session_id, rollout_id=session.rollout_id, group_id=session.group_id,
        call_index=call_index, model=state.cfg.model.name, dialect=dialect.NAME,
        messages=messages[n:] if n else messages, tools=conv.tools, reply=reply,
        prefix_call=prefix_call if n else -1, n_prefix=n,
    )


async def _complete_in_engine(state: ProxyState, session: Session, conv: Conversation, dialect: ModuleType):
    """`render = "engine"`: vLLM renders and parses; we only translate and record."""
    chat_fn = getattr(state.engine, "chat", None)
    if chat_fn is None:
        raise ConfigError('engine.render = "engine" needs the vllm engine')
    sampling = _sampling(state, conv, 0, session)
    version = state.engine.policy_version
    messages = [template_message(m, parse_arguments=False) for m in conv.messages]
    try:
        async with asyncio.timeout(state.cfg.engine.timeout_s):
            reply = await chat_fn(messages, [template_tool(t) for t in conv.tools], sampling, session_id=session.session_id)
    except TimeoutError:
        _engine_failed(session)
        raise EngineTimeout(f"no generation within {state.cfg.engine.timeout_s} s") from None
    except EngineError:
        _engine_failed(session)
        raise
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
    return reply.prompt_ids, reply.generation, version, completion, "render:engine"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat)


async def responses_create(request: web.Request) -> web.StreamResponse:
    return await _complete(request, responses)


async def messages_create(request: web.Request) -> web.StreamResponse:
    return await _complete(request, anthropic)


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
                    format_error_markers: tuple[str, ...] = ()) -> Session:
        return self.state.new_session(rollout_id, group_id, format_error_markers=format_error_markers)

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
        tg.create_task(recorder.run())
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
            if box_runner is not None:
                await box_runner.cleanup()
            await runner.cleanup()
            recorder.close()
            await asyncio.to_thread(render_pool.shutdown)
