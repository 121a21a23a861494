"""The vLLM wire's big part, made cheaply: the prompt's JSON going out.

A session's prompts grow call by call (exact history: each one is the last one plus the model's
reply plus the new turn), and `/inference/v1/generate` takes the whole prompt as JSON every time:
1e4-1e5 ids. `PromptJsonCache` keeps each session's last prompt with its JSON and formats only the
ids a new prompt adds (in Rust, `polar_fast.wire.json_int32s`). The reply carries no echo of the
prompt (the engine never asks for `return_token_ids` there).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Sequence

import msgspec

from polar_fast.wire import json_int32s


class PromptJsonCache:
    """`json(session_id, ids)` is `msgspec.json.encode(list(ids))`, reusing the session's last
    prompt's JSON when `ids` extends it. Keeps at most `max_bytes` (ids + JSON, ~10 bytes per id),
    least recently used sessions dropped first."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        # session id -> (its last prompt's ids as bytes: immutable, unlike the caller's array; JSON)
        self._last: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        self.hits = 0  # prompts that extended or repeated the session's last one

    def json(self, session_id: str, ids: Sequence[int]) -> bytes:
        if not (isinstance(ids, array) and ids.typecode == "i" and ids):
            return msgspec.json.encode(list(ids))
        raw = ids.tobytes()
        last = self._last.pop(session_id, None)
        if last is not None:
            self._bytes -= len(last[0]) + len(last[1])
        if last is not None and raw.startswith(last[0]):
            self.hits += 1
            n = len(last[0]) // ids.itemsize
            text = last[1] if n == len(ids) else b",".join((memoryview(last[1])[:-1], memoryview(json_int32s(ids[n:]))[1:]))
        else:
            text = json_int32s(ids)
        if session_id and len(raw) + len(text) <= self._max_bytes:
            self._last[session_id] = (raw, text)
            self._bytes += len(raw) + len(text)
            while self._bytes > self._max_bytes:
                _, (old_raw, old_text) = self._last.popitem(last=False)
                self._bytes -= len(old_raw) + len(old_text)
        return text

