"""Faults in the middle of a whole training run: Docker boxes, the real mini-swe-agent, the real
proxy, merge and learner. Each fault is injected once, at a point the test proves is live.

The model's choices are scripted (ScriptedEngine through the real tokenizer), and the learner trains
the two-layer model with SmolLM2's vocabulary (conftest.tiny_model): a step takes a second, so each
run's timeout measures a hang, not the machine. The SIGSTOP run serves and syncs the real weights
(the real vLLM's). With one agent slot and one group in flight the rollouts take the scripted
replies in this order:
    g0-r0      runs `sleep 12 # polar-chaos-kill`: the test sees that process in the box and
               kills the container (an infra fault: the rollout is retried in a fresh box);
    g0-r1      runs `sleep 25 # polar-chaos-hang`: the harness hangs past harness.timeout_s
               (an agent fault: outcome timeout, reward 0, its call kept);
    g0-r0.a1   the retry floods the harness's own output with 30 MB (written to its parent's
               stdout, past the 8 MiB tail the sandbox keeps), then applies the task's fix and
               submits (reward 1).

The other faults, each in a run of its own:
    disk full  the disk holding records.log (a small tmpfs) fills while a command runs; the next
               call cannot be recorded (503), mini-swe-agent retries it once space is back;
    box full   a rollout writes past its box's sandbox.disk_mb: ENOSPC in the box, the host's disk
               untouched (measured), the rollout scored as usual, never retried;
    ckpt full  the disk holding checkpoints/ (a small tmpfs) fills before a checkpoint: the run
               stops with the message, the previous checkpoint loads, the log reads back whole;
    SIGTERM    arrives while the learner pushes its weights: the sync finishes, the run stops
               with a checkpoint, and a resumed run trains the next step;
    SIGSTOP    the real vLLM is stopped with a call in flight, past engine.timeout_s, then
               continued: the proxy answers the harness with a timeout, the harness retries.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import pytest
from test_train import GROUP_REPLIES, SUBMIT, TASK, bash_call, fix_command, raw_config  # the same scripted run

from polar_fast.config import parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.model import load_tokenizer
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
async def test_container_killed_and_harness_hung_mid_run(tmp_path, docker_required, base_image, tiny_model):
    from polar_fast.rollouts.stack import run_id_for

    replies = [KILL, HANG, FLOOD, bash_call(fix_command(TASK.patch)), SUBMIT]
    raw = raw_config(tmp_path, replies=replies, sandbox={"kind": "docker", "network": "none"},
                     harness={"timeout_s": 20}, run={"groups_in_flight": 1, "tensorboard": False},
                     model={"path": str(tiny_model)})
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


def _left_containers(run_id: str) -> list[str]:
    return _docker("ps", "-aq", "--filter", f"label=polar_fast.run={run_id}").split()


async def _when_running(run_id: str, marker: str) -> None:
    """Returns once the marked command runs in one of the run's containers."""
    while True:
        ids = (await anyio.to_thread.run_sync(_docker, "ps", "-q", "--filter", f"label=polar_fast.run={run_id}")).split()
        for cid in ids:
            if marker in await anyio.to_thread.run_sync(_docker, "top", cid, "-eo", "pid,args"):
                return
        await anyio.sleep(0.2)


def _run_dir_linking(out: Path, name: str, target: Path) -> None:
    out.mkdir()
    (out / name).symlink_to(target)


def _fill(directory: Path) -> Path:
    """Writes a file until the file system refuses (ENOSPC); returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        chunk = b"\0" * 65536
        while True:
            try:
                if os.write(fd, chunk) < len(chunk):
                    chunk = chunk[: max(len(chunk) // 2, 1)]
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return filler
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


def _tmpfs(mnt: Path, size: str):
    """A tmpfs of `size` mounted at `mnt` for the test (real ENOSPC from a real file system);
    needs root, as CI runs."""
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs."""
    yield from _tmpfs(tmp_path / "small-disk", "4m")


