"""Exact history renders only the new suffix: over many turns its prompts equal the reference
construction (earlier prompt + sampled ids + tokens of the whole render's text after the reply),
for the SmolLM2 fallback template, a template that prints tools after the messages, and one that
moves the system prompt into the last user turn (caught by the per-session check)."""

from __future__ import annotations

import json

import pytest

from polar_fast.capture.history import History
from polar_fast.conversation import Message, Tool, ToolCall
from polar_fast.model import load_tokenizer
from polar_fast.testing import renderer_with_template

TOOLS = [Tool(name="bash", description="run", parameters={"type": "object", "properties": {"command": {"type": "string"}}})]
TOOLS_AT_END = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if tools %}[{{ tools | length }} tools]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM_LAST = (  # Mistral-style: the system prompt is repeated in front of the last user turn
    "{% set sys = messages[0].content if messages[0].role == 'system' else '' %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% elif m.role == 'user' and loop.last %}<|im_start|>user\n{{ sys }} {{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# tools tool_call #}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("")


@pytest.mark.parametrize("template", [None, TOOLS_AT_END, SYSTEM_LAST], ids=["fallback", "tools_at_end", "system_last"])
def test_suffix_prompts_equal_whole_render_reference(tokenizer, template):
    r = renderer_with_template(tokenizer, template)
    history = History(r)
    msgs = [Message(role="system", content="You are terse. " * 40), Message(role="user", content="fix the bug")]
    reference: list[int] = []
    for turn in range(6):
        prompt = history.prompt(msgs, TOOLS)
        if turn == 0:
            assert prompt.history == "render:first_call"
            reference = r.render(msgs, TOOLS).tolist()
        else:
            assert prompt.history == "exact"
            cut = r.text_after(msgs, TOOLS, n_through)
            reference = reference + completion + r.encode(cut)
        assert list(prompt.ids) == reference
        reply_text = f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "ls {turn}"}}}}\n</tool_call>'
        completion = tokenizer.encode(reply_text, add_special_tokens=False) + [tokenizer.eos_token_id]
        content, reasoning, calls = r.parse(completion, TOOLS, lambda: f"call_{turn}")
        reply = Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls)
        history.remember(prompt, completion, reply)
        # The client sends the reply back re-serialised, then a tool result, sometimes a user turn.
        echoed = Message(role="assistant", content=content + " ", tool_calls=tuple(
            ToolCall(id="x", name=c.name, arguments=json.dumps(json.loads(c.arguments), indent=1)) for c in calls))
        msgs = msgs + [echoed, Message(role="tool", content=f"out {turn}\n" * 5, tool_call_id="x")]
        n_through = len(msgs) - 1
        if turn % 2:
            msgs.append(Message(role="user", content=f"now step {turn}"))
    assert history.causes["exact"] == 5
    assert ("exact_full" in history.causes) == (template == SYSTEM_LAST)


def test_tools_reach_suffix_probe(tokenizer):
    tkey = b"k"
    assert not renderer_with_template(tokenizer, None).tools_reach_suffix(TOOLS, tkey)
    assert renderer_with_template(tokenizer, TOOLS_AT_END).tools_reach_suffix(TOOLS, tkey)
