"""Dialect golden tests: real CLI requests in, canonical conversations out; canonical completions
in, the event sequences real clients parse out.

`tests/data/harness_requests/<harness>.json` are third requests captured from the five real CLIs
in tests/test_harness_proxy.py (after a write-tool call and two parallel shell calls), with long
texts cut and only the tools used kept. Each must parse into the expected roles, calls and tools.
The fix tables pin behaviour the real CLIs needed (each named after what broke without it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_fast.capture import dialects
from polar_fast.capture.dialects import DialectError, ReplyMeta, anthropic, responses
from polar_fast.capture.dialects import chat_completions as chat
from polar_fast.conversation import Completion, ToolCall

DATA = Path(__file__).parent / "data" / "harness_requests"
DIALECTS = {"codex": responses, "claude-code": anthropic, "qwen-code": chat, "pi": chat, "mini-swe-agent": chat}
THINK = "The user wants a file; the write tool makes it."

# harness -> (roles, tool names called per assistant turn, tools offered, stream, max_tokens)
GOLDEN = {
    "codex": ("system system user user assistant tool assistant tool tool",
              [["exec_command"], ["exec_command", "exec_command"]], ["exec_command"], True, None),
    "claude-code": ("system user system assistant tool assistant tool tool",
                    [["Write"], ["Bash", "Bash"]], ["Bash", "Write"], True, 32000),
    "qwen-code": ("system user assistant tool assistant tool tool",
                  [["write_file"], ["run_shell_command", "run_shell_command"]], ["run_shell_command", "write_file"],
                  True, 32000),
    "pi": ("system user assistant tool assistant tool tool", [["write"], ["bash", "bash"]], ["bash", "write"], True, 16384),
    "mini-swe-agent": ("system user assistant tool assistant tool tool", [["bash"], ["bash", "bash"]], ["bash"],
                       False, None),
}


@pytest.mark.parametrize("harness", sorted(GOLDEN))
def test_real_cli_request_parses(harness):
    conv = DIALECTS[harness].parse((DATA / f"{harness}.json").read_bytes())
    roles, calls, tools, stream, max_tokens = GOLDEN[harness]
    assert " ".join(m.role for m in conv.messages) == roles
    assistants = [m for m in conv.messages if m.role == "assistant"]
    assert [[c.name for c in m.tool_calls] for m in assistants] == calls
    assert sorted(t.name for t in conv.tools) == tools
    assert (conv.stream, conv.max_tokens) == (stream, max_tokens)
    # Every tool result answers a call of an earlier assistant turn, by id.
    ids = {c.id for m in assistants for c in m.tool_calls}
    assert all(m.tool_call_id in ids for m in conv.messages if m.role == "tool")
    assert all(json.loads(c.arguments) for m in assistants for c in m.tool_calls)
    assert assistants[0].content == "I'll create the file now."
    if harness != "mini-swe-agent":  # litellm does not send reasoning back
        assert assistants[0].reasoning == THINK
    assert not any(m.content.startswith(anthropic.BILLING_HEADER) for m in conv.messages)


# ----------------------------------------------------------------------------- anthropic fixes


def _anthropic(**body) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 10, **body}).encode()


SCHEMA = {"type": "object", "properties": {"cell": {"type": "string"}}}
TOOLS = [
    {"name": "ToolSearch", "description": "find tools", "input_schema": {"type": "object", "properties": {}}},
    {"name": "NotebookEdit", "description": "edit a notebook", "input_schema": SCHEMA, "defer_loading": True},
]


def _tool_search(content) -> list[dict]:
    return [
        {"role": "user", "content": "find a notebook tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "notebook"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]},
    ]


NOTEBOOK_DEF = '{"name":"NotebookEdit","description":"edit a notebook","input_schema":{"type":"object","properties":{"cell":{"type":"string"}}}}'

# Claude Code's ToolSearch answers with tool_reference blocks; a 400 made it drop tool search
# after three retries, change its tool list and so break exact history.
TOOL_REFERENCE_CASES = [
    ([{"type": "tool_reference", "tool_name": "NotebookEdit"}], NOTEBOOK_DEF),
    ([{"type": "text", "text": "found:"}, {"type": "tool_reference", "tool_name": "NotebookEdit"}], "found:\n" + NOTEBOOK_DEF),
    ([{"type": "tool_reference", "tool_name": "Gone"}], '{"name":"Gone"}'),
]


@pytest.mark.parametrize(("content", "expected"), TOOL_REFERENCE_CASES, ids=["ref", "text+ref", "unknown"])
def test_tool_reference_becomes_the_tool_definition(content, expected):
    for parse in (anthropic.parse, anthropic.parse_count):
        conv = parse(_anthropic(messages=_tool_search(content), tools=TOOLS))
        assert conv.messages[-1].role == "tool" and conv.messages[-1].content == expected


def test_deferred_tools_stay_out_of_the_tool_list():
    # The API keeps defer_loading tools out of context until referenced; keeping the list
    # constant also keeps exact history when ToolSearch loads one.
    conv = anthropic.parse(_anthropic(messages=[{"role": "user", "content": "hi"}], tools=TOOLS))
    assert [t.name for t in conv.tools] == ["ToolSearch"]


def test_tool_reference_without_name_is_400():
    with pytest.raises(DialectError, match="tool_name"):
        anthropic.parse(_anthropic(messages=_tool_search([{"type": "tool_reference"}]), tools=TOOLS))


HEADER = "x-anthropic-billing-header: cc_version=2.1.332.467; cc_entrypoint=sdk-cli;"
# Claude Code's first system block is attribution metadata whose hash follows the conversation.
BILLING_CASES = [
    ([{"type": "text", "text": HEADER}, {"type": "text", "text": "You are an agent."}], "You are an agent."),
    ([{"type": "text", "text": "You are an agent."}, {"type": "text", "text": HEADER}], "You are an agent."),
    (HEADER + "\nYou are an agent.", "You are an agent."),
    ([{"type": "text", "text": HEADER}], None),
    ("Say x-anthropic-billing-header: is a phrase.", "Say x-anthropic-billing-header: is a phrase."),
]


@pytest.mark.parametrize(("system", "expected"), BILLING_CASES, ids=["first", "last", "string", "only", "inside"])
def test_billing_header_is_not_prompt_text(system, expected):
    conv = anthropic.parse(_anthropic(system=system, messages=[{"role": "user", "content": "hi"}]))
    first = conv.messages[0]
    assert (first.content if first.role == "system" else None) == expected


# ----------------------------------------------------------------------------- stream sequences

COMPLETION = Completion(
    content="Checking.",
    reasoning="think",
    tool_calls=(ToolCall(id="call_1", name="bash", arguments='{"command":"ls"}'),
                ToolCall(id="call_2", name="bash", arguments='{"command":"pwd"}')),
    finish_reason="tool_calls",
    prompt_tokens=10,
    completion_tokens=5,
)
META = ReplyMeta(id="abc", created=1, model="m")


def _events(dialect) -> list[dict | str]:
    out = []
    for frame in dialect.stream(COMPLETION, META, include_usage=True):
        data = frame.split(b"data: ", 1)[1].strip()
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_anthropic_stream_sequence():
    events = _events(anthropic)
    kinds = [e["type"] + (":" + e["delta"]["type"] if e["type"] == "content_block_delta" else "") for e in events]
    block = ["content_block_start", "content_block_delta:input_json_delta", "content_block_stop"]
    assert kinds == ["message_start",
                     "content_block_start", "content_block_delta:thinking_delta", "content_block_delta:signature_delta",
                     "content_block_stop", "content_block_start", "content_block_delta:text_delta", "content_block_stop",
                     *block, *block, "message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2, 3]
    assert [e["content_block"].get("id") for e in starts[2:]] == ["call_1", "call_2"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 5


def test_responses_stream_sequence():
    events = _events(responses)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    call = ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        *call, *call, "response.completed"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "message", "function_call", "function_call"]
    assert [i.get("call_id") for i in done[2:]] == ["call_1", "call_2"]
    assert events[-1]["response"]["output"] == done and events[-1]["response"]["usage"]["output_tokens"] == 5


def test_chat_stream_sequence():
    events = _events(chat)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == 15
    deltas = [e["choices"][0] for e in events[:-2]]
    assert [d["delta"] for d in deltas[:3]] == [{"role": "assistant", "content": ""}, {"reasoning_content": "think"},
                                               {"content": "Checking."}]
    calls = [d["delta"]["tool_calls"][0] for d in deltas[3:7]]
    assert [(c["index"], c.get("id"), c["function"].get("name")) for c in calls] == [
        (0, "call_1", "bash"), (0, None, None), (1, "call_2", "bash"), (1, None, None)]
    assert [d["finish_reason"] for d in deltas] == [None] * 7 + ["tool_calls"]


def test_the_dialects_satisfy_their_protocol(tmp_path):
    """mypy over the dialects package: each module checked against the `Dialect` Protocol where
    DIALECTS maps its name to it, and the modules' own types (the rest of the tree is not in scope)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--cache-dir", str(tmp_path),
                          "polar_fast/capture/dialects"], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(dialects.DIALECTS) == ["anthropic", "chat", "responses"] and dialects.DIALECTS["chat"] is chat
