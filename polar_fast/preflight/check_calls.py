"""The `harnesses check` lines read from how a harness's calls relate to each other: history
(does each call continue an earlier one token for token?) and context (did it compact?).

Both rest on one rule for telling the main conversation from side calls: a call continues an
earlier one when its prompt starts with more than half of that call's prompt tokens ("shares
most of it"). A title request or a small-model request has its own short system prompt and
shares little; a request of the main conversation shares at least the system prompt and the
tool schemas, which are most of a coding CLI's first request.

Compaction is recognised in two shapes, both after the call the check filled past the
threshold (F):
- shortened: a main-conversation request with F's system prompt that no longer holds the
  conversation up to F (it does not start with F's prompt) and no longer holds the fill;
- summarised: a request (S) whose reply (the summary) a later main-conversation request (R)
  hands back outside the model's own turns, R no longer holding the conversation up to F.
  Claude Code's summary request re-sends the conversation in another shape; Pi may keep the
  filled reply verbatim after its summary. Both are this shape.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec

from polar_fast.preflight import Item, failed, not_applicable, passed
from polar_fast.records import CallRecord, ExchangeRecord

AREA = "harness"
FILL_TOKENS = 600  # how far past the compaction threshold the compaction run's reply goes
_MIN_SUMMARY_CHARS = 8  # a reply shorter than this cannot be told apart when handed back


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shares_most(earlier: CallRecord, later: CallRecord) -> int:
    """Tokens of `earlier`'s prompt that `later` starts with, when more than half (else 0)."""
    common = common_prefix(earlier.prompt_ids, later.prompt_ids)
    return common if common > len(earlier.prompt_ids) // 2 else 0


# --------------------------------------------------------------------------- history


def history_item(calls: list[CallRecord], exchanges: list[ExchangeRecord], tokenizer) -> Item:
    pairs = []  # (i, j, tokens in common): call j continues call i's conversation
    for j in range(1, len(calls)):
        joined = [list(c.prompt_ids) + list(c.completion_ids) for c in calls[:j]]
        common = [common_prefix(p, calls[j].prompt_ids) for p in joined]
        i = max(range(j), key=lambda k: common[k])
        if common[i] > len(calls[i].prompt_ids) // 2:
            pairs.append((i, j, common[i]))
    if not pairs:
        return failed(AREA, "history", f"no call continued an earlier one ({len(calls)} calls; one continues "
                      "another when it starts with most of its prompt)",
                      "the harness must resend its conversation (see the tool call line)")
    broken = [(i, j, k) for i, j, k in pairs if k < len(calls[i].prompt_ids) + len(calls[i].completion_ids)]
    if not broken:
        return passed(AREA, "history", f"{len(pairs)} continuations token-exact: each prompt starts with the "
                      "previous prompt + its sampled ids")
    i, j, k = broken[0]
    a, b = calls[i], calls[j]
    expected = list(a.prompt_ids) + list(a.completion_ids)
    n_prompt = len(a.prompt_ids)
    where = ("before any sampled token: the harness rebuilt its prompt" if k < n_prompt
             else f"{k - n_prompt} tokens into the {len(a.completion_ids)} it sampled")
    lost = len(a.completion_ids) - max(0, k - n_prompt)
    return failed(AREA, "history",
                  f"call {j} re-renders call {i}: first differing token at {k:,} of call {i}'s {n_prompt:,} prompt "
                  f"tokens, {where} (expected {tokenizer.decode(expected[k:k + 12])!r}, sent "
                  f"{tokenizer.decode(list(b.prompt_ids[k:k + 12]))!r}; proxy: {b.history}); the harness changed: "
                  f"{describe_change(exchanges, a, b)}; cost: {merge_cost(calls)}, {lost} of call {i}'s "
                  f"{len(a.completion_ids)} sampled tokens come back only as prompt",
                  "resend the conversation as it was sent and answered (earlier turns in order, the assistant "
                  "turn's content, reasoning and tool calls)")


