"""The training run end to end: real pools, real harness CLI, real proxy, real merge and learner.

The model's choices are scripted (ScriptedEngine through the real SmolLM2 tokenizer): in each
group the first rollout applies the task's known fix and the second does nothing, so rewards
differ, advantages are non-zero and the learner really updates the weights. The learner's model
is the two-layer one with SmolLM2's vocabulary, tokenizer and template (the `tiny_model`
fixture): with scripted choices the real weights prove nothing more here, and its steps and
checkpoints take a second. Runs of the real weights: test_default_run.py (embedded engine),
test_chaos.py's real-vLLM run, test_vllm_real.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import anyio
import msgspec
import pytest
import torch

from polar_fast import merge
from polar_fast.config import parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.grpo import MismatchError
from polar_fast.model import load_model, load_tokenizer
from polar_fast.records import Outcome, RunEndRecord, read_log
from polar_fast.report.view.browser import view_server
from polar_fast.rollouts.tasks import load_builtin
from polar_fast.train import RunError, train
from polar_fast.warm_start import SUBMIT as SUBMIT_COMMAND
from polar_fast.warm_start import bash_call

TASK = load_builtin()[0]


def fix_command(patch: str) -> str:
    return f"cat > /tmp/fix.patch <<'POLAR_EOF'\n{patch}POLAR_EOF\ngit apply /tmp/fix.patch"


SUBMIT = bash_call(SUBMIT_COMMAND)
# one group: rollout 0 fixes the bug, rollout 1 looks around and gives up
GROUP_REPLIES = [bash_call(fix_command(TASK.patch)), SUBMIT, bash_call("ls"), SUBMIT]


def raw_config(tmp_path, *, steps: int = 1, sandbox: dict | None = None, harness_name: str = "mini-swe-agent",
               replies: list[str] = GROUP_REPLIES, **sections) -> dict:
    raw = {
        "run": {"output_dir": str(tmp_path / "run"), "steps": steps, "groups_per_step": 1,
                "tensorboard": True, "max_staleness": 4,
                "zero_variance_skips": 0},  # scripted groups: each test trains the group it scripts
        "engine": {"kind": "scripted", "scripted_replies": replies * steps},
        "sampling": {"max_tokens": 4096},
        "sandbox": sandbox or {"kind": "local"},
        "harness": {"name": harness_name, "max_steps": 4, "timeout_s": 120},
        "tasks": {"source": "builtin", "limit": 1},
        # one agent slot and one boot worker: rollouts consume the scripted replies in order
        "pools": {"group_size": 2, "boot_workers": 1, "agent_workers": 1, "eval_workers": 1, "prewarm": 0},
        "learner": {"lr": 1e-3},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def run_config(tmp_path, **options):
    return parse_config(raw_config(tmp_path, **options))


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_one_step_local_sandbox_trains_on_the_captured_calls(tmp_path, tiny_model):
    cfg = run_config(tmp_path, model={"path": str(tiny_model)})
    summary = await train(cfg)

    [step] = summary.steps
    assert step["outcomes/ok"] == 2  # later groups may finish (and fail: no replies left) meanwhile
    assert step["learner/step"] == 1 and step["learner/version"] == 1
    assert step["reward/mean"] == 0.5 and step["learner/n_rollouts"] == 2
    assert step["learner/n_terms"] == step["proxy/sampled_tokens"] > 0
    assert 0 < step["merge/tokens_forwarded"] < step["proxy/call_tokens"]
    assert step["learner/grad_norm"] > 0
    # run.groups_in_flight defaults to 2 x groups_per_step; stragglers are reported every step
    assert step["stragglers/groups_in_flight"] <= 2 * cfg.run.groups_per_step
    assert step["stragglers/running"] >= 0 and step["stragglers/oldest_s"] >= 0
    assert summary.checkpoint.endswith("step_1.pt")
    await anyio.to_thread.run_sync(check_run_files, tmp_path / "run", step)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_last_step_trains_with_no_rollout_running_beside_it(tmp_path, tiny_model, monkeypatch):
    """Once the last step has its groups, the rollouts still in flight could only be abandoned at
    its end: they are stopped before it, so they take no CPU or memory from it. Replies for three
    groups keep the pools busy, and the step takes 3 s more: were the pools left running, the
    next group's rollouts would be running when the step's pool statistics are read."""
    from polar_fast.grpo import Learner

    real_step = Learner.step

    def slow_step(self, groups, **options):
        time.sleep(3)
        return real_step(self, groups, **options)

    monkeypatch.setattr(Learner, "step", slow_step)
    cfg = run_config(tmp_path, replies=GROUP_REPLIES * 3, model={"path": str(tiny_model)},
                     pools={"agent_workers": 2, "boot_workers": 2})
    summary = await train(cfg)

    [step] = summary.steps
    assert step["learner/n_rollouts"] == 2
    assert (step["pools/agent/running"], step["pools/boot/running"]) == (0, 0)
    contents = await anyio.to_thread.run_sync(read_log, tmp_path / "run" / "records.log")
    trained = {r.rollout_id for r in contents.rollouts if r.outcome is not Outcome.ABANDONED}
    abandoned = [r for r in contents.rollouts if r.outcome is Outcome.ABANDONED]
    assert len(trained) == 2 and abandoned, "no rollout was in flight when the last step began"
    assert all(r.error.startswith("the run ended (finished: 1 of 1 steps done)") for r in abandoned)


def check_run_files(run, step) -> None:
    contents = read_log(run / "records.log")
    assert contents.torn_bytes == 0
    # the group it trained; a group that started meanwhile was still in flight when the run ended
    rewards = {r.rollout_id: r.reward for r in contents.rollouts if r.outcome is not Outcome.ABANDONED}
    assert sorted(rewards.values()) == [0.0, 1.0]
    end = contents.records[-1]
    assert isinstance(end, RunEndRecord) and end.reason == "finished: 1 of 1 steps done" and end.step == 1
    abandoned = [r for r in contents.rollouts if r.outcome is Outcome.ABANDONED]
    assert end.abandoned == len(abandoned) and all("the run ended (finished" in r.error for r in abandoned)
    calls = contents.calls
    assert len(calls) == 4 and {c.policy_version for c in calls} == {0}
    by_rollout = {}
    for c in calls:
        by_rollout.setdefault(c.rollout_id, []).append(c)
    for first, second in by_rollout.values():  # exact history across the harness's two turns
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == \
            first.prompt_ids + first.completion_ids
    merged = merge.merge(calls)
    assert merged.stats.n_breaks == 0 and merged.stats.n_samples == step["learner/n_terms"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    assert list((run / "tensorboard").iterdir())


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_engine_down_is_an_infra_error_never_scored(tmp_path, tiny_model):
    # the engine answers nothing; the harness keeps retrying until its timeout
    cfg = run_config(tmp_path, replies=[], pools={"infra_retries": 0}, harness={"timeout_s": 15},
                     model={"path": str(tiny_model)})
    summary = await train(cfg)

    [step] = summary.steps
    assert step["outcomes/infra_error"] == 2 and step["outcomes/agent_error"] == 0
    assert step["learner/n_rollouts"] == 0 and step["learner/n_terms"] == 0
    contents = await anyio.to_thread.run_sync(read_log, tmp_path / "run" / "records.log")
    final = [r for r in contents.rollouts if r.group_id == contents.rollouts[0].group_id]
    assert all(r.reward is None and "engine" in r.error for r in final)


class ShiftedEngine(ScriptedEngine):
    """Scripted choices recorded with the learner's model's own logprobs (a forward per call, at temperature 1)
    plus `shift`: a misconfigured engine, as the run sees one."""

    made_up_logprobs = False

    def __init__(self, replies: list[str], tokenizer, model, shift: float) -> None:
        super().__init__(replies, tokenizer)
        self.model, self.shift = model, shift

    async def generate(self, prompt_ids, sampling, *, session_id: str = ""):
        gen = await super().generate(prompt_ids, sampling, session_id=session_id)
        own = await anyio.to_thread.run_sync(self._logprobs, list(prompt_ids), gen.token_ids)
        return msgspec.structs.replace(gen, logprobs=[lp + self.shift for lp in own])

    @torch.no_grad()
    def _logprobs(self, prompt: list[int], ids: list[int]) -> list[float]:
        logits = self.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_an_engine_that_disagrees_with_the_learner_stops_the_run_at_its_first_step(tmp_path, tiny_model):
    cfg = run_config(tmp_path, model={"path": str(tiny_model)})
    tokenizer, model = await anyio.to_thread.run_sync(lambda: (load_tokenizer(cfg.model.path),
                                                               load_model(cfg.model.path).eval()))
    with pytest.raises(MismatchError) as caught:  # itself, not inside the TaskGroups' exception groups
        await train(cfg, engine=ShiftedEngine(GROUP_REPLIES, tokenizer, model, shift=1.0))
    text = str(caught.value)
    assert "learner.max_mismatch_kl = 0.01" in text and "The run stopped before training" in text
    assert "engine.dtype = float32, learner.dtype = float32" in text and "\n- a kernel:" in text
    figures = caught.value.figures
    assert figures.abs_mean == pytest.approx(1.0, abs=1e-3) and figures.abs_max == pytest.approx(1.0, abs=1e-3)
    assert figures.kl == pytest.approx(math.exp(-1.0), abs=1e-3)  # k3 at r = e^-1: e^-1 - 1 + 1
    await anyio.to_thread.run_sync(check_nothing_trained, tmp_path / "run")


def check_nothing_trained(run) -> None:
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()  # no step was logged
    assert not list(run.glob("checkpoints/*.pt"))  # nor saved
    assert len(read_log(run / "records.log").calls) >= 4  # what the rollouts captured is kept


@pytest.mark.anyio
async def test_an_output_dir_in_use_is_refused_without_resume(tmp_path):
    await anyio.to_thread.run_sync(lambda: (tmp_path / "run").mkdir())
    await anyio.to_thread.run_sync((tmp_path / "run" / "records.log").write_bytes, b"")
    with pytest.raises(RunError, match="--resume"):
        await train(run_config(tmp_path))


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    from polar_fast.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[learner]\nlr = 'fast'\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "learner.lr" in err and "float" in err and "Traceback" not in err


# ------------------------------------------------------------------------- kill -9, then resume


def toml_text(raw: dict) -> str:
    """Enough TOML for a run config: one table per section, scalar and list values."""
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def run_containers(run_id: str) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=polar_fast.run={run_id}"],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.split()


def wait_for(predicate, timeout_s: float, proc) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.5)


KILL_MARK = "polar-killed-while-this-runs"


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(900)
def test_kill_9_then_resume_keeps_every_call_and_leaves_no_container(tmp_path, docker_required, base_image,
                                                                     tiny_model):
    from polar_fast.rollouts.stack import run_id_for

    out = tmp_path / "run"
    # the first group trains step 1; the rollouts after it sleep (mini-swe-agent cuts each command
    # at 30 s, 4 steps a rollout) until the kill. A resumed run starts the replies over: its first
    # group trains step 2
    raw = raw_config(tmp_path, steps=2, sandbox={"kind": "docker", "network": "none"}, run={"tensorboard": False},
                     engine={"scripted_replies": GROUP_REPLIES + [bash_call(f"sleep 60 # {KILL_MARK}")] * 40},
                     model={"path": str(tiny_model)})
    config = tmp_path / "run.toml"
    config.write_text(toml_text(raw))
    command = [sys.executable, "-m", "polar_fast", "--config", str(config), "--quiet"]
    with subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        try:
            # step 1 is checkpointed and a rollout of the next group is running its command
            wait_for(lambda: (out / "checkpoints" / "step_1.pt").exists() and (out / "metrics.jsonl").exists()
                     and running(KILL_MARK), 600, proc)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    before = read_log(out / "records.log")
    assert len(before.calls) > 4
    # no run-end marker and no live writer: view shows the rollouts the kill cut off as abandoned
    ended = {r.rollout_id for r in before.rollouts}
    cut_off = {c.rollout_id for c in before.calls} - ended
    assert cut_off and not isinstance(before.records[-1], RunEndRecord)
    with view_server(out) as url:
        rows = json.loads(urllib.request.urlopen(url + "api/rollouts?outcome=abandoned&limit=500", timeout=120).read())["rows"]
        run = json.loads(urllib.request.urlopen(url + "api/run", timeout=120).read())
    assert {r["rollout_id"] for r in rows} == cut_off
    assert all("without a run-end marker (killed or crashed)" in r["error"] for r in rows)
    assert run["state"] == "ended without a run-end marker: killed or crashed" and run["steps"] == 1

    resumed = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    after = read_log(out / "records.log")
    assert after.records[: len(before.records)] == before.records  # nothing captured was lost
    # the resumed run first closed the killed one: its cut-off rollouts abandoned, then a crashed marker
    closing = after.records[len(before.records): len(before.records) + len(cut_off) + 1]
    assert {r.rollout_id for r in closing[:-1]} == cut_off
    assert all(r.outcome is Outcome.ABANDONED and "killed or crashed" in r.error for r in closing[:-1])
    assert isinstance(closing[-1], RunEndRecord) and closing[-1].reason.startswith("crashed")
    assert isinstance(after.records[-1], RunEndRecord) and after.records[-1].reason == "finished: 2 of 2 steps done"
    assert len(after.calls) > len(before.calls) and after.torn_bytes == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the same step numbering across the kill
    assert (out / "checkpoints" / "step_2.pt").exists()
    assert run_containers(run_id_for(out)) == []


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(900)
async def test_one_step_in_docker_with_an_npm_harness_bumps_the_policy(tmp_path, docker_required, base_image,
                                                                       tiny_model):
    """Pi (an npm CLI) in `--network none` containers, reaching the proxy through its socket."""
    replies = [bash_call(fix_command(TASK.patch)), "Done: the fix is applied.", bash_call("ls"), "I could not fix it."]
    cfg = run_config(tmp_path, harness_name="pi", replies=replies, sandbox={"kind": "docker", "network": "none"},
                     model={"path": str(tiny_model)})
    summary = await train(cfg)

    [step] = summary.steps
    assert step["outcomes/ok"] == 2
    assert step["reward/mean"] == 0.5 and step["learner/version"] == 1
    assert step["learner/grad_norm"] > 0 and step["learner/n_terms"] == step["proxy/sampled_tokens"]
    contents = await anyio.to_thread.run_sync(read_log, tmp_path / "run" / "records.log")
    calls = contents.calls
    assert len(calls) == 4 and all(c.dialect == "chat" for c in calls)
    merged = merge.merge(calls)
    assert merged.stats.n_samples == step["learner/n_terms"] and merged.stats.n_breaks == 0
    trained = [r for r in contents.rollouts if r.outcome is not Outcome.ABANDONED]  # not the group the end cut off
    assert sorted(r.reward for r in trained) == [0.0, 1.0]


STOP_MARK = "polar-stopped-while-this-runs"


def running(marker: str) -> bool:
    """Whether a process of this machine has `marker` on its command line (a local box's command)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return True
        except OSError:
            continue
    return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_saves_a_checkpoint_records_the_rollout_in_flight_and_exits_0(tmp_path, tiny_model):
    """SIGINT while the first rollout's command runs: the run stops, saves a checkpoint, and
    records that rollout as abandoned (why, and its one call), then its end; `view` shows both."""
    out = tmp_path / "run"
    raw = raw_config(tmp_path, steps=5, run={"tensorboard": False}, replies=[bash_call(f"sleep 300 # {STOP_MARK}")],
                     model={"path": str(tiny_model)})
    config = tmp_path / "run.toml"
    config.write_text(toml_text(raw))
    command = [sys.executable, "-m", "polar_fast", "--config", str(config), "--quiet"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        wait_for(lambda: running(STOP_MARK), 300, proc)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "stopped early on request" in output and "abandoned 1" in output
    assert list((out / "checkpoints").glob("step_*.pt"))
    contents = read_log(out / "records.log")
    assert contents.torn_bytes == 0
    rollout_id = f"{TASK.instance_id}-g0-r0"
    [abandoned] = contents.rollouts  # one agent slot and one box: the only rollout in flight
    assert (abandoned.rollout_id, abandoned.outcome, abandoned.reward, abandoned.n_calls) == (
        rollout_id, Outcome.ABANDONED, None, 1)
    assert abandoned.error == "the run ended (stopped: SIGINT), while running the agent (1 model calls)"
    end = contents.records[-1]
    assert isinstance(end, RunEndRecord) and (end.reason, end.step, end.abandoned) == ("stopped: SIGINT", 0, 1)
    show_in_browser(out, rollout_id, tmp_path)


CANCEL_MARK = "polar-cancelled-while-this-runs"


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_run_cancelled_from_outside_records_its_end_and_leaves_no_task_or_listener(tmp_path, tiny_model):
    """A run cancelled by an anyio scope (which cancels again at every await, unlike one Ctrl-C)
    while a rollout's command runs: its teardown still runs whole. The rollout gets its
    abandoned record and the run its end marker, the proxy stops listening, and no task of the
    run outlives it (a task left waiting made the event loop's close hang)."""
    import asyncio
    import socket

    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = run_config(tmp_path, run={"tensorboard": False}, proxy={"port": port},
                     replies=[bash_call(f"sleep 300 # {CANCEL_MARK}")], model={"path": str(tiny_model)})
    ours = asyncio.current_task()
    before = asyncio.all_tasks()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_while_it_runs() -> None:
                while not await anyio.to_thread.run_sync(running, CANCEL_MARK):
                    await anyio.sleep(0.2)
                scope.cancel()

            tg.start_soon(cancel_while_it_runs)
            await train(cfg)
    assert scope.cancelled_caught
    assert not await anyio.to_thread.run_sync(running, CANCEL_MARK)  # the box's command is gone
    left = [t for t in asyncio.all_tasks() - before if t is not ours and not t.done()]
    assert left == []
    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0
    [abandoned] = contents.rollouts
    assert (abandoned.outcome, abandoned.n_calls) == (Outcome.ABANDONED, 1)
    assert abandoned.error == "the run ended (cancelled), while running the agent (1 model calls)"
    end = contents.records[-1]
    assert isinstance(end, RunEndRecord) and (end.reason, end.abandoned) == ("cancelled", 1)
    with pytest.raises(OSError):  # the proxy no longer listens
        await anyio.to_thread.run_sync(lambda: socket.create_connection(("127.0.0.1", port), timeout=5).close())


def show_in_browser(run, rollout_id: str, tmp_path) -> None:
    """The stopped run in `view` and a headless browser: the rollout reads abandoned, and why."""
    from test_view import css, wait_ready

    from polar_fast.report.view import browser
    from polar_fast.report.view.browser import chromium, view_server

    if not browser.browser_available():
        if os.environ.get("CI") or os.environ.get("POLAR_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromium-driver are missing (scripts/test.sh installs them)")
        pytest.skip("no chromium/chromium-driver: apt-get install -y chromium chromium-driver")
    with view_server(run) as url, chromium() as d:
        d.get(f"{url}rollouts?outcome=abandoned")
        wait_ready(d)
        assert [tr.get_attribute("data-rollout-id") for tr in css(d, "tr[data-rollout-id]")] == [rollout_id]
        d.get(f"{url}rollouts/{rollout_id}")
        wait_ready(d)
        d.save_screenshot(str(tmp_path / "abandoned.png"))
        assert css(d, "#outcome")[0].text == "abandoned"
        assert "the run ended (stopped: SIGINT), while running the agent" in css(d, "#main")[0].text
        d.get(url)
        wait_ready(d)
        assert css(d, "#run-state")[0].text == "ended: stopped: SIGINT"
        assert css(d, "h2")[0].text.startswith("Run: 0 step(s)")


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_step_names_the_causes_of_zero_rewards_and_the_periodic_eval_is_logged(tmp_path, tiny_model):
    """One group: a rollout that fixes the task and one that answers without a tool call, which
    mini-swe-agent rejects with its format error. The step's metrics count both causes, and the
    held-out eval after the step scores the scripted fix of its task."""
    from polar_fast.engines.scripted import PlaybookEngine
    from polar_fast.model import load_tokenizer
    from polar_fast.rollouts.families import family_tasks

    train_task, heldout_task = await anyio.to_thread.run_sync(
        lambda: (family_tasks("train", families=["constant"], per_family=1)[0],
                 family_tasks("heldout", families=["constant"])[0]))
    plays = {train_task.problem_statement: [[bash_call(fix_command(train_task.patch)), SUBMIT],
                                            ["I am not sure what to do.", SUBMIT]],
             heldout_task.problem_statement: [[bash_call(fix_command(heldout_task.patch)), SUBMIT]]}
    engine = PlaybookEngine(plays, await anyio.to_thread.run_sync(load_tokenizer))
    cfg = run_config(tmp_path, tasks={"source": "families", "families": ["constant"], "per_family": 1},
                     eval={"every_steps": 1, "limit": 1, "samples": 1, "k": [1]}, model={"path": str(tiny_model)})
    summary = await train(cfg, engine=engine)

    [step] = summary.steps
    assert step["reward/mean"] == 0.5 and step["learner/n_terms"] > 0
    assert step["causes/mini-swe-agent/no_tool_call"] == 1 and step["causes/mini-swe-agent/format_error"] == 1
    assert step["causes/mini-swe-agent/zero_reward"] == 1 and step["causes/mini-swe-agent/truncated"] == 0
    assert summary.causes["mini-swe-agent"]["no_tool_call"] == 1
    [ev] = summary.evals
    assert ev["step"] == 1 and ev["pass_at"] == {"1": 1.0} and ev["split"] == "heldout"
    text = await anyio.to_thread.run_sync((tmp_path / "run" / "metrics.jsonl").read_text)
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["eval/pass@1"] for x in lines if "eval/pass@1" in x] == [1.0]
    rollouts = (await anyio.to_thread.run_sync(read_log, tmp_path / "run" / "records.log")).rollouts
    assert {r.purpose for r in rollouts if r.task_id == heldout_task.instance_id} == {"eval"}
