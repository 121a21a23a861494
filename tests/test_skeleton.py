"""Suffix skeletons (capture/skeleton.py) give exactly the Jinja text after a reply, for the SmolLM2
fallback template and other layouts, on random new messages; templates that trim, escape or
branch on a message's text are caught (at learning, or by the checked and audited uses)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_fast.capture import skeleton as sk
from polar_fast.conversation import Message, Tool, ToolCall
from polar_fast.model import load_tokenizer
from polar_fast.testing import renderer_with_template

TOOLS = [Tool(name="bash", description="run", parameters={"type": "object", "properties": {"command": {"type": "string"}}})]
ID_IN_RESULT = (  # prints each tool result's call id; tools listed at the end of every render
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if tools %}[{{ tools | length }} tools]{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{# tools tool_call #}"
)
BRANCHES_ON_TEXT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if 'ERROR' in m.content %}(failed) {% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{# tools tool_call #}"
)
HEAD = [Message(role="system", content="x"), Message(role="user", content="x")]
CALL = ToolCall(id="c1", name="bash", arguments='{"command": "ls"}')


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("")




_texts = st.text(max_size=30) | st.sampled_from(["", " padded \n", "<|im_end|>", "</tool_response>", '{"a": "\\""}', "é\u2028"])
_new = st.lists(
    st.tuples(st.sampled_from(["tool", "tool", "user", "system"]), _texts, st.booleans()).map(
        lambda t: Message(role=t[0], content=t[1], tool_call_id="call_9" if t[0] == "tool" and t[2] else "")
    ),
    min_size=1,
    max_size=4,
)
_replies = st.sampled_from([
    Message(role="assistant", content="", tool_calls=(CALL,)),
    Message(role="assistant", content="Running it.", tool_calls=(CALL, CALL)),
    Message(role="assistant", content="Done.", reasoning="checked"),
])


@pytest.mark.parametrize("template", [None, ID_IN_RESULT], ids=["fallback", "id_in_result"])
def test_skeleton_text_equals_jinja(tokenizer, template):
    r = renderer_with_template(tokenizer, template)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(_replies, _new, st.booleans())
    def check(reply, new, with_tools):
        tools, key = (TOOLS, b"tools-1") if with_tools else ([], b"")
        want = r.text_after([*HEAD, reply, *new], tools, len(HEAD) + 1, tools_key=key)
        assert r.skeletons.text_after(HEAD, reply, new, tools, key) == want

    check()
    assert r.skeletons.served > 100 and r.skeletons.retired == 0


def test_a_template_that_trims_gets_no_skeleton(tokenizer):
    r = renderer_with_template(tokenizer, TRIMS)
    reply, new = Message(role="assistant", content="ok"), [Message(role="user", content="  spaced  ")]
    for _ in range(5):
        assert r.skeletons.text_after(HEAD, reply, new, [], b"") == r.text_after([*HEAD, reply, *new], [], 3)
    assert r.skeletons.served == 0


def test_a_template_that_reads_the_text_is_caught_by_a_checked_or_audited_use(tokenizer, monkeypatch):
    r = renderer_with_template(tokenizer, BRANCHES_ON_TEXT)
    reply = Message(role="assistant", content="ok")
    plain, failing = [Message(role="user", content="fine")], [Message(role="user", content="ERROR: no")]
    jinja = lambda new: r.text_after([*HEAD, reply, *new], [], 3)  # noqa: E731
    # the markers show no branch: the skeleton is learnt, and serves plain texts exactly
    for _ in range(sk.CHECKED_USES + 3):
        assert r.skeletons.text_after(HEAD, reply, plain, [], b"") == jinja(plain)
    assert r.skeletons.served >= 3 and r.skeletons.retired == 0
    # an audited use that sees the branch retires it, and that call gets the Jinja text
    monkeypatch.setattr(sk, "AUDIT_EVERY", 1)
    assert r.skeletons.text_after(HEAD, reply, failing, [], b"") == jinja(failing)
    assert r.skeletons.retired == 1
    assert r.skeletons.text_after(HEAD, reply, failing, [], b"") == jinja(failing)  # Jinja from now on
