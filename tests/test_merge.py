"""The merge: Rust == Python reference, plus the invariants the learner relies on.

Every invariant test runs on both implementations through the `merge_impl` fixture, which calls
them as the learner does: through the face, `polar_fast.merge.merge(..., impl=...)`.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from merge_traces import group_traces

from polar_fast import merge as rust
from polar_fast.errors import MergeError
from polar_fast.merge import reference as reference
from polar_fast.merge.arrays import EXTRA_FIELDS, TOKEN_FIELDS, Merged
from polar_fast.records import CallRecord

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = ("tree", "paths")


@pytest.fixture(scope="module", params=rust.IMPLS)
def merge_impl(request):
    return SimpleNamespace(merge=functools.partial(rust.merge, impl=request.param),
                           pack=functools.partial(rust.pack, impl=request.param))


def test_the_face_selects_the_reference_and_refuses_other_impls():
    calls = [call("a", [1, 2], [3]), call("b", [1, 2], [4])]
    assert_same(rust.merge(calls, impl="reference"), reference.merge(calls))
    assert rust.pack_plans(rust.merge(calls), max_tokens=8, impl="reference")[0].index.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="merge impl"):
        rust.merge(calls, impl="python")  # type: ignore[arg-type]


def call(rollout: str, prompt: list[int], completion: list[int], version: int = 0, index: int = 0) -> CallRecord:
    return CallRecord(
        session_id=rollout, rollout_id=rollout, group_id="g", call_index=index,
        prompt_ids=prompt, completion_ids=completion,
        completion_logprobs=[-(t + 1) / 8 for t in completion],
        policy_version=version, finish_reason="stop", dialect="chat",
    )


def sequences(m) -> list[list[int]]:
    return [m.tokens[a:b].tolist() for a, b in zip(m.offsets[:-1], m.offsets[1:])]


def assert_same(a: Merged, b: Merged) -> None:
    assert a.stats == b.stats
    assert a.rollout_ids == b.rollout_ids
    for name in TOKEN_FIELDS + EXTRA_FIELDS + ("offsets",):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


# ------------------------------------------------------------------------------ Rust == reference


@SETTINGS
@given(calls=group_traces(), layout=st.sampled_from(LAYOUTS), max_tokens=st.integers(1, 40))
def test_rust_equals_reference(calls, layout, max_tokens):
    a, b = rust.merge(calls, layout=layout), reference.merge(calls, layout=layout)
    assert_same(a, b)
    try:
        expected = reference.pack_plans(b, max_tokens=max_tokens)
    except MergeError:
        with pytest.raises(MergeError):
            rust.pack_plans(a, max_tokens=max_tokens)
        return
    got = rust.pack_plans(a, max_tokens=max_tokens)
    assert len(got) == len(expected)
    for p, q in zip(got, expected):
        for name in ("index", "parent", "size", "loss_mask", "offsets", "extra_ids", "extra_index"):
            np.testing.assert_array_equal(getattr(p, name), getattr(q, name), err_msg=name)


@SETTINGS
@given(calls=group_traces())
def test_msgpack_and_object_inputs_agree(calls):
    payload = msgspec.msgpack.encode(calls)
    assert_same(rust.merge(payload), rust.merge(calls))

    class Plain:  # any object with the record's attributes
        def __init__(self, c: CallRecord) -> None:
            for f in ("rollout_id", "prompt_ids", "completion_ids", "completion_logprobs", "policy_version"):
                setattr(self, f, getattr(c, f))

    assert_same(rust.merge([Plain(c) for c in calls]), rust.merge(calls))


# ---------------------------------------------------------------------------------- invariants


def expected_samples(calls) -> Counter:
    """(token path, rollout, logprob, version) for every sampled token of every call."""
    out = Counter()
    for c in calls:
        seq = c.prompt_ids + c.completion_ids
        for j, lp in enumerate(c.completion_logprobs):
            i = len(c.prompt_ids) + j
            out[(tuple(seq[: i + 1]), c.rollout_id, float(np.float32(lp)), c.policy_version)] += 1
    return out


def prefix_of(batch, i: int) -> tuple[int, ...]:
    chain = []
    while i >= 0:
        chain.append(int(batch.tokens[i]))
        i = int(batch.parent[i])
    return tuple(reversed(chain))


def loss_terms(batch, rollout_ids) -> Counter:
    """The same tuples, read back from merge output: primary samples plus extras."""
    out = Counter()
    for i in np.flatnonzero(batch.loss_mask):
        out[(prefix_of(batch, i), rollout_ids[batch.rollout[i]], float(batch.logprobs[i]), int(batch.versions[i]))] += 1
    for e, i in enumerate(batch.extra_index):
        out[(prefix_of(batch, int(i)), rollout_ids[batch.extra_rollout[e]], float(batch.extra_logprob[e]),
             int(batch.extra_version[e]))] += 1
    return out


@SETTINGS
@given(calls=group_traces(), layout=st.sampled_from(LAYOUTS))
def test_every_sample_is_one_loss_term_with_its_logprob(merge_impl, calls, layout):
    m = merge_impl.merge(calls, layout=layout)
    assert loss_terms(m, m.rollout_ids) == expected_samples(calls)
    assert int(m.loss_mask.sum()) + len(m.extra_index) == m.stats.n_samples == sum(len(c.completion_ids) for c in calls)


@SETTINGS
@given(calls=group_traces())
def test_every_path_is_a_call_and_every_call_lies_on_a_path(merge_impl, calls):
    m = merge_impl.merge(calls, layout="paths")
    paths = sequences(m)
    seqs = [c.prompt_ids + c.completion_ids for c in calls]
    assert all(p in seqs for p in paths)
    assert all(any(p[: len(s)] == s for p in paths) for s in seqs)
    assert m.stats.n_leaves == len(paths)


@SETTINGS
@given(calls=group_traces())
def test_tree_holds_each_prefix_once_and_size_encodes_ancestry(merge_impl, calls):
    m = merge_impl.merge(calls, layout="tree")
    prefixes = [prefix_of(m, i) for i in range(len(m.tokens))]
    assert len(set(prefixes)) == len(prefixes) == m.stats.n_nodes
    distinct = {tuple(s[: k + 1]) for c in calls for s in [c.prompt_ids + c.completion_ids] for k in range(len(s))}
    assert set(prefixes) == distinct
    for q in range(len(m.tokens)):
        by_rule = {k for k in range(len(m.tokens)) if k <= q < k + m.size[k]}
        by_parent, k = set(), q
        while k >= 0:
            by_parent.add(k)
            k = int(m.parent[k])
        assert by_rule == by_parent
        assert m.positions[q] == len(by_parent) - 1


@SETTINGS
@given(calls=group_traces(), layout=st.sampled_from(LAYOUTS), max_tokens=st.integers(1, 40))
def test_packing_keeps_every_loss_term_once_within_budget(merge_impl, calls, layout, max_tokens):
    m = merge_impl.merge(calls, layout=layout)
    try:
        batches = merge_impl.pack(m, max_tokens=max_tokens)
    except MergeError:
        longest = max(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
        assert longest > max_tokens
        return
    assert all(0 < len(b) <= max_tokens for b in batches)
    total = Counter()
    for b in batches:
        total += loss_terms(b, m.rollout_ids)
        np.testing.assert_array_equal(b.positions[b.parent >= 0], b.positions[b.parent[b.parent >= 0]] + 1)
    assert total == expected_samples(calls)
    covered = set(np.concatenate([b.node for b in batches]).tolist())
    assert covered == set(m.node.tolist())


# ------------------------------------------------------------------------------ worked examples


def test_worked_example_tree(merge_impl):
    calls = [
        call("a", [1, 2, 3], [4, 5]),
        call("b", [1, 2, 3], [4, 6]),  # same prompt, samples 4 too: an extra sample
        call("a", [1, 2, 3, 4, 5, 7], [8]),  # exact-history extension
        call("a", [1, 2, 9], [10]),  # compaction: leaves inside the earlier prompt
        call("b", [11], [12]),  # sub-agent: a new root
    ]
    m = merge_impl.merge(calls)
    assert m.tokens.tolist() == [1, 2, 3, 4, 5, 7, 8, 6, 9, 10, 11, 12]
    assert m.parent.tolist() == [-1, 0, 1, 2, 3, 4, 5, 3, 1, 8, -1, 10]
    assert m.size.tolist() == [10, 9, 6, 5, 3, 2, 1, 1, 2, 1, 2, 1]
    assert m.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1]
    assert m.offsets.tolist() == [0, 10, 12]
    assert m.extra_index.tolist() == [3] and m.extra_rollout.tolist() == [1]
    assert m.rollout_ids == ["a", "b"]
    s = m.stats
    assert (s.extend, s.completion_fork, s.in_prompt, s.new_root, s.in_completion) == (2, 1, 1, 1, 0)
    assert s.n_call_tokens == 23 and s.n_nodes == 12


def test_worked_example_split_repeats_ancestors_without_loss(merge_impl):
    calls = [call("a", [1], [2, 3, 4]), call("a", [1, 2], [5, 6])]
    m = merge_impl.merge(calls)
    batches = merge_impl.pack(m, max_tokens=4)
    assert [b.tokens.tolist() for b in batches] == [[1, 2, 3, 4], [1, 2, 5, 6]]
    assert [b.loss_mask.tolist() for b in batches] == [[0, 1, 1, 1], [0, 0, 1, 1]]
    assert batches[1].versions.tolist() == [-1, -1, 0, 0]


def test_stripped_thinking_is_a_break_inside_a_completion(merge_impl):
    calls = [call("a", [1, 2], [50, 51, 3]), call("a", [1, 2, 3, 9], [4])]
    assert merge_impl.merge(calls).stats.in_completion == 1


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"prompt_ids": [-1]}, "out of range"),
        ({"prompt_ids": [2**31]}, "out of range"),
        ({"policy_version": 2**40}, "out of range"),
    ],
)
def test_bad_input_raises_merge_error(merge_impl, bad, match):
    record = msgspec.structs.replace(call("a", [1], [2]), **bad)
    with pytest.raises(MergeError, match=match):
        merge_impl.merge([record])


def test_mismatched_logprobs_raise_merge_error(merge_impl):
    class Loose:
        rollout_id, prompt_ids, completion_ids, completion_logprobs, policy_version = "a", [1], [2, 3], [0.0], 0

    with pytest.raises(MergeError, match="logprobs"):
        merge_impl.merge([Loose()])


def test_rust_rejects_garbage_bytes_and_bad_layout():
    with pytest.raises(MergeError):
        rust.merge(b"\x93not msgpack")
    with pytest.raises(MergeError):
        rust.merge([call("a", [1], [2])], layout="dag")
    with pytest.raises(MergeError):
        rust.pack(rust.merge([call("a", [1], [2])]), max_tokens=0)


def test_empty_group(merge_impl):
    m = merge_impl.merge([])
    assert len(m.tokens) == 0 and m.offsets.tolist() == [0] and merge_impl.pack(m, max_tokens=8) == []


@pytest.mark.anyio
async def test_merge_releases_the_gil_and_leaves_the_loop_running():
    prompt = list(range(20_000))
    calls = [call(f"r{r}", prompt + [r] * k, list(range(50)), index=k) for r in range(8) for k in range(60)]
    payload = msgspec.msgpack.encode(calls)
    ticks = 0
    task = asyncio.ensure_future(rust.merge_async(payload))
    while not task.done():
        ticks += 1
        await asyncio.sleep(0)
    merged = await task
    assert merged.stats.n_calls == len(calls)
    assert ticks > 1


def test_a_call_holding_a_prompt_delta_is_refused():
    # On disk an exact-history call stores only its new prompt ids; merging that tail as if it
    # were the whole prompt would train on the wrong context.
    whole = CallRecord(session_id="s", rollout_id="r", group_id="g", call_index=0, prompt_ids=[1, 2, 3],
                       completion_ids=[4], completion_logprobs=[-0.1], policy_version=0, finish_reason="stop",
                       dialect="chat")
    delta = msgspec.structs.replace(whole, call_index=1, prompt_ids=[5], prefix_call=0, n_prefix=4)
    rust.merge([whole])  # fine
    with pytest.raises(MergeError, match="prompt delta"):
        rust.merge([whole, delta])
