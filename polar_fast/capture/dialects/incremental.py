"""A session's successive requests parsed by decoding only what is new in each.

A harness resends the whole conversation on every call (~100 kB late in a run) and appends a
message or two: decoding it all again was the proxy's largest cost per call. We keep the last
requests' bytes, the byte spans of their conversation items (the dialect's `ITEMS` array, found
by `polar_fast.wire.json_value_span` / `json_array_items`) and their parse state (`Fold` marks). A new
request that shares a byte prefix covering the first k items of one of them decodes only items
k.. (msgspec) and resumes the fold after item k - 1. When the bytes after its item array are
unchanged too, every other field of the earlier Conversation is kept; when they changed (Codex
sends a new turn id each call, Claude Code a changed tool list) the request is decoded without
its items, and the fold resumes only if what it depends on (system prompt, tool definitions) is
unchanged.

Everything else (a session's first request, a new system prompt, an edited message before the
shared prefix ends, a malformed body) is a full parse, which also produces every
error message: the incremental path never raises and never answers differently (tests compare
it with the full parse on random edits). Reused messages are the same objects, so history
matching compares them by identity.
"""

from __future__ import annotations

from bisect import bisect_right

import msgspec

from polar_fast.capture.dialects import Dialect, DialectError, Fold, fold_items
from polar_fast.conversation import Conversation
from polar_fast.wire import common_prefix_len, json_array_items, json_value_span

_RECENT = 3  # requests remembered: a harness may interleave a side conversation (titles, summaries)


class _Parsed(msgspec.Struct):
    body: bytes
    open: int  # offset of the item array's `[`
    ends: list[int]  # end offset of each item
    close: int  # offset of its `]`
    conv: Conversation
    fold: Fold


class IncrementalParser:
    """`parse(body)` equals `dialect.parse(body)`, at the cost of the new items only when the
    body extends one of the last few it parsed."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._item_list = list[dialect.ITEM]  # type: ignore[name-defined]
        self._recent: list[_Parsed] = []
        self.n_full = 0
        self.n_incremental = 0

    def parse(self, body: bytes) -> Conversation:
        if self._recent:
            best = self._recent[-1]
            shared = common_prefix_len(best.body, body)
            all_items = best.ends[-1] if best.ends else best.open + 1  # bytes through its last item
            if shared < all_items:  # not an extension of all of the last request's items: maybe of an earlier one
                for recent in self._recent[:-1]:
                    n = common_prefix_len(recent.body, body)
                    if n > shared:
                        best, shared = recent, n
            parsed = self._extend(best, body, shared)
            if parsed is not None:
                self.n_incremental += 1
                self._keep(parsed, replacing=best)
                return parsed.conv
        conv, fold = self.dialect.parse_fold(body)  # raises the dialect's errors
        self.n_full += 1
        parsed = self._scan(body, conv, fold)
        if parsed is not None:
            self._keep(parsed)
        return conv

    def _keep(self, parsed: _Parsed, replacing: _Parsed | None = None) -> None:
        if replacing is not None:
            self._recent.remove(replacing)
        self._recent.append(parsed)
        del self._recent[:-_RECENT]

    def _scan(self, body: bytes, conv: Conversation, fold: Fold) -> _Parsed | None:
        span = json_value_span(body, self.dialect.ITEMS)
        scanned = json_array_items(body, span[0]) if span is not None else None
        if span is None or scanned is None:  # e.g. responses `input` as a plain string
            return None
        spans, close = scanned
        if len(spans) != fold.n_items:  # cannot happen for a body msgspec decoded; never guess
            return None
        return _Parsed(body, span[0], [e for _, e in spans], close, conv, fold)

    def _extend(self, last: _Parsed, body: bytes, shared: int) -> _Parsed | None:
        k = bisect_right(last.ends, shared)  # items whose bytes are all shared
        if k == 0 and shared <= last.open:
            return None
        scanned = json_array_items(body, last.ends[k - 1] if k else last.open, after_item=k > 0)
        if scanned is None:
            return None
        spans, close = scanned
        tail = memoryview(last.body)[last.close :]
        try:
            items = msgspec.json.decode(b"[" + body[spans[0][0] : spans[-1][1]] + b"]", type=self._item_list) if spans else []
            fold = last.fold.resumed(k)
            if len(body) - close == len(tail) and body.endswith(tail):
                fold_items(fold, items, k)
                conv = self.dialect.extend(last.conv, fold)
            else:  # other fields changed (harness metadata, a tool added): decode them, not the items
                rest = body[: last.open] + b"[]" + body[close + 1 :]
                if json_value_span(rest, self.dialect.ITEMS) != (last.open, last.open + 2):
                    return None  # the key again further on: a decoder would take that one
                req: object = msgspec.json.decode(rest, type=self.dialect.REQUEST)
                if self.dialect.start(req).context() != fold.context():
                    return None  # e.g. a new system prompt: what the items convert to may differ
                fold_items(fold, items, k)
                conv = self.dialect.finish(req, fold)
        except (msgspec.DecodeError, msgspec.ValidationError, DialectError):
            return None  # the full parse says what is wrong
        return _Parsed(body, last.open, last.ends[:k] + [e for _, e in spans], close, conv, fold)
