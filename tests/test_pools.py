"""The three pools end to end with a scripted agent (no harness, no model): rewards, outcome
classes, infra retries, cancellation cleanup, prewarm and backpressure. Docker cases use the real
Engine; local cases the subprocess sandbox."""

from __future__ import annotations

import uuid

import anyio
import pytest

import polar_fast.rollouts.sandboxes.docker  # noqa: F401  (imported before the loop: import reads files)
from polar_fast.config import PoolsConfig, SandboxConfig
from polar_fast.pools import Pools
from polar_fast.records import Outcome
from polar_fast.rollouts.agent import CommandAgent
from polar_fast.rollouts.sandboxes import make_sandbox_factory
from polar_fast.rollouts.tasks import load_builtin, prepare_repo

pytestmark = pytest.mark.anyio
BUILTIN = {t.repo.split("/")[1]: t for t in load_builtin()}


def apply_gold(task) -> str:
    return f"git apply <<'POLAR_PATCH_END'\n{task.patch}POLAR_PATCH_END\n"


def small(**changes) -> PoolsConfig:
    base = dict(group_size=2, boot_workers=2, agent_workers=2, eval_workers=2, prewarm=1, queue_size=2,
                infra_retries=1, boot_timeout_s=120, eval_timeout_s=120)
    return PoolsConfig(**{**base, **changes})


async def run_pools(pools, tasks):
    groups = []

    async def on_group(group):
        groups.append(group)

    await pools.run(tasks, on_group)
    return groups


@pytest.fixture
async def local():
    f = make_sandbox_factory(SandboxConfig(kind="local"), run_id=f"pools-{uuid.uuid4().hex[:6]}")
    yield f
    assert await f.remove_leftovers() == 0


async def test_local_outcomes_ok_agent_error_timeout(local):
    tasks = [BUILTIN["intervals"], BUILTIN["lru"], BUILTIN["csvline"]]
    scripts = {"intervals": apply_gold, "lru": lambda t: "exit 4", "csvline": lambda t: "sleep 999"}
    agent = CommandAgent(lambda t: scripts[t.repo.split("/")[1]](t))
    pools = Pools(small(), local, agent, agent_timeout_s=1.0)
    groups = await run_pools(pools, tasks)
    by_task = {g.task.repo.split("/")[1]: g for g in groups}
    assert sorted(by_task) == ["csvline", "intervals", "lru"]
    assert [(r.outcome, r.reward) for r in by_task["intervals"].records] == [(Outcome.OK, 1.0)] * 2
    assert [(r.outcome, r.reward) for r in by_task["lru"].records] == [(Outcome.AGENT_ERROR, 0.0)] * 2
    assert [(r.outcome, r.reward) for r in by_task["csvline"].records] == [(Outcome.TIMEOUT, 0.0)] * 2
    assert all("b/spans/merge.py" in r.diff for r in by_task["intervals"].rollouts)
    stats = pools.statistics()
    assert stats.groups_done == 3 and stats.rollouts_done == 6 and stats.retries == 0
    assert stats.agent.completed == 6 and stats.eval.completed == 2 and stats.boot.completed == 6
    assert sum(stats.agent.histogram) == 6 and stats.agent.running == 0 and stats.boot.queued == 0
    assert 0 < stats.agent.busy_fraction <= 1


async def test_local_wrong_fix_scores_0(local):
    task = BUILTIN["roman"]
    wrong = "sed -i 's/(1, \"I\"),/(4, \"IV\"),\\n    (1, \"I\"),/' numerals.py"
    groups = await run_pools(Pools(small(group_size=1), local, CommandAgent(wrong), agent_timeout_s=30), [task])
    (rollout,) = groups[0].rollouts
    assert rollout.record.outcome is Outcome.OK and rollout.record.reward == 0.0
    assert rollout.eval.failed == task.FAIL_TO_PASS  # partial fix: 4 but not 9
    assert '+    (4, "IV"),' in rollout.diff


async def test_infra_errors_are_retried_then_never_scored(local):
    calls = {"n": 0}

    async def flaky_prepare(box, task):
        calls["n"] += 1
        if calls["n"] == 1:
            await box.remove()  # the sandbox vanishes while booting
        await prepare_repo(box, task)

    task = BUILTIN["semver"]
    pools = Pools(small(group_size=1, infra_retries=1), local, CommandAgent(apply_gold), agent_timeout_s=30,
                  prepare=flaky_prepare)
    (group,) = await run_pools(pools, [task])
    (record,) = group.records
    assert (record.outcome, record.reward, record.attempt) == (Outcome.OK, 1.0, 1)
    assert record.rollout_id.endswith(".a1")
    assert pools.statistics().boot.failed == 1

    async def always_fails(box, task):
        await box.remove()
        await prepare_repo(box, task)

    pools = Pools(small(group_size=1, infra_retries=2), local, CommandAgent(apply_gold), agent_timeout_s=30,
                  prepare=always_fails)
    (group,) = await run_pools(pools, [task])
    (record,) = group.records
    assert (record.outcome, record.reward, record.attempt) == (Outcome.INFRA_ERROR, None, 2)
    assert "boot:" in record.error and pools.statistics().boot.failed == 3


