"""Polar's prefix-merging trajectory builder, as its code runs it: the chain baseline of merge_bench.

Our own implementation of the algorithm in NVIDIA-NeMo/ProRL-Agent-Server
src/polar/trajectory/builder/prefix_merging.py (read, not copied), on polar_fast CallRecords.
Per session (here: per rollout), in capture order:

  routing      a call joins the open chain whose tip (the last joined call's prompt) is the
               longest non-empty token prefix of its prompt; ties go to the earliest chain; a call
               that extends no tip opens a new chain. Every chain stays open.
  finalizing   the stream starts as chain[0]'s prompt + its sampled completion (loss 1). For each
               next call: its prompt must start with the previous call's prompt, else STOP; the
               tail after that prefix holds the template's copy of the previous assistant turn,
               then the interstitial (tool turn, glue). The interstitial is what follows the
               tail's first end-of-turn token (from that token on, when the previous completion
               did not end with one); no end-of-turn token in the tail: STOP. The interstitial is
               appended with loss 0, then the call's sampled completion with loss 1.
  STOP         the chain's stream ends there; that call's and every later call's completions in
               the chain are never trained (dropped).

The end-of-turn id is given, or taken from the last token of the first completion that ended
naturally (finish reason stop / tool_calls / stop_sequence), as Polar does.

What the bench also counts, which Polar does not report: a completion is *drifted* when the stream
it is trained on (everything before it) differs from the prompt it was sampled under, e.g. a turn
whose reasoning the template stripped from history, trained after the raw reasoning-bearing body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from polar_fast.records import CallRecord

NATURAL_STOPS = frozenset({"stop", "tool_calls", "stop_sequence"})


@dataclass
class ChainTrace:
    """One finalized chain: the stream the learner trains on and what it lost."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    kept: int = 0  # calls merged into the stream
    calls: int = 0  # calls routed to the chain
    trained: int = 0  # sampled tokens with loss 1
    dropped: int = 0  # sampled tokens of calls after the STOP
    drifted: int = 0  # trained sampled tokens whose stream context != their sampling prompt


def route(calls: Sequence[CallRecord]) -> list[list[CallRecord]]:
    """One session's calls (capture order) grouped into chains by longest tip prefix."""
    chains: list[list[CallRecord]] = []
    tips: list[list[int]] = []
    for call in calls:
        prompt = list(call.prompt_ids)
        best, best_len = None, 0
        for i, tip in enumerate(tips):  # strict > keeps the earliest chain on a tie
            if len(tip) > best_len and len(tip) <= len(prompt) and prompt[: len(tip)] == tip:
                best, best_len = i, len(tip)
        if best is None:
            best = len(chains)
            chains.append([])
            tips.append([])
        chains[best].append(call)
        tips[best] = prompt
    return chains


def end_of_turn(chain: Sequence[CallRecord]) -> int | None:
    for call in chain:
        if call.finish_reason in NATURAL_STOPS and call.completion_ids:
            return call.completion_ids[-1]
    return None


def interstitial(tail: list[int], previous_completion: list[int], eot: int | None) -> list[int] | None:
    """The template tokens between the previous assistant body and the next completion; None = STOP."""
    if eot is None or eot not in tail:
        return None
    k = tail.index(eot)
    return tail[k + 1 :] if previous_completion and previous_completion[-1] == eot else tail[k:]


def finalize(chain: Sequence[CallRecord], eot: int | None = None) -> ChainTrace:
    eot = end_of_turn(chain) if eot is None else eot
    first = chain[0]
    out = ChainTrace(calls=len(chain))
    out.tokens = list(first.prompt_ids)
    out.loss_mask = [0] * len(out.tokens)
    _append_completion(out, first)
    prev_prompt, prev_completion = list(first.prompt_ids), list(first.completion_ids)
    for i, call in enumerate(chain[1:], start=1):
        prompt = list(call.prompt_ids)
        glue = None
        if len(prompt) >= len(prev_prompt) and prompt[: len(prev_prompt)] == prev_prompt:
            glue = interstitial(prompt[len(prev_prompt) :], prev_completion, eot)
        if glue is None:  # STOP: the rest of the chain is never trained
            out.dropped = sum(len(c.completion_ids) for c in chain[i:])
            break
        out.tokens += glue
        out.loss_mask += [0] * len(glue)
        _append_completion(out, call)
        prev_prompt, prev_completion = prompt, list(call.completion_ids)
    return out


def _append_completion(out: ChainTrace, call: CallRecord) -> None:
    if out.tokens != list(call.prompt_ids):
        out.drifted += len(call.completion_ids)
    out.tokens += call.completion_ids
    out.loss_mask += [1] * len(call.completion_ids)
    out.trained += len(call.completion_ids)
    out.kept += 1


def polar_chain_merge(calls: Sequence[CallRecord], eot: int | None = None) -> list[ChainTrace]:
    """Every chain of every rollout in a group (Polar builds one trajectory per session)."""
    by_rollout: dict[str, list[CallRecord]] = {}
    for call in calls:
        by_rollout.setdefault(call.rollout_id, []).append(call)
    return [finalize(chain, eot) for rollout in by_rollout.values() for chain in route(rollout)]
