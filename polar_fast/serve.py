"""`python -m polar_fast serve`: the capture proxy alone, with the configured engine, until Ctrl-C.

For collecting traces from any harness by hand: create a session (`POST /sessions`), point the
harness at `<base_url>` from the reply (or use the token as its API key), and every call lands in
`<output_dir>/records.log` as it completes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from polar_fast.config import Config, engine_config
from polar_fast.records import RecordLog
from polar_fast.signals import StopSignal


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