FILL_MARK = "polar-chaos-diskfull"
# the pause lets the test see the command and fill the disk (a few docker calls: seconds on a busy
# machine); ~7.6 kB of words: the next call's record is several pages, so no page left half-free can hold it
FILL = bash_call(f"sleep 6 # {FILL_MARK}\nyes polar-chaos-filler-line | head -n 400")
AGAIN = bash_call("echo answered after the disk had room again")


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(600)
async def test_the_record_disk_fills_mid_run(tmp_path, docker_required, base_image, small_disk, tiny_model):
    from polar_fast.rollouts.stack import run_id_for

    # r0: FILL, then AGAIN (its record fails: the harness gets a 503), AGAIN (its retry), fix, submit;
    # a second failed try takes the second AGAIN, and the fix still reaches the harness
    replies = [FILL, AGAIN, AGAIN, bash_call(fix_command(TASK.patch)), SUBMIT, bash_call("ls"), SUBMIT]
    raw = raw_config(tmp_path, replies=replies, sandbox={"kind": "docker", "network": "none"},
                     run={"groups_in_flight": 1, "tensorboard": False}, model={"path": str(tiny_model)})
    cfg = parse_config(raw)
    out = tmp_path / "run"  # the log's disk is the small one
    await anyio.to_thread.run_sync(_run_dir_linking, out, "records.log", small_disk / "records.log")
    engine = ScriptedEngine(replies, await anyio.to_thread.run_sync(load_tokenizer, cfg.model.path))
    run_id = await anyio.to_thread.run_sync(run_id_for, out)
    filled: list[Path] = []

    async def fill_then_free() -> None:
        await _when_running(run_id, FILL_MARK)
        filled.append(await anyio.to_thread.run_sync(_fill, small_disk))
        # the engine answered the call after FILL, whose record then failed, and then the
        # harness's retry of it: a record failed, however slow the machine. Space comes back
        # now, well before the next try (the harness's client retries ~0.4 s on), so the
        # retry's record fails too or lands: one or two failures
        while engine.remaining() > len(replies) - 3:
            await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(filled[0].unlink)

    async with anyio.create_task_group() as tg:
        tg.start_soon(fill_then_free)
        with anyio.fail_after(500):
            summary = await train(cfg, engine=engine)
        tg.cancel_scope.cancel()

    assert len(filled) == 1  # the disk was full while the marked command ran
    [step] = summary.steps  # the run continued and trained its group
    assert step["learner/step"] == 1 and step["outcomes/ok"] == 2 and step["outcomes/infra_error"] == 0
    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0
    g = f"{TASK.instance_id}-g0"
    final = {r.rollout_id: r for r in contents.rollouts if r.group_id == g}
    r0 = final[f"{g}-r0"]
    # the harness got past the failure: scored as usual (reward untouched), its failed calls counted
    failed = r0.causes["record_failure"]
    assert (r0.outcome, r0.reward) == (Outcome.OK, 1.0) and failed in (1, 2)
    assert (final[f"{g}-r1"].outcome, final[f"{g}-r1"].reward) == (Outcome.OK, 0.0)
    # every answered call is in the log: r0's 5 engine replies but the unrecorded ones, r1's 2
    calls = [c for c in contents.calls if c.group_id == g]
    assert sum(c.rollout_id == f"{g}-r0" for c in calls) == 5 - failed
    assert sum(c.rollout_id == f"{g}-r1" for c in calls) == 2
    assert await anyio.to_thread.run_sync(_left_containers, run_id) == []


class _TermDuringSync(ScriptedEngine):
    """Sends this process SIGTERM from inside the learner's first weight push, which then takes
    a moment more: the signal lands while the sync is live."""

    terms = 0

    async def update_weights(self, named_tensors, *, version: int) -> None:
        if version == 1 and not self.terms:
            # without the run's handler SIGTERM would end pytest: refuse rather than send it
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            self.terms += 1
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep(0.5)
        await super().update_weights(named_tensors, version=version)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(600)
