"""`tasks validate`: the reference patch must pass and the empty patch must fail, in real
sandboxes. The fixture repo tests/data/tasks/calc has three SWE-bench-shaped rows: calc-1 holds,
calc-2's reference patch is broken, calc-3's FAIL_TO_PASS names a test that already passes.

The Docker test builds the fixture's image the way the published images are laid out (the repo
committed at /testbed, at base_commit) on top of the built-in base image, with `docker commit`:
no registry is reachable here."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import msgspec
import pytest

import polar_fast.rollouts.sandboxes.docker  # noqa: F401  (imported before the loop: import reads files)
from polar_fast.config import SandboxConfig
from polar_fast.rollouts.sandboxes import make_sandbox_factory
from polar_fast.rollouts.sandboxes.images import image_exists
from polar_fast.rollouts.tasks import load_tasks, snapshot_commit, snapshot_files
from polar_fast.rollouts.validate import BROKEN, HOLDS, format_report, validate_tasks

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tasks"
CALC_REPO = DATA / "calc" / "repo"
GREET_REPO = DATA / "greet" / "repo"  # run with django's test spec: its tests/runtests.py takes django's options
GIT_IDENT = {"GIT_AUTHOR_NAME": "polar_fast", "GIT_AUTHOR_EMAIL": "tasks@polar-fast.invalid",
             "GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_NAME": "polar_fast",
             "GIT_COMMITTER_EMAIL": "tasks@polar-fast.invalid", "GIT_COMMITTER_DATE": "1700000000 +0000"}


CALC_TASKS = load_tasks(str(DATA / "calc.jsonl"))  # read before any event loop runs
GREET_TASKS = load_tasks(str(DATA / "greet.jsonl"))


def expect_calc_verdicts(checks) -> None:
    by_id = {c.instance_id: c for c in checks}
    assert [c.instance_id for c in checks] == ["polar-fixtures__calc-1", "polar-fixtures__calc-2",
                                               "polar-fixtures__calc-3"]
    assert by_id["polar-fixtures__calc-1"].verdict == HOLDS, by_id["polar-fixtures__calc-1"].problems
    assert by_id["polar-fixtures__calc-1"].reference_reward == 1.0 and by_id["polar-fixtures__calc-1"].empty_reward == 0.0
    broken = by_id["polar-fixtures__calc-2"]
    assert broken.verdict == BROKEN and broken.reference_reward == 0.0
    assert broken.problems == ["reference patch leaves tests not passing: tests.test_calc.TestCalc.test_add"]
    vacuous = by_id["polar-fixtures__calc-3"]
    assert vacuous.verdict == BROKEN and vacuous.empty_reward == 1.0
    assert vacuous.problems[0].startswith("empty patch passes") and "test_mul" in vacuous.problems[0]


def test_fixture_base_commit_is_the_repo_snapshot():
    assert {t.base_commit for t in CALC_TASKS} == {snapshot_commit(snapshot_files(CALC_REPO))}


@pytest.mark.anyio
async def test_validate_in_local_sandboxes():
    # local boxes have no image: give the same rows the repo as a snapshot
    tasks = [msgspec.structs.replace(t, repo_snapshot=str(CALC_REPO)) for t in CALC_TASKS]
    factory = make_sandbox_factory(SandboxConfig(kind="local"), run_id="validate-local")
    seen = []
    checks = await validate_tasks(tasks, factory, workers=2, timeout_s=120, on_check=seen.append)
    expect_calc_verdicts(checks)
    assert sorted(c.instance_id for c in seen) == sorted(c.instance_id for c in checks)
    report = format_report(checks)
    assert "BROKEN  polar-fixtures__calc-2: reference patch" in report
    assert report.endswith("3 tasks: 1 hold, 2 do not hold, 0 not judged (sandbox failures)")


def build_fixture_image(base_image: str, repo: Path, head: str) -> str:
    """`repo` at /testbed, committed as `head`, as SWE-bench's images hold their repos."""
    files = snapshot_files(repo)
    tag = f"polar_fast/fixture-{repo.parent.name}:{head[:12]}"
    if image_exists(tag):
        return tag
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel, data in files.items():
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), 0o755 if os.access(repo / rel, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    run = lambda *argv: subprocess.run(argv, check=True, capture_output=True, text=True)  # noqa: E731
    cid = run("docker", "create", "--network", "none", "--entrypoint", "sleep", base_image, "infinity").stdout.strip()
    try:
        run("docker", "start", cid)
        run("docker", "exec", cid, "mkdir", "-p", "/testbed")
        subprocess.run(["docker", "cp", "-", f"{cid}:/testbed"], input=buf.getvalue(), check=True, capture_output=True)
        env = [f"--env={k}={v}" for k, v in GIT_IDENT.items()]
        made = run("docker", "exec", *env, "-w", "/testbed", cid, "sh", "-c",
                   "git init -q -b main . && git add -A && git commit -q -m base && git rev-parse HEAD").stdout.strip()
        assert made == head, f"{repo}: the image's commit {made} is not the rows' base_commit {head}"
        run("docker", "commit", "--change", "WORKDIR /testbed", cid, tag)
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    return tag


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "polar_fast", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.docker
def test_validate_cli_on_a_locally_built_image_flags_the_broken_tasks(base_image, tmp_path):
    image = build_fixture_image(base_image, CALC_REPO, CALC_TASKS[0].base_commit)
    out = tmp_path / "checks.json"
    done = run_cli("tasks", "validate", str(DATA / "calc.jsonl"), "--set", "sandbox.kind=docker",
                   "--set", f"tasks.image={image}", "--json", str(out))
    assert done.returncode == 1, done.stdout + done.stderr  # some tasks do not hold
    assert "BROKEN  polar-fixtures__calc-2: reference patch leaves tests not passing" in done.stdout
    assert "BROKEN  polar-fixtures__calc-3: empty patch passes" in done.stdout
    assert "holds   polar-fixtures__calc-1" in done.stdout and "BROKEN  polar-fixtures__calc-1" not in done.stdout
    expect_calc_verdicts([msgspec.convert(c, _Check) for c in json.loads(out.read_text())])


class _Check(msgspec.Struct):
    instance_id: str
    verdict: str
    problems: list[str]
    reference_reward: float | None
    empty_reward: float | None


@pytest.mark.docker
def test_validate_cli_names_a_missing_image_and_how_to_provide_it(docker_required):
    done = run_cli("tasks", "validate", str(DATA / "swebench_verified.jsonl"), "--set", "sandbox.kind=docker")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'swebench/sweb.eval.x86_64.django_1776_django-11099:latest'" in done.stderr
    assert "docker pull" in done.stderr and "tasks.image" in done.stderr


def test_validate_cli_says_image_tasks_need_docker_sandboxes():
    done = run_cli("tasks", "validate", str(DATA / "swebench_verified.jsonl"))  # sandbox.kind defaults to local
    assert done.returncode == 2, done.stdout + done.stderr
    assert "django__django-11099" in done.stderr and "--set sandbox.kind=docker" in done.stderr


@pytest.mark.docker
@pytest.mark.anyio
async def test_validate_runs_the_derived_django_spec_in_a_docker_box(base_image):
    """The rows name no test command: the django spec's script runs (bash, conda lines failing
    harmlessly in an image without conda, SWE-bench's markers) and the django parser reads ids
    in the form the rows list them."""
    import anyio

    image = await anyio.to_thread.run_sync(build_fixture_image, base_image, GREET_REPO, GREET_TASKS[0].base_commit)
    tasks = [msgspec.structs.replace(t, image=image) for t in GREET_TASKS]
    assert all("./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 greet_tests.test_greet"
               in t.test_command and t.log_parser == "django" for t in tasks)
    factory = make_sandbox_factory(SandboxConfig(kind="docker"), run_id=f"validate-{os.getpid()}")
    try:
        checks = await validate_tasks(tasks, factory, workers=2, timeout_s=120)
    finally:
        await factory.aclose()
    holds, stale = checks
    assert holds.verdict == HOLDS and (holds.reference_reward, holds.empty_reward) == (1.0, 0.0), holds.problems
    assert stale.verdict == BROKEN and stale.problems[0].startswith("reference patch: agent diff did not apply")


@pytest.mark.docker
def test_training_run_stops_at_start_on_a_missing_image(docker_required, tmp_path):
    done = run_cli("--quiet", "--set", f"tasks.source={DATA / 'swe_gym.parquet'}", "--set", "sandbox.kind=docker",
                   "--set", f"run.output_dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'xingyaoww/sweb.eval.x86_64.pandas-dev_s_pandas-53122:latest'" in done.stderr
    assert "docker load" in done.stderr and not (tmp_path / "run" / "records.log").exists()


@pytest.mark.docker
@pytest.mark.anyio
async def test_a_docker_box_from_a_missing_image_says_how_to_provide_it(docker_required):
    from polar_fast.rollouts.sandboxes import SandboxError, SandboxSpec

    factory = make_sandbox_factory(SandboxConfig(kind="docker"), run_id=f"missing-{os.getpid()}")
    try:
        with pytest.raises(SandboxError, match=r"'polar_fast/no-such-image:1' \(task rollout-1\) is not in the local "
                                               r"Docker Engine.*docker pull"):
            await factory.create(SandboxSpec(name="rollout-1", image="polar_fast/no-such-image:1"))
    finally:
        await factory.aclose()
