"""The least any packing of a merged tree can forward under a micro-batch budget (merge_bench's
`pack_overhead` divides by this).

A token can only be forwarded in a micro-batch that also holds its whole ancestor chain (it attends
to it). So a node v at depth d (d ancestors) shares each micro-batch it is in with d ancestors and
itself, leaving at most B - d - 1 tokens for its descendants there; every copy of a descendant sits
in a micro-batch that holds v. With m(u) the copies node u needs at least,
    m(v) >= ceil(sum of m(u) over v's strict descendants / (B - d - 1)),  and m(v) >= 1.
Bottom-up this gives the trie's nodes plus each ancestor chain that any split must repeat. It drops
bin-packing integrality between siblings, so it is a bound, not always reachable.
"""

from __future__ import annotations

import numpy as np


def pack_lower_bound(parent: np.ndarray, size: np.ndarray, positions: np.ndarray, max_tokens: int) -> int:
    """Tokens forwarded at least, over tree-layout arrays (DFS pre-order, `positions` = depth)."""
    depth = positions.astype(np.int64)
    size = size.astype(np.int64)
    tight = np.flatnonzero(depth + size > max_tokens)  # subtrees that cannot fit with their chain
    if len(tight) and int((max_tokens - depth[tight] - 1).min()) < 1:
        raise ValueError(f"a root-to-leaf path exceeds max_tokens={max_tokens}")
    acc: dict[int, int] = {}  # extra copies among a tight node's strict descendants
    extra_total = 0
    for v in tight[::-1].tolist():  # children come after parents in pre-order
        inner = int(size[v]) - 1 + acc.pop(v, 0)
        room = max_tokens - int(depth[v]) - 1
        extra = max(0, -(-inner // room) - 1)
        extra_total += extra
        p = int(parent[v])
        if p >= 0:  # a tight node's parent is tight too
            acc[p] = acc.get(p, 0) + (inner - (int(size[v]) - 1)) + extra
    return len(size) + extra_total