async def test_slow_consumer_backpressure_bounds_work_in_flight(local):
    """With on_group blocked, the pools stop taking tasks once the queues are full."""
    release = anyio.Event()
    taken = []

    def tasks():
        for n in range(50):
            taken.append(n)
            yield BUILTIN["ledger"]

    async def on_group(group):
        await release.wait()

    cfg = small(group_size=1, queue_size=1, prewarm=0, agent_workers=1, eval_workers=1, boot_workers=1)
    pools = Pools(cfg, local, CommandAgent("true"), agent_timeout_s=30, prepare=_no_prepare,
                  collect_diff=_empty_diff, score=_instant_score)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pools.run, tasks(), on_group)
        while pools.statistics().eval.completed < 2:  # eval is blocked on the full done queue
            await anyio.sleep(0.01)
        held, still = len(taken), 0
        while still < 30:  # until the producer has stopped taking tasks
            await anyio.sleep(0.01)
            held, still = len(taken), (still + 1 if len(taken) == held else 0)
        # one item per queue slot and per blocked worker, then the producer waits: far below 50
        assert held <= 10
        await anyio.sleep(0.2)
        assert len(taken) == held
        stats = pools.statistics()
        assert stats.groups_done == 0
        tg.cancel_scope.cancel()
    assert await local.remove_leftovers() == 0


async def test_boots_wait_while_the_disk_is_short_and_say_why(local):
    """The disk reserve: no box boots while a watched disk is short; the pools say why, then go on
    once there is room, and nothing is lost."""
    from polar_fast.rollouts.admission import DiskReserve

    free = {"mb": 900}
    reserve = DiskReserve({"the sandboxes' data root": "/fake/root"}, need_mb=1000, poll_s=0.01,
                          free=lambda path: free["mb"])
    pools = Pools(small(group_size=2), local, CommandAgent(apply_gold), agent_timeout_s=30, reserve=reserve)
    groups = []

    async def on_group(group):
        groups.append(group)

    async with anyio.create_task_group() as tg:
        tg.start_soon(pools.run, [BUILTIN["intervals"]], on_group)
        while not pools.statistics().waiting_for_disk:
            await anyio.sleep(0.01)
        why = pools.statistics().waiting_for_disk
        assert why == ("boots wait for disk: 900 MiB free on the sandboxes' data root (/fake/root), 1000 MiB "
                       "needed (run.min_free_disk_mb + sandbox.disk_mb)")
        assert pools.statistics().boot.completed == 0 and pools.statistics().boot.running == 0  # nothing booted
        free["mb"] = 1000  # space came back
    assert [(r.outcome, r.reward) for g in groups for r in g.records] == [(Outcome.OK, 1.0)] * 2
    assert pools.statistics().waiting_for_disk == "" and reserve.waits == 2


async def test_a_stop_abandons_what_is_in_flight_with_its_calls(local):
    """Cancelled mid-group: the member that finished keeps its record, the one still running
    gets an `abandoned` record with the reason, what it was doing and the calls it made."""
    from polar_fast.records import CallRecord
    from polar_fast.rollouts.agent import AgentResult

    def made_call(rollout_id: str) -> CallRecord:
        return CallRecord(session_id=rollout_id, rollout_id=rollout_id, group_id="g", call_index=0, prompt_ids=[1],
                          completion_ids=[2], completion_logprobs=[-0.1], policy_version=0, finish_reason="stop",
                          dialect="chat")

    class OneHangs(CommandAgent):
        async def run(self, box, task, *, rollout_id, group_id, timeout_s, calls, guide=()):
            if rollout_id.endswith("-r0"):
                return AgentResult(exit_code=0)
            try:
                await anyio.sleep_forever()
            finally:  # as HarnessAgent does: what it captured reaches the list, also when cut off
                calls.append(made_call(rollout_id))

    pools = Pools(small(group_size=2, prewarm=0), local, OneHangs("true"), agent_timeout_s=600, prepare=_no_prepare,
                  collect_diff=_empty_diff, score=_instant_score, max_groups_in_flight=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_pools, pools, [BUILTIN["lru"], BUILTIN["roman"]])
        while not (pools.statistics().rollouts_done == 1 and pools.statistics().agent.running == 1):
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    left = {r.record.rollout_id: r for r in pools.abandon("the run ended (stopped: SIGTERM)")}
    first = BUILTIN["lru"].instance_id
    assert sorted(left) == [f"{first}-g0-r0", f"{first}-g0-r1"]  # the second group never started
    done, hung = left[f"{first}-g0-r0"].record, left[f"{first}-g0-r1"]
    assert (done.outcome, done.reward) == (Outcome.OK, 1.0)
    assert (hung.record.outcome, hung.record.reward, hung.record.n_calls) == (Outcome.ABANDONED, None, 1)
    assert hung.record.error == "the run ended (stopped: SIGTERM), while running the agent (1 model calls)"
    assert [c.rollout_id for c in hung.calls] == [f"{first}-g0-r1"]
    assert pools.abandon("again") == []  # handed over once
    assert await local.remove_leftovers() == 0


