"""Suffix skeletons: what a chat template prints after an assistant reply, with holes for the
texts of the new messages, so an exact-history call joins strings instead of running Jinja.

Exact history renders, per call, a short stand-in conversation and keeps the text after the
reply's end-of-turn (history.py). When the new messages are user, tool or system turns, the
usual template prints each text verbatim inside markup that depends only on the roles. A
skeleton is that markup, learnt once per shape (stand-in head, the reply's shape, the new
messages' roles, the tools) from a render with unique markers in place of each content and
tool-call id. It is kept only if a second render, with a different reply and other markers
wrapped in whitespace, quotes, backslashes, braces and tags, equals the skeleton filled with
those markers: a template that trims, escapes, or reads the text or the reply fails that.

Never trusted blindly: the first `CHECKED_USES` uses of each skeleton and one in `AUDIT_EVERY`
after are rendered by Jinja as well, and any difference retires that skeleton for good (the
Jinja text is used). What this cannot see is a template that branches on the text of a new
message in a way neither the probes nor the audited calls show.
"""

from __future__ import annotations

import re
from typing import Protocol

from polar_fast.conversation import Message, Tool, ToolCall

CHECKED_USES = 2
AUDIT_EVERY = 64
_MARK = re.compile("\ue000([ab])(\\d+)\ue001")
_RETIRED = "retired"


class TextAfter(Protocol):
    """What skeletons learn from and are checked against: `Renderer.text_after` (render.py), the
    Jinja text after the end-of-turn that closes messages[n_through - 1]."""

    def __call__(self, messages: list[Message], tools: list[Tool], n_through: int, *,
                 tools_key: bytes | None = None) -> str | None: ...


def _marker(tag: str, field: int) -> str:
    return f"\ue000{tag}{field}\ue001"


def _tricky(tag: str, field: int) -> str:
    return f" \n\t\"'\\{{%}} <tool_response><think>{_marker(tag, field)}</think></tool_response> é\n "


def _stand_in_reply(reply: Message, tag: str) -> Message:
    calls = tuple(
        ToolCall(id=f"call_{tag}{j}", name=f"f{tag}", arguments='{"a": 1}' if tag == "a" else '{"b": [2, "x"]}')
        for j in range(len(reply.tool_calls))
    )
    return Message(
        role="assistant",
        content=("reply " + tag) if reply.content else "",
        reasoning=("why " + tag) if reply.reasoning else "",
        tool_calls=calls,
    )


def _with_fields(new: list[Message], values) -> list[Message]:
    return [
        Message(role=m.role, content=values(2 * i), tool_call_id=values(2 * i + 1) if m.tool_call_id else "")
        for i, m in enumerate(new)
    ]


class _Skeleton:
    __slots__ = ("parts", "uses")

    def __init__(self, parts: list[str | int]) -> None:
        self.parts = parts  # literal text, or the index of a field: 2i content, 2i + 1 id of new[i]
        self.uses = 0

    def fill(self, new: list[Message]) -> str:
        out = []
        for p in self.parts:
            if p.__class__ is str:
                out.append(p)
            else:
                m = new[p >> 1]  # type: ignore[operator]
                out.append(m.tool_call_id if p & 1 else m.content)  # type: ignore[operator]
        return "".join(out)


def _split(text: str) -> list[str | int]:
    parts: list[str | int] = []
    at = 0
    for match in _MARK.finditer(text):
        parts.append(text[at : match.start()])
        parts.append(int(match.group(2)))
        at = match.end()
    parts.append(text[at:])
    return [p for p in parts if p != ""]


class Skeletons:
    """Per renderer (they depend on the template only): `text_after` equals
    `render_text_after(head + [reply] + new, tools, len(head) + 1, tools_key=tools_key)`."""

    def __init__(self, render_text_after: TextAfter) -> None:
        self.render_text_after = render_text_after
        self._known: dict[tuple, _Skeleton | str] = {}
        self.retired = 0  # skeletons a Jinja render contradicted
        self.served = 0

    def text_after(
        self, head: list[Message], reply: Message, new: list[Message], tools: list[Tool], tools_key: bytes
    ) -> str | None:
        def jinja() -> str | None:
            return self.render_text_after([*head, reply, *new], tools, len(head) + 1, tools_key=tools_key)

        if tools and not tools_key or any(m.role not in ("user", "tool", "system") or m.tool_calls or m.reasoning for m in new):
            return jinja()
        key = (
            tuple(m.role for m in head),
            (bool(reply.content), bool(reply.reasoning), len(reply.tool_calls)),
            tuple((m.role, bool(m.tool_call_id)) for m in new),
            tools_key if tools else b"",
        )
        skeleton = self._known.get(key)
        if skeleton is None:
            skeleton = self._known[key] = self._learn(head, reply, new, tools, tools_key)
            if len(self._known) > 4096:  # shapes are few; a flood of odd ones must not grow memory
                self._known.clear()
        if skeleton is _RETIRED:
            return jinja()
        assert isinstance(skeleton, _Skeleton)
        skeleton.uses += 1
        text = skeleton.fill(new)
        if skeleton.uses <= CHECKED_USES or skeleton.uses % AUDIT_EVERY == 0:
            want = jinja()
            if want != text:
                self._known[key] = _RETIRED
                self.retired += 1
                return want
        self.served += 1
        return text

    def _learn(self, head: list[Message], reply: Message, new: list[Message], tools: list[Tool], tools_key: bytes) -> _Skeleton | str:
        render, n = self.render_text_after, len(head) + 1
        first = render([*head, _stand_in_reply(reply, "a"), *_with_fields(new, lambda f: _marker("a", f))], tools, n, tools_key=tools_key)
        probe = _with_fields(new, lambda f: _tricky("b", f))
        second = render([*head, _stand_in_reply(reply, "b"), *probe], tools, n, tools_key=tools_key)
        if first is None or second is None:
            return _RETIRED
        skeleton = _Skeleton(_split(first))
        return skeleton if skeleton.fill(probe) == second else _RETIRED
