"""Pure-Python twin of polar_fast.wire: short and obviously correct, used by tests and benches
only (Rust == reference on random inputs). The JSON scanners follow rust/merge/src/wire/jsonscan.rs
rules: structural scanning only, a top-level key found at most once and never spelled with an
escape. The codecs are what the Rust ones must equal: zlib and msgspec.
"""

from __future__ import annotations

import zlib
from typing import Iterable

import msgspec

crc32 = zlib.crc32


def msgpack_int32s(ids: Iterable[int]) -> bytes:
    return msgspec.msgpack.encode(list(ids))


def json_int32s(ids: Iterable[int]) -> bytes:
    return msgspec.json.encode(list(ids))

_WS = b" \t\n\r"


def _skip_ws(b: bytes, i: int) -> int:
    while i < len(b) and b[i] in _WS:
        i += 1
    return i


def _string_end(b: bytes, i: int) -> int | None:
    j = i + 1
    while j < len(b):
        if b[j] == ord("\\"):
            j += 2
        elif b[j] == ord('"'):
            return j + 1
        else:
            j += 1
    return None


def value_end(b: bytes, i: int) -> int | None:
    if i >= len(b):
        return None
    c = b[i]
    if c == ord('"'):
        return _string_end(b, i)
    if c in b"{[":
        stack = [c]
        j = i + 1
        while stack:
            if j >= len(b):
                return None
            c = b[j]
            if c == ord('"'):
                end = _string_end(b, j)
                if end is None:
                    return None
                j = end
                continue
            if c in b"{[":
                stack.append(c)
            elif c in b"}]":
                if (stack[-1] == ord("{")) != (c == ord("}")):
                    return None
                stack.pop()
            j += 1
        return j
    if c in b",]}:":
        return None
    j = i
    while j < len(b) and b[j] not in b",]} \t\n\r":
        j += 1
    return j


def json_value_span(b: bytes, key: str) -> tuple[int, int] | None:
    i = _skip_ws(b, 0)
    if b[i : i + 1] != b"{":
        return None
    i = _skip_ws(b, i + 1)
    if b[i : i + 1] == b"}":
        return None
    found = None
    while True:
        if b[i : i + 1] != b'"':
            return None
        key_end = _string_end(b, i)
        if key_end is None:
            return None
        name = b[i + 1 : key_end - 1]
        if b"\\" in name:
            return None
        i = _skip_ws(b, key_end)
        if b[i : i + 1] != b":":
            return None
        i = _skip_ws(b, i + 1)
        end = value_end(b, i)
        if end is None:
            return None
        if name == key.encode():
            if found is not None:
                return None
            found = (i, end)
        i = _skip_ws(b, end)
        if b[i : i + 1] == b",":
            i = _skip_ws(b, i + 1)
        elif b[i : i + 1] == b"}":
            return found
        else:
            return None


def json_array_items(b: bytes, at: int, *, after_item: bool = False) -> tuple[list[tuple[int, int]], int] | None:
    items: list[tuple[int, int]] = []
    if after_item:
        i = _skip_ws(b, at)
        if b[i : i + 1] == b"]":
            return items, i
        if b[i : i + 1] != b",":
            return None
        i = _skip_ws(b, i + 1)
    else:
        if b[at : at + 1] != b"[":
            return None
        i = _skip_ws(b, at + 1)
        if b[i : i + 1] == b"]":
            return items, i
    while True:
        end = value_end(b, i)
        if end is None:
            return None
        items.append((i, end))
        i = _skip_ws(b, end)
        if b[i : i + 1] == b",":
            i = _skip_ws(b, i + 1)
        elif b[i : i + 1] == b"]":
            return items, i
        else:
            return None


def common_prefix_len(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
