"""`harnesses check` (preflight/harness_check.py, check_model.py, check_calls.py) on agents that
once got false verdicts, each a tiny Python agent the test declares, run through the real proxy,
pools and a local sandbox:

- a text-edit agent (no tools: it applies the SEARCH/REPLACE blocks of its replies, as aider
  does) acts through its definition's `[check] edit` and gets no failed line; its tool call
  line says the edit was applied and shown back;
- an agent whose bash tool requires `description` as well as `command` (as Crush's does), and
  whose first request is a title side call with no tools, passes the tool call line;
- an agent that makes a title side call but never compacts fails the context line, which names
  the side call; it runs its commands outside the repo, so the fix never lands and `end` fails
  at reward 0.0, saying so.
"""

from __future__ import annotations

import pytest
from test_harness_config import _check, tiny_agent

from polar_fast.preflight.check_model import MARK_FILE, shell_tool

TEXT_AGENT = r'''
import json, os, re, sys, urllib.request

url = os.environ["POLAR_URL"] + "/chat/completions"
BLOCK = re.compile(r"^(\S[^\n]*)\n<<<<<<< SEARCH\n(.*?)^=======\n(.*?)^>>>>>>> REPLACE$", re.S | re.M)
messages = [{"role": "system", "content": "Edit files with blocks: the path, <<<<<<< SEARCH, old lines, =======, "
                                          "new lines, >>>>>>> REPLACE. Reply without a block when done."},
            {"role": "user", "content": os.environ["TASK"]}]
for _ in range(int(os.environ["STEPS"])):
    body = json.dumps({"model": os.environ["MODEL"], "messages": messages}).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["KEY"]}
    message = json.load(urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60))["choices"][0]["message"]
    messages.append(message)
    blocks = BLOCK.findall(message.get("content") or "")
    if not blocks:
        sys.exit(0)
    report = []
    for path, old, new in blocks:
        text = open(path).read() if os.path.exists(path) else ""
        if old not in text:
            report.append(f"{path}: the SEARCH lines are not in the file")
            continue
        text = text.replace(old, new, 1) if old else text + new
        open(path, "w").write(text)
        report.append(f"{path} now reads:\n{text}")
    messages.append({"role": "user", "content": "\n\n".join(report)})
sys.exit(1)
'''

SEARCH_REPLACE = "{{ file }}\n<<<<<<< SEARCH\n{{ old }}=======\n{{ new }}>>>>>>> REPLACE\n"


def text_edit_agent() -> dict:
    return tiny_agent() | {"files": {"agent.py": TEXT_AGENT}, "check": {"edit": SEARCH_REPLACE}}


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_text_edit_agent_acts_through_its_check_edit_and_gets_no_failed_line(tmp_path):
    items, text = await _check(tmp_path, text_edit_agent())
    assert [i.status for i in items.values()] == ["pass", "n/a", "pass", "pass", "pass"], text
    assert items["tool call"].evidence.startswith(f"the edit reply was applied ({MARK_FILE} holds 'polar-check-42' "
                                                  "after the run) and call 1 showed it back"), text
    assert "reward 1.0 (the task's tests pass)" in items["end"].evidence, text
    # what the run showed, not what the agent is assumed to do
    assert "declares no compaction threshold" in items["context"].evidence, text
    assert "seen here (1,000,000-token window): 3 calls" in items["context"].evidence, text


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_text_edit_agent_whose_edits_do_not_land_fails_the_tool_call_line(tmp_path):
    # its template writes blocks the agent does not parse: nothing is applied, and the lines say so
    items, text = await _check(tmp_path, text_edit_agent() | {"check": {"edit": "edit {{ file }}: {{ old }} -> {{ new }}"}})
    assert items["tool call"].status == "fail", text
    assert f"after the run {MARK_FILE} does not exist" in items["tool call"].evidence, text
    assert items["end"].status == "fail" and "but reward 0.0" in items["end"].evidence, text
    assert "the scripted fix was never sent" in items["end"].evidence, text  # it ended after its first reply


CRUSH_LIKE = r'''
import json, os, subprocess, sys, urllib.request

url = os.environ["POLAR_URL"] + "/chat/completions"
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["KEY"]}

def ask(messages, tools=None):
    body = {"model": os.environ["MODEL"], "messages": messages} | ({"tools": tools} if tools else {})
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    return json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]

# a title first: a side call with its own system prompt and no tools
ask([{"role": "system", "content": "Write a five-word title for the task."}, {"role": "user", "content": os.environ["TASK"]}])
tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "required": ["command", "description"],
    "properties": {"command": {"type": "string"}, "description": {"type": "string", "description": "what it does"}}}}}]
messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": os.environ["TASK"]}]
for _ in range(int(os.environ["STEPS"])):
    message = ask(messages, tools)
    messages.append(message)
    if not message.get("tool_calls"):
        sys.exit(0)
    for call in message["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        missing = [k for k in ("command", "description") if not isinstance(arguments.get(k), str)]
        if missing:
            output = "missing required parameter: " + ", ".join(missing)
        else:
            done = subprocess.run(arguments["command"], shell=True, capture_output=True, text=True)
            output = done.stdout + done.stderr
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
sys.exit(1)
'''


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_shell_tool_that_requires_a_description_too_passes_the_tool_call_line(tmp_path):
    items, text = await _check(tmp_path, tiny_agent() | {"files": {"agent.py": CRUSH_LIKE}})
    assert items["tool call"].status == "pass", text
    assert "and its required description filled from its schema" in items["tool call"].evidence, text
    assert items["end"].status == "pass", text


