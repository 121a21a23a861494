"""Task loading (JSONL, parquet, HF datasets dir), row validation, the built-in suite, and the
repo preparation that scrubs future history."""

from __future__ import annotations

import json
import subprocess

import anyio
import pytest

from polar_fast.config import SandboxConfig
from polar_fast.rollouts.sandboxes import SandboxSpec, make_sandbox_factory
from polar_fast.rollouts.tasks import TaskError, load_builtin, load_tasks, patch_files, prepare_repo, repo_diff

BUILTIN = load_builtin()


def _row(**changes):
    row = {k: v for k, v in {
        "instance_id": "org__proj-1", "repo": "org/proj", "base_commit": "a" * 40,
        "problem_statement": "fix it", "test_patch": "diff --git a/t.py b/t.py\n",
        "FAIL_TO_PASS": json.dumps(["t.py::test_a"]), "PASS_TO_PASS": "[]",
        "image": "img:1", "hints_text": "", "extra_column": 3,
    }.items()}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


def test_jsonl_with_swebench_json_encoded_lists(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_row()) + "\n" + json.dumps(_row(instance_id="org__proj-2")) + "\n")
    tasks = load_tasks(str(path))
    assert [t.instance_id for t in tasks] == ["org__proj-1", "org__proj-2"]
    assert tasks[0].FAIL_TO_PASS == ["t.py::test_a"] and tasks[0].PASS_TO_PASS == []
    assert tasks[0].test_files() == ["t.py"]
    assert tasks[0].shell_test_command().endswith("t.py")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_commit": None}, r"row 2: field 'base_commit': missing"),
        ({"FAIL_TO_PASS": 5}, r"row 2: field 'FAIL_TO_PASS'"),
        ({"FAIL_TO_PASS": "[not json"}, r"row 2: field 'FAIL_TO_PASS': not a JSON list"),
        ({"FAIL_TO_PASS": "[]"}, r"row 2: .*FAIL_TO_PASS is empty"),
        ({"base_commit": "main"}, r"row 2: .*not a hex commit"),
        ({"instance_id": "org__proj-1"}, r"row 2: field 'instance_id': duplicate"),
    ],
)
def test_invalid_row_names_row_and_field(tmp_path, change, message):
    path = tmp_path / "tasks.jsonl"
    second = _row(**{"instance_id": "org__proj-9", **change})
    path.write_text(json.dumps(_row()) + "\n" + json.dumps(second) + "\n")
    with pytest.raises(TaskError, match=message):
        load_tasks(str(path))


def test_jsonl_bad_json_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_row()) + "\n{oops\n")
    with pytest.raises(TaskError, match="row 2: not valid JSON"):
        load_tasks(str(path))


