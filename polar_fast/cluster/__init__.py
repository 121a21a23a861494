"""Past one machine on Ray (`[cluster] kind = "ray"`; docs/scaling.md).

The driver (where the run starts) holds the learner. Each node offering `cluster.rollout_resource`
runs one rollout actor (node.py): today's rollout stack in its own uvloop thread: capture proxy,
bounded pools, local sandboxes, a crash-safe record log. driver.py hands groups to nodes by free
capacity and streams every node's records into the driver's log as they are written; a node that
dies turns its in-flight rollouts into abandoned records and its groups are retried elsewhere.
replicas.py places vLLM servers with a placement group. Ray carries no tokens of generation:
harnesses reach the engine over HTTP, weights travel as files or NCCL.

Nothing here is imported on the local path: only cluster runs import Ray.
"""

from polar_fast.errors import PolarError


class ClusterError(PolarError):
    """The cluster cannot give the run what it asked for (a placement, an actor, a rollout node
    left alive); the message says what was asked and what the cluster offers."""