SIDE_CALLER = r'''
import json, os, subprocess, sys, tempfile, urllib.request

url = os.environ["POLAR_URL"] + "/chat/completions"
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["KEY"]}
scratch = tempfile.mkdtemp()  # where it runs commands: never the task's repo

def ask(messages, tools=None):
    body = {"model": os.environ["MODEL"], "messages": messages} | ({"tools": tools} if tools else {})
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    return json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]

tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": os.environ["TASK"]}]
for step in range(int(os.environ["STEPS"])):
    message = ask(messages, tools)
    messages.append(message)
    if step == 0:  # a title, once the first reply is in: a side call, never a compaction
        ask([{"role": "system", "content": "Write a five-word title for the task."},
             {"role": "user", "content": os.environ["TASK"]}])
    if not message.get("tool_calls"):
        sys.exit(0)
    for call in message["tool_calls"]:
        command = json.loads(call["function"]["arguments"])["command"]
        done = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=scratch)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": done.stdout + done.stderr})
sys.exit(1)
'''


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_a_side_call_is_no_compaction_and_end_fails_at_reward_0(tmp_path):
    agent = tiny_agent() | {"files": {"agent.py": SIDE_CALLER},
                            "compaction_threshold": "context_window - max_output_tokens"}  # declared, never done
    items, text = await _check(tmp_path, agent)
    context = items["context"]
    assert context.status == "fail" and context.evidence.endswith("no compaction"), text
    assert "call 1 (" in context.evidence and "is a side call (it shares" in context.evidence, text
    assert "still hold the whole conversation" in context.evidence, text
    end = items["end"]
    assert end.status == "fail" and "exit 0 after 4 calls, but reward 0.0" in end.evidence, text
    assert "the scripted fix was sent 1 time(s), and after the run the repo's changes were: none" in end.evidence, text
    assert items["tool call"].status == "pass", text  # its commands ran, elsewhere


def test_the_scripted_call_fills_every_required_argument_by_its_schema_type():
    schema = {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "required": ["command", "description", "timeout", "background", "mode"],
        "properties": {"command": {"type": "string"}, "description": {"type": "string"},
                       "timeout": {"type": "integer", "maximum": 30}, "background": {"type": "boolean"},
                       "mode": {"enum": ["safe", "full"]}, "cwd": {"type": "string"}}}}}
    view = {"type": "function", "function": {"name": "view", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    import json

    tool = shell_tool(f"<tools>\n{json.dumps(view)}\n{json.dumps(schema)}\n</tools>")
    assert tool is not None and (tool.name, tool.command_arg) == ("bash", "command")
    assert tool.required == {"description": "polar check", "timeout": 30, "background": False, "mode": "safe"}
    assert json.loads(tool.call("ls").split("\n")[1]) == [{"name": "bash", "arguments": {**tool.required, "command": "ls"}}]


def _call(index: int, prompt: list[int], completion: list[int], messages: list, reply: str):
    from polar_fast.conversation import Message
    from polar_fast.records import CallRecord, ExchangeRecord

    ids = dict(session_id="s", rollout_id="r", group_id="g", call_index=index, dialect="chat")
    return (CallRecord(**ids, prompt_ids=prompt, completion_ids=completion, completion_logprobs=[0.0] * len(completion),
                       policy_version=0, finish_reason="stop"),
            ExchangeRecord(**ids, model="m", messages=[Message(role=r, content=c) for r, c in messages],
                           reply=Message(role="assistant", content=reply)))


def test_context_passes_a_summary_request_and_the_restart_from_it_and_names_a_side_call_otherwise():
    from polar_fast.preflight.check_calls import compaction_verdict

    fill = "context " * 20
    system, tools, task = list(range(100, 160)), list(range(200, 240)), [7] * 10
    first = [("system", "SYS"), ("user", "task")]
    filled = _call(0, system + tools + task, [9] * 60, first, f"I'll look. {fill}")
    going_on = _call(1, system + tools + task + [9] * 60 + [5] * 5, [8] * 6,
                     first + [("assistant", f"I'll look. {fill}"), ("tool", "polar-check-42")], "Now I apply the fix.")
    title = _call(2, [300] * 12, [4] * 3, [("system", "Write a title."), ("user", "task")], "A title")
    # Claude Code's shape: the conversation re-sent under another system prompt, then a restart from its reply
    summary = _call(3, [400] * 30 + [9] * 60, [6] * 8, [("system", "Summarise."), ("user", f"task {fill}")],
                    "Summary: the fix is under way.")
    restart = _call(4, system + tools + [6] * 8, [3] * 2,
                    [("system", "SYS"), ("user", "Continued from: Summary: the fix is under way.")], "Done.")

    def verdict(*pairs):
        calls, exchanges = [c for c, _ in pairs], [e for _, e in pairs]
        return compaction_verdict(calls, exchanges, fill.strip(), 100, "told window 1,000")

    item = verdict(filled, going_on, title, summary, restart)
    assert item.status == "pass", item.evidence
    assert "call 3 (90 prompt tokens) summarised the conversation and call 4 (108 prompt tokens) starts again" \
        in item.evidence
    item = verdict(filled, going_on, title)  # a title after the filled call, never a compaction
    assert item.status == "fail" and item.evidence.endswith("no compaction"), item.evidence
    assert "call(s) 1 still hold the whole conversation" in item.evidence
    assert "call 2 (12 prompt tokens) is a side call (it shares 0 of call 0's 110 prompt tokens" in item.evidence
    item = verdict(filled, going_on, title, summary)  # a summary request no request started from
    assert item.status == "fail" and "call 3 (90 prompt tokens) re-sent the conversation in another shape" \
        in item.evidence, item.evidence
