"""merge_bench's baselines hold to their definitions: Polar's prefix-merging chain (routing by longest
tip prefix, interstitials after the first end-of-turn token, STOP drops the rest of a chain) and the
lower bound that `pack_overhead` divides by. ChatML-shaped toy ids: 9 = <|im_end|>, 8 = glue."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from polar_fast import merge as rust
from polar_fast.records import CallRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "support"))

from pack_bound import pack_lower_bound  # noqa: E402
from polar_chain import finalize, polar_chain_merge, route  # noqa: E402

EOT, GLUE = 9, 8


def call(prompt: list[int], completion: list[int], index: int = 0, rollout: str = "r0",
         finish: str = "tool_calls") -> CallRecord:
    return CallRecord(session_id=rollout, rollout_id=rollout, group_id="g", call_index=index,
                      prompt_ids=prompt, completion_ids=completion, completion_logprobs=[-0.1] * len(completion),
                      policy_version=0, finish_reason=finish, dialect="chat")


def turn(tool: list[int]) -> list[int]:
    """What a template appends after an assistant body: end of turn, the tool turn, the generation prompt."""
    return [EOT, GLUE] + tool + [EOT, GLUE]


def conversation(system: list[int], bodies: list[list[int]], rollout: str = "r0") -> list[CallRecord]:
    calls, prompt = [], list(system)
    for i, body in enumerate(bodies):
        calls.append(call(prompt, body + [EOT], i, rollout))
        prompt = prompt + body + turn([40 + i, 50 + i])
    return calls


def test_a_strictly_extending_conversation_is_one_trace_with_no_drops():
    calls = conversation([1, 2, 3], [[11, 12], [13], [14, 15, 16]])
    (trace,) = polar_chain_merge(calls, eot=EOT)
    last = calls[-1]
    assert trace.tokens == last.prompt_ids + last.completion_ids  # interstitials from the template's copy
    assert (trace.kept, trace.dropped, trace.drifted) == (3, 0, 0)
    assert sum(trace.loss_mask) == trace.trained == sum(len(c.completion_ids) for c in calls)
    assert finalize(calls).tokens == trace.tokens  # end of turn auto-detected from a natural stop


def test_compaction_starts_a_second_chain():
    calls = conversation([1, 2, 3], [[11, 12], [13]])
    compacted = call([1, 2, 70, 71, GLUE], [14, EOT], 2)  # system + summary: extends no tip
    calls.append(compacted)
    calls.append(call(compacted.prompt_ids + [14] + turn([60]), [15, EOT], 3))
    chains = route(calls)
    assert [[c.call_index for c in chain] for chain in chains] == [[0, 1], [2, 3]]
    traces = polar_chain_merge(calls, eot=EOT)
    assert [t.dropped for t in traces] == [0, 0] and [t.kept for t in traces] == [2, 2]


def test_an_interleaved_sub_agent_lets_the_main_calls_rejoin_their_chain():
    main = conversation([1, 2, 3], [[11, 12], [13], [14]])
    sub = conversation([5, 6], [[21], [22]])
    calls = [main[0], sub[0], sub[1], main[1], main[2]]
    assert [[c.prompt_ids[0] for c in chain] for chain in route(calls)] == [[1, 1, 1], [5, 5]]
    traces = polar_chain_merge(calls, eot=EOT)
    assert [(t.kept, t.dropped, t.drifted) for t in traces] == [(3, 0, 0), (2, 0, 0)]


def test_a_retry_stops_the_chain_and_drops_the_rest():
    first, second, third = conversation([1, 2, 3], [[11, 12], [13], [14, 15]])
    retry = call(first.prompt_ids, [30, 31, EOT], 1)  # same prompt again; the harness kept the retry
    after = call(first.prompt_ids + [30, 31] + turn([60]), [13, EOT], 2)
    calls = [first, retry, after, call(after.prompt_ids + [13] + turn([61]), [14, 15, EOT], 3)]
    (chain,) = route(calls)  # the retry's prompt equals the tip, so it joins (longest prefix)
    assert len(chain) == 4
    (trace,) = polar_chain_merge(calls, eot=EOT)
    assert trace.kept == 1 and trace.tokens == first.prompt_ids + first.completion_ids
    assert trace.dropped == 3 + 2 + 3  # the retry's and every later completion in the chain


def test_a_turn_whose_reasoning_the_template_strips_is_trained_on_a_drifted_context():
    system, think, answer = [1, 2], [80, 81, 82], [11]
    c0 = call(system, think + answer + [EOT])
    c1 = call(system + answer + turn([40]), [12, EOT], 1)  # history holds the answer only
    (trace,) = polar_chain_merge([c0, c1], eot=EOT)
    assert (trace.kept, trace.dropped, trace.drifted) == (2, 0, 2)
    assert trace.tokens == system + think + answer + [EOT] + [GLUE, 40, EOT, GLUE] + [12, EOT]


def test_a_truncated_completion_keeps_the_templates_end_of_turn_and_a_tail_without_one_stops():
    c0 = call([1, 2], [11, 12], finish="length")  # cut before its end of turn
    c1 = call([1, 2, 11, 12] + turn([40]), [13, EOT], 1)
    (trace,) = polar_chain_merge([c0, c1], eot=EOT)
    assert trace.tokens == [1, 2, 11, 12, EOT, GLUE, 40, EOT, GLUE, 13, EOT]
    no_eot = call([1, 2, 11, 12, 40], [13, EOT], 1)
    (trace,) = polar_chain_merge([c0, no_eot], eot=EOT)
    assert (trace.kept, trace.dropped) == (1, 2)


def fan(width: int, depth: int) -> list[CallRecord]:
    """One shared root token, then `width` rollouts of `depth` distinct tokens each."""
    return [call([1], [10 * (r + 1) + k for k in range(depth)], 0, f"r{r}", "length") for r in range(width)]


@pytest.mark.parametrize("budget,bound", [(13, 13), (9, 14), (5, 15)])
def test_the_pack_lower_bound_counts_the_chains_a_split_must_repeat(budget, bound):
    tree = rust.merge(fan(3, 4), layout="tree")
    assert tree.stats.n_nodes == 13
    got = pack_lower_bound(tree.parent, tree.size, tree.positions, budget)
    assert got == bound
    assert sum(len(p.index) for p in rust.pack_plans(tree, max_tokens=budget)) >= got


def test_the_pack_lower_bound_never_exceeds_what_pack_forwards():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "support"))
    from synthetic_traces import PROFILES, group_calls

    calls = group_calls(PROFILES["pi"], rollouts=4, calls_per_rollout=(10, 20), seed=3)
    tree = rust.merge(calls, layout="tree")
    longest = max(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    for budget in (longest, longest + 1_000, 2 * longest):
        packed = sum(len(p.index) for p in rust.pack_plans(tree, max_tokens=budget))
        assert tree.stats.n_nodes <= pack_lower_bound(tree.parent, tree.size, tree.positions, budget) <= packed


def test_a_path_longer_than_the_budget_is_refused():
    tree = rust.merge(fan(2, 6), layout="tree")
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        pack_lower_bound(tree.parent, tree.size, tree.positions, 6)
