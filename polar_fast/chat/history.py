"""Exact history: later prompts of a session extend earlier prompts + sampled ids token for token.

Per session we keep, for every answered call, its canonical messages plus the assistant message
we returned, its tools, prompt ids and sampled ids. A new request matches call i when its tools
equal call i's and its messages start with call i's messages + that reply, compared by role,
stripped content and tool-call name + arguments as canonical JSON (never by ids, reasoning or
whitespace, which clients rewrite). The longest match wins. The new prompt is

    call_i.prompt_ids + call_i.completion_ids (+ end-of-turn id if sampling did not end with it)
    + tokens(rendered text after the end-of-turn that closes call i's reply)

The rendered text of the new request is cut right after its n-th end-of-turn token, n being the
number of turn ends up to and including call i's reply; that cut sits after a special token,
where BPE merges cannot cross, and it does not depend on how the template re-renders older turns
(Qwen3 drops old reasoning). No match → render from scratch; the label says why.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Literal

import msgspec

from polar_fast.chat.render import Renderer
from polar_fast.dialects import Message, Tool

_Key = tuple


def _canonical_args(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return text.strip()


def message_key(m: Message) -> _Key:
    calls = tuple((c.name, _canonical_args(c.arguments)) for c in m.tool_calls)
    return (m.role, m.content.strip(), calls)


def tools_key(tools: list[Tool]) -> bytes:
    return msgspec.json.encode(sorted((msgspec.to_builtins(t) for t in tools), key=lambda t: t["name"]), order="sorted")


class Prompt(msgspec.Struct, frozen=True):
    ids: list[int]
    history: str  # "exact", or "render:<cause>"
    turn_ends: int  # end-of-turn marks in the rendered prompt text (to cut later suffixes)
    keys: tuple  # message keys of the request
    tools: bytes


class _Call(msgspec.Struct):
    keys: tuple  # request messages + the reply we sent
    tools: bytes
    ids: list[int]  # prompt ids + sampled ids (+ end-of-turn when sampling stopped without it)
    turn_ends: int  # end-of-turn marks through the reply


class History:
    def __init__(
        self, renderer: Renderer, mode: Literal["exact", "template"] = "exact", *, max_calls: int = 32
    ) -> None:
        self.renderer = renderer
        self.mode = mode
        self.max_calls = max_calls  # older calls are forgotten (their ids are the memory cost)
        self._calls: list[_Call] = []
        self.causes: Counter[str] = Counter()

    def prompt(self, messages: list[Message], tools: list[Tool]) -> Prompt:
        keys = tuple(message_key(m) for m in messages)
        tkey = tools_key(tools)
        text = self.renderer.text(messages, tools, generation_prompt=True)
        turn_ends = text.count(self.renderer.eot)
        call = self._match(keys, tkey) if self.mode == "exact" else None
        if call is not None:
            cut = _after_nth(text, self.renderer.eot, call.turn_ends)
            if cut >= 0:
                self.causes["exact"] += 1
                return Prompt(call.ids + self.renderer.encode(text[cut:]), "exact", turn_ends, keys, tkey)
            label = "render:template_mismatch"
        elif self.mode == "template":
            label = "render:template"
        else:
            label = "render:no_match" if self._calls else "render:first_call"
        self.causes[label] += 1
        return Prompt(self.renderer.encode(text), label, turn_ends, keys, tkey)

    def _match(self, keys: tuple, tkey: bytes) -> _Call | None:
        best = None
        for call in reversed(self._calls):
            n = len(call.keys)
            if n <= len(keys) and (best is None or n > len(best.keys)) and call.tools == tkey and keys[:n] == call.keys:
                best = call
        return best

    def remember(self, prompt: Prompt, completion_ids: list[int], reply: Message) -> None:
        if self.mode == "template":
            return
        ids = prompt.ids + completion_ids
        if not completion_ids or completion_ids[-1] not in self.renderer.stop_ids:
            ids.append(self.renderer.eot_id)
        keys = prompt.keys + (message_key(reply),)
        self._calls.append(_Call(keys, prompt.tools, ids, prompt.turn_ends + 1))
        if len(self._calls) > self.max_calls:
            del self._calls[0]


def _after_nth(text: str, mark: str, n: int) -> int:
    """Index just past the n-th occurrence of `mark` in `text`, or -1."""
    at = -len(mark)
    for _ in range(n):
        at = text.find(mark, at + len(mark))
        if at < 0:
            return -1
    return at + len(mark)
