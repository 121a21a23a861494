"""`python -m polar_fast view --run runs/NAME`: a local web page for one run.

Three views, as static pages over a small JSON API (app.py), no front-end build step:
- run: curves from metrics.jsonl drawn as hand-written SVG (reward, held-out pass@k when an eval
  ran, pool busy fractions and queue depths, tokens sampled vs forwarded, staleness), the
  outcome counts and the config;
- rollouts: a paged, filterable, sortable table (run_data.py indexes records.log incrementally);
- one rollout: the conversation the harness had, the token view re-merged with the run's merge
  (tokens.py), and its export as SFT JSON.

The server binds to 127.0.0.1. Any other address needs a key (`--key`), which every request must
carry (`?key=`, then a cookie, or `Authorization: Bearer`): records hold whole prompts and code.
"""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path

from polar_fast.errors import PolarError


class ViewError(PolarError):
    """The view cannot start (no run there, a public address without a key)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_bind(host: str, key: str) -> None:
    if not is_loopback(host) and not key:
        raise ViewError(f"view: {host} is not a loopback address, and records hold whole prompts and code; "
                        "pass --key SECRET to serve it there (every request must then carry the key)")


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ViewError(f"view: no run directory at {run_dir}")
    if not any((run_dir / name).exists() for name in ("records.log", "metrics.jsonl", "config.json")):
        raise ViewError(f"view: {run_dir} holds no run (no records.log, metrics.jsonl or config.json); "
                        "pass a run's output_dir")


async def serve_view(run_dir: Path, *, host: str = "127.0.0.1", port: int = 8765, key: str = "",
                     ready: asyncio.Event | None = None) -> None:
    """Serve the view until cancelled (Ctrl-C). Prints the address it is reachable at."""
    from aiohttp import web

    from polar_fast.report.view.app import make_app
    from polar_fast.signals import StopSignal

    check_bind(host, key)
    await asyncio.to_thread(check_run_dir, run_dir)
    runner = web.AppRunner(make_app(run_dir, key=key), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # the real port when port == 0
        shown = f"[{host}]" if ":" in host else host
        print(f"polar_fast view of {run_dir} on http://{shown}:{bound}/" + (f"?key={key}" if key else ""),
              flush=True)
        if ready is not None:
            ready.set()
        with StopSignal() as stop:
            await stop.event.wait()
    finally:
        await runner.cleanup()
