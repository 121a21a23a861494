"""What a careful agent does to fix a task, derived from the task itself: the plan a teacher types.

A teacher knows the answer (the task's reference patch) but demonstrates finding it: search for
the symbol the statement names, read the file, reproduce the bug where the statement gives a call,
make the edit, check it, submit. `fix_plan` derives each part from the task alone, so a teacher
works for any task with a small reference patch (the generated families, the built-in suite):
- edits: each hunk's removed lines and the lines added in their place (a pure addition keeps the
  context line before it as its anchor), checked to occur exactly once in the file;
- symbol: the first name called or quoted in the statement that the patched file defines or
  mentions, else the name of the function the hunk sits in;
- call: the statement's first backticked expression that calls the symbol with literal
  arguments, or names the constant (printed before and after the edit to show the bug and the
  fix), when the symbol can be imported. A call with names for arguments (`total(a, b)`, a
  signature, not a call) is never taken: printing it raises NameError before and after the
  edit, and a demonstration would then teach the student to call a failing check a success.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from polar_fast.errors import PolarError
from polar_fast.rollouts.tasks import Task


class PlanError(PolarError, ValueError):
    """The task's patch is not one a teacher can demonstrate (missing, ambiguous, binary)."""


@dataclass(frozen=True)
class FixPlan:
    path: str  # the file the fix changes (the first, when several)
    edits: list[tuple[str, str, str]]  # (path, old text, new text)
    symbol: str
    module: str  # dotted module of `path`
    call: str  # "" when the statement gives no call to reproduce
    source: str  # the text of `path` before the fix (what reading the file shows)


def fix_plan(task: Task) -> FixPlan:
    files = _patched_files(task.patch)
    if not files:
        raise PlanError(f"{task.instance_id}: no reference patch a teacher can follow")
    root = Path(task.repo_snapshot) if task.repo_snapshot else None
    edits = []
    for path, hunks in files.items():
        text = (root / path).read_text() if root else ""
        for old, new in hunks:
            if root and text.count(old) != 1:
                raise PlanError(f"{task.instance_id}: {old!r} does not occur exactly once in {path}")
            edits.append((path, old, new))
    path = next(iter(files))
    source = (root / path).read_text() if root else ""
    symbol = _symbol(task.problem_statement, source, task.patch)
    module = path[:-3].replace("/", ".") if path.endswith(".py") else ""
    call = _call(task.problem_statement, symbol, source) if module else ""
    return FixPlan(path, edits, symbol, module, call, source)


def _patched_files(patch: str) -> dict[str, list[tuple[str, str]]]:
    """path -> [(old, new)] per hunk change: consecutive removed lines and the added lines after them."""
    files: dict[str, list[tuple[str, str]]] = {}
    path = None
    removed: list[str] = []
    added: list[str] = []
    before = ""  # the last context line: the anchor of a pure addition

    def flush() -> None:
        nonlocal removed, added
        if path and (removed or added):
            if removed:
                files[path].append(("\n".join(removed), "\n".join(added)))
            else:
                files[path].append((before, "\n".join([before, *added])))
        removed, added = [], []

    for line in patch.splitlines():
        if line.startswith("diff --git "):
            flush()
            path = line.split(" b/", 1)[1]
            files[path] = []
        elif line.startswith(("--- ", "+++ ", "index ")):
            continue
        elif line.startswith("@@"):
            flush()
        elif line.startswith("-"):
            if added:
                flush()
            removed.append(line[1:])
        elif line.startswith("+"):
            added.append(line[1:])
        else:
            flush()
            before = line[1:] if line.startswith(" ") else line
    flush()
    return {p: h for p, h in files.items() if h}


def _symbol(statement: str, source: str, patch: str) -> str:
    names = [m.group(0).split(".")[-1] for m in (re.match(r"[A-Za-z_][\w.]*", s)
                                                  for s in re.findall(r"`([^`]+)`", statement)) if m]
    for leaf in names:  # a name the file defines first, then any it mentions
        if re.search(rf"^(\s*def {re.escape(leaf)}\(|class {re.escape(leaf)}\b|{re.escape(leaf)} =)", source, re.M):
            return leaf
    for leaf in names:
        if re.search(rf"\b{re.escape(leaf)}\b", source):
            return leaf
    header = re.search(r"^@@ [^@]* @@ (?:def|class) (\w+)", patch, re.M)
    if header:
        return header.group(1)
    defined = re.search(r"^def (\w+)", source, re.M)
    return defined.group(1) if defined else ""


def _call(statement: str, symbol: str, source: str) -> str:
    """A call of the function the file defines, or the constant it assigns, as the statement quotes it."""
    defines = re.search(rf"^def {re.escape(symbol)}\(", source, re.M)
    assigns = re.search(rf"^{re.escape(symbol)} =", source, re.M)
    for snippet in re.findall(r"`([^`]+)`", statement):
        if (defines and snippet.startswith(f"{symbol}(") and _literal_call(snippet)) or (assigns and snippet == symbol):
            return snippet
    return ""


def _literal_call(snippet: str) -> bool:
    """`f(1, 'x', [2, 3])`: a call whose every argument is a literal, so it runs as written."""
    try:
        node = ast.parse(snippet, mode="eval").body
    except SyntaxError:
        return False
    if not isinstance(node, ast.Call):
        return False
    try:
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            ast.literal_eval(arg)
    except ValueError:
        return False
    return True
