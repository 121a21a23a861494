"""A task row: the `Task` struct in the SWE-bench / SWE-Gym / SkyRL-v0 schema, one published row
parsed into it, and the content-addressed commits of repo snapshots.

A `Task` row carries the upstream fields (instance_id, repo, base_commit, problem_statement,
test_patch, FAIL_TO_PASS, PASS_TO_PASS, patch, image, environment_setup_commit, ...), with
unknown columns ignored. `parse_task` takes a row as it is published:
- SWE-bench / SWE-bench Verified: flat rows, FAIL_TO_PASS / PASS_TO_PASS JSON-encoded strings;
- SWE-Gym: flat rows, the lists as lists;
- NovaSky-AI/SkyRL-v0-293-data: the SWE-bench fields inside an `instance` struct (lists as
  lists, or the struct JSON-encoded), beside `data_source`, `prompt` and `ability` columns; the
  instance is unwrapped, `data_source` kept, and `prompt` used when the instance has no
  problem_statement.
What the publishers leave implicit is derived here as they derive it: the Docker image
(task_images.py; an `image` template overrides it), and for a repo with a published test spec the
test command in the image's conda env and the log parser (test_specs.py, log_parsers.py).
Our own fields: `test_command` (a row's own wins; default for other repos: pytest on the files
the test patch touches), `log_parser`, `data_source`, and `repo_snapshot` (a directory with the
repo's files at base_commit: the built-in and generated tasks ship their repos that way instead
of as images). A snapshot becomes a one-commit repo whose hash is fixed by the content (fixed
author, dates and message), so base_commit is computed here (`snapshot_commit`).

The task sources (files, the built-in suite, the generated families) and putting a task's repo
into a sandbox build on this module: tasks.py, families.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from polar_fast.errors import PolarError
from polar_fast.rollouts.task_images import derive_image, image_from_template
from polar_fast.rollouts.test_specs import repo_spec, test_command

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
    log_parser: str = ""  # log_parsers.PARSERS name; "" = the default (pytest + unittest)
    data_source: str = ""  # SkyRL-v0's column: "swe-gym", "swe-bench", ...
    repo_snapshot: str = ""  # host dir with the repo's files at base_commit (built-in tasks)
    solution_command: str = ""  # a one-line shell fix a teacher can type (generated families; never shown)

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


# ------------------------------------------------------------------------------------ a row


def parse_task(row: Any, *, where: str = "row", image: str = "") -> Task:
    """One published row (any of the three schemas) as a Task; `image` as in load_tasks."""
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected an object, got {type(row).__name__}")
    row, prefix = _unwrap_instance(dict(row), where)
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if isinstance(row.get(key), str):  # SWE-bench stores the lists JSON-encoded
            try:
                row[key] = json.loads(row[key])
            except json.JSONDecodeError:
                raise TaskError(f"{where}: field {prefix + key!r}: not a JSON list: {row[key][:80]!r}") from None
    for alias in ("image_name", "docker_image"):  # SWE-smith / R2E-style names for the same thing
        if not row.get("image") and isinstance(row.get(alias), str):
            row["image"] = row[alias]
    try:
        _derive(row, image)
    except ValueError as e:
        raise TaskError(f"{where}: {e}") from None
    try:
        return msgspec.convert(row, Task, strict=False)
    except msgspec.ValidationError as e:
        raise TaskError(f"{where}: {_explain(str(e), prefix)}") from None


def _unwrap_instance(row: dict, where: str) -> tuple[dict, str]:
    """SkyRL-v0 rows hold the SWE-bench fields in `instance`; flat rows pass through."""
    if "instance" not in row:
        return row, ""
    instance = row["instance"]
    if isinstance(instance, str):  # some copies of the set store the struct JSON-encoded
        try:
            instance = json.loads(instance)
        except json.JSONDecodeError:
            raise TaskError(f"{where}: field 'instance': not a JSON object: {instance[:80]!r}") from None
    if not isinstance(instance, dict):
        raise TaskError(f"{where}: field 'instance': expected a struct of SWE-bench fields, "
                        f"got {type(instance).__name__}")
    flat = dict(instance)
    if isinstance(row.get("data_source"), str) and not flat.get("data_source"):
        flat["data_source"] = row["data_source"]
    if not flat.get("problem_statement") and (prompt := _prompt_text(row.get("prompt"))):
        flat["problem_statement"] = prompt
    return flat, "instance."


def _prompt_text(prompt: Any) -> str:
    """A SkyRL `prompt`: the text itself, or chat messages whose last user turn is the task."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return ""


def _derive(row: dict, image_template: str) -> None:
    """Fill what the publishers leave implicit: image, test command, log parser."""
    iid, repo = row.get("instance_id"), row.get("repo")
    if not (isinstance(iid, str) and isinstance(repo, str)):
        return  # the convert below names the missing field
    version = str(row.get("version") or "")
    if image_template:
        row["image"] = image_from_template(image_template, instance_id=iid, repo=repo, version=version)
    elif not row.get("image"):
        row["image"] = derive_image(iid, repo, data_source=str(row.get("data_source") or ""))
    spec = repo_spec(repo, version)
    if spec is None:
        return
    if not row.get("test_command") and isinstance(row.get("test_patch"), str):
        row["test_command"] = test_command(repo, version, row["test_patch"])
    if not row.get("log_parser"):
        row["log_parser"] = spec.parser


def _explain(message: str, prefix: str = "") -> str:
    match = re.search(r" - at `\$\.?(.*)`$", message)
    if match:
        return f"field {prefix + match.group(1)!r}: {message[: match.start()]}"
    if m := re.search(r"missing required field `(\w+)`", message):
        return f"field {prefix + m.group(1)!r}: missing"
    return message


# ---------------------------------------------------------------------------- repo snapshots


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


def _sh_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
