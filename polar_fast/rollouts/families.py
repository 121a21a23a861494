"""Generated task families: small repair tasks from a seed, in five splits that share no statement.

Each family is a kind of bug (family_kinds.py), from one the statement spells out to one the agent
has to find:

    constant  a module constant has the wrong value; the statement names the file and both values
    returns   a function returns the wrong expression; the statement names the file and the fix
    rename    a function must be renamed, its callers too; the statement names the file
    compare   an off-by-one comparison, described by a failing call
    operator  the wrong arithmetic operator, described by a failing call and the right result
    default   a wrong default argument, described by what a call without it gives
    literal   a typo in a returned string, described by a call's output
    index     (transfer only) an off-by-one index or slice, described by a failing call
    swap      (transfer only) operands in the wrong order, described by a failing call

The last five name no file: the agent has to search the repo (a module beside decoys, flat, in a
package or in a nested package), read the code, and change the one line. A task is a tiny Python
repo with unittest tests, a test patch that adds the tests the fix must make pass (FAIL_TO_PASS)
beside tests that pass before and after (PASS_TO_PASS), and the reference fix. Repo files are
written once under the cache (content-addressed), so a task is an ordinary `Task` with
`repo_snapshot` and runs in any sandbox like the hand-written suite.

Splits, by seed:
- "train": seeds 0..per_family-1; "demos" (warm-start teacher demonstrations, warm_start.py):
  seeds from DEMO_SEED_BASE. Both draw names and numbers from the train side's vocabulary.
- "validation": VALIDATION_SEEDS, its own vocabulary: everything tuned is tuned on it.
- "heldout": HELDOUT_SEEDS of the trainable families, "heldout_large": HELDOUT_LARGE_SEEDS of
  the same (a larger frozen split, for measuring a change), "transfer": TRANSFER_SEEDS of the
  two families that never train (TRANSFER_FAMILIES); all from the eval side's vocabulary.
The vocabularies are disjoint, so no held-out or transfer statement equals a train, demo or
validation statement (tests/test_families.py checks it over wide seed ranges). The held-out and
transfer tasks are frozen, and so is heldout_large: tests/test_families.py pins their digests,
so no change made while tuning a run can move them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import shlex
from pathlib import Path

from polar_fast.rollouts.family_kinds import EVAL_SIDE, KINDS, TRAIN_SIDE, TRANSFER_KINDS, VALIDATION_SIDE, Side
from polar_fast.rollouts.task_rows import Task, TaskError, parse_task, snapshot_commit

FAMILIES = tuple(k for k in KINDS if k not in TRANSFER_KINDS)  # the ones a run may train on
TRANSFER_FAMILIES = TRANSFER_KINDS
SPLITS = ("train", "demos", "validation", "heldout", "heldout_large", "transfer")
DEMO_SEED_BASE = 500_000
VALIDATION_SEEDS = range(700_000, 700_024)  # per family: where every setting is tuned (24 x 7 = 168 tasks)
HELDOUT_SEEDS = range(1_000_000, 1_000_004)  # per family: 4 x 7 families = 28 held-out tasks
# per family: 48 x 7 = 336 held-out tasks, enough to measure a change in pass@1 (bench/learning_bench.py).
# Made, and pinned (heldout_large_digest), before any result was seen on it.
HELDOUT_LARGE_SEEDS = range(1_000_100, 1_000_148)
TRANSFER_SEEDS = range(1_100_000, 1_100_008)  # per transfer family: 8 x 2 = 16 tasks
TEST_COMMAND = "python3 -m unittest -v"


def side_of(seed: int) -> Side:
    if seed >= HELDOUT_SEEDS.start:
        return EVAL_SIDE
    if seed >= VALIDATION_SEEDS.start:
        return VALIDATION_SIDE
    return TRAIN_SIDE


def family_task(family: str, seed: int, *, cache_root: Path | None = None) -> Task:
    """The task of `family` for `seed`: the same seed always gives the same task."""
    try:
        make = KINDS[family]
    except KeyError:
        raise TaskError(f"unknown task family {family!r}; families: {', '.join(KINDS)}") from None
    g = make(random.Random(f"{family}:{seed}"), side_of(seed))
    leaf = g.module.rsplit(".", 1)[-1]
    test_path = f"tests/test_{leaf}.py"
    files = {**g.files, "tests/__init__.py": "", test_path: _test_file(g.module, leaf, g.imports, g.keep)}
    fixed = _apply(files, g.edits)
    if fixed == files:
        raise AssertionError(f"family {family} seed {seed}: the fix changes nothing")  # a generator bug
    repo = _materialise(files, cache_root or _default_cache())
    row = {
        "instance_id": f"family__{family}-{seed}",
        "repo": f"polar-families/{family}",
        "base_commit": snapshot_commit({k: v.encode() for k, v in files.items()}),
        "problem_statement": g.statement,
        "test_patch": _diff(test_path, files[test_path],
                            _test_file(g.module, leaf, g.imports_after, {**g.keep, **g.add})),
        "patch": "".join(_diff(path, files[path], fixed[path]) for path in sorted(fixed) if fixed[path] != files[path]),
        "FAIL_TO_PASS": _ids(g.module, leaf, list(g.add)),
        "PASS_TO_PASS": _ids(g.module, leaf, list(g.keep)),
        "test_command": TEST_COMMAND,
        "repo_snapshot": str(repo),
        "solution_command": replace_command(g.edits),
        "version": "2",
    }
    return parse_task(row, where=f"family {family} seed {seed}")


def split_families(split: str, families: list[str] | None = None) -> tuple[str, ...]:
    """The families a split draws from: the run's (all trainable ones when None), or the transfer
    families for "transfer", which never train."""
    if split not in SPLITS:
        raise TaskError(f"task families have the splits {', '.join(map(repr, SPLITS))}, not {split!r}")
    if split == "transfer":
        return TRANSFER_FAMILIES
    for name in families or ():
        if name not in KINDS:
            raise TaskError(f"unknown task family {name!r}; families: {', '.join(KINDS)}")
        if name in TRANSFER_FAMILIES:
            raise TaskError(f"task family {name!r} belongs to the transfer split, which never trains or tunes; "
                            f"trainable families: {', '.join(FAMILIES)}")
    return tuple(families or FAMILIES)


def split_seeds(split: str, per_family: int) -> range:
    return {"train": range(per_family), "demos": range(DEMO_SEED_BASE, DEMO_SEED_BASE + per_family),
            "validation": VALIDATION_SEEDS, "heldout": HELDOUT_SEEDS, "heldout_large": HELDOUT_LARGE_SEEDS,
            "transfer": TRANSFER_SEEDS}[split]


def family_tasks(split: str, *, families: list[str] | None = None, per_family: int = 16,
                 cache_root: Path | None = None) -> list[Task]:
    """A split's tasks, families interleaved (so a limit keeps every family)."""
    names = split_families(split, families)
    return [family_task(name, seed, cache_root=cache_root) for seed in split_seeds(split, per_family) for name in names]


