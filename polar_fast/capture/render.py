"""Canonical messages → prompt ids with the model's chat template; sampled ids → reply parts.

Choices:
- The template is the tokenizer's own when it can show tools (it mentions `tools` and
  `tool_call`); otherwise the Hermes-style ChatML fallback (template.py), e.g. for SmolLM2.
- Rendering uses transformers' compiled Jinja environment directly (the one
  `apply_chat_template` uses, with the tokenizer's special tokens as variables), skipping its
  per-call deep copies: the proxy renders every request, and prompts reach ~100k characters.
- The rendered text is tokenised with `add_special_tokens=False`, since the template writes
  BOS/role tokens itself; special-token text in the template becomes the special ids.
- Tokenisation goes through the Rust tokenizer's `encode_batch_fast`, which releases the GIL:
  callers run long texts in a worker thread and the event loop keeps serving meanwhile
  (`encode` would hold the GIL for the whole text).
- Tool-call arguments go to the template as objects (HF convention); text that is not a JSON
  object is passed as a string.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable

from polar_fast.capture.parsers import parse_tool_calls, split_reasoning
from polar_fast.capture.skeleton import Skeletons
from polar_fast.capture.template import HERMES_CHATML, template_supports_tools
from polar_fast.capture.tokenizer import fast_encoder
from polar_fast.conversation import Message, Tool, ToolCall

# A conversation whose last turns show what a template prints after a reply: a tool result, a
# user turn and the generation prompt (see `Renderer.tools_reach_suffix`).
_PROBE = [
    Message(role="system", content="s"),
    Message(role="user", content="u"),
    Message(role="assistant", content="a", tool_calls=(ToolCall(id="c", name="f", arguments='{"x": 1}'),)),
    Message(role="tool", content="r", tool_call_id="c"),
    Message(role="user", content="v"),
]
_CACHE_MIN_CHARS = 2048  # turns at least this long are cached (system prompts, tool schemas)
_CACHE_TURNS = 64


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
        # The Rust byte-level BPE (same ids, faster) where it reproduces this tokenizer
        # exactly, else the HF tokenizers backend of a fast tokenizer, else the slow tokenizer.
        self._fast = fast_encoder(tokenizer)
        # Texts up to this long cost less to tokenise on the event loop than a thread hop does.
        self.inline_encode_chars = 16384 if self._fast is not None else 1024
        backend = getattr(tokenizer, "_tokenizer", None)
        self._batch = getattr(backend, "encode_batch_fast", None)
        # transformers' decode of a fast tokenizer is the backend's, plus an optional clean-up of
        # spaces; calling the backend skips the wrapper where that is off
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=False)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        # long turns -> ids, LRU; arrays, which the garbage collector never walks (lists it would)
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cache_lock = threading.Lock()  # encode() runs in worker threads
        self._tools_reach_suffix: dict[bytes, bool] = {}
        self._ends_cache: dict[tuple, int] = {}  # see _ends_through
        self.skeletons = Skeletons(self.text_after)  # exact-history suffixes without Jinja, checked

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
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> array:
        """Token ids of rendered text, as array("i"). The text is cut after every end-of-turn
        mark and each turn is tokenised on its own (identical ids: BPE never merges across a
        special token), with an LRU cache of long turns, so the system prompt + tool schemas
        that every session of a run shares are tokenised once. Uncached turns go to the
        tokenizer in one batch; parts are joined as arrays (a list of 2e4 Python ints cost more
        than tokenising them)."""
        turns: list[str] = []
        start = 0
        while start < len(text):
            end = text.find(self.eot, start)
            end = len(text) if end < 0 else end + len(self.eot)
            turns.append(text[start:end])
            start = end
        parts: list[array | None] = [self._cached(t) for t in turns]
        todo = [i for i, p in enumerate(parts) if p is None]
        if todo:
            for i, ids in zip(todo, self._encode_many([turns[i] for i in todo])):
                parts[i] = ids
                if len(turns[i]) >= _CACHE_MIN_CHARS:
                    self._remember(turns[i], ids)
        out = array("i")
        for part in parts:
            out.extend(part)  # type: ignore[arg-type]
        return out

    def encode_suffix(self, text: str) -> array:
        """`encode(text)` for the new suffix of an exact-history call. The turn cache is for
        text every session shares (system prompts, tool schemas), which a suffix of new tool
        results and messages never is."""
        return self._encode_many([text])[0]

    def _encode_many(self, texts: list[str]) -> list[array]:
        if self._fast is not None:  # int32 bytes from Rust: no Python int per token
            out = []
            for text in texts:
                ids = array("i")
                ids.frombytes(self._fast.encode_bytes(text))
                out.append(ids)
            return out
        if self._batch is not None:
            return [array("i", e.ids) for e in self._batch(texts, add_special_tokens=False)]
        return [array("i", self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def _cached(self, turn: str) -> array | None:
        if len(turn) < _CACHE_MIN_CHARS:  # short turns: the cache would cost more than it saves
            return None
        with self._cache_lock:
            ids = self._cache.get(turn)
            if ids is not None:
                self._cache.move_to_end(turn)
            return ids

    def _remember(self, turn: str, ids: array) -> None:
        with self._cache_lock:
            self._cache[turn] = ids
            if len(self._cache) > _CACHE_TURNS:
                self._cache.popitem(last=False)

    def text_after(
        self, messages: list[Message], tools: list[Tool], n_through: int, *, tools_key: bytes | None = None
    ) -> str | None:
        """Rendered text (with the generation prompt) after the end-of-turn that closes
        messages[n_through - 1], or None when the template does not close it with one. Its
        position is the end-of-turn count of the render of messages[:n_through]. With
        `tools_key` (naming `tools`, b"" for none; only for short stand-in conversations, it
        keys a cache), that render is skipped when messages of the same shape were counted."""
        n_ends = self._ends_through(messages[:n_through], tools, tools_key)
        text = self.text(messages, tools, generation_prompt=True)
        at = -len(self.eot)
        for _ in range(n_ends):
            at = text.find(self.eot, at + len(self.eot))
            if at < 0:
                return None
        return text[at + len(self.eot) :] if n_ends else None

    def _ends_through(self, messages: list[Message], tools: list[Tool], tools_key: bytes | None) -> int:
        """End-of-turn marks in the render of `messages`. A template prints them per turn, not
        per character of content: messages with the same roles and the same fields set give
        the same count, unless a text holds the mark itself (then it is counted afresh)."""
        shape = None
        if tools_key is not None and (tools_key or not tools):
            eot = self.eot
            shape = (tools_key, *(
                (m.role, bool(m.content), bool(m.reasoning), tuple(bool(c.arguments) for c in m.tool_calls), bool(m.tool_call_id))
                for m in messages
            ))
            if any(eot in m.content or eot in m.reasoning or any(eot in c.arguments or eot in c.name or eot in c.id for c in m.tool_calls)
                   for m in messages):
                shape = None
        n = self._ends_cache.get(shape) if shape is not None else None
        if n is None:
            n = self.text(messages, tools, generation_prompt=False).count(self.eot)
            if shape is not None:
                if len(self._ends_cache) >= 1024:
                    self._ends_cache.clear()
                self._ends_cache[shape] = n
        return n

    def tools_reach_suffix(self, tools: list[Tool], key: bytes) -> bool:
        """Whether the template prints anything tool-dependent after an assistant reply (most
        print tool schemas only in the system turn). Probed once per tool set (`key`): the
        probe's text after the reply, with and without the tools."""
        if not tools:
            return False
        known = self._tools_reach_suffix.get(key)
        if known is None:
            known = self.text_after(_PROBE, tools, 3) != self.text_after(_PROBE, [], 3)
            if len(self._tools_reach_suffix) >= 256:
                self._tools_reach_suffix.clear()
            self._tools_reach_suffix[key] = known
        return known

    def render(self, messages: list[Message], tools: list[Tool]) -> array:
        """Prompt ids of a conversation, as array("i") (a Sequence[int])."""
        return self.encode_array(self.text(messages, tools, generation_prompt=True))

    def parse(
        self, completion_ids: list[int], tools: list[Tool], new_call_id: Callable[[], str]
    ) -> tuple[str, str, tuple[ToolCall, ...]]:
        """(content, reasoning, tool calls) of a sampled completion."""
        ids = completion_ids[:-1] if completion_ids and completion_ids[-1] in self.stop_ids else completion_ids
        text = self._decode(ids)
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


def template_message(m: Message, *, parse_arguments: bool = True) -> dict[str, Any]:
    """A message as OpenAI-style chat dicts. Chat templates want tool-call arguments as objects;
    an OpenAI-compatible server (vLLM's chat route) wants the JSON text: parse_arguments=False."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _arguments(c.arguments) if parse_arguments else c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def template_tool(t: Tool) -> dict[str, Any]:
    params = t.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": params}}
