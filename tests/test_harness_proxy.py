"""The five real harness CLIs against the real capture proxy, end to end on this host.

Each CLI runs through its adapter's command (private HOME, bounded time, process group killed)
against `scripted_proxy`: a real proxy whose scripted engine's replies are texts tokenised by the
real SmolLM2 tokenizer, rendered and parsed by the proxy (hermes `<tool_call>` blocks) and
translated into the harness's dialect. The scripted model takes three steps, picked by how many
tool results its prompt holds, so side calls a CLI makes get an answer too:

1. reasoning, a sentence, and a call of the harness's own file-writing tool (its real name and
   argument schema, as the CLI's first request offers it; SmolLM2's list form of the block);
2. two parallel calls of its shell tool, one printing the file back with a marker;
3. a final answer (mini-swe-agent ends only through its bash tool printing the submit marker).
Claude Code first calls ToolSearch for a tool it sends with `defer_loading`: the result comes back
as a `tool_reference` block, which the proxy expands into that tool's definition.

We assert the CLI exited 0, the file holds the (non-ASCII) content, the shell output came back
to the model as a tool result, every call the CLI made was answered (no 4xx/5xx) in the mode
under test, and the session's records chain token-exactly: each main-loop call's prompt starts
with the previous call's prompt ids + sampled ids.

Modes: Codex (Responses), Qwen Code and Pi (Chat Completions) always stream; mini-swe-agent
(litellm) never streams; Claude Code streams and, when a streaming request gets a 404, retries it
non-streaming, which a loopback front provokes so the real client parses our non-streaming
Messages reply. The modes a harness cannot use are skips that name the fact.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from harness_run import run_on_host

from polar_fast.engines import Generation, Sampling
from polar_fast.model import load_tokenizer
from polar_fast.records import CallRecord
from polar_fast.rollouts.harnesses import ModelLimits, get_harness
from polar_fast.testing import scripted_proxy

FILE = "hello.txt"
CONTENT = "hello from polar_fast ✓"
SEEN_MARK = "seen:"  # step 2 prints SEEN_MARK + the file; the final prompt must hold it
MODEL = "smollm2-135m-instruct"
DEFERRED_TOOL = "NotebookEdit"  # a Claude Code tool sent with defer_loading, found by ToolSearch
RUN_TIMEOUT_S = 100.0
# The CLIs' system prompts + tool schemas (up to ~20k tokens) exceed SmolLM2's 8k context; the
# scripted engine has no context limit, so the proxy is told the model takes long prompts.
PROXY_CONFIG = {"model": {"max_context_tokens": 1_000_000}}
LIMITS = ModelLimits(context_tokens=1_000_000, max_output_tokens=1024)  # as PROXY_CONFIG + the sampling default


def hermes(*calls: tuple[str, dict], text: str = "", think: str = "") -> str:
    """A reply in SmolLM2's tool-call format: optional <think>, text, one block with a list."""
    block = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    head = f"<think>\n{think}\n</think>\n" if think else ""
    return f"{head}{text}\n<tool_call>\n{block}\n</tool_call>"


@dataclass(frozen=True)
class Tools:
    """One harness's tools as its CLI offers them: name + arguments builders."""

    write: Callable[[Path, str], tuple[str, dict]]  # (absolute path, content) -> call
    shell: Callable[[str], tuple[str, dict]]  # command -> call


def _shell_tool(name: str, arg: str) -> Callable[[str], tuple[str, dict]]:
    return lambda command: (name, {arg: command})


def _printf(path: Path, content: str) -> str:
    return f"printf '%s' '{content}' > '{path}'"


