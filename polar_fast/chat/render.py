"""Canonical messages → prompt ids with the model's chat template; sampled ids → reply parts.

Choices:
- The template is the tokenizer's own when it can show tools (it mentions `tools` and
  `tool_call`); otherwise the Hermes-style ChatML fallback (template.py), e.g. for SmolLM2.
- Rendering uses transformers' compiled Jinja environment directly (the one
  `apply_chat_template` uses, with the tokenizer's special tokens as variables), skipping its
  per-call deep copies: the proxy renders every request, and prompts reach ~100k characters.
- The rendered text is tokenised with `add_special_tokens=False`, since the template writes
  BOS/role tokens itself; special-token text in the template becomes the special ids.
- Tool-call arguments go to the template as objects (HF convention); text that is not a JSON
  object is passed as a string.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

from polar_fast.chat.parsers import parse_tool_calls, split_reasoning
from polar_fast.chat.template import HERMES_CHATML, template_supports_tools
from polar_fast.dialects import Message, Tool, ToolCall


class Renderer:
    def __init__(self, tokenizer, *, tool_parser: str = "hermes", reasoning: bool = True) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        if template_supports_tools(own):
            self.template, self.fallback = own, False
        else:
            if "<|im_start|>" not in tokenizer.get_vocab():
                raise ValueError("the tokenizer's chat template has no tool support and it is not ChatML")
            self.template, self.fallback = HERMES_CHATML, True
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.eot = tokenizer.eos_token  # end-of-turn text, e.g. <|im_end|>
        self.eot_id = tokenizer.eos_token_id
        self.stop_ids = {self.eot_id}
        self._variables = dict(tokenizer.special_tokens_map)
        self._compiled = _compile(self.template)
        self._encode_cached = functools.lru_cache(maxsize=64)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
        )

    def text(self, messages: list[Message], tools: list[Tool], *, generation_prompt: bool) -> str:
        msgs = [template_message(m) for m in messages]
        schemas = [template_tool(t) for t in tools] or None
        if self._compiled is not None:
            return self._compiled.render(
                messages=msgs, tools=schemas, add_generation_prompt=generation_prompt, **self._variables
            )
        return self.tokenizer.apply_chat_template(
            msgs, tools=schemas, chat_template=self.template, add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text. The text is cut after every end-of-turn mark and each turn
        is tokenised on its own (identical ids: BPE never merges across a special token), with an
        LRU cache per turn, so the system prompt + tool schemas that every session of a run
        shares are tokenised once."""
        ids: list[int] = []
        start = 0
        while start < len(text):
            end = text.find(self.eot, start)
            end = len(text) if end < 0 else end + len(self.eot)
            ids += self._encode_turn(text[start:end])
            start = end
        return ids

    def _encode_turn(self, text: str) -> list[int]:
        if len(text) < 2048:  # short turns: the cache would cost more than it saves
            return self.tokenizer.encode(text, add_special_tokens=False)
        return list(self._encode_cached(text))

    def render(self, messages: list[Message], tools: list[Tool]) -> list[int]:
        return self.encode(self.text(messages, tools, generation_prompt=True))

    def parse(
        self, completion_ids: list[int], tools: list[Tool], new_call_id: Callable[[], str]
    ) -> tuple[str, str, tuple[ToolCall, ...]]:
        """(content, reasoning, tool calls) of a sampled completion."""
        ids = completion_ids[:-1] if completion_ids and completion_ids[-1] in self.stop_ids else completion_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        reasoning, content = split_reasoning(text) if self.reasoning else ("", text)
        content, calls = parse_tool_calls(content, tools, self.tool_parser) if tools else (content, [])
        return content, reasoning, tuple(ToolCall(id=new_call_id(), name=n, arguments=a) for n, a in calls)


def _compile(template: str):
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # private helper moved: fall back to the public (slower) path
        return None
    return _compile_jinja_template(template)


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def template_tool(t: Tool) -> dict[str, Any]:
    params = t.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": params}}
