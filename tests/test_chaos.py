"""Faults in the middle of a whole training run: Docker boxes, the real mini-swe-agent, the real
proxy, merge and learner. Each fault is injected once, at a point the test proves is live.

The model's choices are scripted (ScriptedEngine through the real tokenizer). With one agent slot
and one group in flight the rollouts take the scripted replies in this order:
    g0-r0      runs `sleep 12 # polar-chaos-kill`: the test sees that process in the box and
               kills the container (an infra fault: the rollout is retried in a fresh box);
    g0-r1      runs `sleep 25 # polar-chaos-hang`: the harness hangs past harness.timeout_s
               (an agent fault: outcome timeout, reward 0, its call kept);
    g0-r0.a1   the retry floods the harness's own output with 30 MB (written to its parent's
               stdout, past the 8 MiB tail the sandbox keeps), then applies the task's fix and
               submits (reward 1).
"""

from __future__ import annotations

import subprocess

import anyio
import pytest
from test_train import SUBMIT, TASK, bash_call, fix_command, raw_config  # the same scripted run

from polar_fast.config import parse_config
from polar_fast.records import Outcome, read_log
from polar_fast.train import train

KILL = bash_call("sleep 12 # polar-chaos-kill")
HANG = bash_call("sleep 25 # polar-chaos-hang")
FLOOD = bash_call("head -c 30000000 /dev/zero | tr '\\0' x > /proc/$PPID/fd/1; echo flooded")


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=30).stdout


async def _kill_when_live(run_id: str, marker: str, killed: list[str]) -> None:
    """Kill the run's container once the marked command runs in it (proof the fault is live)."""
    while not killed:
        ids = (await anyio.to_thread.run_sync(_docker, "ps", "-q", "--filter", f"label=polar_fast.run={run_id}")).split()
        for cid in ids:
            if marker in await anyio.to_thread.run_sync(_docker, "top", cid, "-eo", "pid,args"):
                await anyio.to_thread.run_sync(_docker, "kill", cid)
                killed.append(cid)
                return
        await anyio.sleep(0.2)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(600)
async def test_container_killed_and_harness_hung_mid_run(tmp_path, docker_required, base_image):
    from polar_fast.rollouts.stack import run_id_for

    replies = [KILL, HANG, FLOOD, bash_call(fix_command(TASK.patch)), SUBMIT]
    raw = raw_config(tmp_path, replies=replies, sandbox={"kind": "docker", "network": "none"},
                     harness={"timeout_s": 20}, run={"groups_in_flight": 1, "tensorboard": False})
    cfg = parse_config(raw)
    out = tmp_path / "run"
    run_id = await anyio.to_thread.run_sync(run_id_for, out)
    killed: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_kill_when_live, run_id, "polar-chaos-kill", killed)
        with anyio.fail_after(500):
            summary = await train(cfg)
        tg.cancel_scope.cancel()

    assert len(killed) == 1  # the fault was injected, while its command ran
    # the run continued: it trained its step on the group
    [step] = summary.steps
    assert step["learner/step"] == 1 and step["learner/grad_norm"] > 0
    assert step["outcomes/ok"] == 1 and step["outcomes/timeout"] == 1 and step["outcomes/infra_error"] == 0

    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0  # the log reads back whole
    g = f"{TASK.instance_id}-g0"
    calls_by_rollout: dict[str, int] = {}
    for c in (c for c in contents.calls if c.group_id == g):  # a later group may start (and fail: no replies left)
        calls_by_rollout[c.rollout_id] = calls_by_rollout.get(c.rollout_id, 0) + 1
    # every answered call (one per scripted reply) is in the log, the killed attempt's too
    assert calls_by_rollout == {f"{g}-r0": 1, f"{g}-r1": 1, f"{g}-r0.a1": 3}
    # the flood was written (a failed redirect would have put its error in the observation)
    seen = [str(m.content) for e in contents.exchanges if e.rollout_id == f"{g}-r0.a1" for m in e.messages]
    assert any('"output": "flooded\\n"' in text for text in seen)
    # one infra fault, retried; the hang is the agent's (timeout, reward 0); rewards untouched
    final = {r.rollout_id: (r.outcome, r.reward) for r in contents.rollouts if r.group_id == g}
    assert final == {f"{g}-r0.a1": (Outcome.OK, 1.0), f"{g}-r1": (Outcome.TIMEOUT, 0.0)}
    # no container of the run is left
    left = await anyio.to_thread.run_sync(_docker, "ps", "-aq", "--filter", f"label=polar_fast.run={run_id}")
    assert left.split() == []