def describe_change(exchanges: list[ExchangeRecord], a: CallRecord, b: CallRecord) -> str:
    """What call b's request did to call a's conversation and reply, from the canonical messages."""
    by_index = {(e.session_id, e.call_index): e for e in exchanges}
    ea, eb = by_index.get((a.session_id, a.call_index)), by_index.get((b.session_id, b.call_index))
    if ea is None or eb is None:
        return "unknown (no exchange records)"
    changes = []
    if [(m.role, m.content) for m in eb.messages[: len(ea.messages)]] != [(m.role, m.content) for m in ea.messages]:
        changes.append(_earlier_messages(ea.messages, eb.messages))
    reply = ea.reply
    # where the reply should be; a harness that reorders its turns may have it elsewhere, unchanged
    mine = [m for m in eb.messages if m.role == "assistant"]
    sent = next((m for m in mine if m.content == reply.content), None) or next(
        (m for m in mine if m.content.split() == reply.content.split()), None)
    if sent is None and len(eb.messages) > len(ea.messages) and eb.messages[len(ea.messages)].role == "assistant":
        sent = eb.messages[len(ea.messages)]
    if sent is None:
        changes.append("the reply is missing from the resent conversation")
    else:
        if reply.reasoning and not sent.reasoning:
            changes.append("reasoning dropped")
        if [(c.name, _json(c.arguments)) for c in reply.tool_calls] != [(c.name, _json(c.arguments))
                                                                          for c in sent.tool_calls]:
            changes.append("tool call rewritten")
        if reply.content != sent.content:
            same = reply.content.split() == sent.content.split()
            changes.append("whitespace changed" if same else
                           f"text changed ({reply.content[:40]!r} -> {sent.content[:40]!r})")
    return ", ".join(changes) or "nothing in the canonical messages (a rendering difference)"


def _earlier_messages(before: list, after: list) -> str:
    """'earlier messages edited: ...' naming the first difference, and messages dropped or moved."""
    first = next(i for i, (x, y) in enumerate(zip(before + [None], after + [None]))
                 if x is None or y is None or (x.role, x.content) != (y.role, y.content))
    contents = [m.content for m in after]
    dropped = [m for m in before if m.content not in contents]
    moved = [m for i, m in enumerate(before) if m.content in contents and contents.index(m.content) != i]
    was = before[first] if first < len(before) else None
    now = after[first] if first < len(after) else None
    text = (f"earlier messages edited: message {first} was {_brief(was)}, is {_brief(now)} "
            f"({len(before)} messages before the reply, {len(after)} sent)")
    if dropped:
        text += f"; {len(dropped)} dropped (first: {_brief(dropped[0])})"
    if moved:
        text += f"; {len(moved)} moved to another place"
    return text


def _brief(m) -> str:
    return "nothing" if m is None else f"{m.role} {m.content[:40]!r}"


