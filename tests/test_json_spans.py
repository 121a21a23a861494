"""The Rust JSON span scanner (rust/merge/src/wire/jsonscan.rs) against its Python reference and
against a real JSON decoder: the offsets it gives must cut out exactly the decoded values."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_fast import wire
from polar_fast.wire import reference as ref

SETTINGS = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ['"', "\\", '\\"', "]", "}", "[{", '"]}', "\u2028", "é"]
)
_scalars = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False) | _text
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4), max_leaves=12)
_layout = st.fixed_dictionaries(
    {"indent": st.none() | st.integers(0, 2), "ascii": st.booleans(), "sep": st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")])}
)


def _dumps(value, layout) -> bytes:
    text = json.dumps(value, indent=layout["indent"], ensure_ascii=layout["ascii"], separators=layout["sep"])
    return text.encode()


@SETTINGS
@given(
    st.lists(_values, max_size=6),
    st.dictionaries(st.sampled_from(["model", "tools", "stream", "n", "x"]), _values, max_size=3),
    _layout,
    st.integers(0, 3),
)
def test_spans_cut_out_the_decoded_values(items, others, layout, where):
    doc = dict(list(others.items())[:where]) | {"messages": items} | dict(list(others.items())[where:])
    body = b"  " + _dumps(doc, layout) + b"\n"
    span = wire.json_value_span(body, "messages")
    assert span == ref.json_value_span(body, "messages")
    assert span is not None
    assert json.loads(body[span[0] : span[1]]) == items
    scanned = wire.json_array_items(body, span[0])
    assert scanned == ref.json_array_items(body, span[0])
    spans, close = scanned
    assert close == span[1] - 1
    assert [json.loads(body[s:e]) for s, e in spans] == items
    for k in range(len(spans)):  # resuming after any element gives the rest
        assert wire.json_array_items(body, spans[k][1], after_item=True) == (spans[k + 1 :], close)
        assert ref.json_array_items(body, spans[k][1], after_item=True) == (spans[k + 1 :], close)


@SETTINGS
@given(st.binary(max_size=60) | _values.map(lambda v: json.dumps({"messages": v}).encode()), st.data())
def test_rust_equals_reference_on_any_bytes(body, data):
    if body and data.draw(st.booleans()):  # damage a document: cut it or flip a byte
        i = data.draw(st.integers(0, len(body) - 1))
        body = body[:i] if data.draw(st.booleans()) else body[:i] + bytes([data.draw(st.sampled_from(b'"\\[]{},: x'))]) + body[i + 1 :]
    assert wire.json_value_span(body, "messages") == ref.json_value_span(body, "messages")
    for at in {0, len(body) // 2, max(0, len(body) - 1)}:
        for after in (False, True):
            assert wire.json_array_items(body, at, after_item=after) == ref.json_array_items(body, at, after_item=after)
    other = data.draw(st.binary(max_size=60))
    assert wire.common_prefix_len(body, other) == ref.common_prefix_len(body, other)
    assert wire.common_prefix_len(body, body + other) == len(body)


def test_refusals():
    assert wire.json_value_span(b'{"messages": [], "messages": [1]}', "messages") is None  # twice
    assert wire.json_value_span(b'{"m\\u0065ssages": [1]}', "messages") is None  # escaped key
    assert wire.json_value_span(b'[{"messages": []}]', "messages") is None  # not an object
    assert wire.json_array_items(b"[1, 2", 0) is None
    assert wire.json_array_items(b'{"a": 1}', 0) is None
