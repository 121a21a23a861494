"""The cluster items of `check` (cluster/check.py does the asking; n/a on one machine)."""

from __future__ import annotations

from polar_fast.config import Config
from polar_fast.preflight import Item, failed, not_applicable, passed

PROBE_TIMEOUT_S = 60.0


def check_cluster(cfg: Config) -> list[Item]:
    if cfg.cluster.kind != "ray":
        return [not_applicable("cluster", "ray", "cluster.kind = \"local\": the rollouts run in this process")]
    try:
        from polar_fast.cluster.check import check_cluster as ask
    except ImportError as e:  # the `ray` extra is missing
        return [failed("cluster", "ray", f"cluster.kind = \"ray\" but Ray does not import: {e}",
                       "pip install 'polar_fast[ray]'")]
    return [passed("cluster", name, evidence) if ok else failed("cluster", name, evidence, fix)
            for name, ok, evidence, fix in ask(cfg, PROBE_TIMEOUT_S)]
