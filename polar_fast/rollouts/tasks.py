"""Tasks in the SWE-bench / SWE-Gym / SkyRL-v0 schema, and putting a task's repo into a sandbox.

A `Task` row carries the upstream fields (instance_id, repo, base_commit, problem_statement,
test_patch, FAIL_TO_PASS, PASS_TO_PASS, patch, image, environment_setup_commit, ...), with
unknown columns ignored. Two fields are ours: `test_command` (how to run the tests; default:
pytest on the files the test patch touches) and `repo_snapshot` (a directory with the repo's
files at base_commit: the built-in tasks ship their repos that way instead of as images).
SWE-bench's JSON-encoded test lists ("[\"a\", \"b\"]") are decoded. Rows come from JSONL,
parquet or a local HF `datasets` directory; a bad row fails the load with its 1-based row number
and the field.

`prepare_repo` leaves the repo at `box.workdir`, checked out at base_commit, with every other
commit, ref, reflog entry and remote gone (`scrub_history`), so an agent cannot find the fix in
the repo's future. A snapshot becomes a one-commit repo whose hash is fixed by the content (fixed
author, dates and message), so base_commit is computed here and checked against git's answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgspec

from polar_fast.errors import PolarError

BUILTIN_DIR = Path(__file__).with_name("tasks_builtin")
SNAPSHOT_IDENT = "polar_fast <tasks@polar-fast.invalid> 1700000000 +0000"
SNAPSHOT_MESSAGE = "base\n"
_SKIP_NAMES = {"__pycache__", ".git", ".pytest_cache"}


class TaskError(PolarError, ValueError):
    """A task source or row is invalid; the message names the row and the field."""


class Task(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str] = []
    patch: str = ""  # the reference fix; never shown to the agent
    image: str = ""  # docker image with the repo at the sandbox workdir ("" = config / base image)
    environment_setup_commit: str = ""
    version: str = ""
    hints_text: str = ""
    created_at: str = ""
    test_command: str = ""  # shell command run in the repo; "" = pytest on the test patch's files
    repo_snapshot: str = ""  # host dir with the repo's files at base_commit (built-in tasks)

    def __post_init__(self) -> None:
        if not self.FAIL_TO_PASS:
            raise ValueError("FAIL_TO_PASS is empty: a task needs at least one test the fix makes pass")
        if not re.fullmatch(r"[0-9a-f]{7,40}", self.base_commit):
            raise ValueError(f"base_commit {self.base_commit!r} is not a hex commit id")

    def test_files(self) -> list[str]:
        return patch_files(self.test_patch)

    def shell_test_command(self) -> str:
        if self.test_command:
            return self.test_command
        files = " ".join(_sh_quote(f) for f in self.test_files())
        return f"python -m pytest -rA -p no:cacheprovider {files}"


def patch_files(patch: str) -> list[str]:
    """Paths a unified git diff touches (new side; old side for deletions), in order."""
    files: list[str] = []
    for match in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.M):
        path = match.group(2) if match.group(2) != "/dev/null" else match.group(1)
        if path not in files:
            files.append(path)
    return files


# ---------------------------------------------------------------------------------------- loading


def load_tasks(source: str, *, split: str = "train", limit: int = 0, shuffle_seed: int = 0) -> list[Task]:
    """Tasks from "builtin", a .jsonl / .parquet file, or a local HF datasets directory."""
    if source == "builtin":
        tasks = load_builtin()
    else:
        tasks = list(_validate(_rows(source, split), source))
    if not tasks:
        raise TaskError(f"{source}: no tasks")
    if shuffle_seed:
        random.Random(shuffle_seed).shuffle(tasks)
    return tasks[:limit] if limit else tasks


def parse_task(row: Any, *, where: str = "row") -> Task:
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected an object, got {type(row).__name__}")
    row = dict(row)
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if isinstance(row.get(key), str):  # SWE-bench stores the lists JSON-encoded
            try:
                row[key] = json.loads(row[key])
            except json.JSONDecodeError:
                raise TaskError(f"{where}: field {key!r}: not a JSON list: {row[key][:80]!r}") from None
    try:
        return msgspec.convert(row, Task, strict=False)
    except msgspec.ValidationError as e:
        raise TaskError(f"{where}: {_explain(str(e))}") from None


def _explain(message: str) -> str:
    match = re.search(r" - at `\$\.?(.*)`$", message)
    if match:
        return f"field {match.group(1)!r}: {message[: match.start()]}"
    if m := re.search(r"missing required field `(\w+)`", message):
        return f"field {m.group(1)!r}: missing"
    return message


def _validate(rows: Iterable[Any], source: str) -> Iterator[Task]:
    seen: set[str] = set()
    for number, row in enumerate(rows, start=1):
        task = parse_task(row, where=f"{source}: row {number}")
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
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    else:
        raise TaskError(f"task source {source!r}: unknown format (use .jsonl, .parquet or a datasets dir)")


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


def snapshot_files(root: Path) -> dict[str, bytes]:
    """Relative path -> content of every file under root (caches and .git skipped)."""
    files: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_NAMES)
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            full = Path(dirpath) / name
            files[full.relative_to(root).as_posix()] = full.read_bytes()
    return files


def snapshot_commit(files: dict[str, bytes]) -> str:
    """The commit id git gives these files as one commit by SNAPSHOT_IDENT (all mode 100644)."""
    return _git_object("commit", (
        f"tree {_tree(files)}\nauthor {SNAPSHOT_IDENT}\ncommitter {SNAPSHOT_IDENT}\n\n{SNAPSHOT_MESSAGE}"
    ).encode())


def _tree(files: dict[str, bytes]) -> str:
    entries: dict[str, tuple[str, str]] = {}  # sort key -> (mode name, hex id)
    subdirs: dict[str, dict[str, bytes]] = {}
    for path, data in files.items():
        head, sep, rest = path.partition("/")
        if sep:
            subdirs.setdefault(head, {})[rest] = data
        else:
            entries[head] = (f"100644 {head}", _git_object("blob", data))
    for name, sub in subdirs.items():
        entries[name + "/"] = (f"40000 {name}", _tree(sub))  # git sorts trees as "name/"
    body = b"".join(
        mode_name.encode() + b"\0" + bytes.fromhex(oid) for _, (mode_name, oid) in sorted(entries.items())
    )
    return _git_object("tree", body)


def _git_object(kind: str, body: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).hexdigest()


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


async def repo_diff(box, base_commit: str, *, timeout_s: float = 120) -> str:
    """Everything changed in the repo since base_commit (tracked, new and committed files)."""
    script = 'git add -A >/dev/null && git -c core.quotepath=false diff --cached --binary "$1"'
    done = await box.exec(["sh", "-c", script, "diff", base_commit], timeout_s=timeout_s)
    if done.exit_code != 0:
        raise TaskError(f"git diff against {base_commit[:12]} failed: {done.stderr.strip()[-800:]}")
    return done.stdout


def _sh_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