def test_parquet_and_datasets_dir(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(), _row(instance_id="org__proj-2")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    assert len(load_tasks(str(tmp_path / "t.parquet"))) == 2
    bad = [_row(), _row(instance_id="org__proj-2", problem_statement=None, repo=None)]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(TaskError, match=r"row 2: field '(repo|problem_statement)'"):
        load_tasks(str(tmp_path / "bad.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    loaded = load_tasks(str(tmp_path / "ds"), split="train", limit=1)
    assert [t.instance_id for t in loaded] == ["org__proj-1"]
    with pytest.raises(TaskError, match="no split 'test'"):
        load_tasks(str(tmp_path / "ds"), split="test")


def test_unknown_source_is_clear(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(str(tmp_path / "missing.jsonl"))


def test_builtin_suite_is_eight_distinct_repos():
    assert len(BUILTIN) >= 8
    assert len({t.repo for t in BUILTIN}) == len(BUILTIN)
    for task in BUILTIN:
        assert task.FAIL_TO_PASS and task.PASS_TO_PASS and task.patch
        assert set(patch_files(task.test_patch)).isdisjoint(patch_files(task.patch))
        assert all(f.startswith("tests/") for f in task.test_files())


def test_builtin_base_commit_is_what_git_computes(tmp_path):
    """The pure-Python hash must equal real git's commit of the same files."""
    from polar_fast.rollouts.tasks import snapshot_files

    task = BUILTIN[0]
    for rel, data in snapshot_files(__import__("pathlib").Path(task.repo_snapshot)).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    env = {"GIT_AUTHOR_NAME": "polar_fast", "GIT_AUTHOR_EMAIL": "tasks@polar-fast.invalid",
           "GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_NAME": "polar_fast",
           "GIT_COMMITTER_EMAIL": "tasks@polar-fast.invalid", "GIT_COMMITTER_DATE": "1700000000 +0000",
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    script = "git init -q . && git add -A && git commit -q -m base && git rev-parse HEAD"
    head = subprocess.run(["sh", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert head.stdout.strip() == task.base_commit


@pytest.mark.anyio
async def test_prepare_scrubs_future_commits_refs_and_remotes():
    task = BUILTIN[0]
    factory = make_sandbox_factory(SandboxConfig(kind="local"), run_id="scrub")
    async with factory.open(SandboxSpec()) as box:
        await prepare_repo(box, task)
        # give the repo a future: the fix committed on a branch and a tag, a remote, a stash
        future = (
            "git -c user.name=x -c user.email=x@x checkout -q -b fix && git apply {p} && "
            "git -c user.name=x -c user.email=x@x commit -qam fix && git tag v2 && "
            "git remote add origin https://example.invalid/r.git && git checkout -q main && "
            "echo junk >> README && git add README && git -c user.name=x -c user.email=x@x stash -q && "
            "git rev-parse fix"
        )
        await box.write_files({f"{box.home}/fix.patch": task.patch})
        done = await box.exec(["sh", "-c", future.format(p=f"{box.home}/fix.patch")])
        assert done.exit_code == 0, done.stderr
        fix_commit = done.stdout.strip()
        await prepare_repo(box, task.__class__(**{**_fields(task), "repo_snapshot": ""}))
        log = await box.exec(["git", "log", "--all", "--format=%H"])
        assert log.stdout.split() == [task.base_commit]
        refs = await box.exec(["git", "for-each-ref", "--format=%(refname)"])
        assert refs.stdout.split() == ["refs/heads/main"]
        assert (await box.exec(["git", "cat-file", "-e", fix_commit])).exit_code != 0
        assert (await box.exec(["git", "remote"])).stdout == ""
        assert await repo_diff(box, task.base_commit) == ""


def _fields(task):
    import msgspec

    return msgspec.structs.asdict(task)


@pytest.mark.anyio
async def test_repo_diff_includes_new_and_committed_files():
    task = BUILTIN[1]
    factory = make_sandbox_factory(SandboxConfig(kind="local"), run_id="diff")
    async with factory.open(SandboxSpec()) as box:
        await prepare_repo(box, task)
        await box.write_files({"NEW.txt": "new\n"})
        await box.exec(["sh", "-c", "echo more >> NEW2.txt && git add NEW2.txt && "
                                    "git -c user.name=x -c user.email=x@x commit -qm c"])
        diff = await repo_diff(box, task.base_commit)
        assert "b/NEW.txt" in diff and "b/NEW2.txt" in diff
    await anyio.sleep(0)


@pytest.mark.anyio
async def test_repo_diff_is_what_git_add_all_gives_without_writing_to_the_repo():
    """Edits, a deletion, a staged file edited again, new text, binary and non-ASCII files, an
    ignored file and a commit: the write-free diff, applied to the base commit, gives the tree
    `git add -A` records."""
    task = BUILTIN[1]
    factory = make_sandbox_factory(SandboxConfig(kind="local"), run_id="diff-tree")
    async with factory.open(SandboxSpec()) as box:
        await prepare_repo(box, task)
        changes = (
            "set -e; f=$(git ls-files | head -n 1); g=$(git ls-files | sed -n 2p); echo edit >> \"$f\"; rm \"$g\"\n"
            "echo staged > st.txt; git add st.txt; echo again >> st.txt; printf 'b\\000in' > bin.dat\n"
            "mkdir -p 'sub dir'; printf 'ünï' > 'sub dir/ü.txt'; echo '*.ignored' >> .gitignore; echo x > a.ignored\n"
            "echo c > committed.txt; git add committed.txt; git -c user.name=x -c user.email=x@x commit -qm c\n"
        )
        assert (await box.exec(["sh", "-c", changes])).exit_code == 0
        index = (await box.exec(["sh", "-c", "git ls-files -s | md5sum"])).stdout
        diff = await repo_diff(box, task.base_commit)
        assert (await box.exec(["sh", "-c", "git ls-files -s | md5sum"])).stdout == index  # nothing staged
        recorded = (await box.exec(["sh", "-c", "git add -A && git write-tree"])).stdout.strip()
        await box.write_files({f"{box.home}/agent.diff": diff})
        replay = (f'set -e; git clone -q . "$HOME/replay"; cd "$HOME/replay"; git checkout -q {task.base_commit}; '
                  'git apply --binary "$HOME/agent.diff"; git add -A; git write-tree')
        done = await box.exec(["sh", "-c", replay])
        assert done.exit_code == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == recorded
        assert "a.ignored" not in diff and "b/committed.txt" in diff and "GIT binary patch" in diff
