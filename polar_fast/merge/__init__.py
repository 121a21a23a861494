"""Prefix-trie merge of a group's captured calls into training sequences (the face of `polar_fast._native`).

`merge(calls, layout=...)` inserts every call of a group of rollouts into one token trie (Rust,
GIL released) and returns `Merged`: numpy arrays, one entry per output token, described in
merge/arrays.py. `pack(merged, max_tokens=...)` bins its sequences into micro-batches. The exact rules
(samples, break causes, layouts, splitting) are stated in merge/reference.py, the pure-Python
twin that the tests hold the Rust crate to.

Callers always come through here. `impl="reference"` runs the Python twin instead of the crate
(same arguments, same results): the tests run both, and bench/ falls back to it where the
extension cannot run.
"""

from __future__ import annotations

import asyncio
from typing import Literal, Sequence, get_args

import msgspec

from polar_fast import _native
from polar_fast.errors import MergeError
from polar_fast.merge.arrays import Layout, Merged, MergeStats, MicroBatch, PackPlan, gather
from polar_fast.records import CallRecord

__all__ = ["IMPLS", "Impl", "MergeError", "MergeStats", "Merged", "MicroBatch", "PackPlan", "gather", "merge",
           "merge_async", "pack", "pack_plans"]

Impl = Literal["rust", "reference"]  # the crate, or its pure-Python twin (merge/reference.py)
IMPLS: tuple[Impl, ...] = get_args(Impl)

_calls_encoder = msgspec.msgpack.Encoder()


def merge(calls: Sequence[CallRecord] | bytes, *, layout: Layout = "tree", impl: Impl = "rust") -> Merged:
    """Merge a group's calls (in capture order) into one trie; see the module docstring.

    `calls` is a list of CallRecord (or objects with the same attributes) or msgpack bytes of a
    list of CallRecord (the Rust crate only). Raises MergeError on inconsistent input (never panics).
    """
    if impl != "rust":
        return _reference(impl).merge(calls, layout=layout)
    if isinstance(calls, (bytes, bytearray, memoryview)):
        payload = bytes(calls)
    elif all(isinstance(c, CallRecord) for c in calls):
        delta = next((c for c in calls if c.prefix_call >= 0), None)
        if delta is not None:  # its prompt_ids are only the tail: merging it would be wrong
            raise MergeError(f"call {delta.session_id}#{delta.call_index} holds a prompt delta; read calls "
                             "through LogContents.calls or Session.records(), which complete them")
        payload = _calls_encoder.encode(list(calls))
    else:
        payload = None
    raw = _native.merge(payload if payload is not None else list(calls), layout=layout)
    return _wrap(raw, layout)


async def merge_async(calls: Sequence[CallRecord] | bytes, *, layout: Layout = "tree") -> Merged:
    """`merge` in a worker thread (the Rust part releases the GIL), so the event loop keeps going."""
    return await asyncio.to_thread(merge, calls, layout=layout)


def pack(merged: Merged, *, max_tokens: int, impl: Impl = "rust") -> list[MicroBatch]:
    """Bin the merged sequences into micro-batches of at most `max_tokens` tokens each."""
    return [gather(merged, plan) for plan in pack_plans(merged, max_tokens=max_tokens, impl=impl)]


def pack_plans(merged: Merged, *, max_tokens: int, impl: Impl = "rust") -> list[PackPlan]:
    """The index plan behind `pack` (which merged positions go where), computed in Rust."""
    if impl != "rust":
        return _reference(impl).pack_plans(merged, max_tokens=max_tokens)
    raw = _native.pack_plan(merged.parent, merged.size, merged.offsets, merged.loss_mask,
                           merged.extra_index, layout=merged.layout, max_tokens=max_tokens)
    return [PackPlan(**plan) for plan in raw]


def _reference(impl: str):
    if impl != "reference":
        raise ValueError(f"merge impl must be one of {', '.join(IMPLS)}, not {impl!r}")
    from polar_fast.merge import reference

    return reference


def _wrap(raw: dict, layout: Layout) -> Merged:
    stats = MergeStats(**raw.pop("stats"))
    return Merged(layout=layout, stats=stats, **raw)
