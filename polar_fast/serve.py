"""`python -m polar_fast serve`: serving without training, until Ctrl-C.

- `serve_forever`: the capture proxy alone, with the configured engine. For collecting traces
  from any harness by hand: create a session (`POST /sessions`), point the harness at
  `<base_url>` from the reply (or use the token as its API key), and every call lands in
  `<output_dir>/records.log` as it completes.
- `serve_rollouts` (`serve --rollouts`): the rollout service, polar_fast as the rollout generator
  of an external trainer: the whole rollout stack (rollouts/stack.py) and pools, with the HTTP API
  of rollouts/service.py in front of the finished groups.
"""

from __future__ import annotations

import asyncio
import ipaddress
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

import msgspec

from polar_fast.config import Config, engine_config
from polar_fast.records import RecordLog
from polar_fast.signals import StopSignal

if TYPE_CHECKING:
    from polar_fast.rollouts.service import RolloutService
    from polar_fast.rollouts.stack import Rollouts


async def serve_forever(cfg: Config, *, host: str | None = None, port: int | None = None,
                        ready: asyncio.Event | None = None) -> None:
    from polar_fast.engines import build_engine
    from polar_fast.proxy import open_proxy

    proxy_cfg = msgspec.structs.replace(cfg.proxy, host=host or cfg.proxy.host,
                                        port=cfg.proxy.port if port is None else port)
    cfg = msgspec.structs.replace(cfg, proxy=proxy_cfg)
    out = Path(cfg.run.output_dir)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    engine = await asyncio.to_thread(build_engine, cfg.model, engine_config(cfg))
    log = await asyncio.to_thread(RecordLog, out / "records.log", fsync=cfg.proxy.record_fsync)
    try:
        with StopSignal() as stop:
            async with open_proxy(cfg, engine, log) as proxy:
                print(f"polar_fast proxy on {proxy.base_url}  (model {cfg.model.name!r}, engine {cfg.engine.kind})", flush=True)
                if proxy.unix_socket:
                    print(f"also on unix socket {proxy.unix_socket}", flush=True)
                print(f"new session: curl -X POST {proxy.base_url}/sessions ; records: {out / 'records.log'}", flush=True)
                print(f"tell the harness: context {cfg.model.max_context_tokens} tokens, output cap "
                      f"{cfg.sampling.max_tokens} tokens (docs/harnesses.md)", flush=True)
                if ready is not None:
                    ready.set()
                await stop.event.wait()
    finally:
        log.close()
        await engine.aclose()


# ---------------------------------------------------------------------------------- rollout service


@dataclass(eq=False)
class RunningService:
    service: RolloutService
    url: str  # http://HOST:PORT of the service API
    rollouts: Rollouts  # proxy, engine, agent, factory (on a Ray cluster: cluster/driver.py ClusterRollouts)


@asynccontextmanager
async def open_rollout_service(cfg: Config, *, host: str | None = None,
                               port: int | None = None) -> AsyncIterator[RunningService]:
    """Engine, proxy, pools and the service API, for the life of the block. On exit the service
    stops taking groups, open streams end, and in-flight rollouts are abandoned (sandboxes removed)."""
    from aiohttp import web

    from polar_fast.cluster import rollout_side
    from polar_fast.errors import ConfigError
    from polar_fast.pools import Pools
    from polar_fast.rollouts.service import RolloutService
    from polar_fast.rollouts.tasks import load_builtin

    sc = msgspec.structs.replace(cfg.rollout_service, host=host or cfg.rollout_service.host,
                                 port=cfg.rollout_service.port if port is None else port)
    if not _is_loopback(sc.host) and not sc.api_key:
        raise ConfigError(f"rollout_service.host={sc.host!r} listens beyond loopback: set rollout_service.api_key")
    run_dir = Path(cfg.run.output_dir)
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    builtin = {t.instance_id: t for t in await asyncio.to_thread(load_builtin)}
    async with rollout_side(cfg, run_dir) as r:  # here, or on a Ray cluster's rollout nodes
        service = RolloutService(sc, default_group_size=cfg.pools.group_size, record=r.proxy.record, builtin=builtin)
        runner = web.AppRunner(service.make_app(), handle_signals=False, access_log=None)
        async with asyncio.TaskGroup() as tg:
            pools = tg.create_task(service.run(Pools.for_rollouts(r)))
            try:
                await runner.setup()
                site = web.TCPSite(runner, sc.host, sc.port)
                await site.start()
                bound = site._server.sockets[0].getsockname()[1]  # the real port when port == 0
                yield RunningService(service, f"http://{f'[{sc.host}]' if ':' in sc.host else sc.host}:{bound}", r)
            finally:
                service.close()
                pools.cancel()
                await runner.cleanup()


async def serve_rollouts(cfg: Config, *, host: str | None = None, port: int | None = None) -> None:
    """Run the service until SIGINT/SIGTERM (the CLI's entry point)."""
    with StopSignal() as stop:
        async with open_rollout_service(cfg, host=host, port=port) as running:
            where = (f"{len(running.rollouts.cluster.alive)} rollout nodes" if cfg.cluster.kind == "ray"
                     else f"proxy {running.rollouts.proxy.base_url}")
            print(f"polar_fast rollout service on {running.url}  ({where}, harness {cfg.harness.name}, "
                  f"engine {cfg.engine.kind})", flush=True)
            print(f"submit: curl -X POST {running.url}/rollouts/groups -d '{{\"task\": \"<builtin id>\"}}'", flush=True)
            await stop.event.wait()


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
