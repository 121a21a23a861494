"""The bytes the proxy reads and writes on every call, done in Rust (rust/merge/src/wire and the
crc32fast crate): the one face of those native functions. Everything else imports them from here.

    crc32(data)                      zlib.crc32 of a record frame (SIMD)
    msgpack_int32s(ids)              MessagePack of list(ids), byte for byte as msgspec writes it
    json_int32s(ids)                 JSON of list(ids), byte for byte as msgspec writes it
    json_value_span(body, key)       where top-level `key`'s value sits in a JSON object
    json_array_items(body, at, ...)  where the elements of the array at `at` begin and end
    common_prefix_len(a, b)          length of the longest common prefix

`ids` is a contiguous int32 buffer such as `array("i")`, so no Python int is made per id. The
JSON scanners are structural only: callers decode what they point at with a real decoder. The
pure-Python twin of each function is in wire/reference.py, and the tests hold the two equal.
"""

from __future__ import annotations

from polar_fast._native import (
    common_prefix_len,
    crc32,
    json_array_items,
    json_int32s,
    json_value_span,
    msgpack_int32s,
)

__all__ = ["common_prefix_len", "crc32", "json_array_items", "json_int32s", "json_value_span", "msgpack_int32s"]