async def test_sigterm_during_a_weight_sync_stops_then_resumes(tmp_path, docker_required, base_image, tiny_model):
    from polar_fast.rollouts.stack import run_id_for

    raw = raw_config(tmp_path, steps=2, sandbox={"kind": "docker", "network": "none"},
                     run={"groups_in_flight": 1, "tensorboard": False, "checkpoint_every": 10},
                     model={"path": str(tiny_model)})
    cfg = parse_config(raw)
    out = tmp_path / "run"
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, cfg.model.path)
    first = _TermDuringSync(GROUP_REPLIES * 2, tokenizer)  # enough for a group that starts meanwhile
    with anyio.fail_after(300):
        stopped = await train(cfg, engine=first)
    run_id = await anyio.to_thread.run_sync(run_id_for, out)

    assert first.terms == 1 and first.policy_version == 1  # the signal came mid-sync; the sync finished
    assert stopped.stopped_early and [s["learner/step"] for s in stopped.steps] == [1]
    assert Path(stopped.checkpoint).name == "step_1.pt"  # saved at the step it stopped after
    assert await anyio.to_thread.run_sync(_left_containers, run_id) == []
    calls_before = len((await anyio.to_thread.run_sync(read_log, out / "records.log")).calls)

    second = ScriptedEngine(GROUP_REPLIES * 2, tokenizer)
    with anyio.fail_after(300):
        resumed = await train(cfg, resume=True, engine=second)
    assert [s["learner/step"] for s in resumed.steps] == [2] and not resumed.stopped_early
    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0 and len(contents.calls) >= calls_before + 4
    # the resumed engine serves the checkpointed policy from its first call: none is stamped 0
    assert min(c.policy_version for c in contents.calls[calls_before:]) == 1
    assert [s["outcomes/infra_error"] for s in [*stopped.steps, *resumed.steps]] == [0, 0]
    assert await anyio.to_thread.run_sync(_left_containers, run_id) == []


STALL_TIMEOUT_S = 20.0  # engine.timeout_s of the SIGSTOP run: a real call here takes a few seconds
HOLD_S = STALL_TIMEOUT_S + 8  # stopped past the timeout; mini-swe-agent retries 4 s after an error


def _vllm_process_group(run_dir: Path) -> int:
    """The session vLLM's process group (the launcher starts it as a group leader serving run_dir/weights)."""
    needle = str(run_dir / "weights").encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and any(needle in a for a in argv):
            return os.getpgid(int(proc.name))
    raise AssertionError(f"no vLLM process serves {run_dir}")


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(900)
async def test_the_real_vllm_stopped_mid_call(real_vllm, tmp_path, docker_required, base_image):
    from safetensors.torch import load_file
    from test_vllm_real import engine_for, served_version

    from polar_fast.learner.weight_sync import DiskSync
    from polar_fast.rollouts.stack import run_id_for

    out = tmp_path / "run"  # DiskSync writes what the server loads
    await anyio.to_thread.run_sync(_run_dir_linking, out, "weights", real_vllm.weights.parent)
    cfg = parse_config({
        "run": {"output_dir": str(out), "steps": 1, "groups_per_step": 1, "groups_in_flight": 1,
                "tensorboard": False, "zero_variance_skips": 0},  # the base model scores 0: train what comes
        "engine": {"kind": "vllm", "url": real_vllm.url, "timeout_s": STALL_TIMEOUT_S},
        "sampling": {"max_tokens": 8},
        "sandbox": {"kind": "docker", "network": "none"},
        "harness": {"name": "mini-swe-agent", "max_steps": 2, "timeout_s": 600},
        "pools": {"group_size": 2, "agent_workers": 1, "boot_workers": 1, "eval_workers": 1, "prewarm": 0},
        "tasks": {"limit": 1},
    })
    original = await anyio.to_thread.run_sync(load_file, str(real_vllm.weights))
    pgid = await anyio.to_thread.run_sync(_vllm_process_group, real_vllm.run_dir)
    run_id = await anyio.to_thread.run_sync(run_id_for, out)
    in_flight: list[int] = []
    stopped: list[int] = []

    def on_event(kind: str, data: dict) -> None:
        if kind == "status":
            in_flight.append(data["calls_in_flight"])

    async def stop_mid_call() -> None:
        while not (in_flight and in_flight[-1] > 0):  # the proxy reports a call waiting on the engine
            await anyio.sleep(0.05)
        os.killpg(pgid, signal.SIGSTOP)
        stopped.append(in_flight[-1])
        try:
            await anyio.sleep(HOLD_S)
        finally:
            os.killpg(pgid, signal.SIGCONT)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_mid_call)
            with anyio.fail_after(800):
                summary = await train(cfg, on_event=on_event)
            tg.cancel_scope.cancel()
    finally:
        os.killpg(pgid, signal.SIGCONT)
        engine = engine_for(real_vllm)  # the original weights served again for the other tests
        engine.policy_version = await served_version(real_vllm.url)
        await DiskSync(engine, real_vllm.weights.parent).push(original.items(), version=engine.policy_version)
        await engine.aclose()

    assert stopped == [1]  # stopped once, with one call in flight
    [step] = summary.steps  # the run continued and trained its group
    assert step["learner/step"] == 1 and step["outcomes/infra_error"] == 0
    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0
    rollouts = [r for r in contents.rollouts if r.outcome not in (Outcome.INFRA_ERROR, Outcome.ABANDONED)]
    assert len(rollouts) >= 2
    # the stalled call timed out (answered with the proxy's timeout error); the harness's retries
    # (its client's own, then mini-swe-agent's 4 s later) reach the engine once it runs again.
    # Each failed call is counted; the harness got past them, so none is an infra error.
    assert 1 <= sum(r.causes.get("engine_failure", 0) for r in rollouts) <= 3
    for r in rollouts:  # every answered call is in the log
        assert sum(c.rollout_id == r.rollout_id for c in contents.calls) == r.n_calls > 0, r
    assert await anyio.to_thread.run_sync(_left_containers, run_id) == []