def heldout_digest() -> str:
    """sha256 over every held-out and transfer task's statement, patches and tests (tests pin it)."""
    return _digest([*family_tasks("heldout"), *family_tasks("transfer")])


def heldout_large_digest() -> str:
    """sha256 over every heldout_large task, the same fields (tests pin it apart: the older
    held-out digest must not move)."""
    return _digest(family_tasks("heldout_large"))


def _digest(tasks: list[Task]) -> str:
    h = hashlib.sha256()
    for task in tasks:
        fields = [task.instance_id, task.problem_statement, task.patch, task.test_patch, task.base_commit,
                  *task.FAIL_TO_PASS, "|", *task.PASS_TO_PASS]
        h.update(json.dumps(fields).encode())
    return h.hexdigest()


def replace_command(edits: list[tuple[str, str, str]]) -> str:
    """One shell command that makes the edits: exact-text replacement, one occurrence each."""
    parts = []
    for path, old, new in edits:
        code = (f"import pathlib; p = pathlib.Path({path!r}); s = p.read_text(); "
                f"assert {old!r} in s; p.write_text(s.replace({old!r}, {new!r}, 1))")
        parts.append(f"python3 -c {shlex.quote(code)}")
    return " && ".join(parts)


def _apply(files: dict[str, str], edits: list[tuple[str, str, str]]) -> dict[str, str]:
    fixed = dict(files)
    for path, old, new in edits:
        if fixed[path].count(old) != 1:
            raise AssertionError(f"family edit {old!r} is not unique in {path}")  # a generator bug
        fixed[path] = fixed[path].replace(old, new)
    return fixed


def _test_file(module: str, leaf: str, imports: list[str], cases: dict[str, str]) -> str:
    body = "".join(f"\n    def {name}(self):\n        {line}\n" for name, line in cases.items())
    return (f"import unittest\n\nfrom {module} import {', '.join(imports)}\n\n\n"
            f"class Test{leaf.capitalize()}(unittest.TestCase):{body}")


def _ids(module: str, leaf: str, names: list[str]) -> list[str]:
    return [f"tests.test_{leaf}.Test{leaf.capitalize()}.{n}" for n in names]


def _diff(path: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def _default_cache() -> Path:
    from polar_fast.model import cache_root

    return cache_root() / "task_families"


def _materialise(files: dict[str, str], root: Path) -> Path:
    """files under root/<content digest>/repo, written once (atomic rename: parallel runs agree)."""
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
    repo = root / digest / "repo"
    if repo.is_dir():
        return repo
    tmp = root / f".{digest}.{os.getpid()}"
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    (root / digest).mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(repo)
    except OSError:  # another process won the race: its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return repo
