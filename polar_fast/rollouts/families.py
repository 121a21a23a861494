"""Generated task families: dozens of small repair tasks from a seed, split into train and held-out.

Each family is a kind of change, from one the statement spells out to one the agent has to find:

    constant  a module constant has the wrong value; the statement names it and the value
    returns   a function returns the wrong expression; the statement gives the right one
    compare   an off-by-one comparison; the statement gives a failing call and what it should be
    rename    a function must be renamed (its callers in the repo too); the tests import the new name

A task is a tiny Python repo (one module, unittest tests), a test patch that adds the tests the fix
must make pass (FAIL_TO_PASS) beside tests that pass before and after (PASS_TO_PASS), and the
reference fix. The repo files are written once under the cache (content-addressed), so a task is
an ordinary `Task` with `repo_snapshot` and runs in any sandbox like the hand-written suite.

Splits are by seed: "train" uses seeds 0..n-1 of each family, "heldout" the fixed HELDOUT_SEEDS,
"demos" (a warm start's teacher demonstrations, warm_start.py) seeds from DEMO_SEED_BASE. A
family's space is small (the returns family has 5 fixes x 20 module names), so two splits can
hold the same statement by chance; the held-out split is what the seeds fix, not a guarantee
that no train task resembles it.
The held-out tasks are frozen: tests/test_families.py pins their digest, so no change made while
tuning a run can move them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from polar_fast.rollouts.task_rows import Task, TaskError, parse_task, snapshot_commit

HELDOUT_SEEDS = range(1_000_000, 1_000_006)  # per family: 6 x 4 families = 24 held-out tasks
DEMO_SEED_BASE = 500_000  # "demos": teacher demonstrations for a warm start, apart from train and held-out
TEST_COMMAND = "python3 -m unittest -v"
_WORDS = ["alpha", "basket", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "iris", "juniper",
          "kestrel", "lumen", "maple", "nectar", "orbit", "pepper", "quartz", "raven", "saffron", "tundra"]
_NOUNS = ["items", "orders", "points", "records", "tickets", "scores", "rows", "tokens", "pages", "files"]


@dataclass(frozen=True)
class Generated:
    module: str  # file name of the module, e.g. "cedar.py"
    source: str  # module before the fix
    fixed: str  # module after the fix
    tests_before: str  # tests/test_<module>.py at base (PASS_TO_PASS only)
    tests_after: str  # the same file with the FAIL_TO_PASS tests added
    statement: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    solution: str  # a one-line shell command that makes the fix (what a teacher would type)


def _name(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _test_file(module: str, imports: list[str], cases: dict[str, str]) -> str:
    body = "".join(f"\n    def {name}(self):\n        {line}\n" for name, line in cases.items())
    return (f"import unittest\n\nfrom {module} import {', '.join(imports)}\n\n\n"
            f"class Test{module.capitalize()}(unittest.TestCase):{body}")


def _ids(module: str, names: list[str]) -> list[str]:
    return [f"tests.test_{module}.Test{module.capitalize()}.{n}" for n in names]


def _constant(rng: random.Random) -> Generated:
    mod, noun = _name(rng), rng.choice(_NOUNS)
    const = rng.choice(["LIMIT", "MAX_ITEMS", "BATCH_SIZE", "PAGE_SIZE", "RETRIES"])
    old = rng.randrange(5, 50)
    new = old + rng.randrange(1, 20)
    src = (f'"""Helpers for {noun}."""\n\n{const} = {old}\n\n\n'
           f"def capped(n):\n    return min(n, {const})\n\n\n"
           f"def count(values):\n    return len(values)\n")
    fixed = src.replace(f"{const} = {old}", f"{const} = {new}")
    keep = {"test_count": "self.assertEqual(count([1, 2, 3]), 3)"}
    add = {"test_value": f"self.assertEqual({const}, {new})",
           "test_capped": f"self.assertEqual(capped({new + 100}), {new})"}
    return Generated(
        f"{mod}.py", src, fixed,
        _test_file(mod, ["count"], keep), _test_file(mod, [const, "capped", "count"], {**keep, **add}),
        f"In `{mod}.py`, `{const}` is {old} but it must be {new}: change `{const} = {old}` to `{const} = {new}`.",
        _ids(mod, list(add)), _ids(mod, list(keep)), _sed(f"{const} = {old}", f"{const} = {new}", f"{mod}.py"),
    )


def _returns(rng: random.Random) -> Generated:
    mod = _name(rng)
    func, wrong, right, a, b = rng.choice([
        ("total", "a - b", "a + b", 7, 3), ("area", "a + b", "a * b", 6, 4),
        ("ratio", "a * b", "a / b", 8, 2), ("spread", "a + b", "a - b", 9, 4),
        ("combined", "a * 2 + b", "a + b * 2", 5, 3),
    ])
    src = (f'"""Arithmetic for reports."""\n\n\ndef {func}(a, b):\n    return {wrong}\n\n\n'
           f"def double(x):\n    return x * 2\n")
    fixed = src.replace(f"return {wrong}", f"return {right}")
    expect = eval(right, {"a": a, "b": b})  # noqa: S307 - fixed table above, not input
    keep = {"test_double": "self.assertEqual(double(4), 8)"}
    add = {f"test_{func}": f"self.assertEqual({func}({a}, {b}), {expect!r})"}
    return Generated(
        f"{mod}.py", src, fixed,
        _test_file(mod, ["double"], keep), _test_file(mod, [func, "double"], {**keep, **add}),
        f"`{func}(a, b)` in `{mod}.py` returns `{wrong}`; it must return `{right}`.",
        _ids(mod, list(add)), _ids(mod, list(keep)), _sed(f"return {wrong}", f"return {right}", f"{mod}.py"),
    )


def _compare(rng: random.Random) -> Generated:
    mod = _name(rng)
    func, var, op, good, limit = rng.choice([
        ("is_adult", "age", ">", ">=", 18), ("fits", "size", "<", "<=", 64),
        ("has_quorum", "votes", ">", ">=", 5), ("within_budget", "cost", "<", "<=", 100),
    ])
    src = (f'"""Checks."""\n\nLIMIT = {limit}\n\n\ndef {func}({var}):\n    return {var} {op} LIMIT\n\n\n'
           f"def describe({var}):\n    return 'yes' if {func}({var}) else 'no'\n")
    fixed = src.replace(f"return {var} {op} LIMIT", f"return {var} {good} LIMIT")
    far = limit + 10 if op == ">" else limit - 10
    keep = {"test_far": f"self.assertTrue({func}({far}))"}
    add = {"test_boundary": f"self.assertTrue({func}({limit}))",
           "test_describe_boundary": f"self.assertEqual(describe({limit}), 'yes')"}
    return Generated(
        f"{mod}.py", src, fixed,
        _test_file(mod, [func], keep), _test_file(mod, [func, "describe"], {**keep, **add}),
        f"`{func}({limit})` in `{mod}.py` returns False, but the limit itself counts: it should return True.",
        _ids(mod, list(add)), _ids(mod, list(keep)), _sed(f"{var} {op} LIMIT", f"{var} {good} LIMIT", f"{mod}.py"),
    )


def _rename(rng: random.Random) -> Generated:
    mod, noun = _name(rng), rng.choice(_NOUNS)
    old, new = rng.choice([("fetch", "load"), ("get", "read"), ("make", "build"), ("calc", "compute")])
    old, new = f"{old}_{noun}", f"{new}_{noun}"
    src = (f'"""{noun.capitalize()}."""\n\n\ndef {old}(n):\n    return list(range(n))\n\n\n'
           f"def first(n):\n    return {old}(n)[:1]\n")
    fixed = src.replace(old, new)
    keep = {"test_first": "self.assertEqual(first(3), [0])"}
    # imported in the test, so the PASS_TO_PASS test still runs (and passes) before the rename
    add = {f"test_{new}": f"from {mod} import {new}; self.assertEqual({new}(3), [0, 1, 2])"}
    return Generated(
        f"{mod}.py", src, fixed,
        _test_file(mod, ["first"], keep), _test_file(mod, ["first"], {**keep, **add}),
        f"Rename the function `{old}` in `{mod}.py` to `{new}`, and update its callers.",
        _ids(mod, list(add)), _ids(mod, list(keep)), _sed(old, new, f"{mod}.py"),
    )


def _sed(old: str, new: str, path: str) -> str:
    """`sed -i` replacing every `old` with `new` (literal text: regex characters escaped)."""
    def escape(text: str, special: str) -> str:
        return "".join("\\" + c if c in special else c for c in text)

    return f"sed -i 's#{escape(old, '.*[]^$#&/')}#{escape(new, '&#')}#g' {path}"


FAMILIES: dict[str, Callable[[random.Random], Generated]] = {
    "constant": _constant, "returns": _returns, "compare": _compare, "rename": _rename,
}


def family_task(family: str, seed: int, *, cache_root: Path | None = None) -> Task:
    """The task of `family` for `seed`: the same seed always gives the same task."""
    try:
        make = FAMILIES[family]
    except KeyError:
        raise TaskError(f"unknown task family {family!r}; families: {', '.join(FAMILIES)}") from None
    g = make(random.Random(f"{family}:{seed}"))
    test_path = f"tests/test_{g.module[:-3]}.py"
    files = {g.module: g.source, "tests/__init__.py": "", test_path: g.tests_before}
    repo = _materialise(files, cache_root or _default_cache())
    row = {
        "instance_id": f"family__{family}-{seed}",
        "repo": f"polar-families/{family}",
        "base_commit": snapshot_commit({k: v.encode() for k, v in files.items()}),
        "problem_statement": g.statement,
        "test_patch": _diff(test_path, g.tests_before, g.tests_after),
        "patch": _diff(g.module, g.source, g.fixed),
        "FAIL_TO_PASS": g.fail_to_pass,
        "PASS_TO_PASS": g.pass_to_pass,
        "test_command": TEST_COMMAND,
        "repo_snapshot": str(repo),
        "solution_command": g.solution,
        "version": "1",
    }
    return parse_task(row, where=f"family {family} seed {seed}")


def family_tasks(split: str, *, families: list[str] | None = None, per_family: int = 16,
                 cache_root: Path | None = None) -> list[Task]:
    """A split's tasks, families interleaved (so a limit keeps every family)."""
    names = families or list(FAMILIES)
    if split == "train":
        seeds = range(per_family)
    elif split == "heldout":
        seeds = HELDOUT_SEEDS
    elif split == "demos":
        seeds = range(DEMO_SEED_BASE, DEMO_SEED_BASE + per_family)
    else:
        raise TaskError(f"task families have the splits 'train', 'heldout' and 'demos', not {split!r}")
    return [family_task(name, seed, cache_root=cache_root) for seed in seeds for name in names]


def heldout_digest() -> str:
    """sha256 over every held-out task's statement, patches and tests (tests pin it)."""
    h = hashlib.sha256()
    for task in family_tasks("heldout"):
        fields = [task.instance_id, task.problem_statement, task.patch, task.test_patch, task.base_commit,
                  *task.FAIL_TO_PASS, "|", *task.PASS_TO_PASS]
        h.update(json.dumps(fields).encode())
    return h.hexdigest()


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