BOX_DISK_MB = 64
FULL_MARK = "polar-chaos-box-full"
# twice the bound, into .git (which the diff leaves out), then a pause while the test measures
FILL_BOX = bash_call(f"dd if=/dev/zero of=.git/filler bs=1M count={2 * BOX_DISK_MB}; echo dd exit $?; "
                     f"sleep 8 # {FULL_MARK}")


def _box_usage(container: str, docker_root: str) -> dict:
    """What a box holds, seen from inside (df of its repo and /tmp) and from the host (its
    writable layer, the data root's file system, its memory cgroup)."""
    df = _docker("exec", container, "df", "-k", "--output=used,size,target", "/testbed", "/tmp").splitlines()[1:]
    used = {target: (int(kb) >> 10, int(size_kb) >> 10) for kb, size_kb, target in (line.split() for line in df)}
    size_rw = int(_docker("inspect", "--size", "--format", "{{.SizeRw}}", container).strip() or 0)
    memory = _docker("stats", "--no-stream", "--format", "{{.MemUsage}}", container).strip()
    return {"df_mb": used, "size_rw_bytes": size_rw, "host_used_mb": shutil.disk_usage(docker_root).used >> 20,
            "memory": memory}


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(600)
async def test_a_box_that_fills_its_disk_is_scored_and_the_host_disk_is_untouched(tmp_path, docker_required, base_image,
                                                                                   tiny_model):
    from polar_fast.rollouts.stack import run_id_for

    # r0 fixes the task, then writes twice its bound; r1 looks and gives up. Both are scored.
    replies = [bash_call(fix_command(TASK.patch)), FILL_BOX, SUBMIT, bash_call("ls"), SUBMIT]
    raw = raw_config(tmp_path, replies=replies, sandbox={"kind": "docker", "network": "none", "disk_mb": BOX_DISK_MB},
                     run={"groups_in_flight": 1, "tensorboard": False},
                     model={"path": str(tiny_model), "max_context_tokens": 4096}, merge={"max_tokens": 4096})
    cfg = parse_config(raw)
    out = tmp_path / "run"
    run_id = await anyio.to_thread.run_sync(run_id_for, out)
    docker_root = (await anyio.to_thread.run_sync(_docker, "info", "--format", "{{.DockerRootDir}}")).strip()
    before_mb = (await anyio.to_thread.run_sync(shutil.disk_usage, docker_root)).used >> 20
    seen: list[dict] = []
    infos: list[str] = []

    async def measure_when_full() -> None:
        await _when_running(run_id, FULL_MARK)
        ids = (await anyio.to_thread.run_sync(_docker, "ps", "-q", "--filter", f"label=polar_fast.run={run_id}")).split()
        for cid in ids:
            if FULL_MARK in await anyio.to_thread.run_sync(_docker, "top", cid, "-eo", "pid,args"):
                seen.append(await anyio.to_thread.run_sync(_box_usage, cid, docker_root))

    def on_event(kind: str, data: dict) -> None:
        if kind == "info":
            infos.append(data["message"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(measure_when_full)
        with anyio.fail_after(500):
            summary = await train(cfg, on_event=on_event)
        tg.cancel_scope.cancel()

    [usage] = seen
    print(f"box full: {usage}; host data root used {before_mb} MiB before the run")
    assert any(m.startswith("sandbox disk: ") for m in infos)  # what start found and how the bound holds
    repo_used, repo_size = usage["df_mb"]["/testbed"]
    assert repo_size == BOX_DISK_MB and repo_used <= BOX_DISK_MB  # the box's repo is full at its bound...
    assert usage["size_rw_bytes"] < 1 << 20  # ...and nothing of it is in its writable layer on the host
    # the run trained its step on the group; the full box was scored (the fix passes), never retried
    [step] = summary.steps
    assert step["learner/step"] == 1 and step["outcomes/ok"] == 2 and step["outcomes/infra_error"] == 0
    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0
    g = f"{TASK.instance_id}-g0"
    final = {r.rollout_id: (r.outcome, r.reward) for r in contents.rollouts if r.group_id == g}
    assert final == {f"{g}-r0": (Outcome.OK, 1.0), f"{g}-r1": (Outcome.OK, 0.0)}
    assert not any(c.rollout_id.startswith(f"{g}-r0.a") for c in contents.calls)  # no retry
    seen_text = [str(m.content) for e in contents.exchanges if e.rollout_id == f"{g}-r0" for m in e.messages]
    assert any("No space left on device" in t and "dd exit 1" in t for t in seen_text)  # ENOSPC, in the box
    assert await anyio.to_thread.run_sync(_left_containers, run_id) == []


class _FillBeforeCheckpoint(ScriptedEngine):
    """Fills the checkpoint disk from inside the learner's second weight push, which comes right
    before that step's checkpoint: the write meets a full disk."""

    def __init__(self, replies, tokenizer, disk: Path) -> None:
        super().__init__(replies, tokenizer)
        self.disk, self.filled = disk, False

    async def update_weights(self, named_tensors, *, version: int) -> None:
        if version == 2:
            await anyio.to_thread.run_sync(_fill, self.disk)
            self.filled = True
        await super().update_weights(named_tensors, version=version)


@pytest.fixture
def checkpoint_disk(tmp_path):
    """A 64 MiB tmpfs: a tiny model's checkpoint (~40 MB) fits once."""
    yield from _tmpfs(tmp_path / "checkpoint-disk", "64m")


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_last_one(tmp_path, checkpoint_disk,
                                                                                         tiny_model):
    from polar_fast.grpo import Learner
    from polar_fast.learner.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
    from polar_fast.records import RunEndRecord

    model_dir = tiny_model
    raw = raw_config(tmp_path, steps=2, model={"path": str(model_dir), "max_context_tokens": 4096},
                     merge={"max_tokens": 4096}, run={"groups_in_flight": 1, "tensorboard": False})
    cfg = parse_config(raw)
    out = tmp_path / "run"
    # the run's checkpoints/ is the small disk (an empty checkpoints dir: start it as a resume)
    await anyio.to_thread.run_sync(_run_dir_linking, out, "checkpoints", checkpoint_disk)
    engine = _FillBeforeCheckpoint(GROUP_REPLIES * 2, await anyio.to_thread.run_sync(load_tokenizer, str(model_dir)),
                                   checkpoint_disk)
    with pytest.raises(CheckpointError) as stopped, anyio.fail_after(500):
        await train(cfg, resume=True, engine=engine)

    assert engine.filled
    message, checkpoints = str(stopped.value), out / "checkpoints"
    assert message.startswith(f"cannot write checkpoint {checkpoints / 'step_2.pt'}") and "No space left" in message
    assert f"the previous checkpoint {checkpoints / 'step_1.pt'} is whole" in message and "--resume" in message
    left = await anyio.to_thread.run_sync(lambda: sorted(p.name for p in checkpoint_disk.iterdir()))
    assert left == ["filler", "latest", "step_1.pt"]  # no .tmp left behind
    previous = await anyio.to_thread.run_sync(latest_checkpoint, checkpoints)
    learner = await anyio.to_thread.run_sync(Learner.from_config, cfg)
    step, version = await anyio.to_thread.run_sync(
        lambda: load_checkpoint(previous, model=learner.policy, optimizer=learner.optimizer))
    assert (step, version) == (1, 1)  # the previous checkpoint loads
    contents = await anyio.to_thread.run_sync(read_log, out / "records.log")
    assert contents.torn_bytes == 0  # the log reads back whole, and says how the run ended
    end = contents.records[-1]
    assert isinstance(end, RunEndRecord) and end.reason.startswith("error: CheckpointError: cannot write checkpoint")
