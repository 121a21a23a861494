"""Reply parsing: `<think>` reasoning and tool calls, chosen per model (`model.tool_parser`).

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one object or a list of
  objects per block (SmolLM2 writes a list); `arguments` may be an object or its JSON text.
- qwen3_coder: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`;
  a value is kept as a string when the tool schema says string, else read as JSON when it parses.
A reply with any malformed call (bad JSON, no name, non-object arguments, unclosed block) is
returned whole as plain content with no calls: the harness sees what the model wrote, and the
proxy never fails on model output.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from polar_fast.conversation import Tool
from polar_fast.errors import PolarError

ParsedCall = tuple[str, str]  # (name, arguments as JSON object text)


class Malformed(PolarError, ValueError):
    """Tool-call text that does not parse; the parser hands it back as content."""


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content). Some templates open <think> in the prompt, so only the close counts."""
    end = text.find("</think>")
    if end < 0:
        if text.lstrip().startswith("<think>"):  # cut off while thinking
            return text.lstrip()[len("<think>") :].strip(), ""
        return "", text
    reasoning = text[:end]
    start = reasoning.find("<think>")
    if start >= 0:
        reasoning = reasoning[start + len("<think>") :]
    return reasoning.strip(), text[end + len("</think>") :].lstrip()


_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _dump(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def _hermes_call(obj: Any) -> ParsedCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise Malformed("tool call without a name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise Malformed("tool call arguments are not an object")
    return obj["name"], _dump(args)


def parse_hermes(text: str, tools: list[Tool]) -> tuple[str, list[ParsedCall]]:
    calls: list[ParsedCall] = []
    for block in _BLOCK.findall(text):
        obj = json.loads(block.strip())
        for item in obj if isinstance(obj, list) else [obj]:
            calls.append(_hermes_call(item))
    rest = _BLOCK.sub("", text)
    if "<tool_call>" in rest:
        raise Malformed("unclosed <tool_call>")
    return rest.strip(), calls


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _param_value(raw: str, schema: dict[str, Any]) -> Any:
    value = raw.strip("\n")
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_qwen3_coder(text: str, tools: list[Tool]) -> tuple[str, list[ParsedCall]]:
    schemas = {t.name: (t.parameters or {}).get("properties", {}) for t in tools}
    calls: list[ParsedCall] = []
    for block in _BLOCK.findall(text):
        functions = _FUNCTION.findall(block)
        if not functions:
            raise Malformed("<tool_call> without <function=...>")
        for name, body in functions:
            props = schemas.get(name.strip(), {})
            args = {k.strip(): _param_value(v, props.get(k.strip(), {})) for k, v in _PARAMETER.findall(body)}
            calls.append((name.strip(), _dump(args)))
    rest = _BLOCK.sub("", text)
    if "<tool_call>" in rest or "<function=" in rest:
        raise Malformed("unclosed tool call")
    return rest.strip(), calls


PARSERS: dict[str, Callable[[str, list[Tool]], tuple[str, list[ParsedCall]]]] = {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
}


def parse_tool_calls(text: str, tools: list[Tool], parser: str) -> tuple[str, list[ParsedCall]]:
    """(content without the calls, calls); malformed output comes back whole as content."""
    try:
        return PARSERS[parser](text, tools)
    except (Malformed, ValueError, RecursionError):
        return text, []
