"""Start-up with a deadline: every placement group and actor start is awaited for at most
`cluster.start_timeout_s`, and one that is not placed by then ends the run with what was asked
for and what the cluster offers (the field's commonest multi-node hang: a placement group that
is never scheduled waits forever, and a worker that never registers times out without a word)."""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from polar_fast.cluster import ClusterError


def offered() -> str:
    """What the cluster offers, node by node: its alive nodes' total resources, in words."""
    import ray

    lines = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = {k: v for k, v in node.get("Resources", {}).items()
                     if not k.startswith("node:") and "_group_" not in k}  # placement-group bookkeeping
        described = ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()))
        lines.append(f"  node {node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')}): {described}")
    return "\n".join(lines) or "  no alive node"


def unplaced(what: str, asked: Mapping[str, float], timeout_s: float) -> ClusterError:
    wanted = ", ".join(f"{k}={v:g}" for k, v in asked.items())
    return ClusterError(f"{what} was not placed within cluster.start_timeout_s = {timeout_s:g} s: it asks for "
                        f"{wanted}; the cluster offers:\n{offered()}\n"
                        "Start nodes that offer it (docs/scaling.md), or ask for less.")


async def placed(ref: Any, what: str, asked: Mapping[str, float], timeout_s: float) -> Any:
    """The value of `ref` (an ObjectRef: a placement group's `ready()`, an actor's first method
    call), or a ClusterError naming `what`, `asked` and the cluster's offer once `timeout_s` has
    passed."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
    except TimeoutError:
        raise unplaced(what, asked, timeout_s) from None
