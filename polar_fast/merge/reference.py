"""Pure-Python reference of the Rust merge (rust/merge): short and obviously correct.

Used only by tests (Rust == reference on random traces) and bench/ (speed ratio). The rules,
shared with the Rust crate and stated once here:

Trie. Calls are inserted in the given order into one token trie: one child per distinct token
after a given prefix, children kept in insertion order. The completion tokens of a call are its
samples. A node's first sample is its primary sample (loss_mask 1, behaviour logprob, policy
version, sampler rollout); any later sample of the same node (another rollout sampled the same
token after the same prefix, or a retry resampled it) is an extra sample. So every sampled token
is exactly one loss term, a prompt that repeats an earlier completion adds no second term, and no
call is ever dropped.

Break causes, judged where a call first leaves the existing trie, at depth i under node P:
  P had no children yet          -> "extend" (a clean continuation, or the first call)
  i == 0                         -> "new_root" (shares nothing: a sub-agent or fresh conversation)
  i < len(prompt), a child of P
    holds a sample               -> "in_completion" (history rewritten inside an earlier answer)
  i < len(prompt), otherwise     -> "in_prompt" (compaction, injected reminder, edited history)
  i >= len(prompt)               -> "completion_fork" (sampling diversity, not a break)
  never leaves the trie          -> "duplicate" (a retry that resampled the same tokens)

Layouts. "tree": the forest in DFS pre-order, each node once. "paths": one sequence per leaf
(root to leaf, leaves in DFS order); a shared node is repeated, and its samples count only in the
first path that contains it.

Packing. Units are sequences (paths) or root trees (tree). A tree over the budget is split: a node
keeps its ancestor chain and its children's subtrees are binned first-fit-decreasing into copies
of that chain; an oversize child recurses. Units are then binned first-fit-decreasing. A repeated
node counts its samples only at its first occurrence in micro-batch order.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np

from polar_fast.errors import MergeError
from polar_fast.merge.arrays import LAYOUTS, Merged, MergeStats, MicroBatch, PackPlan, gather

CAUSES = ("extend", "new_root", "in_completion", "in_prompt", "completion_fork", "duplicate")


class _Node:
    __slots__ = ("token", "parent", "depth", "children", "creator", "sample")

    def __init__(self, token: int, parent: int, depth: int, creator: int) -> None:
        self.token = token
        self.parent = parent
        self.depth = depth
        self.children: dict[int, int] = {}
        self.creator = creator
        self.sample: tuple[int, float, int] | None = None  # (rollout, logprob, version)


def merge(calls: Sequence[Any], *, layout: str = "tree") -> Merged:
    if layout not in LAYOUTS:
        raise MergeError(f"layout must be 'tree' or 'paths', not {layout!r}")
    nodes: list[_Node] = []
    roots: dict[int, int] = {}
    rollout_ids: list[str] = []
    rollout_index: dict[str, int] = {}
    extras: list[tuple[int, int, float, int]] = []  # (node, rollout, logprob, version)
    causes = dict.fromkeys(CAUSES, 0)
    n_call_tokens = 0
    n_samples = 0

    for c, call in enumerate(calls):
        prompt, completion = list(call.prompt_ids), list(call.completion_ids)
        logprobs = list(call.completion_logprobs)
        if len(logprobs) != len(completion):
            raise MergeError(f"call {c}: {len(completion)} completion ids but {len(logprobs)} logprobs")
        if not -(2**31) <= call.policy_version < 2**31:
            raise MergeError(f"call {c}: policy_version {call.policy_version} is out of range")
        r = rollout_index.setdefault(call.rollout_id, len(rollout_ids))
        if r == len(rollout_ids):
            rollout_ids.append(call.rollout_id)
        seq = prompt + completion
        n_call_tokens += len(seq)
        n_samples += len(completion)
        parent, left = -1, False
        for i, token in enumerate(seq):
            if not 0 <= token < 2**31:
                raise MergeError(f"call {c}: token id {token} at position {i} is out of range")
            children = roots if parent < 0 else nodes[parent].children
            child = children.get(token)
            if child is None:
                if not left:
                    causes[_cause(nodes, children, i, len(prompt))] += 1
                    left = True
                child = len(nodes)
                nodes.append(_Node(token, parent, i, r))
                children[token] = child
            if i >= len(prompt):
                j = i - len(prompt)
                sample = (r, float(np.float32(logprobs[j])), int(call.policy_version))
                if nodes[child].sample is None:
                    nodes[child].sample = sample
                else:
                    extras.append((child, *sample))
            parent = child
        if not left:
            causes["duplicate"] += 1

    order = _preorder(nodes, roots)
    if layout == "tree":
        arrays = _tree_arrays(nodes, order, extras)
    else:
        arrays = _path_arrays(nodes, order, extras)
    stats = MergeStats(
        n_calls=len(calls),
        n_rollouts=len(rollout_ids),
        n_nodes=len(nodes),
        n_call_tokens=n_call_tokens,
        n_samples=n_samples,
        n_extra_samples=len(extras),
        n_leaves=sum(1 for n in nodes if not n.children),
        n_output_tokens=len(arrays["tokens"]),
        **causes,
    )
    return Merged(layout=layout, rollout_ids=rollout_ids, stats=stats, **arrays)


def _cause(nodes: list[_Node], children: dict[int, int], i: int, n_prompt: int) -> str:
    if not children:
        return "extend"
    if i == 0:
        return "new_root"
    if i >= n_prompt:
        return "completion_fork"
    if any(nodes[child].sample is not None for child in children.values()):
        return "in_completion"
    return "in_prompt"


def _preorder(nodes: list[_Node], roots: dict[int, int]) -> list[int]:
    order: list[int] = []
    stack = list(reversed(roots.values()))
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(nodes[n].children.values()))
    return order


def _empty_arrays() -> dict[str, list]:
    return {k: [] for k in ("tokens", "positions", "parent", "size", "loss_mask", "logprobs",
                            "versions", "rollout", "node")}


def _emit(out: dict[str, list], node: _Node, node_id: int, parent: int, size: int, with_sample: bool) -> None:
    out["tokens"].append(node.token)
    out["positions"].append(node.depth)
    out["parent"].append(parent)
    out["size"].append(size)
    out["node"].append(node_id)
    if with_sample and node.sample is not None:
        rollout, logprob, version = node.sample
        out["loss_mask"].append(1)
        out["logprobs"].append(logprob)
        out["versions"].append(version)
        out["rollout"].append(rollout)
    else:
        out["loss_mask"].append(0)
        out["logprobs"].append(0.0)
        out["versions"].append(-1)
        out["rollout"].append(node.sample[0] if node.sample is not None else node.creator)


def _tree_arrays(nodes: list[_Node], order: list[int], extras: list) -> dict[str, np.ndarray]:
    position = {n: p for p, n in enumerate(order)}
    sizes = [1] * len(nodes)
    for n in reversed(order):
        if nodes[n].parent >= 0:
            sizes[nodes[n].parent] += sizes[n]
    out = _empty_arrays()
    offsets = [0]
    for p, n in enumerate(order):
        node = nodes[n]
        if node.parent < 0 and p > 0:
            offsets.append(p)
        _emit(out, node, n, position[node.parent] if node.parent >= 0 else -1, sizes[n], True)
    if order:
        offsets.append(len(order))
    extra_index = [position[n] for n, *_ in extras]
    return _finish(out, offsets, extra_index, extras)


def _path_arrays(nodes: list[_Node], order: list[int], extras: list) -> dict[str, np.ndarray]:
    out = _empty_arrays()
    offsets = [0]
    first_seen: dict[int, int] = {}
    for leaf in (n for n in order if not nodes[n].children):
        chain = [leaf]
        while nodes[chain[-1]].parent >= 0:
            chain.append(nodes[chain[-1]].parent)
        chain.reverse()
        start = offsets[-1]
        for j, n in enumerate(chain):
            first = n not in first_seen
            if first:
                first_seen[n] = start + j
            _emit(out, nodes[n], n, start + j - 1 if j else -1, len(chain) - j, first)
        offsets.append(start + len(chain))
    extra_index = [first_seen[n] for n, *_ in extras]
    return _finish(out, offsets, extra_index, extras)


def _finish(out: dict[str, list], offsets: list[int], extra_index: list[int], extras: list) -> dict[str, np.ndarray]:
    arrays = {
        "tokens": np.array(out["tokens"], np.int32),
        "positions": np.array(out["positions"], np.int32),
        "parent": np.array(out["parent"], np.int32),
        "size": np.array(out["size"], np.int32),
        "loss_mask": np.array(out["loss_mask"], np.uint8),
        "logprobs": np.array(out["logprobs"], np.float32),
        "versions": np.array(out["versions"], np.int32),
        "rollout": np.array(out["rollout"], np.int32),
        "node": np.array(out["node"], np.int32),
        "offsets": np.array(offsets, np.int32),
        "extra_index": np.array(extra_index, np.int32),
        "extra_rollout": np.array([e[1] for e in extras], np.int32),
        "extra_logprob": np.array([e[2] for e in extras], np.float32),
        "extra_version": np.array([e[3] for e in extras], np.int32),
    }
    return arrays


# ---------------------------------------------------------------------------------------- packing


def pack(merged: Merged, *, max_tokens: int) -> list[MicroBatch]:
    return [gather(merged, plan) for plan in pack_plans(merged, max_tokens=max_tokens)]


def pack_plans(merged: Merged, *, max_tokens: int) -> list[PackPlan]:
    """Which merged positions go into which micro-batch, with local parent/size/offsets/mask."""
    if max_tokens < 1:
        raise MergeError(f"max_tokens must be >= 1, got {max_tokens}")
    units: list[list[int]] = []
    offsets = merged.offsets.tolist()
    size = merged.size.tolist()
    for a, b in zip(offsets, offsets[1:]):
        if merged.layout == "paths" or b - a <= max_tokens:
            if b - a > max_tokens:
                raise MergeError(f"a sequence of {b - a} tokens exceeds max_tokens={max_tokens}")
            units.append(list(range(a, b)))
        else:
            units.extend(_split(a, size, max_tokens))
    bins = _first_fit_decreasing(units, max_tokens)
    return _plans(merged, bins, size)


def _split(root: int, size: list[int], max_tokens: int) -> list[list[int]]:
    """Segments of an oversize tree. Depth-first with an explicit stack (paths run to 100k+
    tokens): a node's oversize children are split before its fitting children are binned."""
    segments: list[list[int]] = []
    frames: list[list] = []  # [node, next child, fitting children]; the frames' nodes are the chain

    def push(v: int) -> None:
        if max_tokens - len(frames) - 1 < 1:
            raise MergeError(
                f"a root-to-leaf path of at least {len(frames) + 2} tokens exceeds max_tokens={max_tokens}"
            )
        frames.append([v, v + 1, []])

    push(root)
    while frames:
        frame = frames[-1]
        v, c, fits = frame
        budget = max_tokens - len(frames)
        if c < v + size[v]:
            frame[1] = c + size[c]
            if size[c] <= budget:
                fits.append(c)
            else:
                push(c)
            continue
        head = [f[0] for f in frames] if fits else []
        for group in _first_fit_decreasing([[c] for c in fits], budget, weight=lambda u: size[u[0]]):
            members = sorted(c for unit in group for c in unit)
            segments.append(head + [i for c in members for i in range(c, c + size[c])])
        frames.pop()
    return segments


