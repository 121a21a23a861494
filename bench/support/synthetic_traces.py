"""Synthetic call traces shaped like real harness sessions, for the merge and learner benches.

A group is G rollouts of one task. Every rollout starts from the same system prompt + tool schemas
(sizes measured on first requests: Claude Code ~21-30k tokens, Qwen Code 19k, Codex 11k, Pi 1.5k,
mini-swe-agent 1k) plus the task statement. Each call samples an optional thinking block and an
action; the next prompt appends the action (with or without the thinking, per harness) and a tool
output of 100-5,000 tokens (log-uniform). Harness events that rewrite history:
  - compaction when the prompt passes the context budget: system + task + a fresh summary;
  - sub-agents: a short fresh conversation with its own system prompt;
  - retries: the same prompt sent again, the first answer thrown away by the harness.
Token ids are random; only the prefix structure matters to the merge. Turn boundaries are written
the way a ChatML template writes them (special ids above the random range, so content never holds
one): a prompt ends with the generation prompt `<|im_start|>assistant\n`, a completion ends with the
`<|im_end|>` the model samples, and history closes each assistant turn with `<|im_end|>\n` before
the tool turn. Baselines that split turns at the end-of-turn token (Polar's prefix merging) see the
same boundaries they would on a real capture.

Frozen: merge_bench prints this file's sha256, so a changed trace shape shows in the bench output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from polar_fast.records import CallRecord

VOCAB = 50_000
IM_END = VOCAB  # end of turn: sampled by the model, written into history by the template
IM_START, ROLE_ASSISTANT, ROLE_TOOL, NEWLINE = VOCAB + 1, VOCAB + 2, VOCAB + 3, VOCAB + 4
GENERATION_PROMPT = [IM_START, ROLE_ASSISTANT, NEWLINE]
TOOL_TURN_OPEN = [IM_END, NEWLINE, IM_START, ROLE_TOOL, NEWLINE]  # closes the assistant turn first
TURN_CLOSE = [IM_END, NEWLINE]


@dataclass(frozen=True)
class Profile:
    name: str
    system_tokens: int  # system prompt + tool schemas of the first request
    strips_thinking: bool  # the harness / template drops earlier reasoning from history
    think_tokens: tuple[int, int]  # per call, uniform range (0, 0 = no thinking)
    action_tokens: tuple[int, int]
    context_budget: int  # compaction threshold, in prompt tokens
    p_subagent: float = 0.02
    p_retry: float = 0.01


PROFILES = {
    "claude-code": Profile("claude-code", 25_000, False, (0, 300), (30, 250), 120_000),
    "qwen-code": Profile("qwen-code", 19_000, True, (50, 400), (30, 200), 100_000),
    "codex": Profile("codex", 11_000, False, (0, 200), (30, 200), 100_000),
    "pi": Profile("pi", 1_500, False, (0, 200), (30, 200), 100_000),
    "mini-swe-agent": Profile("mini-swe-agent", 1_000, False, (0, 0), (40, 250), 64_000, p_subagent=0.0),
}


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def _span(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(rng.integers(lo, hi + 1)) if hi > 0 else 0


def _tool_output(rng: np.random.Generator) -> int:
    return int(np.exp(rng.uniform(np.log(100), np.log(5_000))))


def _tool_turn(rng: np.random.Generator) -> list[int]:
    """What the template appends after an assistant body: its end of turn, the tool result turn,
    and the next generation prompt."""
    return TOOL_TURN_OPEN + _tokens(rng, _tool_output(rng)) + TURN_CLOSE + GENERATION_PROMPT


class _Rollout:
    def __init__(self, rollout_id: str, group_id: str, version: int) -> None:
        self.rollout_id, self.group_id, self.version = rollout_id, group_id, version
        self.calls: list[CallRecord] = []

    def sample(self, rng: np.random.Generator, prompt: list[int], think: int, action: int) -> tuple[list[int], list[int]]:
        thinking, answer = _tokens(rng, think), _tokens(rng, action)
        completion = thinking + answer + [IM_END]
        self.calls.append(
            CallRecord(
                session_id=self.rollout_id, rollout_id=self.rollout_id, group_id=self.group_id,
                call_index=len(self.calls), prompt_ids=prompt, completion_ids=completion,
                completion_logprobs=(-rng.exponential(0.5, len(completion))).tolist(),
                policy_version=self.version, finish_reason="tool_calls", dialect="chat",
            )
        )
        return thinking, answer


def rollout_calls(rng: np.random.Generator, profile: Profile, shared: list[int], n_calls: int,
                  rollout_id: str, group_id: str = "g", version: int = 0) -> list[CallRecord]:
    r = _Rollout(rollout_id, group_id, version)
    prompt = list(shared)
    while len(r.calls) < n_calls:
        if rng.random() < profile.p_subagent:
            sub = _tokens(rng, int(rng.integers(2_000, 3_000))) + GENERATION_PROMPT  # its own system prompt
            for _ in range(int(rng.integers(3, 10))):
                thinking, answer = r.sample(rng, sub, _span(rng, profile.think_tokens), _span(rng, profile.action_tokens))
                sub = sub + thinking + answer + _tool_turn(rng)
        if rng.random() < profile.p_retry:
            r.sample(rng, prompt, _span(rng, profile.think_tokens), _span(rng, profile.action_tokens))
        thinking, answer = r.sample(rng, prompt, _span(rng, profile.think_tokens), _span(rng, profile.action_tokens))
        kept = answer if profile.strips_thinking else thinking + answer
        prompt = prompt + kept + _tool_turn(rng)
        if len(prompt) > profile.context_budget:  # compaction: system + task + summary
            prompt = list(shared[: -len(GENERATION_PROMPT)]) + _tokens(rng, 2_000) + GENERATION_PROMPT
    return r.calls[:n_calls]


def group_calls(profile: Profile, *, rollouts: int, calls_per_rollout: tuple[int, int], seed: int,
                group_id: str = "g") -> list[CallRecord]:
    """One group's calls in capture order (rollouts interleaved, each in its own order)."""
    rng = np.random.default_rng(seed)
    shared = _tokens(rng, profile.system_tokens + 300) + GENERATION_PROMPT  # system + tools + task statement
    per_rollout = [
        rollout_calls(rng, profile, shared, int(rng.integers(calls_per_rollout[0], calls_per_rollout[1] + 1)),
                      f"{group_id}/r{i}", group_id)
        for i in range(rollouts)
    ]
    out: list[CallRecord] = []
    cursors = [0] * rollouts
    while len(out) < sum(map(len, per_rollout)):
        for i, calls in enumerate(per_rollout):
            if cursors[i] < len(calls):
                out.append(calls[cursors[i]])
                cursors[i] += 1
    return out
