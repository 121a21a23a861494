"""Exact history: later prompts of a session extend earlier prompts + sampled ids token for token.

Per session we keep, for every answered call, the keys of its canonical messages plus the
assistant message we returned, its tools key, prompt ids and sampled ids. A new request matches
call i when its tools equal call i's and its messages start with call i's messages + that reply,
compared by role, stripped content and tool-call name + arguments as canonical JSON (never by
ids, reasoning or whitespace, which clients rewrite). The longest match wins. The new prompt is

    call_i.prompt_ids + call_i.completion_ids (+ end-of-turn id if sampling did not end with it)
    + tokens(rendered text after the end-of-turn that closes call i's reply)

Only the new suffix is rendered and tokenised. The template renders a short stand-in
conversation: a short system and user message standing in for the matched prefix, the reply as
the client sent it back, then the new messages; the text after the end-of-turn that closes the
reply is the suffix.
That cut sits right after a special token, where BPE merges cannot cross, and it does not depend
on how the template re-renders older turns (Qwen3 drops old reasoning). For new user, tool and
system turns that render is usually served by a checked skeleton of the template's markup
(skeleton.py) instead of Jinja. Tools are left out of
that render when a probe shows the template only uses them before the suffix (most print them
in the system turn). The first exact call of a session with a new shape of suffix (the roles of
its new messages, e.g. tool, or tool + user) also renders the whole conversation and checks the
stand-in suffix against it; a template whose suffix depends on older turns (Mistral's moves the
system prompt into the last user turn) falls back to whole renders for that session (cause
`exact_full`), still exact.

Costs per exact call stay flat as a session grows: messages unchanged since the previous request
are recognised by identity (the proxy's incremental parse hands back the same objects) or struct
equality and reuse their keys, so matching is pointer comparisons;
prompt ids are joined with one copy, and the call record stores only the new ids (see
records.CallRecord: `Prompt.extends_call`, `n_extended`). Ids are
`array("i")`: a list or tuple of 1e4-1e5 ids is walked element by element by every garbage
collection that finds it alive, which cost more than everything else here together.
No match (compaction, injected reminders, edited history) → render from scratch; the label says
why.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter
from typing import Literal

import msgspec

from polar_fast.capture.render import Renderer
from polar_fast.conversation import Message, Tool

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
    ids: array  # of "i": a Sequence[int] the garbage collector never walks (see the module doc)
    history: str  # "exact", or "render:<cause>"
    keys: tuple  # message keys of the request
    tools: bytes
    # exact history: its first `n_extended` ids are the prompt + sampled ids of the remembered
    # call `extends_call` (-1: none, or that call was remembered without an index)
    extends_call: int = -1
    n_extended: int = 0


class Plan(msgspec.Struct, frozen=True):
    """A prompt before rendering the whole conversation (`whole`: no exact match) or tokenising
    the suffix `text` that follows the `base` ids. `History.plan` is cheap and runs on the event
    loop; `History.finish` holds the heavy part and is safe in a worker thread."""

    base: array  # a matched call's prompt ids
    added: array  # + its sampled ids (+ end-of-turn)
    extends_call: int  # that call's index
    n_extended: int  # len(its prompt + sampled ids)
    text: str
    whole: bool
    history: str
    keys: tuple
    tools: bytes


class _Call(msgspec.Struct):
    keys: tuple  # request messages + the reply we sent
    tools: bytes
    prompt_ids: array
    added: array  # sampled ids (+ the end-of-turn id when sampling did not close)
    call_index: int
    n_sampled_end: int  # len(prompt ids + sampled ids)


_NO_IDS = array("i")


class History:
    def __init__(
        self, renderer: Renderer, mode: Literal["exact", "template"] = "exact", *, max_calls: int = 32
    ) -> None:
        self.renderer = renderer
        self.mode = mode
        self.max_calls = max_calls  # older calls are forgotten (their ids are the memory cost)
        self._calls: list[_Call] = []
        self._last: tuple[list[Message], list[_Key], list[Tool], bytes] = ([], [], [], b"")
        self._checked: set[tuple[str, ...]] = set()  # suffix role shapes checked against a whole render
        self._suffix_local = True  # ... and all agreed
        self.causes: Counter[str] = Counter()

    def prompt(self, messages: list[Message], tools: list[Tool]) -> Prompt:
        return self.finish(self.plan(messages, tools), messages, tools)

    def finish(self, plan: Plan, messages: list[Message], tools: list[Tool]) -> Prompt:
        """The prompt ids of `plan` (made by `plan(messages, tools)`). Touches no session state."""
        if plan.whole:
            return Prompt(self.renderer.render(messages, tools), plan.history, plan.keys, plan.tools)
        tail = plan.added + self.renderer.encode_suffix(plan.text)
        ids = plan.base + tail  # the one copy of the long part
        return Prompt(ids, plan.history, plan.keys, plan.tools, plan.extends_call, plan.n_extended)

    def plan(self, messages: list[Message], tools: list[Tool]) -> Plan:
        keys, tkey = self._keys(messages, tools)
        call = self._match(keys, tkey) if self.mode == "exact" else None
        if call is not None:
            suffix = self._suffix(messages, tools, len(call.keys))
            if suffix is not None:
                self.causes["exact"] += 1
                return Plan(call.prompt_ids, call.added, call.call_index, call.n_sampled_end, suffix, False, "exact", keys, tkey)
            label = "render:template_mismatch"
        elif self.mode == "template":
            label = "render:template"
        else:
            label = "render:no_match" if self._calls else "render:first_call"
        self.causes[label] += 1
        return Plan(_NO_IDS, _NO_IDS, -1, 0, "", True, label, keys, tkey)

    def _keys(self, messages: list[Message], tools: list[Tool]) -> tuple[tuple, bytes]:
        """Message keys and tools key, reusing the previous request's for unchanged messages
        (struct equality is a memcmp; a key costs a strip and a JSON round trip per tool call)."""
        last_msgs, last_keys, last_tools, last_tkey = self._last
        n_last = len(last_msgs)
        keys = [
            last_keys[j] if j < n_last and (m is last_msgs[j] or m == last_msgs[j]) else message_key(m)
            for j, m in enumerate(messages)
        ]
        tkey = last_tkey if last_tkey and (tools is last_tools or tools == last_tools) else tools_key(tools)
        self._last = (messages, keys, tools, tkey)
        return tuple(keys), tkey

    def _match(self, keys: tuple, tkey: bytes) -> _Call | None:
        best = None
        for call in reversed(self._calls):
            n = len(call.keys)
            if n <= len(keys) and (best is None or n > len(best.keys)) and call.tools == tkey and keys[:n] == call.keys:
                best = call
        return best

    def _suffix(self, messages: list[Message], tools: list[Tool], n_matched: int) -> str | None:
        """Rendered text after the end-of-turn that closes messages[n_matched - 1] (the reply),
        or None when the template does not close it where expected."""
        r = self.renderer
        if self._suffix_local:
            head = _stand_in_head(messages[: n_matched - 1])
            tkey = self._last[3]
            stub_tools = tools if r.tools_reach_suffix(tools, tkey) else []
            reply, new = messages[n_matched - 1], messages[n_matched:]
            text = r.skeletons.text_after(head, reply, new, stub_tools, tkey if stub_tools else b"")
            shape = tuple(m.role for m in messages[n_matched:])
            if shape in self._checked and text is not None:
                return text
            whole = r.text_after(messages, tools, n_matched)
            self._checked.add(shape)
            if whole != text:
                self._suffix_local = False
                self.causes["exact_full"] += 1
            return whole
        return r.text_after(messages, tools, n_matched)

    def remember(self, prompt: Prompt, completion_ids: list[int], reply: Message, *, call_index: int = -1) -> None:
        """Keep an answered call for later matches; `call_index` (the session's) is what later
        prompts name as the call they extend."""
        if self.mode == "template":
            return
        closed = bool(completion_ids) and completion_ids[-1] in self.renderer.stop_ids
        added = completion_ids if closed else [*completion_ids, self.renderer.eot_id]
        keys = prompt.keys + (message_key(reply),)
        n_sampled_end = len(prompt.ids) + len(completion_ids)
        self._calls.append(_Call(keys, prompt.tools, prompt.ids, array("i", added), call_index, n_sampled_end))
        if len(self._calls) > self.max_calls:
            del self._calls[0]


_STAND_IN = {role: Message(role=role, content="x") for role in ("system", "user")}


def _stand_in_head(prefix: list[Message]) -> list[Message]:
    """Short stand-ins for the matched prefix before the reply: a system message when the
    conversation starts with one and a user message when it has one. Enough context for
    templates that need a system turn, a user query or alternating roles before a reply, and
    cheap to render and scan however long the real ones are."""
    head: list[Message] = []
    if prefix and prefix[0].role == "system":
        head.append(_STAND_IN["system"])
    if any(m.role == "user" for m in prefix):
        head.append(_STAND_IN["user"])
    return head
