"""Where tasks come from, and putting a task's repo into a sandbox.

`load_tasks(source, ...)` reads a task source: "builtin" (the hand-written suite in
tasks_builtin/, repos shipped as snapshots), "families" (generated, families.py), or published
rows from JSONL, parquet, a local HF `datasets` (save_to_disk) directory, or a dataset directory
as the Hub publishes it (`<split>.parquet`, `data/<split>-*.parquet`, `<split>.jsonl`, e.g. a
`huggingface-cli download` of SkyRL-v0-293-data). Each row becomes a `Task` (task_rows.py: the
schema and how each publisher's rows parse); a bad row fails the load with its 1-based row number
and the field (`instance.FIELD` inside a SkyRL struct).

`prepare_repo` leaves the repo at `box.workdir`, checked out at base_commit, with every other
commit, ref, reflog entry and remote gone (`scrub_history`), so an agent cannot find the fix in
the repo's future. A snapshot's one commit is checked against the base_commit task_rows.py
computed for it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable, Iterator

from polar_fast.errors import PolarError
from polar_fast.rollouts.families import family_tasks
from polar_fast.rollouts.task_rows import (
    Task,
    TaskError,
    parse_task,
    patch_files,
    snapshot_commit,
    snapshot_files,
)

__all__ = ["DiffTooLarge", "Task", "TaskError", "has_splits", "load_builtin", "load_tasks", "parse_task",
           "patch_files", "prepare_repo", "repo_diff", "scrub_history", "shared_tasks", "snapshot_commit",
           "snapshot_files"]

BUILTIN_DIR = Path(__file__).with_name("tasks_builtin")


# ---------------------------------------------------------------------------------------- loading


def load_tasks(source: str, *, split: str = "train", limit: int = 0, shuffle_seed: int = 0,
               image: str = "", families: list[str] | None = None, per_family: int = 16) -> list[Task]:
    """Tasks from "builtin", "families" (generated, rollouts/families.py; split train or heldout),
    a .jsonl / .parquet file, or a local HF datasets directory.
    `image`: a template that overrides every task's image (see task_images.py)."""
    if source == "builtin":
        tasks = load_builtin()
    elif source == "families":
        tasks = family_tasks(split, families=families, per_family=per_family)
    else:
        tasks = list(_validate(_rows(source, split), source, image=image))
    if not tasks:
        raise TaskError(f"{source}: no tasks")
    if shuffle_seed:
        random.Random(shuffle_seed).shuffle(tasks)
    return tasks[:limit] if limit else tasks


def has_splits(source: str) -> bool:
    """Whether a task source holds splits (families, a datasets dir) or is one set of rows
    ("builtin", a .jsonl / .parquet file), whatever split is asked of it."""
    return source == "families" or (source != "builtin" and Path(source).is_dir())


def shared_tasks(train: Iterable[Task], other: Iterable[Task]) -> list[str]:
    """What `other` shares with `train`, one description per shared task: the same instance_id,
    or the same repo at the same base_commit (one repo state seen twice under two ids)."""
    train = list(train)
    ids = {t.instance_id for t in train}
    states = {(t.repo, t.base_commit) for t in train if t.repo and t.base_commit}
    shared = []
    for t in other:
        if t.instance_id in ids:
            shared.append(f"instance_id {t.instance_id}")
        elif (t.repo, t.base_commit) in states:
            shared.append(f"{t.instance_id} (repo {t.repo} at base_commit {t.base_commit[:12]})")
    return shared


def _validate(rows: Iterable[Any], source: str, *, image: str = "") -> Iterator[Task]:
    seen: set[str] = set()
    for number, row in enumerate(rows, start=1):
        task = parse_task(row, where=f"{source}: row {number}", image=image)
        if task.instance_id in seen:
            raise TaskError(f"{source}: row {number}: field 'instance_id': duplicate {task.instance_id!r}")
        seen.add(task.instance_id)
        yield task


def _rows(source: str, split: str) -> Iterator[Any]:
    path = Path(source)
    if not path.exists():
        raise TaskError(f"task source {source!r} does not exist (use 'builtin', .jsonl, .parquet or a dir)")
    if path.is_dir():
        yield from _dataset_rows(path, split)
    elif path.suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif path.suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise TaskError(f"task source {source!r}: unknown format (use .jsonl, .parquet or a datasets dir)")


def _parquet_rows(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def _split_files(path: Path, split: str) -> list[Path] | None:
    """A split's files in a Hub-layout dir; None for a `save_to_disk` dir (or no such files)."""
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return None
    files = [p for p in (path / f"{split}.parquet", path / f"{split}.jsonl") if p.is_file()]
    files += sorted((path / "data").glob(f"{split}-*.parquet"))
    if files:
        return files
    known = sorted({p.name.split("-")[0].split(".")[0] for p in [*path.glob("*.parquet"), *path.glob("*.jsonl"),
                                                                     *path.glob("data/*.parquet")]})
    if known:
        raise TaskError(f"{path}: no split {split!r}; splits: {', '.join(known)}")
    return None


def _jsonl_rows(path: Path) -> Iterator[Any]:
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                raise TaskError(f"{path}: row {number}: empty line")
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}: row {number}: not valid JSON: {e.msg}") from None


