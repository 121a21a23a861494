"""The scripted model of `harnesses check` (preflight/harness_check.py): it walks a harness
through a fixed script, acting the way the harness takes actions.

- A harness with a shell tool (found by its schema in any request, rendered into the prompt by
  the proxy) gets tool calls: reasoning, a sentence and `echo polar-check-$((6*7))` (only a run
  command prints `polar-check-42`), then a call that applies the task's fix, then the end (its
  `end_command` through the shell tool, or a plain answer). Every argument the tool's schema
  requires is filled (`fill_arguments`), so a CLI whose shell tool also wants a `description`
  gets one. The step is the number of tool results in the prompt, so a side call (a title, a
  small-model request) gets an answer too.
- A text-edit agent (no tools: it applies edits written in its replies, like aider's
  SEARCH/REPLACE blocks) gets edits in its own format, from its definition's `[check] edit`
  template: first one that creates MARK_FILE holding `polar-check-42`, then the task's fix as
  one edit per hunk of its patch (`patch_edits`), then a plain answer. Its step is read from
  what the harness showed it (`shown_text`: the prompt without the model's own turns): each edit
  is sent until its effect shows, at most twice, since a CLI may answer an edit by first adding
  the file to its context (aider does, for a file the reply names that it has not been shown).
- Compaction run: the first main-conversation reply of step 0 (a prompt at least
  MAIN_SHARE of the main first request: not a title request) is padded with `fill_tokens` words;
  a later prompt without that padding has compacted, and the task ends there. Until then, a
  shell-tool harness is kept working rather than ended (at most MAX_PADS more calls, each a
  command printing as many other words), so a harness that compacts only when the proxy refuses
  a prompt that outgrew the window (Pi, within one `pi -p` run) gets there, and retries from its
  summary.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections import Counter
from typing import Any, Callable, Sequence

import msgspec

from polar_fast.engines import Generation, Sampling

MARK_COMMAND = "echo polar-check-$((6*7))"
MARK_OUTPUT = "polar-check-42"  # only running MARK_COMMAND prints this
MARK_FILE = "polar-check.txt"  # text-edit agents: the first edit creates it, holding MARK_OUTPUT
NO_TOOL_REPLY = "Done: nothing to do without a shell tool."
FIRST_TEXT = "I'll look at the repository first."
FIX_TEXT = "Now I apply the fix."
DONE_TEXT = "Done: the fix is applied."
MAIN_SHARE = 0.8  # a prompt this share of the main first request's size is the main conversation
MAX_SENDS = 2  # each step is sent at most this often (a CLI may ask again once)
MAX_PADS = 4  # compaction run: padded calls after the fix while the harness has not compacted
_SHELL_NAMES = ("bash", "shell", "exec", "command", "terminal", "run")
_SHELL_ARGS = ("command", "cmd", "script")
_TOOL_RESULT = "<|im_start|>user\n<tool_response>"  # how the chat template renders a tool result
_OWN_TURN = re.compile(r"<\|im_start\|>assistant\n.*?(?:<\|im_end\|>|\Z)", re.S)


class ShellTool(msgspec.Struct, frozen=True):
    name: str
    command_arg: str  # the argument that takes the command
    required: dict[str, Any] = {}  # every other required argument, filled from its schema

    def call(self, command: str) -> str:
        arguments = {**self.required, self.command_arg: command}
        return "<tool_call>\n" + json.dumps([{"name": self.name, "arguments": arguments}]) + "\n</tool_call>"


class Edit(msgspec.Struct, frozen=True):
    file: str
    old: str  # the hunk's old side (context and removed lines); "" = create the file
    new: str  # the hunk's new side (context and added lines)


def fill_arguments(schema: dict[str, Any]) -> Any:
    """A short value a JSON schema accepts: its default or first enum value, else by type (a
    short string, 60 for a number (in range), false, [] or {} with its required properties)."""
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    if kind in ("integer", "number"):
        value = max(schema.get("minimum", -math.inf), min(schema.get("maximum", math.inf), 60))
        return int(value) if kind == "integer" else value
    if kind == "boolean":
        return False
    if kind == "array":
        return []
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: fill_arguments(props.get(k, {})) for k in schema.get("required", [])}
    return "polar check"


def shell_tool(prompt_text: str) -> ShellTool | None:
    """The shell tool among the schemas rendered in the prompt: one with a command argument,
    preferring a shell-like name; its other required arguments filled."""
    block = re.search(r"<tools>\n(.*?)\n</tools>", prompt_text, re.S)
    if block is None:
        return None
    found = []
    for line in block.group(1).splitlines():
        try:
            schema = json.loads(line)
        except ValueError:
            continue
        fn = schema.get("function", schema)
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        arg = next((a for a in _SHELL_ARGS if a in props), None)
        if arg is not None:
            required = {k: fill_arguments(props.get(k, {})) for k in params.get("required", []) if k != arg}
            named_like_shell = any(s in fn.get("name", "").lower() for s in _SHELL_NAMES)
            found.append((not named_like_shell, len(found), ShellTool(fn["name"], arg, required)))
    return min(found)[2] if found else None


def patch_edits(patch: str) -> list[Edit]:
    """One Edit per hunk of a unified diff (a new file: old = "")."""
    edits: list[Edit] = []
    file, old, new, in_hunk = "", [], [], False

    def close() -> None:
        if in_hunk:
            edits.append(Edit(file, "".join(old), "".join(new)))

    for line in patch.splitlines(keepends=True):
        if line.startswith("+++ "):
            close()
            in_hunk = False
            file = line[4:].strip().removeprefix("b/")
        elif line.startswith("@@"):
            close()
            old, new, in_hunk = [], [], True
        elif in_hunk and line[:1] in (" ", "-", "+"):
            if line[0] != "+":
                old.append(line[1:])
            if line[0] != "-":
                new.append(line[1:])
        elif in_hunk and line.startswith("\\"):  # "\ No newline at end of file"
            continue
        elif line.startswith(("diff ", "--- ", "index ")):
            close()
            in_hunk = False
    close()
    return edits


def shown_text(prompt_text: str) -> str:
    """What the harness showed the model: the prompt without the model's own (assistant) turns."""
    return _OWN_TURN.sub("", prompt_text)


