"""A rollout's token view: its calls re-merged with the run's own merge (the Rust trie), one entry
per token of the layout's sequences, with the loss mask, behaviour logprob, policy version and
the call that first put the token into the trie, plus the places where a call's prompt broke
away from what earlier calls had laid down, and why.

Where and why a call broke come from the merge itself, not from a second implementation: the
calls are merged one prefix longer at a time, and call k's cause is the break counter that rose
(merge/reference.py states the rules); the trie nodes it created are those numbered from the
previous merge's node count on (nodes are numbered in creation order), so the depth where it left
the trie is its length minus the nodes it added. That is k merges for k calls: cheap next to a
page load for the call counts a harness makes.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np

from polar_fast import merge
from polar_fast.merge.arrays import MergeStats
from polar_fast.records import CallRecord

CAUSES = ("extend", "new_root", "in_completion", "in_prompt", "completion_fork", "duplicate")
BREAKS = {  # merge cause -> what it means for a person reading a harness's traffic
    "new_root": "sub-agent or new conversation: shares no prefix with the earlier calls",
    "in_completion": "rewrite: the prompt changed an earlier sampled answer (reasoning stripped, reply re-rendered)",
    "in_prompt": "compaction or edited history: the prompt changed earlier prompt text",
    "completion_fork": "retry: the same prompt again, sampled differently",
    "duplicate": "retry: the same prompt again, the same tokens sampled",
}


def _cause(before: MergeStats | None, after: MergeStats) -> str:
    for cause in CAUSES:
        if getattr(after, cause) > (getattr(before, cause) if before else 0):
            return cause
    raise AssertionError("a merged call raised no cause counter")  # every insert counts one


def call_table(calls: Sequence[CallRecord]) -> tuple[list[dict[str, Any]], list[int]]:
    """(one row per call: its merge cause, break depth and what the proxy said of its prompt;
    the node count after each call, which tells which call created a node)."""
    rows, node_counts = [], []
    before: MergeStats | None = None
    for k, call in enumerate(calls):
        after = merge.merge(calls[: k + 1], layout="tree").stats
        added = after.n_nodes - (before.n_nodes if before else 0)
        length = len(call.prompt_ids) + len(call.completion_ids)
        cause = _cause(before, after)
        rows.append({
            "call": k, "session_id": call.session_id, "call_index": call.call_index,
            "cause": cause, "break": BREAKS.get(cause, ""), "depth": length - added,
            "prompt_tokens": len(call.prompt_ids), "sampled_tokens": len(call.completion_ids),
            "policy_version": call.policy_version, "finish_reason": call.finish_reason,
            "history": call.history, "dialect": call.dialect, "guided": call.guided,
        })
        node_counts.append(after.n_nodes)
        before = after
    return rows, node_counts


def token_texts(tokenizer, ids: np.ndarray) -> list[str]:
    """Each id decoded on its own (a byte-level piece may be part of a character)."""
    unique = np.unique(ids).tolist()
    texts = dict(zip(unique, tokenizer.batch_decode([[i] for i in unique])))
    return [texts[i] for i in ids.tolist()]


def token_view(calls: Sequence[CallRecord], *, layout: str, tokenizer) -> dict[str, Any]:
    """The columns the page draws: see the module docstring. `calls` in log order, whole."""
    if not calls:
        return {"layout": layout, "tokens": 0, "calls": [], "offsets": [0]}
    rows, node_counts = call_table(calls)
    merged = merge.merge(calls, layout=layout)
    creator = [bisect.bisect_right(node_counts, n) for n in merged.node.tolist()]
    first_node = {0: 0} | {k: node_counts[k - 1] for k in range(1, len(calls))}
    break_nodes = {first_node[r["call"]]: r["call"] for r in rows
                   if r["cause"] in BREAKS and node_counts[r["call"]] > first_node[r["call"]]}
    marks = {}
    for i, n in enumerate(merged.node.tolist()):
        if n in break_nodes:
            marks.setdefault(break_nodes[n], []).append(i)
    for r in rows:
        r["positions"] = marks.get(r["call"], [])
    extras = np.bincount(merged.extra_index, minlength=len(merged)) if len(merged.extra_index) else None
    mask = merged.loss_mask.astype(bool)
    guided = [k for k, c in enumerate(calls) if c.guided]
    if guided:  # a teacher's reply (CallRecord.guided) is never trained: shown at mask 0, as the learner sees it
        mask &= ~np.isin(np.asarray(creator), guided)
    return {
        "layout": layout,
        "tokens": len(merged),
        "offsets": merged.offsets.tolist(),
        "ids": merged.tokens.tolist(),
        "text": token_texts(tokenizer, merged.tokens),
        "mask": mask.astype(np.int8).tolist(),
        "logprob": [round(x, 4) if m else None for x, m in zip(merged.logprobs.tolist(), mask.tolist())],
        "version": merged.versions.tolist(),
        "call": creator,
        "parent": merged.parent.tolist(),
        "depth": merged.positions.tolist(),
        "extra": extras.tolist() if extras is not None else [],
        "calls": rows,
        "stats": {k: getattr(merged.stats, k) for k in merged.stats.__struct_fields__} | {"n_breaks": merged.stats.n_breaks},
    }
