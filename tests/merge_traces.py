"""Hypothesis strategies for group traces shaped like harness sessions, at toy scale.

A small vocabulary makes collisions (shared completions across rollouts, retries that resample the
same tokens) common, so every break cause and extra samples show up in a few hundred examples.
"""

from __future__ import annotations

from hypothesis import strategies as st

from polar_fast.records import CallRecord

VOCAB = 6


def _tokens(draw, lo: int, hi: int) -> list[int]:
    return draw(st.lists(st.integers(0, VOCAB - 1), min_size=lo, max_size=hi))


def _call(rollout: str, index: int, prompt: list[int], completion: list[int], draw) -> CallRecord:
    logprobs = draw(st.lists(st.floats(-20, 0, width=32), min_size=len(completion), max_size=len(completion)))
    return CallRecord(
        session_id=rollout,
        rollout_id=rollout,
        group_id="g",
        call_index=index,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=logprobs,
        policy_version=draw(st.integers(0, 3)),
        finish_reason="stop",
        dialect="chat",
    )


@st.composite
def group_traces(draw, max_rollouts: int = 3, max_calls: int = 5) -> list[CallRecord]:
    system = _tokens(draw, 0, 4)
    task = _tokens(draw, 0, 3)
    per_rollout: list[list[CallRecord]] = []
    for r in range(draw(st.integers(1, max_rollouts))):
        calls: list[CallRecord] = []
        prompt = system + task
        for i in range(draw(st.integers(1, max_calls))):
            if calls:
                prev = calls[-1]
                history = prev.prompt_ids + prev.completion_ids
                kind = draw(st.sampled_from(["extend", "extend", "compact", "strip", "fresh", "retry"]))
                if kind == "extend":
                    prompt = history + _tokens(draw, 0, 3)
                elif kind == "compact":
                    prompt = system + _tokens(draw, 0, 4)
                elif kind == "strip":
                    cut = draw(st.integers(len(prev.prompt_ids), len(history)))
                    prompt = history[:cut] + _tokens(draw, 0, 3)
                elif kind == "fresh":
                    prompt = _tokens(draw, 0, 4)
                else:
                    prompt = prev.prompt_ids
            completion = _tokens(draw, 0, 4)
            if not prompt and not completion:
                completion = [0]
            calls.append(_call(f"r{r}", i, prompt, completion, draw))
        per_rollout.append(calls)
    # interleave rollouts the way a proxy log would: each rollout's calls stay in order
    order = draw(st.permutations([r for r, calls in enumerate(per_rollout) for _ in calls]))
    cursors = [0] * len(per_rollout)
    out = []
    for r in order:
        out.append(per_rollout[r][cursors[r]])
        cursors[r] += 1
    return out
