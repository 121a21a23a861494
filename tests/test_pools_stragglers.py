"""Stragglers: a rollout that hangs delays only its own group; the cap on groups in flight holds;
partial groups only when asked; a rollout cut off at its timeout keeps its captured calls.

The agents are scripted shell commands in the local sandbox (no model): what is under test is
the pools' bookkeeping, and a hang is simply a command waiting for a file the test creates."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest

from polar_fast.config import PoolsConfig, RunConfig, SandboxConfig, groups_in_flight
from polar_fast.errors import ConfigError
from polar_fast.pools import Pools
from polar_fast.records import Outcome
from polar_fast.rollouts.agent import CommandAgent, HarnessAgent
from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.sandboxes import make_sandbox_factory
from polar_fast.rollouts.tasks import load_builtin
from polar_fast.testing import scripted_proxy

pytestmark = pytest.mark.anyio
TASK = load_builtin()[0]


def small(**changes) -> PoolsConfig:
    base = dict(group_size=2, boot_workers=2, agent_workers=3, eval_workers=1, prewarm=1, queue_size=2,
                infra_retries=0, boot_timeout_s=60, eval_timeout_s=60)
    return PoolsConfig(**{**base, **changes})


@pytest.fixture
async def local():
    f = make_sandbox_factory(SandboxConfig(kind="local"), run_id=f"strag-{uuid.uuid4().hex[:6]}")
    yield f
    assert await f.remove_leftovers() == 0


def hang_until(release: Path, straggler: str) -> CommandAgent:
    """The rollout `straggler` waits for the release file; every other one fails at once
    (agent_error: a final record with reward 0, no eval needed)."""
    script = (f'if [ "$POLAR_ROLLOUT_ID" = "{straggler}" ]; then '
              f'while [ ! -e "{release}" ]; do sleep 0.05; done; fi; exit 3')
    return CommandAgent(script)


def test_groups_in_flight_default_and_floor():
    assert groups_in_flight(RunConfig(groups_per_step=3)) == 6
    assert groups_in_flight(RunConfig(groups_per_step=2, groups_in_flight=5)) == 5
    with pytest.raises(ConfigError, match="groups_in_flight"):
        groups_in_flight(RunConfig(groups_per_step=4, groups_in_flight=3))


async def test_a_straggler_delays_only_its_own_group(local, tmp_path):
    release = tmp_path / "release"
    tasks = [TASK] * 5
    straggler = f"{TASK.instance_id}-g0-r0"
    pools = Pools(small(), local, hang_until(release, straggler), agent_timeout_s=60, max_groups_in_flight=3)
    order, seen_in_flight, seen_stragglers = [], [], []

    async def on_group(group):
        order.append(group.group_id)
        stats = pools.statistics()
        seen_in_flight.append(stats.groups_in_flight)
        seen_stragglers.append((stats.stragglers, stats.oldest_straggler_s))
        if len(order) == 4:  # every group but the straggler's is done: let it go
            await anyio.to_thread.run_sync(release.touch)

    with anyio.fail_after(120):
        await pools.run(tasks, on_group)
    assert order[-1] == f"{TASK.instance_id}-g0"  # the others did not wait for it
    assert sorted(order) == sorted(f"{TASK.instance_id}-g{i}" for i in range(5))
    assert max(seen_in_flight) <= 3  # the cap held (on_group sees its own group still in flight)
    stragglers, oldest = seen_stragglers[3]
    assert stragglers == 1 and oldest > 0
    assert pools.statistics().stragglers == 0 and pools.statistics().partial_groups == 0


async def test_without_room_in_flight_the_straggler_blocks_the_rest(local, tmp_path):
    """The control: with one group in flight, nothing else starts until the straggler ends, so
    the test above can fail."""
    release = tmp_path / "release"
    straggler = f"{TASK.instance_id}-g0-r0"
    pools = Pools(small(), local, hang_until(release, straggler), agent_timeout_s=60, max_groups_in_flight=1)
    order = []

    async def on_group(group):
        order.append(group.group_id)

    async with anyio.create_task_group() as tg:
        tg.start_soon(pools.run, [TASK] * 3, on_group)
        with anyio.move_on_after(3):
            while pools.statistics().stragglers == 0:
                await anyio.sleep(0.05)
        assert order == [] and pools.statistics().groups_in_flight == 1
        await anyio.to_thread.run_sync(release.touch)
    assert order == [f"{TASK.instance_id}-g{i}" for i in range(3)]


async def test_partial_group_only_when_asked_and_the_late_rollout_is_still_recorded(local, tmp_path):
    release = tmp_path / "release"
    straggler = f"{TASK.instance_id}-g0-r2"
    late = []

    async def on_late(rollout):
        late.append(rollout.record)

    pools = Pools(small(group_size=3), local, hang_until(release, straggler), agent_timeout_s=60,
                  max_groups_in_flight=2, partial_group_after_s=0.2, on_late=on_late)
    groups = []

    async def on_group(group):
        groups.append(group)
        await anyio.to_thread.run_sync(release.touch)

    with anyio.fail_after(120):
        await pools.run([TASK], on_group)
    (group,) = groups
    assert [r.rollout_id for r in group.records] == [f"{TASK.instance_id}-g0-r0", f"{TASK.instance_id}-g0-r1"]
    assert [r.rollout_id for r in late] == [straggler] and late[0].outcome is Outcome.AGENT_ERROR
    stats = pools.statistics()
    assert stats.partial_groups == 1 and stats.groups_done == 1 and stats.rollouts_done == 3


class CallThenHang:
    """A stand-in harness (why a fake: the model's choices decide when a real harness hangs):
    one real model call over HTTP to the proxy, then it hangs past the rollout's timeout."""

    name = "call-then-hang"

    def command(self, *, prompt, proxy_url, api_key, model, home, bundle, max_steps, limits) -> AgentCommand:
        script = ("import json, sys, time, urllib.request\n"
                  "body = json.dumps({'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
                  "req = urllib.request.Request(sys.argv[1] + '/v1/chat/completions', data=body,\n"
                  "    headers={'Content-Type': 'application/json'})\n"
                  "urllib.request.urlopen(req, timeout=30).read()\n"
                  "print('called', flush=True)\n"
                  "time.sleep(600)\n")
        return AgentCommand(argv=["python3", "-c", script, proxy_url], env={}, files={})


async def test_a_rollout_past_its_timeout_ends_as_timeout_and_keeps_its_calls(local, tmp_path):
    async with scripted_proxy(tmp_path, ["a reply"], cycle=True) as px:
        agent = HarnessAgent(px.proxy, CallThenHang(), tmp_path, model="m", max_steps=1, use_socket=False,
                             limits=ModelLimits(context_tokens=2048, max_output_tokens=64))
        pools = Pools(small(group_size=1), local, agent, agent_timeout_s=4)
        groups = []

        async def on_group(group):
            groups.append(group)

        with anyio.fail_after(120):
            await pools.run([TASK], on_group)
    (group,) = groups
    (record,) = group.records
    assert record.outcome is Outcome.TIMEOUT and record.reward == 0.0 and record.n_calls == 1
    calls = group.calls  # the group's record carries them, though the run was cut off
    assert len(calls) == 1 and calls[0].rollout_id == record.rollout_id and calls[0].completion_ids
