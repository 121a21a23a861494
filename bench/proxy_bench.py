"""Proxy overhead: added latency and throughput of the capture proxy over direct engine calls.

A fixed-latency fake engine (the scripted engine with `delay_s`) sits behind (a) the proxy, run
in its own process as in production, driven over HTTP by simulated harness sessions, and (b)
nothing: the same engine called directly with the same prompt token ids (the ids the proxy
recorded for a session of the same shape). Sessions look like real harness runs: a first prompt
of ~20k tokens (system prompt with tool schemas and a long task), then turns that each add the
model's tool call, a tool result and get a short answer. Concurrency = sessions in flight.

Prints one row per (concurrency, mode): p50/p99 latency through the proxy and direct, the added
latency, requests/s both ways and their ratio, and CPU ms per request of the proxy process (all
its threads), of the floor server (`floor`, below) and of this load-generating client. `floor +p50`
is the added p50 of a do-nothing aiohttp server with the proxy's routes, request bodies and
reply bytes, driven by the same client: what HTTP and the load generator cost on this machine
before the proxy does any work (the part of `added` no proxy change can remove). Correctness beside timing: every call after a
session's first must be an exact-history extension. Last line:
RESULT added_p50_ms=X added_p99_ms=Y rps_ratio=Z floor_added_p50_ms=F [cpu_of_engine=C
rps_per_core_vs_litellm=L]   (X, Y, F at concurrency 64 streaming; Z = proxy requests/s / direct
requests/s at concurrency 256, streaming; C, L below).

`--engine vllm` puts production's engine client in the proxy: the proxy's `VllmEngine` talks HTTP
to a fake `vllm serve` (own process, on the client's cores, as a GPU server has its own) that
answers `/inference/v1/generate` as vLLM 0.32 does; direct calls post the same request bodies,
made before timing. The added latency then includes sending each prompt as JSON. (No floor
run then: it has no engine hop to compare with.)

    .venv/bin/python bench/proxy_bench.py [--quick] [--engine scripted|vllm] [--render-threads N] [--profile FILE]

`--litellm BIN` (the `litellm` CLI of an environment that has `litellm[proxy]`, e.g. one made by
`uv venv .venv-litellm && uv pip install -p .venv-litellm/bin/python 'litellm[proxy]'`; never a
project dependency) adds LiteLLM's proxy, configured for throughput as its docs advise (no DB, so
no spend tracking; spend and error logs off; logging at ERROR; the local model cost map), on
127.0.0.1 in front of the same fake engine process: that process serves both the token-id route
polar_fast's proxy sends (`/inference/v1/generate`) and the chat route LiteLLM forwards
(`/v1/chat/completions`), with the same latency and reply. It implies `--engine vllm`. Each
(concurrency, mode) then runs polar_fast, LiteLLM and direct calls back to back with the same
sessions; `cpu ms/req` of each proxy process gives requests/s per core (1000 / cpu ms).
RESULT adds rps_per_core_vs_litellm (polar_fast's requests/s per core over LiteLLM's, at the
RESULT row) and cpu_of_engine (polar_fast's CPU per call over the mean engine time per call).

`--realistic`: a real agent call takes seconds of generation, so the fake engine draws each call's
latency from a long-tailed log-normal (median 2 s, sigma 1, capped at 60 s; seeded) and 64-512
sessions run at once (`--concurrency` to change); RESULT reads the highest concurrency. The
proxy, direct and LiteLLM runs draw different latencies there, so read its CPU columns, not the
latency differences. The 20 ms fixed-latency default stays as the stress run.

`--profile` writes a cProfile of the proxy process (event-loop thread); for worker threads use
a sampling profiler on the `--serve` child (py-spy --threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
import uvloop

TOOL_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la src/"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name}: " + "Runs a command in the repository and returns its output. " * 8,
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command line " * 4}},
                "required": ["command"],
            },
        },
    }
    for name in ["bash", "read_file", "write_file", "search", "list_dir", "apply_patch", "run_tests", "git"]
]


def first_messages(session: int, prompt_tokens: int) -> list[dict]:
    # ~80% shared by every session of a run (system prompt, as harnesses send), ~20% its own task.
    system = " ".join(f"Rule {i}: keep edits minimal and run the tests." for i in range(prompt_tokens * 4 // 5 // 11))
    task = f"Task {session}: " + " ".join(f"line{i % 997} of the failing traceback" for i in range(prompt_tokens // 5 // 7))
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


def tool_result(session: int, turn: int) -> str:
    # Each session's own output (no cache can serve it from another session), ~700 tokens.
    return "\n".join(f"-rw-r--r-- 1 user user {1000 + i * session % 9973} Jan {turn} s{session}_file_{i}.py" for i in range(25))


# ----------------------------------------------------------------------------- the proxy process


class _Discard(list):
    """The scripted engine keeps every prompt for tests; here that would only grow memory (and
    the garbage collector's work) on both sides of the comparison."""

    def append(self, item: object) -> None:
        pass


def serve(port_file: str, delay_s: float, profile: str = "", render_threads: int = 1, vllm_url: str = "") -> None:
    from polar_fast.config import parse_config
    from polar_fast.engines.scripted import ScriptedEngine
    from polar_fast.engines.vllm import VllmEngine
    from polar_fast.model import load_tokenizer
    from polar_fast.proxy import open_proxy
    from polar_fast.records import RecordLog

    async def main() -> None:
        cfg = parse_config({"engine": {"kind": "scripted"}, "model": {"max_context_tokens": 1 << 20}, "proxy": {"history_max_calls": 4, "render_threads": render_threads}})
        tok = load_tokenizer("")
        if vllm_url:  # production's engine client, against the fake `vllm serve` (serve_vllm)
            engine = VllmEngine(vllm_url, model="m", timeout_s=600)  # --realistic draws up to 60 s
        else:
            engine = ScriptedEngine([TOOL_CALL], tok, delay_s=delay_s, cycle=True)
            engine.prompts = _Discard()
        log = RecordLog(Path(port_file).with_suffix(".log"))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with open_proxy(cfg, engine, log) as proxy:
            Path(port_file).write_text(proxy.base_url)
            await stop.wait()

    if not profile:
        return uvloop.run(main())
    import cProfile

    with cProfile.Profile() as prof:
        uvloop.run(main())
    prof.dump_stats(profile)


def _chat_replies() -> dict[bool, bytes]:
    """The chat-completions reply bytes (json, sse) for the scripted tool call."""
    from polar_fast.capture.dialects import ReplyMeta
    from polar_fast.capture.dialects import chat_completions as chat
    from polar_fast.conversation import Completion, ToolCall

    call = ToolCall(id="call_0", name="bash", arguments='{"command": "ls -la src/"}')
    completion = Completion(tool_calls=(call,), finish_reason="tool_calls", prompt_tokens=20000, completion_tokens=30)
    meta = ReplyMeta(id="0", created=0, model="m")
    return {False: chat.reply(completion, meta), True: b"".join(chat.stream(completion, meta, include_usage=False))}


REALISTIC = (2.0, 1.0, 60.0)  # log-normal engine latency: median s, sigma, cap s


def _latency(delay_s: float, realistic: bool):
    """Engine latency per call: fixed, or drawn (seeded) from the long-tailed log-normal."""
    if not realistic:
        return lambda: delay_s
    import random

    rng, (median, sigma, cap) = random.Random(0), REALISTIC
    return lambda: min(cap, median * math.exp(sigma * rng.gauss(0, 1)))


def serve_floor(port_file: str, delay_s: float) -> None:
    """The HTTP floor: an aiohttp server with the proxy's routes that reads each request body,
    waits the engine's latency and answers with the reply bytes the proxy would send, doing
    nothing else. The same client against it shows what HTTP and the load generator alone add
    on this machine, apart from the proxy's own work."""
    from aiohttp import web

    replies = _chat_replies()

    async def session(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"token": "t"})

    async def complete(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        await asyncio.sleep(delay_s)
        stream = bool(body.get("stream"))
        return web.Response(body=replies[stream], content_type="text/event-stream" if stream else "application/json")

    _serve_routes(port_file, {"/sessions": session, "/s/{token}/v1/chat/completions": complete})


def _serve_routes(port_file: str, routes: dict) -> None:
    """An aiohttp server of POST routes on 127.0.0.1 until SIGTERM; its URL goes to `port_file`."""
    from aiohttp import web

    async def main() -> None:
        app = web.Application(client_max_size=1 << 26)
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        Path(port_file).write_text(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        await stop.wait()
        await runner.cleanup()

    uvloop.run(main())


def serve_vllm(port_file: str, delay_s: float, realistic: bool = False) -> None:
    """A fake `vllm serve` for `--engine vllm`: POST /inference/v1/generate waits the engine's
    latency and answers as vLLM 0.32 does in `output_mode: "tokens"` (the sampled ids, their
    logprobs, the weight version span); the prompt is found, not decoded: a GPU server does that
    work on its own CPUs, not on this machine's. POST /v1/chat/completions (what LiteLLM
    forwards) waits the same latency and answers the same tool call as chat json or SSE."""
    from aiohttp import web

    from polar_fast.model import load_tokenizer
    from polar_fast.wire import json_value_span

    tok = load_tokenizer("")
    ids = list(tok.encode(TOOL_CALL)) + [tok.eos_token_id]
    reply = msgspec.json.encode({"request_id": "r", "choices": [{
        "index": 0, "token_ids": ids, "finish_reason": "stop",
        "logprobs": {"content": [{"token_id": i, "logprob": -0.01} for i in ids]},
        "weight_versions": [{"version": "0", "start": 0, "end": len(ids)}]}]})

    latency = _latency(delay_s, realistic)
    chat_replies = _chat_replies()

    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        assert json_value_span(body, "token_ids") is not None, body[:200]
        await asyncio.sleep(latency())
        return web.Response(body=reply, content_type="application/json")

    async def chat(request: web.Request) -> web.Response:
        stream = bool(msgspec.json.decode(await request.read()).get("stream"))
        await asyncio.sleep(latency())
        return web.Response(body=chat_replies[stream], content_type="text/event-stream" if stream else "application/json")

    _serve_routes(port_file, {"/inference/v1/generate": generate, "/v1/chat/completions": chat})


# ----------------------------------------------------------------------------- load


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Connection:
    """One keep-alive HTTP/1.1 connection with just enough client to POST a body and read a
    Content-Length reply (the proxy sends every reply, SSE too, in one piece). The load
    generator shares this machine's cores with the proxy: aiohttp's client costs ~3x more CPU per
    request, which would show up as proxy latency."""

    def __init__(self, root: str, key: str = "") -> None:
        host, port = root.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.auth = f"Authorization: Bearer {key}\r\n" if key else ""

    async def __aenter__(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def post(self, path: str, data: bytes) -> tuple[int, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.auth}Content-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n")
        self.writer.writelines((head.encode(), data))
        reply = await self.reader.readuntil(b"\r\n\r\n")
        status = int(reply[9:12])
        lines = reply.lower().split(b"\r\n")
        length = next((int(line[15:]) for line in lines if line.startswith(b"content-length:")), None)
        if length is None and b"transfer-encoding: chunked" in lines:  # LiteLLM's SSE
            return status, await self._chunked()
        assert length is not None, f"reply without Content-Length: {reply[:300]!r}"
        return status, await self.reader.readexactly(length)

    async def _chunked(self) -> bytes:
        parts = []
        while True:
            n = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await self.reader.readexactly(n + 2))
            if n == 0:
                return b"".join(parts)


async def proxy_session(http, root: str, i: int, args, stream: bool, latencies: list[float]) -> str:
    async with http.post(root + "/sessions", json={"rollout_id": f"r{i}"}) as r:
        token = (await r.json())["token"]
    messages = first_messages(i, args.prompt_tokens)
    async with Connection(root) as conn:
        for turn in range(args.turns):
            messages = await _turn(conn, f"/s/{token}/v1/chat/completions", messages, i, turn, stream, latencies)
    return token


async def _turn(conn: Connection, path: str, messages: list[dict], i: int, turn: int, stream: bool, latencies: list[float]) -> list[dict]:
    """One model call of session `i`; returns the conversation the harness sends next."""
    data = msgspec.json.encode({"model": "m", "messages": messages, "tools": TOOLS, "stream": stream, "max_tokens": 64})
    t0 = time.perf_counter()
    status, payload = await conn.post(path, data)
    latencies.append(time.perf_counter() - t0)
    assert status == 200, payload[:300]
    call_id = f"call_{i}_{turn}"
    args_text = json.dumps({"command": "ls -la src/"})
    return messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "bash", "arguments": args_text}}]},
        {"role": "tool", "tool_call_id": call_id, "content": tool_result(i, turn)},
    ]


