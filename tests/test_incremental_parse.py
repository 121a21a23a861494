"""Incremental request parsing (capture/dialects/incremental.py) answers exactly what a full parse does.

Sessions are built from the requests the five real CLIs sent (tests/data/harness_requests): the
conversation grows one item at a time as a harness resends it, with random edits mixed in (an
older item changed, items dropped, a field changed, invalid items, bytes cut or flipped, another
conversation interleaved). Every body must parse to the same Conversation as the dialect's own
parse, or fail with the same error."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_fast.capture.dialects import DialectError, anthropic, responses
from polar_fast.capture.dialects import chat_completions as chat
from polar_fast.capture.dialects.incremental import IncrementalParser

DATA = Path(__file__).parent / "data" / "harness_requests"
DIALECTS = {"codex": responses, "claude-code": anthropic, "qwen-code": chat, "pi": chat, "mini-swe-agent": chat}
REQUESTS = {h: json.loads((DATA / f"{h}.json").read_text()) for h in DIALECTS}


def _outcome(parse, body: bytes):
    try:
        return parse(body)
    except DialectError as e:
        return ("error", e.status, e.message)


def _body(doc: dict, compact: bool) -> bytes:
    return json.dumps(doc, separators=(",", ":") if compact else (", ", ": "), ensure_ascii=False).encode()


@pytest.mark.parametrize("changing_tail", [False, True], ids=["same_tail", "turn_id_after_items"])
@pytest.mark.parametrize("harness", sorted(DIALECTS))
def test_growing_conversation_is_parsed_incrementally(harness, changing_tail):
    dialect, doc = DIALECTS[harness], REQUESTS[harness]
    items = doc[dialect.ITEMS]
    parser = IncrementalParser(dialect)
    previous = None
    for n in range(1, len(items) + 1):
        tail = {"metadata": {"turn_id": f"turn-{n}"}} if changing_tail else {}
        body = _body(doc | {dialect.ITEMS: items[:n]} | tail, compact=True)
        conv = parser.parse(body)
        assert conv == dialect.parse(body)
        if previous is not None:  # the resent messages are the very objects parsed before
            reused = sum(a is b for a, b in zip(previous.messages, conv.messages))
            assert reused >= len(previous.messages) - 1
        previous = conv
    assert parser.n_full == 1 and parser.n_incremental == len(items) - 1


@pytest.mark.parametrize("harness", sorted(DIALECTS))
def test_a_side_conversation_in_between_keeps_the_main_one_incremental(harness):
    """Harnesses interleave short side calls (titles, summaries): the main conversation's next
    request still extends its own last request, not the side call parsed after it."""
    dialect, doc = DIALECTS[harness], REQUESTS[harness]
    items = doc[dialect.ITEMS]
    side = _body(doc | {dialect.ITEMS: [items[0], items[0]], "model": "side-model"}, compact=True)
    parser = IncrementalParser(dialect)
    previous = None
    for n in range(1, len(items) + 1):
        body = _body(doc | {dialect.ITEMS: items[:n]}, compact=True)
        conv = parser.parse(body)
        assert conv == dialect.parse(body)
        if previous is not None:  # decoded from the main conversation's last request
            assert sum(a is b for a, b in zip(previous.messages, conv.messages)) >= len(previous.messages) - 1
        previous = conv
        assert parser.parse(side) == dialect.parse(side)
    assert parser.n_full == 2 and parser.n_incremental == 2 * len(items) - 2


_EDITS = st.sampled_from(
    ["grow", "grow", "grow", "same", "edit_old", "drop", "field", "tail_field", "system", "dup_key", "bad_item", "cut", "flip", "other", "spaces"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(DIALECTS)), st.lists(st.tuples(_EDITS, st.integers(0, 10**6)), min_size=2, max_size=10))
def test_equals_full_parse_under_random_edits(harness, edits):
    dialect, doc = DIALECTS[harness], REQUESTS[harness]
    items = doc[dialect.ITEMS]
    parser = IncrementalParser(dialect)
    n = 1
    current = doc | {dialect.ITEMS: items[:1]}
    for edit, r in edits:
        compact = True
        body = None
        if edit == "grow":
            n = min(len(items), n + 1 + r % 2)
            current = current | {dialect.ITEMS: items[:n]}
        elif edit == "edit_old":
            its = list(current[dialect.ITEMS])
            its[r % len(its)] = items[(r // 7) % len(items)]
            current = current | {dialect.ITEMS: its}
        elif edit == "drop":
            its = current[dialect.ITEMS]
            current = current | {dialect.ITEMS: its[: max(1, len(its) - 1 - r % 2)]}
        elif edit == "field":
            current = current | {"model": f"m{r % 3}"}
        elif edit == "tail_field":  # after the items, as Codex's client_metadata (a turn id) is
            current = {k: v for k, v in current.items() if k != "zz"} | {"zz": {"turn": r % 4}}
        elif edit == "system":  # what the items are folded onto (anthropic system, responses instructions)
            key = {"codex": "instructions", "claude-code": "system"}.get(harness, "zz")
            current = {k: v for k, v in current.items() if k != key} | {key: f"be brief {r % 2}"}
        elif edit == "dup_key":  # the item key again after the items: a decoder takes the last one
            text = _body(current, True)
            body = text[:-1] + b',"' + dialect.ITEMS.encode() + (b'":[]}' if r % 2 else b'":' + json.dumps(items[:1]).encode() + b"}")
        elif edit == "bad_item":
            bad = [{"role": 5}, {"type": "nonsense"}, {"role": "user", "content": [{"type": "image"}]}, 7, {}][r % 5]
            body = _body(current | {dialect.ITEMS: [*current[dialect.ITEMS], bad]}, compact)
        elif edit == "spaces":
            compact = False
        elif edit == "other":
            other = REQUESTS[sorted(DIALECTS)[r % len(DIALECTS)]]
            body = _body(other, compact)
        if body is None:
            body = _body(current, compact)
        if edit == "cut":
            body = body[: r % len(body)]
        elif edit == "flip":
            i = r % len(body)
            body = body[:i] + bytes([b'"]},[{: x'[r % 9]]) + body[i + 1 :]
        assert _outcome(parser.parse, body) == _outcome(dialect.parse, body), edit


def test_a_non_array_conversation_is_always_parsed_whole():
    body = msgspec.json.encode({"model": "m", "input": "hello", "stream": True})
    parser = IncrementalParser(responses)
    assert parser.parse(body) == responses.parse(body) and parser.parse(body) == responses.parse(body)
    assert (parser.n_full, parser.n_incremental) == (2, 0)
