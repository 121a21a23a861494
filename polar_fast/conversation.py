"""The canonical conversation: what every dialect translates to and from, what prompt rendering
reads, and what exchange records and SFT export store.

Canonical choices: tool-call arguments are JSON object text; tool results are strings (text
content parts are joined with newlines); the reasoning of an assistant turn is its own field.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    arguments: str  # JSON object text, as the model wrote it (re-encoded when parsed from XML)


class Message(msgspec.Struct, frozen=True, kw_only=True):
    role: Role
    content: str = ""
    reasoning: str = ""  # assistant only
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str = ""  # tool only


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    model: str = ""
    messages: list[Message]
    tools: list[Tool] = []
    stream: bool = False
    include_usage: bool = False  # chat: stream_options.include_usage
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: FinishReason = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_message(self) -> Message:
        return Message(role="assistant", content=self.content, reasoning=self.reasoning, tool_calls=self.tool_calls)
