"""The rollout side of a run, set up and torn down together: harness bundle, engine, sandbox
factory, record log, capture proxy and the harness agent that points each rollout at its session.

    async with open_rollouts(cfg, run_dir, emit=emit) as r:
        await Pools.for_rollouts(r).run(tasks, on_group)   # pools.py runs rollouts on it

The training run adds a learner on top of this; the rollout service (serve.py, rollouts/service.py)
adds an HTTP API for external trainers. Teardown runs in reverse order of setup, and only for what was
set up: the proxy stops (queued records written), then the log, engine and sandbox factory close,
and last a `vllm serve` the block started (engines/vllm_launch.py) is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
import msgspec

from polar_fast.config import Config, engine_config
from polar_fast.engines import Engine
from polar_fast.proxy import Proxy
from polar_fast.records import RecordLog
from polar_fast.rollouts.admission import DiskReserve
from polar_fast.rollouts.agent import HarnessAgent
from polar_fast.rollouts.harnesses import ModelLimits

SOCKET_DIR_PREFIX = "polar-proxy-"


def run_id_for(output_dir: Path) -> str:
    """Stable across restarts on the same output dir: it labels the run's sandboxes."""
    digest = hashlib.sha256(str(output_dir.resolve()).encode()).hexdigest()[:10]
    return f"{output_dir.name}-{digest}"


def with_proxy_socket(cfg: Config, socket_dir: str) -> Config:
    """A Docker box without a network reaches the proxy through a Unix socket we mount."""
    if cfg.sandbox.kind == "docker" and cfg.sandbox.network == "none" and not cfg.proxy.unix_socket:
        proxy = msgspec.structs.replace(cfg.proxy, unix_socket=f"{socket_dir}/proxy.sock")
        return msgspec.structs.replace(cfg, proxy=proxy)
    return cfg


def with_admin_key(cfg: Config) -> Config:
    """Boxes that reach the proxy's TCP port (Docker with host networking, the local sandbox)
    must not reach its admin routes: they get a key generated for the run, which no box sees.
    (The local sandbox runs as the same user on the same machine, so this only raises the bar;
    docs/config.md says to use Docker for untrusted agents.)"""
    reaches_tcp = cfg.sandbox.kind == "local" or cfg.sandbox.network == "host"
    if reaches_tcp and not cfg.proxy.admin_key:
        proxy = msgspec.structs.replace(cfg.proxy, admin_key=secrets.token_hex(16))
        return msgspec.structs.replace(cfg, proxy=proxy)
    return cfg


@dataclass(eq=False)
class Rollouts:
    cfg: Config  # as served: proxy.unix_socket set for network-none boxes, admin_key for the others
    engine: Engine
    proxy: Proxy
    agent: HarnessAgent
    factory: Any  # sandboxes.SandboxFactory
    log: RecordLog
    run_id: str
    leftovers_removed: int  # sandboxes of an earlier, killed process on this run id
    reserve: DiskReserve | None = None  # boots wait while the host's disks are short (rollouts/admission.py)


@asynccontextmanager
async def open_rollouts(cfg: Config, run_dir: Path, *, emit: Callable[[str, dict], None] | None = None,
                        engine: Engine | None = None) -> AsyncIterator[Rollouts]:
    """Everything a rollout needs, for the life of the block; records go to run_dir/records.log.
    A vllm engine with no url gets a `vllm serve` started first and stopped last. `engine`
    replaces the configured one (tests, evaluation with a scripted policy); it is closed here."""
    if engine is not None:
        async with _open_rollouts(cfg, run_dir, emit=emit, engine=engine) as rollouts:
            yield rollouts
        return
    from polar_fast.engines.vllm_launch import launched_vllm

    async with launched_vllm(cfg, run_dir, emit=emit) as cfg, _open_rollouts(cfg, run_dir, emit=emit) as rollouts:
        yield rollouts


@asynccontextmanager
async def _open_rollouts(cfg: Config, run_dir: Path, *, emit: Callable[[str, dict], None] | None = None,
                         engine: Engine | None = None) -> AsyncIterator[Rollouts]:
    from polar_fast.engines import build_engine
    from polar_fast.proxy import open_proxy
    from polar_fast.rollouts.harnesses import bundle_root, run_harness
    from polar_fast.rollouts.sandboxes import sandbox_class

    emit = emit or (lambda kind, data: None)
    harness = await asyncio.to_thread(run_harness, cfg.harness)  # a bad definition stops here, before anything boots
    emit("info", {"message": f"installing harness {harness.name} (cached after the first run)"})
    bundle = await asyncio.to_thread(harness.install, bundle_root(cfg.harness.bundle_dir))
    if engine is None:
        emit("info", {"message": f"loading the model for the {cfg.engine.kind} engine"})
        engine = await asyncio.to_thread(build_engine, cfg.model, engine_config(cfg))
    try:
        run_id = await asyncio.to_thread(run_id_for, run_dir)  # resolve() reads the file system
        # importing a backend reads package metadata (aiodocker): do it off the loop
        factory_class = await asyncio.to_thread(sandbox_class, cfg.sandbox.kind)
        factory = factory_class(cfg.sandbox, run_id=run_id)
        try:
            host = await factory.check()  # how sandbox.disk_mb is enforced; SandboxError when it cannot be
            emit("info", {"message": f"sandbox disk: {host.disk_bound}"})
            reserve = DiskReserve({"the sandboxes' data root": host.data_root, "run.output_dir": str(run_dir)},
                                  need_mb=cfg.run.min_free_disk_mb + max(cfg.sandbox.disk_mb, 0))
            leftovers = await factory.remove_leftovers(run_id)
            log = await asyncio.to_thread(RecordLog, run_dir / "records.log", fsync=cfg.proxy.record_fsync)
            # a short path: Unix socket paths cap at ~108 bytes
            socket_dir = await asyncio.to_thread(tempfile.mkdtemp, prefix=SOCKET_DIR_PREFIX)
            cfg = with_admin_key(with_proxy_socket(cfg, socket_dir))
            try:
                async with open_proxy(cfg, engine, log) as proxy:
                    limits = ModelLimits(context_tokens=cfg.model.max_context_tokens,
                                         max_output_tokens=cfg.sampling.max_tokens)
                    agent = HarnessAgent(proxy, harness, bundle, model=cfg.model.name, max_steps=cfg.harness.max_steps,
                                         use_socket=bool(cfg.proxy.unix_socket), limits=limits)
                    yield Rollouts(cfg, engine, proxy, agent, factory, log, run_id, leftovers, reserve)
            finally:  # each teardown shielded: a block cancelled from outside still closes its parts
                with anyio.CancelScope(shield=True):
                    await asyncio.to_thread(log.close)
                    await asyncio.to_thread(_remove_socket_dir, socket_dir)
        finally:
            with contextlib.suppress(AttributeError), anyio.CancelScope(shield=True), anyio.move_on_after(60):
                await factory.aclose()  # factories without resources have no aclose
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(60):
            await engine.aclose()


def _remove_socket_dir(socket_dir: str) -> None:
    with contextlib.suppress(OSError):
        Path(socket_dir, "proxy.sock").unlink(missing_ok=True)
        Path(socket_dir).rmdir()