TOOLS: dict[str, Tools] = {
    "codex": Tools(lambda p, c: ("exec_command", {"cmd": _printf(p, c)}), _shell_tool("exec_command", "cmd")),
    "claude-code": Tools(lambda p, c: ("Write", {"file_path": str(p), "content": c}), _shell_tool("Bash", "command")),
    "qwen-code": Tools(lambda p, c: ("write_file", {"file_path": str(p), "content": c}),
                       _shell_tool("run_shell_command", "command")),
    "pi": Tools(lambda p, c: ("write", {"path": str(p), "content": c}), _shell_tool("bash", "command")),
    "mini-swe-agent": Tools(lambda p, c: ("bash", {"command": _printf(p, c)}), _shell_tool("bash", "command")),
}


def script(name: str, task: Path) -> list[str]:
    tools = TOOLS[name]
    first = hermes(tools.write(task / FILE, CONTENT), text="I'll create the file now.",
                   think="The user wants a file; the write tool makes it.")
    # A command that exits straight after printing: Qwen Code settles its shell call on exit, so
    # without the adapter's BASH_ENV wait this output was now and then lost (seen in CI).
    second = hermes(tools.shell(f"printf '{SEEN_MARK}%s\\n' \"$(cat {FILE})\""), tools.shell("ls -la"),
                    text="Checking it.")
    final = "Done: the file is written."
    if name == "mini-swe-agent":
        final = hermes(tools.shell("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"), text="Submitting.")
    if name == "claude-code":  # load a deferred tool first: its result is a tool_reference block
        return [hermes(("ToolSearch", {"query": f"select:{DEFERRED_TOOL}"})), first, second, final]
    return [first, second, final]


# Modes a harness cannot use, with the fact that says why.
NO_STREAM = {"mini-swe-agent": "mini-swe-agent calls litellm.completion without stream=True: it never streams"}
NO_JSON = {
    "codex": "Codex CLI speaks the Responses API only as an SSE stream (no non-streaming request)",
    "qwen-code": "Qwen Code's agent loop calls generateContentStream: its model calls always stream",
    "pi": "pi-ai's openai-completions provider always sends stream: true",
}


class StepEngine:
    """Scripted engine whose reply is picked by the prompt: reply k once k tool results
    (`<tool_response>`, as the proxy's template renders them) are in it, the last one after."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.policy_version = 0
        self.tokenizer = tokenizer
        self._replies = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in replies]
        self.prompts: list[str] = []  # decoded, for assertions

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        text = await asyncio.to_thread(self.tokenizer.decode, list(prompt_ids))
        self.prompts.append(text)
        # Parallel results of one step share a user turn: count turns, not blocks.
        steps = text.count("<|im_start|>user\n<tool_response>")
        ids = self._replies[min(steps, len(self._replies) - 1)][: sampling.max_tokens]
        return Generation(token_ids=ids, logprobs=[-0.01 * (i + 1) for i in range(len(ids))], finish_reason="stop")

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass


@dataclass
class Seen:
    path: str
    stream: bool
    status: int
    body: bytes  # the request body as the CLI sent it


_PASSED_HEADERS = ("content-type", "content-encoding", "cache-control")


@dataclass
class Front:
    url: str  # http://127.0.0.1:PORT, standing in for the proxy's root URL
    seen: list[Seen]

    def model_calls(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith(("/chat/completions", "/responses", "/messages"))]


@asynccontextmanager
async def front(target: str, *, refuse_streams: bool = False) -> AsyncIterator[Front]:
    """A loopback front for the proxy at `target` that notes each request's path, `stream` flag
    and reply status. With `refuse_streams`, a streaming request gets a 404 (a gateway without
    streaming) and goes no further."""
    seen: list[Seen] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        stream = bool(raw) and bool(json.loads(raw).get("stream"))
        if refuse_streams and stream:
            seen.append(Seen(request.path, stream, 404, raw))
            error = {"type": "error", "error": {"type": "not_found_error", "message": "streaming is not available"}}
            return web.json_response(error, status=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with http.request(request.method, target + request.path_qs, data=raw, headers=headers) as r:
                seen.append(Seen(request.path, stream, r.status, raw))
                keep = {k: v for k, v in r.headers.items() if k.lower() in _PASSED_HEADERS}
                reply = web.StreamResponse(status=r.status, headers=keep)
                await reply.prepare(request)
                async for chunk in r.content.iter_any():  # SSE passes through as it comes
                    await reply.write(chunk)
                await reply.write_eof()
                return reply

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield Front(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen)
    finally:
        await runner.cleanup()


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def exact_chain(records: list[CallRecord]) -> list[int]:
    """The longest chain of call indices, from call 0, where each call's prompt starts with the
    previous one's prompt ids + sampled ids."""
    best: dict[int, list[int]] = {0: [0]}
    for j in range(1, len(records)):
        for i in range(j):
            joined = records[i].prompt_ids + records[i].completion_ids
            if i in best and records[j].prompt_ids[: len(joined)] == joined and len(best[i]) + 1 > len(best.get(j, [])):
                best[j] = best[i] + [j]
    return max(best.values(), key=len) if records else []