def _json(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def merge_cost(calls: list[CallRecord]) -> str:
    from polar_fast.merge import merge

    stats = merge(calls, layout="tree").stats
    return (f"the merge breaks {stats.n_breaks} times (in_completion {stats.in_completion}, in_prompt "
            f"{stats.in_prompt}, new_root {stats.new_root}) and forwards {stats.n_nodes} tokens for "
            f"{stats.n_samples} sampled")


# --------------------------------------------------------------------------- context


def context_not_measured(name: str, calls: list[CallRecord], window: int) -> Item:
    """The context line of a harness that declares no compaction threshold: what its run showed."""
    if not calls:
        return not_applicable(AREA, "context", f"not measured: {name} declares no compaction threshold, and no "
                              "model call was made")
    sizes = [len(c.prompt_ids) for c in calls]
    continuing = sum(any(shares_most(e, c) for e in calls[:j]) for j, c in enumerate(calls) if j)
    return not_applicable(AREA, "context", f"not measured: {name} declares no compaction threshold, so no run "
                          f"tells it a window to compact at; seen here ({window:,}-token window): {len(calls)} calls, "
                          f"prompts of {min(sizes):,} to {max(sizes):,} tokens, {continuing} continuing an earlier call")


async def compaction_item(cfg, harness, task, tokenizer, first: int, acting: dict[str, Any],
                          run_once: Callable) -> Item:
    """A second run whose window puts the compaction threshold just past the first request, with a
    first reply FILL_TOKENS past it; then `compaction_verdict` on its calls."""
    from polar_fast.preflight.check_model import CheckEngine
    from polar_fast.rollouts.harnesses import ModelLimits

    out = max(cfg.sampling.max_tokens, 2048)  # room for the filling reply
    window = first + out
    while harness.compaction_threshold(ModelLimits(context_tokens=window, max_output_tokens=out)) < first + 200:
        window += 256
    threshold = harness.compaction_threshold(ModelLimits(context_tokens=window, max_output_tokens=out))
    s = msgspec.structs.replace
    small = s(cfg, model=s(cfg.model, max_context_tokens=window), sampling=s(cfg.sampling, max_tokens=out))
    engine = CheckEngine(tokenizer, **acting, fill_tokens=threshold - first + FILL_TOKENS, main_prompt_tokens=first)
    run = await run_once(small, engine, task)
    evidence = f"told window {window:,} and output cap {out:,} (threshold {threshold:,})"
    return compaction_verdict(run.calls, run.exchanges, engine.filled, threshold, evidence)


def compaction_verdict(calls: list[CallRecord], exchanges: list[ExchangeRecord], fill: str, threshold: int,
                       evidence: str) -> Item:
    """Pass on a compaction of the main conversation after the filled call (module docstring)."""
    by_index = {e.call_index: e for e in exchanges}
    filled = next((c for c in calls if fill and fill in _reply(by_index, c)), None)
    if filled is None:  # a reply cut short by the output cap no longer holds the whole fill
        filled = next((c for c in calls if len(c.prompt_ids) + len(c.completion_ids) > threshold), None)
    if filled is None or len(filled.prompt_ids) + len(filled.completion_ids) <= threshold:
        return failed(AREA, "context", f"{evidence}; the filling reply never took a main-conversation call past it "
                      f"({len(calls)} calls)", "see the tool call line")
    joined = list(filled.prompt_ids) + list(filled.completion_ids)
    evidence += f"; call {filled.call_index} reached {len(joined):,} tokens"
    after = [c for c in calls if c.call_index > filled.call_index]
    system = _system(by_index.get(filled.call_index))

    def holds_conversation(c: CallRecord) -> bool:
        return common_prefix(joined, c.prompt_ids) >= len(filled.prompt_ids)

    main = [c for c in after if shares_most(filled, c) and not holds_conversation(c)]
    for restart in main:  # summarised: the nearest earlier reply it hands back, outside the model's turns
        e = by_index.get(restart.call_index)
        summary = next((s for s in reversed(after) if s.call_index < restart.call_index
                        and len(_reply(by_index, s).strip()) >= _MIN_SUMMARY_CHARS
                        and _shows(e, _reply(by_index, s).strip())), None)
        if summary is not None:
            return passed(AREA, "context", f"{evidence}; call {summary.call_index} ({len(summary.prompt_ids):,} "
                          f"prompt tokens) summarised the conversation and call {restart.call_index} "
                          f"({len(restart.prompt_ids):,} prompt tokens) starts again from that summary: it compacted")
    for c in main:  # shortened: the same system prompt, the fill gone
        e = by_index.get(c.call_index)
        if e is not None and _system(e) == system and not any(fill in m.content for m in e.messages):
            return passed(AREA, "context", f"{evidence}; call {c.call_index} ({len(c.prompt_ids):,} prompt tokens), "
                          "with the same system prompt, no longer holds the conversation: it compacted (shortened)")
    told = _after_filled(filled, after, main, holds_conversation, by_index, fill)
    return failed(AREA, "context", f"{evidence}; after it: {told}: no compaction",
                  "tell the harness the window and output cap ({{ context_window }}, {{ max_output_tokens }}) "
                  "where it reads them")


def _after_filled(filled: CallRecord, after: list[CallRecord], main: list[CallRecord], holds,
                  by_index: dict[int, ExchangeRecord], fill: str) -> str:
    """What the calls after the filled one were, each named for what it was."""
    if not after:
        return "no call"
    parts = []
    kept = [c.call_index for c in after if holds(c)]
    if kept:
        parts.append(f"call(s) {', '.join(map(str, kept))} still hold the whole conversation")
    if main:
        parts.append(f"call(s) {', '.join(str(c.call_index) for c in main)} re-sent the conversation rewritten, and "
                     "no later request started from a summary")
    for c in after:
        if c in main or holds(c):
            continue
        e = by_index.get(c.call_index)
        if fill and e is not None and any(fill in m.content for m in e.messages):
            parts.append(f"call {c.call_index} ({len(c.prompt_ids):,} prompt tokens) re-sent the conversation in "
                         "another shape, but no later request started from its reply")
            continue
        common = common_prefix(filled.prompt_ids, c.prompt_ids)
        parts.append(f"call {c.call_index} ({len(c.prompt_ids):,} prompt tokens) is a side call (it shares "
                     f"{common:,} of call {filled.call_index}'s {len(filled.prompt_ids):,} prompt tokens: a title or "
                     "small-model request), not counted")
    return "; ".join(parts)


def _reply(by_index: dict[int, ExchangeRecord], c: CallRecord) -> str:
    e = by_index.get(c.call_index)
    return e.reply.content if e is not None else ""


def _system(e: ExchangeRecord | None) -> str | None:
    if e is None or not e.messages or e.messages[0].role != "system":
        return None
    return e.messages[0].content


def _shows(e: ExchangeRecord | None, text: str) -> bool:
    return e is not None and any(text in m.content for m in e.messages if m.role != "assistant")
