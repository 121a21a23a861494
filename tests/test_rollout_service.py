"""The rollout service over real HTTP. First the API alone (submitted groups, errors, batches and
the stream, with finished groups handed in directly); then the whole process: real pools, the
mini-swe-agent CLI in local sandboxes, the real proxy with a scripted engine, rewards from the
task's tests, and batches equal to a merge of the calls in records.log."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import numpy as np
import pytest

from polar_fast import merge
from polar_fast.config import RolloutServiceConfig, parse_config
from polar_fast.errors import ConfigError
from polar_fast.records import CallRecord, Outcome, RolloutRecord, read_log
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord
from polar_fast.rollouts.service import FRAME_HEADER, RolloutService, decode_batch
from polar_fast.serve import open_rollout_service
from polar_fast.rollouts.tasks import load_builtin
from polar_fast.warm_start import SUBMIT as SUBMIT_COMMAND
from polar_fast.warm_start import bash_call

pytestmark = pytest.mark.anyio
TASK = load_builtin()[0]
ROW = msgspec.to_builtins(TASK)


def call(rollout: str, index: int, prompt: list[int], completion: list[int]) -> CallRecord:
    return CallRecord(session_id=rollout, rollout_id=rollout, group_id="g", call_index=index, prompt_ids=prompt,
                      completion_ids=completion, completion_logprobs=[-0.5] * len(completion), policy_version=3,
                      finish_reason="stop", dialect="chat")


class Harness:
    """Stands in for the recorder in the API-only tests."""

    def __init__(self) -> None:
        self.recorded: list[RolloutRecord] = []

    async def record(self, record) -> None:
        self.recorded.append(record)


async def finish(service: RolloutService, group_id: str, rewards: list[float | None]) -> GroupRecord:
    """Hand the service a finished group as the pools would (an infra error made no calls)."""
    rollouts = []
    for i, reward in enumerate(rewards):
        rid = f"{group_id}-r{i}"
        outcome = Outcome.OK if reward is not None else Outcome.INFRA_ERROR
        record = RolloutRecord(rollout_id=rid, group_id=group_id, task_id=TASK.instance_id, harness="h",
                               outcome=outcome, reward=reward)
        calls = [call(rid, 0, [1, 2, 3], [4 + i, 5]), call(rid, 1, [1, 2, 3, 4 + i, 5, 6], [7])]
        rollouts.append(FinishedRollout(record=record, calls=calls if reward is not None else []))
    group = GroupRecord(group_id=group_id, task=TASK, rollouts=rollouts)
    await service.on_group(group)
    return group


@pytest.fixture
async def api():
    harness = Harness()
    cfg = RolloutServiceConfig(max_pending_groups=2, keep_groups=2, api_key="sesame", layout="tree")
    service = RolloutService(cfg, default_group_size=2, record=harness.record, builtin={TASK.instance_id: TASK})
    runner = aiohttp.web.AppRunner(service.make_app(), access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as http:
        yield service, harness, http, url
    service.close()
    await runner.cleanup()


async def test_submit_errors_and_limits(api):
    service, _, http, url = api
    async with aiohttp.ClientSession() as anonymous, anonymous.post(f"{url}/rollouts/groups", json={"task": "x"}) as r:
        assert r.status == 401 and "api key" in (await r.json())["error"]["message"]
    cases = [({"task": "nope"}, "no builtin task 'nope'"),
             ({"task": {**ROW, "FAIL_TO_PASS": []}}, "FAIL_TO_PASS is empty"),
             ({"task": {k: v for k, v in ROW.items() if k != "repo"}}, "repo"),
             ({"task": TASK.instance_id, "group_size": 0}, "group_size must be in [1, 1024]"),
             ({"tasks": TASK.instance_id}, "takes JSON")]
    for body, message in cases:
        async with http.post(f"{url}/rollouts/groups", json=body) as r:
            assert r.status == 400 and message in (await r.json())["error"]["message"], body
    async with http.post(f"{url}/rollouts/groups", json={"task": TASK.instance_id}) as r:
        first = await r.json()
    async with http.post(f"{url}/rollouts/groups", json={"task": ROW, "group_size": 3}) as r:
        second = await r.json()
    assert first["status"] == second["status"] == "pending" and first["group_id"] != second["group_id"]
    assert first["group_id"].startswith(TASK.instance_id + "-")
    async with http.post(f"{url}/rollouts/groups", json={"task": TASK.instance_id}) as r:
        assert r.status == 429  # max_pending_groups = 2
    async with http.get(f"{url}/rollouts/groups/{second['group_id']}") as r:
        status = await r.json()
    assert (status["status"], status["group_size"], status["seq"]) == ("pending", 3, -1)
    async with http.get(f"{url}/rollouts/groups/{first['group_id']}/batch") as r:
        assert r.status == 409
    async with http.get(f"{url}/rollouts/groups/nope") as r:
        assert r.status == 404
    # What the pools will run, in submission order:
    specs = [service._receive.receive_nowait() for _ in range(2)]
    assert [(s.group_id, s.group_size, s.task) for s in specs] == \
        [(first["group_id"], 2, TASK), (second["group_id"], 3, TASK)]


async def read_frames(response: aiohttp.ClientResponse, n: int) -> list[bytes]:
    frames = []
    for _ in range(n):
        (length,) = FRAME_HEADER.unpack(await response.content.readexactly(FRAME_HEADER.size))
        frames.append(await response.content.readexactly(length))
    return frames


async def test_batches_poll_and_stream(api):
    service, harness, http, url = api
    ids = []
    for _ in range(3):
        async with http.post(f"{url}/rollouts/groups", json={"task": TASK.instance_id}) as r:
            ids.append((await r.json())["group_id"])
        if len(ids) == 2:  # two pending is the limit: finish the first to make room
            group = await finish(service, ids[0], [1.0, 0.0])
    async with http.get(f"{url}/rollouts/stream") as stream:
        (early,) = await read_frames(stream, 1)  # the one finished before the stream opened
        await finish(service, ids[1], [0.5, None])
        (live,) = await read_frames(stream, 1)
    async with http.get(f"{url}/rollouts/groups/{ids[0]}/batch") as r:
        assert r.content_type == "application/msgpack" and await r.read() == early
    batch = decode_batch(early)
    assert (batch["group_id"], batch["seq"], batch["layout"]) == (ids[0], 0, "tree")
    assert batch["rollout_ids"] == [f"{ids[0]}-r0", f"{ids[0]}-r1"] and batch["rewards"] == [1.0, 0.0]
    expected = merge.merge(group.calls)
    for name in ("tokens", "parent", "size", "loss_mask", "logprobs", "versions", "rollout", "offsets"):
        assert np.array_equal(batch["arrays"][name], getattr(expected, name)), name
    assert batch["stats"]["n_samples"] == expected.stats.n_samples == 6
    assert [r["rollout_id"] for r in batch["rollouts"]] == batch["rollout_ids"]
    assert [r.rollout_id for r in harness.recorded][:2] == batch["rollout_ids"]  # logged as in a training run

    second = decode_batch(live)
    assert second["seq"] == 1 and second["rollout_ids"] == [f"{ids[1]}-r0"] and second["rewards"] == [0.5]
    assert [r["outcome"] for r in second["rollouts"]] == ["ok", "infra_error"]

    await finish(service, ids[2], [1.0, 1.0])  # keep_groups = 2: the first is dropped
    async with http.get(f"{url}/rollouts/groups/{ids[0]}") as r:
        assert r.status == 404 and "dropped" in (await r.json())["error"]["message"]
    async with http.get(f"{url}/rollouts/groups/{ids[2]}") as r:
        done = await r.json()
    assert (done["status"], done["seq"], [x["reward"] for x in done["rollouts"]]) == ("done", 2, [1.0, 1.0])
    async with http.get(f"{url}/rollouts/stream", params={"after": "1"}) as stream:
        (after,) = await read_frames(stream, 1)
        service.close()  # ends open streams
        assert await stream.content.read() == b""
    assert decode_batch(after)["group_id"] == ids[2]


async def test_non_loopback_needs_a_key(tmp_path):
    cfg = parse_config({"run": {"output_dir": str(tmp_path)}, "rollout_service": {"host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="rollout_service.api_key"):
        async with open_rollout_service(cfg):
            pass


SUBMIT = bash_call(SUBMIT_COMMAND)
FIX = bash_call(f"cat > /tmp/fix.patch <<'POLAR_EOF'\n{TASK.patch}POLAR_EOF\ngit apply /tmp/fix.patch")


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_service_runs_real_rollouts(tmp_path):
    # One boot and one agent slot: rollouts take the scripted replies in submission order.
    # Group A: r0 fixes the bug, r1 looks and gives up. Group B (one rollout, task as JSON): fixes it.
    replies = [FIX, SUBMIT, bash_call("ls"), SUBMIT, FIX, SUBMIT]
    cfg = parse_config({
        "run": {"output_dir": str(tmp_path / "run")},
        "engine": {"kind": "scripted", "scripted_replies": replies},
        "sampling": {"max_tokens": 4096},
        "sandbox": {"kind": "local"},
        "harness": {"name": "mini-swe-agent", "max_steps": 4, "timeout_s": 120},
        "pools": {"group_size": 2, "boot_workers": 1, "agent_workers": 1, "eval_workers": 1, "prewarm": 0},
        "rollout_service": {"layout": "paths"},
    })
    async with open_rollout_service(cfg) as running, aiohttp.ClientSession() as http:
        url = running.url
        async with http.get(f"{url}/rollouts/stream") as stream:
            async with http.post(f"{url}/rollouts/groups", json={"task": TASK.instance_id}) as r:
                a = (await r.json())["group_id"]
            async with http.post(f"{url}/rollouts/groups", json={"task": ROW, "group_size": 1}) as r:
                b = (await r.json())["group_id"]
            frames = await read_frames(stream, 2)
        async with http.get(f"{url}/rollouts/statistics") as r:
            stats = await r.json()
        assert stats["pending_groups"] == 0 and stats["pools"]["agent"]["completed"] == 3
        batches = {(batch := decode_batch(f))["group_id"]: batch for f in frames}
        assert running.rollouts.engine.remaining() == 0
    assert sorted(batches) == sorted([a, b])
    assert [r["outcome"] for r in batches[a]["rollouts"]] == ["ok", "ok"]
    assert batches[a]["rewards"] == [1.0, 0.0] and batches[b]["rewards"] == [1.0]

    contents = await asyncio.to_thread(read_log, tmp_path / "run" / "records.log")
    assert {r.rollout_id: r.reward for r in contents.rollouts} == {f"{a}-r0": 1.0, f"{a}-r1": 0.0, f"{b}-r0": 1.0}
    for group_id, batch in batches.items():
        calls = [c for c in contents.calls if c.group_id == group_id]
        assert len(calls) == 2 * batch["arrays"]["offsets"].size - 2  # two calls per rollout, one path each
        expected = merge.merge(calls, layout="paths")
        assert batch["layout"] == "paths" and batch["rollout_ids"] == expected.rollout_ids
        for name in ("tokens", "loss_mask", "logprobs", "versions", "offsets"):
            assert np.array_equal(batch["arrays"][name], getattr(expected, name)), name