def _describe(records: list[CallRecord]) -> str:
    return "; ".join(f"#{r.call_index} {r.history} {r.finish_reason} {len(r.prompt_ids)}+{len(r.completion_ids)}"
                     for r in records)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("name", sorted(TOOLS))
async def test_harness_runs_tools_through_proxy(name, stream, bundles, dirs, tmp_path):
    if stream and name in NO_STREAM:
        pytest.skip(NO_STREAM[name])
    if not stream and name in NO_JSON:
        pytest.skip(NO_JSON[name])
    home, task = dirs
    tokenizer = await asyncio.to_thread(load_tokenizer, "")
    engine = StepEngine(tokenizer, script(name, task))
    refuse = not stream and name not in NO_STREAM  # Claude Code streams unless refused
    async with scripted_proxy(tmp_path, engine=engine, config=PROXY_CONFIG) as px:
        async with front(px.root_url, refuse_streams=refuse) as fr:
            cmd = get_harness(name).command(
                prompt=f"Create the file {FILE} containing exactly: {CONTENT}", proxy_url=f"{fr.url}/s/{px.token}",
                api_key=px.token, model=MODEL, home=str(home), bundle=str(bundles[name]), max_steps=8,
                limits=LIMITS)
            code, output = await run_on_host(cmd, home=home, cwd=task, timeout_s=RUN_TIMEOUT_S)
        records = await px.records()
    where = f"{name} exited {code}; calls: {_describe(records)}; output:\n{output[-3000:]}"
    assert code == 0, where
    assert await asyncio.to_thread(_read, task / FILE) == CONTENT, where
    # mini-swe-agent hands tool output to the model as JSON text (non-ASCII \u-escaped).
    printed = (SEEN_MARK + CONTENT, json.dumps(SEEN_MARK + CONTENT)[1:-1])
    last_prompt = engine.prompts[-1][-1500:] if engine.prompts else ""
    assert any(m in p for p in engine.prompts for m in printed), (
        f"shell output never reached the model; {where}\nend of the last prompt:\n{last_prompt}")

    if name == "claude-code":  # the deferred tool's definition reached the model in the result
        assert any(f'{{"name":"{DEFERRED_TOOL}"' in p for p in engine.prompts), where

    answered = [s for s in fr.model_calls() if s.status == 200]
    assert len(answered) == len(fr.model_calls()) - sum(s.status == 404 for s in fr.model_calls()), where
    assert len(answered) == len(records) >= 3, where
    assert {s.stream for s in answered} == {stream}, [(s.stream, s.status) for s in fr.model_calls()]
    if refuse:
        assert any(s.status == 404 for s in fr.model_calls()), "the client never tried to stream"
    n_steps = len(script(name, task))
    assert [r.finish_reason for r in records[: n_steps - 1]] == ["tool_calls"] * (n_steps - 1), where
    chain = exact_chain(records)
    assert len(chain) >= n_steps, f"exact-history chain {chain}; {where}"
    assert all(records[i].history == "exact" for i in chain[1:]), where
