"""Past one machine on Ray (`[cluster] kind = "ray"`; docs/scaling.md).

The driver (where the run starts) holds the learner. Each node offering `cluster.rollout_resource`
runs one rollout actor (node.py): today's rollout stack in its own uvloop thread: capture proxy,
bounded pools, local sandboxes, a crash-safe record log. driver.py hands groups to nodes by free
capacity and streams every node's records into the driver's log as they are written; a node that
dies turns its in-flight rollouts into abandoned records and its groups are retried elsewhere.
replicas.py places vLLM servers with a placement group. Ray carries no tokens of generation:
harnesses reach the engine over HTTP, weights travel as files or NCCL.

`rollout_side` is the one door: train, eval and serve open their rollouts through it, on one
machine or on the cluster, and use them the same way. Only a cluster run imports Ray, or this
package's other modules.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from polar_fast.errors import PolarError

if TYPE_CHECKING:
    from polar_fast.config import Config


class ClusterError(PolarError):
    """The cluster cannot give the run what it asked for (a placement, an actor, a rollout node
    left alive); the message says what was asked and what the cluster offers."""


@asynccontextmanager
async def rollout_side(cfg: Config, run_dir: Path, *, emit: Callable[[str, dict], None] | None = None,
                       engine: Any = None) -> AsyncIterator[Any]:
    """Where the rollouts run, for the life of the block: this process (rollouts/stack.py
    `Rollouts`), or the rollout nodes of a Ray cluster (`cluster.kind = "ray"`, driver.py
    `ClusterRollouts`: the same face; `Pools.for_rollouts` gives pools that hand each group to a
    node). `engine` replaces the configured one (tests: a scripted policy, copied to each node)."""
    if cfg.cluster.kind == "ray":
        from polar_fast.cluster.driver import open_cluster

        async with open_cluster(cfg, run_dir, emit=emit, engine=engine) as rollouts:
            yield rollouts
    else:
        from polar_fast.rollouts.stack import open_rollouts

        async with open_rollouts(cfg, run_dir, emit=emit, engine=engine) as rollouts:
            yield rollouts
