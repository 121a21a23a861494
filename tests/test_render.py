"""Rendering and parsing with the real SmolLM2 tokenizer: fallback template, per-turn encoding,
tool-call parsers (well-formed and malformed), <think> splitting, exact history across templates."""

from __future__ import annotations

import json

import pytest

from polar_fast.capture.history import History
from polar_fast.capture.parsers import parse_tool_calls, split_reasoning
from polar_fast.capture.render import Renderer
from polar_fast.conversation import Message, Tool, ToolCall
from polar_fast.model import load_tokenizer

TOOLS = [Tool(name="bash", parameters={"type": "object", "properties": {"command": {"type": "string"}, "n": {"type": "integer"}}})]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(load_tokenizer(""))


def test_smollm2_uses_the_hermes_fallback(renderer):
    assert renderer.fallback
    text = renderer.text([Message(role="user", content="hi")], TOOLS, generation_prompt=True)
    assert "<tools>" in text and '"name": "bash"' in text and text.endswith("<|im_start|>assistant\n")


def test_per_turn_encoding_equals_whole_text(renderer):
    msgs = [Message(role="system", content="rule " * 3000), Message(role="user", content="go <|im_end|> on " * 50)]
    text = renderer.text(msgs, TOOLS, generation_prompt=True)
    assert renderer.encode(text) == renderer.tokenizer.encode(text, add_special_tokens=False)
    assert renderer.encode(text) == renderer.encode(text)  # cached path too
    assert renderer.encode_suffix(text).tolist() == renderer.encode(text)  # uncached, int32 bytes


def test_reply_decoding_equals_the_tokenizers(renderer):
    # the renderer calls the tokenizers backend directly (no space clean-up configured)
    tok = renderer.tokenizer
    rng = __import__("random").Random(7)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randrange(40))]
        assert renderer._decode(ids) == tok.decode(ids, skip_special_tokens=False)


def test_end_of_turn_counts_cached_by_shape_equal_a_fresh_render():
    renderer = Renderer(load_tokenizer(""))  # its own cache
    call = ToolCall(id="c", name="bash", arguments='{"command": "ls"}')
    replies = [Message(role="assistant", content=text, reasoning=why, tool_calls=calls)
               for text in ("", "done", "say <|im_end|> twice <|im_end|>") for why in ("", "hm")
               for calls in ((), (call,), (call, call))]
    head = [Message(role="system", content="x"), Message(role="user", content="x")]
    for tools, key in (([], b""), (TOOLS, b"tools-1")):
        for _ in range(2):  # the second pass is served from the cache
            for reply in replies:
                msgs = [*head, reply]
                want = renderer.text(msgs, tools, generation_prompt=False).count(renderer.eot)
                assert renderer._ends_through(msgs, tools, key) == want
    assert renderer._ends_cache and len(renderer._ends_cache) < 2 * len(replies)


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        ("hermes", 'ok\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', "ok", [("bash", {"command": "ls"})]),
        ("hermes", '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
        ("hermes", '<tool_call>{"name": "bash", "arguments": {"command": </tool_call>', None, []),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', None, []),
        ("hermes", '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', None, []),
        ("hermes", '<tool_call>{"name": "x", "arguments": {}}', None, []),
        ("qwen3_coder", "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>", "", [("bash", {"command": "ls -la", "n": 3})]),
        ("qwen3_coder", "<tool_call>\n<parameter=command>\nls\n</parameter>\n</tool_call>", None, []),
        ("qwen3_coder", "<tool_call>\n<function=bash>\n<parameter=command>\nls", None, []),
    ],
)
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(text, TOOLS, parser)
    assert [(n, json.loads(a)) for n, a in got] == calls
    assert got_content == (text if content is None else content)


@pytest.mark.parametrize(
    "text,reasoning,content",
    [("<think>\nhmm\n</think>\n\nanswer", "hmm", "answer"), ("hmm</think>answer", "hmm", "answer"),
     ("<think>cut off", "cut off", ""), ("plain", "", "plain")],
)
def test_split_reasoning(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def _run_two_calls(renderer, reply_text: str, second_assistant: Message | None = None):
    tok = renderer.tokenizer
    history = History(renderer)
    msgs = [Message(role="system", content="sys"), Message(role="user", content="do it")]
    p1 = history.prompt(msgs, TOOLS)
    completion = tok.encode(reply_text, add_special_tokens=False) + [tok.eos_token_id]
    content, reasoning, calls = renderer.parse(completion, TOOLS, lambda: "call_1")
    reply = Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls)
    history.remember(p1, completion, reply)
    msgs2 = msgs + [second_assistant or reply, Message(role="tool", content="out", tool_call_id="x")]
    return p1, completion, history.prompt(msgs2, TOOLS)


def test_exact_history_extends_and_matches_scratch_render(renderer):
    p1, completion, p2 = _run_two_calls(renderer, '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    assert p2.history == "exact" and list(p2.ids[: len(p1.ids) + len(completion)]) == list(p1.ids) + completion
    # Client-side whitespace and ids differ, arguments re-serialised: still a match.
    call = ToolCall(id="other", name="bash", arguments='{ "command":"ls" }')
    _, _, p3 = _run_two_calls(renderer, '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', Message(role="assistant", content=" ", tool_calls=(call,)))
    assert p3.history == "exact"


def test_exact_history_keeps_sampled_tokens_the_template_would_change(renderer):
    # Sampled text that the template would render differently (reasoning is not re-rendered by
    # the fallback): the next prompt still holds exactly the sampled ids.
    p1, completion, p2 = _run_two_calls(renderer, "<think>plan</think>Answer.")
    assert p2.history == "exact" and list(p2.ids[: len(p1.ids) + len(completion)]) == list(p1.ids) + completion
    assert p2.ids != renderer.render([Message(role="system", content="sys"), Message(role="user", content="do it"),
                                      Message(role="assistant", content="Answer.", reasoning="plan"),
                                      Message(role="tool", content="out", tool_call_id="x")], TOOLS)


def test_own_template_with_tools_is_used_and_history_cuts_on_turn_ends():
    tok = load_tokenizer("")
    own = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.name }}</tool_call>{% endif %}<|im_end|>\n{% endfor %}{% if tools %}{{ tools | length }}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

    class Tok:  # the real tokenizer with a tool-aware template of its own
        def __getattr__(self, name):
            return getattr(tok, name)

        chat_template = own

    r = Renderer(Tok())
    assert not r.fallback
    _, _, p2 = _run_two_calls(r, "hi")
    assert p2.history == "exact"