class CheckEngine:
    """The scripted model of the module docstring (an engine: `generate`, `update_weights`)."""

    def __init__(self, tokenizer, *, fix_patch: str, end_command: str = "",
                 edit_reply: Callable[[str, str, str], str] | None = None, fill_tokens: int = 0,
                 main_prompt_tokens: int = 0) -> None:
        self.policy_version = 0
        self.tokenizer = tokenizer
        self.fix = f"git apply <<'POLAR_EOF'\n{fix_patch}POLAR_EOF"
        self.edits = patch_edits(fix_patch)
        self.end_command = end_command
        self.edit_reply = edit_reply  # (file, old, new) -> an edit in the CLI's format; None: it acts by tools
        self.fill = " ".join(["context"] * fill_tokens)
        self.main_prompt_tokens = main_prompt_tokens  # the main first request's size (compaction run)
        self.filled = ""  # the fill once sent: a prompt without it is compacted, and the task ends
        self.prompts: list[str] = []
        self.tool: ShellTool | None = None  # the shell tool, from the first request that offers one
        self.sent: Counter[str] = Counter()  # replies per step: "first", "fix", "end"
        self.first_prompt_tokens = 0  # the longest prompt answered with step 0 (the main first request)

    def reply(self, text: str, n_tokens: int) -> str:
        tool = shell_tool(text)
        self.tool = self.tool or tool
        if tool is None and self.edit_reply is None:
            return NO_TOOL_REPLY
        if self.filled and self.filled not in text:
            return self._end(tool)  # compacted: end the task rather than start over (it might compact again)
        if tool is not None:
            step = ("first", "fix")[text.count(_TOOL_RESULT)] if text.count(_TOOL_RESULT) < 2 else "end"
        else:
            shown = shown_text(text)
            fixed = all(e.new in shown for e in self.edits)
            step = "first" if MARK_OUTPUT not in shown else "fix" if not fixed else "end"
        if tool is None and step != "end" and self.sent[step] >= MAX_SENDS:
            step = "end"  # the CLI keeps asking: its edits do not land (the tool call line says so)
        if step == "end" and tool is not None and self.filled and self.sent["pad"] < MAX_PADS:
            step = "pad"  # not compacted yet: keep the conversation growing
        self.sent[step] += 1
        if step == "first":
            self.first_prompt_tokens = max(self.first_prompt_tokens, n_tokens)
            fill = ""
            if self.fill and not self.filled and n_tokens >= MAIN_SHARE * self.main_prompt_tokens:
                fill = self.filled = self.fill
            opening = f"<think>\nFirst I look at the repository.\n</think>\n{FIRST_TEXT}{' ' + fill if fill else ''}\n"
            if tool is not None:
                return opening + tool.call(MARK_COMMAND)
            return opening + self.edit_reply(MARK_FILE, "", MARK_OUTPUT + "\n")
        if step == "pad":  # a long output, not a long reply: a reply the window cuts short ends the turn
            return "Still looking.\n" + tool.call(f"printf 'padding %.0s' $(seq 1 {len(self.fill.split())})")
        if step == "fix":
            if tool is not None:
                return f"{FIX_TEXT}\n" + tool.call(self.fix)
            return f"{FIX_TEXT}\n" + "".join(self.edit_reply(e.file, e.old, e.new) for e in self.edits)
        return self._end(tool)

    def _end(self, tool: ShellTool | None) -> str:
        if tool is not None and self.end_command:
            return "Submitting.\n" + tool.call(self.end_command)
        return DONE_TEXT

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        text = await asyncio.to_thread(self.tokenizer.decode, list(prompt_ids))
        self.prompts.append(text)
        reply = self.reply(text, len(prompt_ids))
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_tokens]
        return Generation(token_ids=ids, logprobs=[-0.01] * len(ids),
                          finish_reason="stop" if len(ids) < sampling.max_tokens else "length")

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass
