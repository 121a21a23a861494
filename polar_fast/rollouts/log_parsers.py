"""Test logs -> one status per test id, in the id format each task set's test lists use.

A task's FAIL_TO_PASS / PASS_TO_PASS strings were produced by its publisher's own log parser, so
a test only matches when we read the log the same way. Each parser here follows the log format
and id rules that SWE-bench's harness (and SWE-Gym's fork of it) documents for a family of repos:
- `pytest`: `-rA` summary lines, `STATUS id` (a FAILED line's ` - reason` dropped);
- `pytest_options`: the same, with a parametrize option that is an absolute path cut to its last
  component (requests, pylint, pydicom);
- `pytest_v2`: also strips colour codes, and accepts `id STATUS` lines of older pytest -v;
- `pydantic`: `pytest_v2` that also drops the `[ 42%]` progress after FAILED;
- `matplotlib`: `pytest` with MouseButton enum names written as their numbers;
- `seaborn`: FAILED summary lines and `id PASSED` verbose lines;
- `django`: `test_x (module.Class) ... ok` lines of django's runtests.py, ids as printed;
- `sympy`: `test_x ok|F|E` lines of bin/test, plus the `___ file.py:test_x ___` failure headers;
- `default`: this project's own reading (pytest and stdlib unittest, worst status wins), used by
  the built-in tasks and by repos no publisher lists.
As upstream, a test reported twice keeps the last status, and XFAIL counts as passed.
"""

from __future__ import annotations

import re
from typing import Callable

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
_WORDS = {"PASSED": PASSED, "FAILED": FAILED, "ERROR": ERROR, "SKIPPED": SKIPPED, "XFAIL": PASSED}
_COLOUR = re.compile(r"\[(\d+)m")
_CONTROL = str.maketrans("", "", "".join(chr(c) for c in range(1, 32)))


def _status_first(line: str) -> tuple[str, str] | None:
    """`STATUS id ...` -> (id, status), or None when the line is not a status line."""
    word = next((w for w in _WORDS if line.startswith(w)), None)
    if word is None:
        return None
    if word == "FAILED":
        line = line.replace(" - ", " ")
    parts = line.split()
    if len(parts) < 2 or parts[0] not in _WORDS:
        return None
    return parts[1], _WORDS[parts[0]]


def parse_pytest(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.split("\n"):
        if hit := _status_first(line):
            out[hit[0]] = hit[1]
    return out


def parse_pytest_options(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.split("\n"):
        if not (hit := _status_first(line)):
            continue
        test, status = hit
        if m := re.match(r"(.*?)\[(.*)\]", test):
            main, option = m.groups()
            if option.startswith("/") and not option.startswith("//") and "*" not in option:
                option = "/" + option.split("/")[-1]
            test = f"{main}[{option}]"
        out[test] = status
    return out


def parse_pytest_v2(log: str, *, drop_progress: bool = False) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.split("\n"):
        line = _COLOUR.sub("", line).translate(_CONTROL)
        if drop_progress:
            line = re.sub(r"FAILED\s*\[.*?\]", "FAILED", line)
        if hit := _status_first(line):
            out[hit[0]] = hit[1]
        elif any(line.endswith(w) for w in _WORDS) and len(parts := line.split()) >= 2:
            out[parts[0]] = _WORDS.get(parts[1], FAILED)  # upstream keeps the odd word: not a pass
    return out


def parse_pydantic(log: str) -> dict[str, str]:
    return parse_pytest_v2(log, drop_progress=True)


def parse_matplotlib(log: str) -> dict[str, str]:
    return parse_pytest(log.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3"))


def parse_seaborn(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.split("\n"):
        parts = line.split()
        if line.startswith("FAILED") and len(parts) > 1:
            out[parts[1]] = FAILED
        elif " PASSED " in line and len(parts) > 1 and parts[1] == "PASSED":
            out[parts[0]] = PASSED
        elif line.startswith("PASSED") and len(parts) > 1:
            out[parts[1]] = PASSED
    return out


_DJANGO_PASS = (" ... ok", " ... OK", " ...  OK")
# runtests.py sometimes prints a long message between "..." and "ok"; the test still passed
_DJANGO_SPLIT_OK = [
    r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
    r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
    r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
]


def parse_django(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    last_started = None
    for line in (raw.strip() for raw in log.split("\n")):
        if "--version is equivalent to version" in line:
            out["--version is equivalent to version"] = PASSED
        if " ... " in line:
            last_started = line.split(" ... ")[0]
        if suffix := next((s for s in _DJANGO_PASS if line.endswith(s)), None):
            if line.startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                line = line.split("...", 1)[-1].strip()  # a migration message glued to the test line
            out[line.rsplit(suffix, 1)[0]] = PASSED
        if " ... skipped" in line:
            out[line.split(" ... skipped")[0]] = SKIPPED
        if line.endswith(" ... FAIL"):
            out[line.split(" ... FAIL")[0]] = FAILED
        if line.startswith("FAIL:") and len(line.split()) > 1:
            out[line.split()[1].strip()] = FAILED
        if line.endswith(" ... ERROR"):
            out[line.split(" ... ERROR")[0]] = ERROR
        if line.startswith("ERROR:") and len(line.split()) > 1:
            out[line.split()[1].strip()] = ERROR
        if line.startswith("ok") and last_started is not None:
            out[last_started] = PASSED  # output between "..." and "ok"
    for pattern in _DJANGO_SPLIT_OK:
        for m in re.finditer(pattern, log, re.M):
            out[m.group(1)] = PASSED
    return out


def parse_sympy(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for _, path, test, _ in re.findall(r"(_*) (.*)\.py:(.*) (_*)", log):
        out[f"{path}.py:{test}"] = FAILED
    for line in (raw.strip() for raw in log.split("\n")):
        if not line.startswith("test_"):
            continue
        for ending, status in ((" E", ERROR), (" F", FAILED), (" ok", PASSED)):
            if line.endswith(ending):
                out[line.split()[0]] = status
    return out


# The default reading: pytest (`-rA` summary lines and `-v` lines) and stdlib unittest `-v` (Python
# 3.11 prints `test_x (pkg.mod.Class.test_x) ... ok`; older ones omit the method name, which is
# added back), so ids look like `tests/test_a.py::test_x` or `pkg.mod.Class.test_x`.
_DEFAULT_PYTEST_WORDS = {"PASSED": PASSED, "XPASS": PASSED, "FAILED": FAILED, "ERROR": ERROR,
                         "SKIPPED": SKIPPED, "XFAIL": SKIPPED}
_PYTEST_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+?)(?: - .*)?$", re.M)
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
_UNITTEST = re.compile(
    r"^(\w+) \(([\w.]+)\)(?:\n[^\n]*?)? \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)",
    re.M,
)
_UNITTEST_WORDS = {"ok": PASSED, "unexpected success": FAILED, "FAIL": FAILED, "ERROR": ERROR,
                   "skipped": SKIPPED, "expected failure": SKIPPED}
_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}  # a test reported twice keeps its worst status


def parse_test_output(text: str) -> dict[str, str]:
    """The default reading (above); a test reported twice keeps its worst status."""
    statuses: dict[str, str] = {}

    def put(test: str, status: str) -> None:
        if test not in statuses or _RANK[status] > _RANK[statuses[test]]:
            statuses[test] = status

    for word, test in _PYTEST_SUMMARY.findall(text):
        put(test, _DEFAULT_PYTEST_WORDS[word])
    for test, word in _PYTEST_VERBOSE.findall(text):
        put(test, _DEFAULT_PYTEST_WORDS[word])
    for method, where, word in _UNITTEST.findall(text):
        test = where if where.endswith("." + method) else f"{where}.{method}"
        put(test, _UNITTEST_WORDS[word])
    return statuses


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "default": parse_test_output,
    "pytest": parse_pytest,
    "pytest_options": parse_pytest_options,
    "pytest_v2": parse_pytest_v2,
    "pydantic": parse_pydantic,
    "matplotlib": parse_matplotlib,
    "seaborn": parse_seaborn,
    "django": parse_django,
    "sympy": parse_sympy,
}


def parse_log(parser: str, log: str) -> dict[str, str]:
    """Statuses by test id; parser "" is the default reading. A log holding SWE-bench's start
    and end markers (test_specs.py prints them) is read only between them."""
    from polar_fast.rollouts.test_specs import END_TESTS, START_TESTS

    if (parse := PARSERS.get(parser or "default")) is None:
        raise ValueError(f"unknown log parser {parser!r}; known: {', '.join(sorted(PARSERS))}")
    if START_TESTS in log and END_TESTS in log.split(START_TESTS, 1)[1]:
        log = log.split(START_TESTS, 1)[1].split(END_TESTS, 1)[0]
    return parse(log)