def _first_fit_decreasing(units: list[list[int]], capacity: int, weight=len) -> list[list[list[int]]]:
    order = sorted(range(len(units)), key=lambda u: -weight(units[u]))  # stable: ties keep order
    bins: list[list[list[int]]] = []
    loads: list[int] = []
    for u in order:
        w = weight(units[u])
        for b, load in enumerate(loads):
            if load + w <= capacity:
                bins[b].append(units[u])
                loads[b] += w
                break
        else:
            bins.append([units[u]])
            loads.append(w)
    return bins


def _plans(merged: Merged, bins: list[list[list[int]]], size: list[int]) -> list[PackPlan]:
    owner_seen: set[int] = set()
    extras_at: dict[int, list[int]] = {}
    for e, i in enumerate(merged.extra_index.tolist()):
        extras_at.setdefault(i, []).append(e)
    mask = merged.loss_mask.tolist()
    parents = merged.parent.tolist()
    plans = []
    for units in bins:
        index, parent, local_size, loss_mask, offsets = [], [], [], [], [0]
        extra_ids, extra_local = [], []
        for unit in units:
            base = len(index)
            for p, i in enumerate(unit):
                owned = i not in owner_seen
                owner_seen.add(i)
                index.append(i)
                loss_mask.append(mask[i] if owned else 0)
                parent.append(-1 if p == 0 else base + bisect.bisect_left(unit, parents[i]))
                local_size.append(bisect.bisect_left(unit, i + size[i]) - p)
                if owned:
                    for e in extras_at.get(i, ()):
                        extra_ids.append(e)
                        extra_local.append(base + p)
            offsets.append(len(index))
        plans.append(
            PackPlan(
                index=np.array(index, np.int32),
                parent=np.array(parent, np.int32),
                size=np.array(local_size, np.int32),
                loss_mask=np.array(loss_mask, np.uint8),
                offsets=np.array(offsets, np.int32),
                extra_ids=np.array(extra_ids, np.int32),
                extra_index=np.array(extra_local, np.int32),
            )
        )
    return plans