async def run_floor(root: str, args, concurrency: int, stream: bool) -> tuple[list[float], float]:
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(proxy_session(http, root, i, args, stream, latencies) for i in range(concurrency)))
        return latencies, len(latencies) / (time.perf_counter() - t0)


async def run_proxy(root: str, args, concurrency: int, stream: bool) -> tuple[list[float], float, list[list[int]]]:
    latencies: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(proxy_session(http, root, i, args, stream, latencies) for i in range(concurrency)))
        wall = time.perf_counter() - t0
        async with http.get(f"{root}/sessions/{tokens[0]}/records") as r:
            records = msgspec.json.decode(await r.read())
        for token in tokens:
            async with http.delete(f"{root}/sessions/{token}") as r:
                await r.read()
    histories = [c["history"] for c in records]
    assert histories == ["render:first_call"] + ["exact"] * (args.turns - 1), histories
    for a, b in zip(records, records[1:]):
        joined = a["prompt_ids"] + a["completion_ids"]
        assert b["prompt_ids"][: len(joined)] == joined
    return latencies, len(latencies) / wall, [c["prompt_ids"] for c in records]


async def run_litellm(root: str, args, concurrency: int, stream: bool) -> tuple[list[float], float]:
    """The same sessions (bodies, turns, concurrency) through LiteLLM's chat route."""
    latencies: list[float] = []

    async def session(i: int) -> None:
        messages = first_messages(i, args.prompt_tokens)
        async with Connection(root, args.litellm_key) as conn:
            for turn in range(args.turns):
                messages = await _turn(conn, "/v1/chat/completions", messages, i, turn, stream, latencies)

    t0 = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(concurrency)))
    return latencies, len(latencies) / (time.perf_counter() - t0)