def _dataset_rows(path: Path, split: str) -> Iterator[Any]:
    files = _split_files(path, split)
    if files is not None:  # a dataset repo as published on the Hub: <split>.parquet, data/<split>-*.parquet
        for file in files:
            yield from (_jsonl_rows(file) if file.suffix == ".jsonl" else _parquet_rows(file))
        return
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise TaskError(f"{path}: not a saved HF datasets directory: {e}") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise TaskError(f"{path}: no split {split!r}; splits: {', '.join(data)}")
        data = data[split]
    yield from data


# --------------------------------------------------------------------------------- built-in suite


def load_builtin() -> list[Task]:
    """The built-in suite: tasks_builtin/<name>/{task.json, repo/, test.patch, fix.patch}."""
    tasks = []
    for entry in sorted(BUILTIN_DIR.iterdir()):
        if not (entry / "task.json").is_file():
            continue
        meta = json.loads((entry / "task.json").read_text())
        snapshot = entry / "repo"
        row = {
            **meta,
            "base_commit": snapshot_commit(snapshot_files(snapshot)),
            "test_patch": (entry / "test.patch").read_text(),
            "patch": (entry / "fix.patch").read_text(),
            "repo_snapshot": str(snapshot),
        }
        tasks.append(parse_task(row, where=f"builtin task {entry.name}"))
    return tasks


# ------------------------------------------------------------------------------- repo in a sandbox

SCRUB_SCRIPT = r"""
set -e
base="$1"
git -c advice.detachedHead=false checkout -q -f --detach "$base"
for remote in $(git remote); do git remote remove "$remote"; done
git for-each-ref --format='%(refname)' | while read -r ref; do git update-ref -d "$ref"; done
git checkout -q -B main "$base"
git stash clear 2>/dev/null || true
rm -f .git/ORIG_HEAD .git/FETCH_HEAD .git/MERGE_HEAD .git/CHERRY_PICK_HEAD .git/logs/refs/stash
git reflog expire --expire=now --all
git -c gc.auto=0 gc -q --prune=now
"""


async def scrub_history(box, base_commit: str, *, timeout_s: float = 300) -> None:
    """Leave only base_commit and its ancestors in the repo at box.workdir (branch `main`)."""
    done = await box.exec(["sh", "-c", SCRUB_SCRIPT, "scrub", base_commit], timeout_s=timeout_s)
    if done.exit_code != 0:
        raise TaskError(f"scrubbing history to {base_commit[:12]} failed: {done.stderr.strip()[-800:]}")


async def prepare_repo(box, task: Task, *, timeout_s: float = 300) -> None:
    """The task's repo at box.workdir, at base_commit, with its future history scrubbed."""
    if task.repo_snapshot:
        import anyio

        files = await anyio.to_thread.run_sync(snapshot_files, Path(task.repo_snapshot))
        await box.write_files(files)
        env = {
            "GIT_AUTHOR_NAME": "polar_fast", "GIT_AUTHOR_EMAIL": "tasks@polar-fast.invalid",
            "GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_NAME": "polar_fast",
            "GIT_COMMITTER_EMAIL": "tasks@polar-fast.invalid", "GIT_COMMITTER_DATE": "1700000000 +0000",
        }
        script = "git init -q -b main . && git add -A && git commit -q --no-verify -m base && git rev-parse HEAD"
        done = await box.exec(["sh", "-c", script], env=env, timeout_s=timeout_s)
        head = done.stdout.strip()
        if done.exit_code != 0 or head != task.base_commit:
            raise TaskError(
                f"{task.instance_id}: snapshot commit is {head or done.stderr.strip()[-400:]!r},"
                f" expected base_commit {task.base_commit}"
            )
    await scrub_history(box, task.base_commit, timeout_s=timeout_s)


# The worktree against base_commit (tracked files, committed or not), then each untracked file
# not ignored as a new file: the patch `git add -A && git diff --cached` gives, without writing
# an index or an object, so a box whose disk is full still hands over its work.
DIFF_SCRIPT = r"""
git -c core.quotepath=false diff --binary "$1" || exit $?
git ls-files -z --others --exclude-standard | xargs -0 -r sh -c '
for f; do git -c core.quotepath=false diff --binary --no-index -- /dev/null "$f"; [ $? -le 1 ] || exit 255; done' sh
"""


class DiffTooLarge(PolarError):
    """The repo's diff passed the sandbox's output cap: the agent's outcome, never an infra error."""


async def repo_diff(box, base_commit: str, *, timeout_s: float = 120) -> str:
    """Everything changed in the repo since base_commit (tracked, new and committed files),
    read without writing to the box (see DIFF_SCRIPT). DiffTooLarge when it passed the
    sandbox's output cap, which would keep only its tail."""
    done = await box.exec(["sh", "-c", DIFF_SCRIPT, "diff", base_commit], timeout_s=timeout_s)
    if done.truncated:
        raise DiffTooLarge(f"the diff against {base_commit[:12]} is larger than the "
                           f"{len(done.stdout.encode()) >> 20} MiB the sandbox keeps of a command's output: not evaluated")
    if done.exit_code != 0:
        raise TaskError(f"git diff against {base_commit[:12]} failed: {done.stderr.strip()[-800:]}")
    return done.stdout
