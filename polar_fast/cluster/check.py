"""What `check` says of a Ray cluster before a long run (preflight, `cluster.kind = "ray"`):
the cluster answers at `cluster.address`; enough nodes offer `cluster.rollout_resource`, and
each of them imports the same polar_fast as the driver; the engine replicas' bundles fit the
GPUs the nodes have. Read-only: nothing is placed that outlives the check."""

from __future__ import annotations

import importlib.metadata
import os
import shutil

from polar_fast.config import Config


def _probe(output_dir: str) -> dict:
    """Runs on a rollout node: what it would run the rollouts with."""
    import socket
    import sys

    import polar_fast

    disk = shutil.disk_usage(output_dir if os.path.isdir(output_dir) else "/")
    return {"host": socket.gethostname(), "python": sys.version.split()[0], "polar_fast": polar_fast.__file__,
            "version": importlib.metadata.version("polar_fast"), "free_gb": disk.free / 2**30}


def check_cluster(cfg: Config, timeout_s: float) -> list[tuple[str, bool, str, str]]:
    """(name, ok, evidence, fix) per item; joins and leaves the cluster itself."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    c, e = cfg.cluster, cfg.engine
    joined = not ray.is_initialized()
    try:
        if joined:
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except ConnectionError as error:
        return [("connect", False, f"no Ray cluster at {c.address!r}: {error}",
                 "start one (`ray start --head`; docs/scaling.md) or set cluster.address")]
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        rollout = [n for n in nodes if n.get("Resources", {}).get(c.rollout_resource, 0) >= 1]
        items = [("connect", True, f"{len(nodes)} alive nodes at {c.address!r}", "")]
        enough = len(rollout) >= c.min_rollout_nodes
        items.append(("rollout nodes", enough,
                      f"{len(rollout)} nodes offer {c.rollout_resource} (cluster.min_rollout_nodes = {c.min_rollout_nodes})",
                      "" if enough else f"start nodes with --resources '{{\"{c.rollout_resource}\": 1}}'"))
        probe = ray.remote(num_cpus=0)(_probe)
        mine = importlib.metadata.version("polar_fast")
        for node in rollout:
            ref = probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                cfg.run.output_dir)
            name = f"rollout node {node['NodeID'][:12]}"
            try:
                seen = ray.get(ref, timeout=timeout_s)
            except Exception as error:  # a node that cannot run a task would hang the run's start
                items.append((name, False, f"did not run a probe within {timeout_s:g} s: {type(error).__name__}",
                               "check the node's Ray logs and that it has polar_fast installed"))
                continue
            same = seen["version"] == mine
            items.append((name, same, f"{seen['host']}: python {seen['python']}, polar_fast {seen['version']}, "
                                      f"{seen['free_gb']:.0f} GB free at run.output_dir",
                          "" if same else f"install polar_fast {mine} (the driver's) on it"))
        if e.kind == "vllm" and not (e.url or e.urls) and e.gpus_per_replica > 0:
            fit = sum(int(n.get("Resources", {}).get("GPU", 0) // e.gpus_per_replica) for n in nodes)
            ok = fit >= e.replicas
            items.append(("engine replicas", ok, f"{e.replicas} replicas x {e.gpus_per_replica} GPUs: the nodes' GPUs "
                                                 f"hold {fit} such bundles", "" if ok else "add GPU nodes or lower "
                                                                                         "engine.replicas"))
        return items
    finally:
        if joined:
            ray.shutdown()