async def run_direct(engine, prompts: list[list[int]], concurrency: int, vllm_url: str = "") -> tuple[list[float], float]:
    """The engine alone: in-process (scripted), or over HTTP with request bodies made before
    timing (`--engine vllm`: what vLLM's latency would be to a client that costs nothing)."""
    from polar_fast.engines import Sampling

    latencies: list[float] = []
    sampling = Sampling(max_tokens=64)
    bodies = [
        msgspec.json.encode({"model": "m", "token_ids": ids, "sampling_params": {"max_tokens": 64, "logprobs": 0},
                             "output_mode": "tokens"}) for ids in prompts
    ] if vllm_url else []

    async def session() -> None:
        if not vllm_url:
            for ids in prompts:
                t0 = time.perf_counter()
                await engine.generate(ids, sampling)
                latencies.append(time.perf_counter() - t0)
            return
        async with Connection(vllm_url) as conn:
            for body in bodies:
                t0 = time.perf_counter()
                status, _ = await conn.post("/inference/v1/generate", body)
                latencies.append(time.perf_counter() - t0)
                assert status == 200

    t0 = time.perf_counter()
    await asyncio.gather(*(session() for _ in range(concurrency)))
    return latencies, len(latencies) / (time.perf_counter() - t0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """cpu_s of a process and its live descendants (a server that forks workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_s(p)
        except OSError:
            continue
        todo.extend(children.get(p, ()))
    return total


async def bench(root: str, floor_root: str, args, server_pid: int, floor_pid: int) -> None:
    from polar_fast.engines.scripted import ScriptedEngine

    engine = ScriptedEngine([[1] * 30], delay_s=args.delay_ms / 1000, cycle=True)
    engine.prompts = _Discard()
    kind = "fake vLLM server over HTTP (the vllm engine client in the proxy)" if args.vllm_url else "in-process scripted engine"
    latency = (f"log-normal, median {REALISTIC[0]} s, sigma {REALISTIC[1]}, cap {REALISTIC[2]} s" if args.realistic
               else f"{args.delay_ms} ms")
    print(f"engine: {kind}, latency {latency}; first prompt ~{args.prompt_tokens} tokens, {args.turns} turns/session")
    header = (
        f"{'conc':>5} {'mode':>5} {'n':>5} {'proxy p50':>10} {'p99':>8} {'direct p50':>11} {'p99':>7} {'added p50':>10}"
        f" {'p99':>8} {'floor +p50':>11} {'proxy rps':>10} {'direct rps':>11} {'ratio':>6} {'cpu ms/req':>10} {'floor':>6} {'client':>7}"
        f" {'cpu/engine':>10}"
    )
    print(header)
    ms = lambda x: x * 1000  # noqa: E731
    results, litellm_rows = {}, []
    for concurrency in args.concurrency:
        # --quick keeps what RESULT reads (streaming) beyond concurrency 1, to stay under 30 s.
        for stream in (False, True) if not args.quick or concurrency == 1 else (True,):
            cpu0, client0 = cpu_s(server_pid), time.process_time()
            lat_p, rps_p, prompts = await run_proxy(root, args, concurrency, stream)
            cpu_ms = (cpu_s(server_pid) - cpu0) * 1000 / len(lat_p)
            client_ms = (time.process_time() - client0) * 1000 / len(lat_p)
            lat_d, rps_d = await run_direct(engine, prompts, concurrency, args.vllm_url)
            engine_ms = ms(sum(lat_d) / len(lat_d))  # the engine's own time per call, measured
            added50 = ms(percentile(lat_p, 0.5) - percentile(lat_d, 0.5))
            added99 = ms(percentile(lat_p, 0.99) - percentile(lat_d, 0.99))
            floor50 = floor_cpu_ms = math.nan  # --engine vllm: the direct calls have an HTTP hop the floor lacks
            if floor_root:
                floor0 = cpu_s(floor_pid)
                lat_f, _ = await run_floor(floor_root, args, concurrency, stream)
                floor_cpu_ms = (cpu_s(floor_pid) - floor0) * 1000 / len(lat_f)
                floor50 = ms(percentile(lat_f, 0.5) - percentile(lat_d, 0.5))
            mode = "sse" if stream else "json"
            litellm_cpu_ms = math.nan
            if args.litellm_root:
                lit0 = tree_cpu_s(args.litellm_pid)
                lat_l, rps_l = await run_litellm(args.litellm_root, args, concurrency, stream)
                litellm_cpu_ms = (tree_cpu_s(args.litellm_pid) - lit0) * 1000 / len(lat_l)
                litellm_rows.append((concurrency, mode, len(lat_l), ms(percentile(lat_l, .5)), ms(percentile(lat_l, .99)),
                                     ms(percentile(lat_l, .5) - percentile(lat_d, .5)), rps_l, litellm_cpu_ms,
                                     litellm_cpu_ms / engine_ms, cpu_ms))
                print(f"  (LiteLLM at {concurrency} {mode}: {litellm_cpu_ms:.2f} cpu ms/req, table below)", flush=True)
            results[(concurrency, mode)] = (added50, added99, rps_p / rps_d, floor50, cpu_ms / engine_ms,
                                            litellm_cpu_ms / cpu_ms)
            print(
                f"{concurrency:>5} {mode:>5} {len(lat_p):>5} {ms(percentile(lat_p, .5)):>10.2f} {ms(percentile(lat_p, .99)):>8.2f}"
                f" {ms(percentile(lat_d, .5)):>11.2f} {ms(percentile(lat_d, .99)):>7.2f} {added50:>10.2f} {added99:>8.2f}"
                f" {floor50:>11.2f} {rps_p:>10.1f} {rps_d:>11.1f} {rps_p / rps_d:>6.3f} {cpu_ms:>10.2f} {floor_cpu_ms:>6.2f} {client_ms:>7.2f}"
                f" {cpu_ms / engine_ms:>10.5f}",
                flush=True,
            )
    if floor_root:
        print("floor +p50: added p50 of a do-nothing aiohttp server with the same routes, bodies and replies (HTTP + this client alone)")
    print("cpu/engine: the proxy's CPU per call over the engine's own time per call (direct calls' mean latency)")
    if litellm_rows:
        print("\nLiteLLM proxy, same fake engine process, sessions and concurrency, run right after polar_fast's row")
        print(f"{'conc':>5} {'mode':>5} {'n':>5} {'p50':>10} {'p99':>8} {'added p50':>10} {'rps':>8} {'cpu ms/req':>10}"
              f" {'cpu/engine':>10} {'rps/core':>9} {'polar_fast rps/core':>20} {'ratio':>6}")
        for conc, mode, n, p50, p99, added, rps, lit_ms, frac, polar_ms in litellm_rows:
            print(f"{conc:>5} {mode:>5} {n:>5} {p50:>10.2f} {p99:>8.2f} {added:>10.2f} {rps:>8.1f} {lit_ms:>10.2f}"
                  f" {frac:>10.5f} {1000 / lit_ms:>9.1f} {1000 / polar_ms:>20.1f} {lit_ms / polar_ms:>6.2f}")
    mid = results.get((64, "sse")) or next(iter(results.values()))
    top = results.get((256, "sse")) or list(results.values())[-1]
    if args.realistic:
        mid = top = list(results.values())[-1]
    line = (f"RESULT added_p50_ms={mid[0]:.3f} added_p99_ms={mid[1]:.3f} rps_ratio={top[2]:.3f} "
            f"floor_added_p50_ms={mid[3]:.3f} cpu_of_engine={mid[4]:.5f}")
    if args.litellm_root:
        line += f" rps_per_core_vs_litellm={mid[5]:.2f}"
    print(line)


def _start_litellm(tmp: str, binary: str, engine_url: str, key: str) -> tuple[subprocess.Popen, str]:
    """LiteLLM's proxy on 127.0.0.1, configured for throughput, in front of the fake engine; `key`
    is its master key (a fresh random one per run: LiteLLM refuses to start without one)."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = os.path.join(tmp, "litellm.yaml")
    Path(config).write_text(
        "model_list:\n"
        "  - model_name: m\n"
        "    litellm_params:\n"
        "      model: openai/m\n"
        f"      api_base: {engine_url}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  set_verbose: false\n"
        "  request_timeout: 600\n"
        "general_settings:\n"
        "  disable_spend_logs: true\n"
        "  disable_error_logs: true\n"
    )
    env = {**os.environ, "LITELLM_MASTER_KEY": key, "LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    env.pop("DATABASE_URL", None)
    log = open(os.path.join(tmp, "litellm.out"), "wb")
    server = subprocess.Popen([binary, "--config", config, "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        if server.poll() is not None:
            raise SystemExit("LiteLLM exited early:\n" + Path(tmp, "litellm.out").read_text()[-3000:])
        try:
            with urllib.request.urlopen(root + "/health/liveliness", timeout=2):
                return server, root
        except OSError:
            if time.time() > deadline:
                raise SystemExit("LiteLLM did not come up in 180 s")
            time.sleep(0.5)


def _start(tmp: str, name: str, argv: list[str]) -> tuple[subprocess.Popen, str]:
    port_file = os.path.join(tmp, name + ".url")
    server = subprocess.Popen([sys.executable, __file__, *argv, port_file])
    while not os.path.exists(port_file) or not Path(port_file).read_text():
        if server.poll() is not None:
            raise SystemExit(f"{name} process exited early")
        time.sleep(0.1)
    return server, Path(port_file).read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run, under 30 s: 4 turns, streaming only above concurrency 1")
    p.add_argument("--prompt-tokens", type=int, default=20000)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--render-threads", type=int, default=1, help="proxy.render_threads of the proxy process")
    p.add_argument("--profile", default="", help="write a cProfile of the proxy process to this file")
    p.add_argument(
        "--engine", choices=["scripted", "vllm"], default="scripted",
        help="scripted: in-process fake engine; vllm: the proxy's vLLM client against a fake `vllm serve` on the client's cores",
    )
    p.add_argument("--litellm", default="", metavar="BIN", help="the `litellm` CLI: add LiteLLM's proxy beside polar_fast (implies --engine vllm)")
    p.add_argument("--realistic", action="store_true", help="engine latency drawn from a long-tailed log-normal of seconds, 64-512 sessions")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--serve-floor", help=argparse.SUPPRESS)
    p.add_argument("--serve-vllm", help=argparse.SUPPRESS)
    p.add_argument("--vllm-url", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args.serve, args.delay_ms / 1000, args.profile, args.render_threads, args.vllm_url)
    if args.serve_floor:
        return serve_floor(args.serve_floor, args.delay_ms / 1000)
    if args.serve_vllm:
        return serve_vllm(args.serve_vllm, args.delay_ms / 1000, args.realistic)
    if args.quick:
        args.turns, args.prompt_tokens = 4, 20000
    if args.litellm or args.realistic:  # one fake engine process serves both proxies (and draws latencies)
        args.engine = "vllm"
    if args.realistic and args.concurrency == [1, 64, 256]:
        args.concurrency = [64, 256, 512]
    args.litellm_root, args.litellm_pid, args.litellm_key = "", 0, ""
    delay = ["--delay-ms", str(args.delay_ms)] + (["--realistic"] if args.realistic else [])
    # Servers and this client on disjoint cores, so the client's work never preempts the proxy's
    # (the harnesses run in their own sandboxes in production).
    cores = sorted(os.sched_getaffinity(0))
    server_cores, client_cores = (set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])) if len(cores) > 1 else (set(cores), set(cores))
    print(f"cores: servers {sorted(server_cores)}, client {sorted(client_cores)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its servers
    with tempfile.TemporaryDirectory() as tmp:
        servers, engine_side = [], []
        try:
            if args.engine == "vllm":
                fake_vllm, args.vllm_url = _start(tmp, "vllm", [*delay, "--serve-vllm"])
                engine_side.append(fake_vllm)
            if args.litellm:
                import secrets

                args.litellm_key = "sk-" + secrets.token_hex(16)
                litellm, args.litellm_root = _start_litellm(tmp, args.litellm, args.vllm_url, args.litellm_key)
                servers.append(litellm)
                args.litellm_pid = litellm.pid
            proxy, root = _start(tmp, "proxy", [*delay, "--profile", args.profile, "--render-threads", str(args.render_threads), "--vllm-url", args.vllm_url, "--serve"])
            servers.append(proxy)
            floor_root, floor_pid = "", 0
            if args.engine == "scripted":
                floor, floor_root = _start(tmp, "floor", [*delay, "--serve-floor"])
                servers.append(floor)
                floor_pid = floor.pid
            for group, cores_of_group in ((servers, server_cores), (engine_side, client_cores)):
                for server in group:
                    for tid in os.listdir(f"/proc/{server.pid}/task"):  # affinity is per thread
                        os.sched_setaffinity(int(tid), cores_of_group)
            os.sched_setaffinity(0, client_cores)
            uvloop.run(bench(root, floor_root, args, proxy.pid, floor_pid))
        finally:
            for server in servers + engine_side:
                server.terminate()
                server.wait()


if __name__ == "__main__":
    main()