async def test_a_diff_past_the_output_cap_is_its_own_outcome_never_retried(local):
    # ~12 MB of diff lines: past the 8 MiB the sandbox keeps of a command's output
    agent = CommandAgent("yes polar-filler-line | head -c 10000000 > big.txt")
    pools = Pools(small(group_size=1), local, agent, agent_timeout_s=60)
    (group,) = await run_pools(pools, [BUILTIN["ledger"]])
    (rollout,) = group.rollouts
    assert (rollout.record.outcome, rollout.record.reward, rollout.record.attempt) == (Outcome.DIFF_TOO_LARGE, 0.0, 0)
    assert "larger than the 8 MiB the sandbox keeps" in rollout.record.error and rollout.diff == ""
    stats = pools.statistics()
    assert stats.retries == 0 and stats.eval.completed == 0  # the agent's outcome: not evaluated, not an infra error


async def _no_prepare(box, task):
    pass


async def _empty_diff(box, task):
    return ""


async def _instant_score(box, task, diff, *, timeout_s):
    from polar_fast.rollouts.reward import EvalResult

    return EvalResult(reward=1.0, tests={}, failed=[])


# ------------------------------------------------------------------------------------------ docker


@pytest.fixture
async def docker(base_image):
    f = make_sandbox_factory(SandboxConfig(kind="docker", cpus=1.0, memory_mb=512, disk_mb=128),
                             run_id=f"pools-{uuid.uuid4().hex[:6]}")
    yield f
    await f.remove_leftovers()
    await f.aclose()


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_docker_solved_1_wrong_0_hanging_killed(docker):
    tag = str(600000 + uuid.uuid4().int % 100000)
    task_ok, task_wrong, task_hang = BUILTIN["transpose"], BUILTIN["wordfreq"], BUILTIN["ledger"]
    scripts = {task_ok.instance_id: apply_gold(task_ok),
               task_wrong.instance_id: "sed -i 's/text)/text.lower())/' wordfreq.py",
               task_hang.instance_id: f"(setsid sleep {tag} &); sleep {tag}"}
    seen_alive = []

    class Watching(CommandAgent):
        async def run(self, box, task, **kw):
            result = await super().run(box, task, **kw)
            if task is task_hang:  # the box still exists here: nothing of the agent may remain
                ps = await box.exec(["ps", "-eo", "stat=,args="])
                seen_alive.extend(l for l in ps.stdout.splitlines() if f"sleep {tag}" in l)
            return result

    pools = Pools(small(group_size=1), docker, Watching(lambda t: scripts[t.instance_id]), agent_timeout_s=2.0)
    groups = {g.task.instance_id: g.records[0] for g in await run_pools(pools, [task_ok, task_wrong, task_hang])}
    assert (groups[task_ok.instance_id].outcome, groups[task_ok.instance_id].reward) == (Outcome.OK, 1.0)
    assert (groups[task_wrong.instance_id].outcome, groups[task_wrong.instance_id].reward) == (Outcome.OK, 0.0)
    assert (groups[task_hang.instance_id].outcome, groups[task_hang.instance_id].reward) == (Outcome.TIMEOUT, 0.0)
    assert seen_alive == []
    assert await docker.list_run() == []


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_docker_cancel_mid_run_leaves_no_container(docker):
    pools = Pools(small(group_size=2, prewarm=2), docker, CommandAgent("sleep 1000"), agent_timeout_s=600)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_pools, pools, [BUILTIN["lru"], BUILTIN["roman"]])
        while not (pools.statistics().agent.running == 2 and pools.statistics().agent.queued >= 1):
            await anyio.sleep(0.05)
        assert len(await docker.list_run()) >= 3  # two agents running, prewarmed boxes waiting
        tg.cancel_scope.cancel()
    assert await docker.list_run() == []


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_docker_container_dying_during_boot_is_infra_error_and_retried(docker):
    killed = []

    async def dies_once(box, task):
        if not killed:
            killed.append(box.id)
            await box.container.kill()  # a real container death in the middle of boot
        await prepare_repo(box, task)

    task = BUILTIN["csvline"]
    pools = Pools(small(group_size=1, infra_retries=1), docker, CommandAgent(apply_gold), agent_timeout_s=60,
                  prepare=dies_once)
    (group,) = await run_pools(pools, [task])
    (record,) = group.records
    assert (record.outcome, record.reward, record.attempt) == (Outcome.OK, 1.0, 1)
    assert pools.statistics().boot.failed == 1 and pools.statistics().retries == 1
    assert await docker.list_run() == []
